"""The scheduler's storage tier: lookups answered in a later step (the minimum over
ranks), prefetch into host under each policy and its bound, failed loads rolled
back and not retried for a while, write policies and failed writes never counted
as stored, no leak when a request aborts during a load. `check_invariants()` runs
after every call (see `Checked`)."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest

from fastkv import CacheConfig, CacheLevel, LookupResult, StorageConfig, TransferResult
from fastkv.scheduler import AllocStatus, CacheManager
from fastkv.scheduler.radix_tree import NodeState
from fastkv.scheduler.storage_tier import MAX_RETRY_KEYS
from fastkv.tp import RankResults
from tests.scheduler.test_cache_manager import BS, Checked, keys, node
from tests.scheduler.test_cache_manager import assert_no_leak as _assert_no_leak


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(*, device=4, host=8, clock=None, tp_size=1, **storage):
    storage.setdefault("write_policy", "none")
    return Checked(
        CacheManager(
            CacheConfig(
                block_size=BS,
                num_device_blocks=device,
                num_host_blocks=host,
                tp_size=tp_size,
                storage=StorageConfig(**storage),
            ),
            clock=clock or Clock(),
        )
    )


def prompt(n: int) -> int:
    return n * BS + 1


def answer(mgr, hits: int | list[int] | None, failed=()) -> tuple:
    """One worker step: lookups answered with `hits` (one value per rank, combined
    like fastkv.tp does; None: not answered), every transfer successful except
    storage blocks `failed`."""
    tasks = mgr.take_swap_metadata()
    ranks = mgr.config.tp_size
    per_rank = (
        [0] * ranks if hits is None else hits if isinstance(hits, list) else [hits] * ranks
    )
    ranks = RankResults(len(per_rank))
    results = []
    for rank, h in enumerate(per_rank):
        batch = [
            LookupResult(q.lookup_id, min(h, len(q.block_hashes)))
            for q in (tasks.lookups if hits is not None else ())
        ]
        for meta in (tasks.evict, tasks.swap_in, tasks.storage_load, tasks.storage_store):
            if meta is None:
                continue
            bad = tuple(failed) if meta is tasks.storage_load and rank == 0 else ()
            batch.append(TransferResult(meta.transfer_id, not bad, "io" if bad else "", bad))
        results += ranks.add(rank, batch)
    mgr.apply_results(results)
    return tasks


def assert_no_leak(mgr) -> None:
    """Every storage transfer and lookup answered too, then the usual check."""
    for _ in range(16):
        tasks = answer(mgr, 0)  # a take may plan flush-ahead writes of its own
        took = (tasks.evict, tasks.swap_in, tasks.storage_load, tasks.storage_store)
        if not any(took) and not tasks.lookups and not mgr.busy:
            break
    _assert_no_leak(mgr)


def admit(mgr, rid, hashes: list[str], hits: int = 0) -> None:
    """Match and allocate, the worker answering lookups with `hits` meanwhile."""
    mgr.match(rid, hashes, prompt(len(hashes)))
    while not mgr.allocate(rid, num_tokens=(len(hashes)) * BS):
        answer(mgr, hits)


def to_storage(**kw):
    mgr = make(write_policy="write_through", **kw)
    admit(mgr, "setup", keys("a", 3))
    mgr.commit("setup", num_computed_tokens=3 * BS)
    mgr.finish("setup")
    mgr.match("big", [], 1)
    while not mgr.allocate("big", num_tokens=4 * BS):
        answer(mgr, 0)
    answer(mgr, 0)
    mgr.abort("big")
    # Push the chain out of the host tier too, by caching other blocks there.
    for i in range(3):
        admit(mgr, f"o{i}", keys(f"o{i}", 4))
        answer(mgr, 0)
        mgr.commit(f"o{i}", num_computed_tokens=4 * BS)
        mgr.finish(f"o{i}")
        while mgr.num_queued_blocks or mgr.num_inflight_transfers:
            answer(mgr, 0)
    assert all(node(mgr, k) is None for k in keys("a", 3)), "the chain is in storage only"
    assert mgr.get_stats().storage.writes >= 3
    return mgr


def test_a_block_found_in_storage_is_loaded_into_host_then_swapped_in() -> None:
    mgr = to_storage()
    hit = mgr.match("r", keys("a", 3), prompt(3))
    assert hit.num_hits == 0 and hit.storage_lookup
    tasks = mgr.take_swap_metadata()
    (lookup,) = tasks.lookups
    assert list(lookup.block_hashes) == keys("a", 3)
    assert (
        mgr.allocate("r", num_tokens=3 * BS).status is AllocStatus.WAIT_FOR_TRANSFERS
    )  # waits
    mgr.apply_results([LookupResult(lookup.lookup_id, 3)])
    load = mgr.take_swap_metadata().storage_load
    assert (load.src_level, load.dst_level) == (CacheLevel.STORAGE, CacheLevel.HOST)
    assert list(load.block_hashes) == keys("a", 3) and load.src_block_ids == []
    assert [node(mgr, k).state for k in keys("a", 3)] == [NodeState.LOADING_FROM_STORAGE] * 3
    assert mgr.allocate("r", num_tokens=3 * BS).status is AllocStatus.WAIT_FOR_TRANSFERS
    mgr.apply_results([TransferResult(load.transfer_id, True)])
    while not (alloc := mgr.allocate("r", num_tokens=3 * BS)):  # device room: evictions first
        answer(mgr, 0)
    assert alloc.num_cached_tokens == 3 * BS and alloc.num_new_blocks == 3
    swap_in = answer(mgr, 0).swap_in
    assert list(swap_in.block_hashes) == keys("a", 3)
    assert mgr.get_stats().storage.hit_blocks == 3
    mgr.finish("r")
    assert_no_leak(mgr)


def test_the_usable_prefix_is_the_minimum_over_ranks() -> None:
    mgr = to_storage(tp_size=2)
    mgr.match("r", keys("a", 3), prompt(3))
    answer(mgr, [3, 2])  # rank 1 holds only two of the blocks
    load = mgr.take_swap_metadata().storage_load
    assert list(load.block_hashes) == keys("a", 2)
    mgr.apply_results([TransferResult(load.transfer_id, True, num_ranks=2)])
    while not (alloc := mgr.allocate("r", num_tokens=3 * BS)):
        answer(mgr, 0)
    assert alloc.num_cached_tokens == 2 * BS and alloc.num_new_blocks == 3
    mgr.abort("r")
    assert_no_leak(mgr)


@pytest.mark.parametrize("failing_rank_block", [0, 1])
def test_a_failed_load_on_one_rank_is_rolled_back_and_not_retried_for_a_while(
    failing_rank_block: int,
) -> None:
    clock = Clock()
    mgr = to_storage(clock=clock, retry_after_s=30, tp_size=2)
    mgr.match("r", keys("a", 3), prompt(3))
    answer(mgr, [3, 3])
    tasks = answer(mgr, [3, 3], failed=(failing_rank_block,))  # the load: one bad block
    assert tasks.storage_load is not None
    # From the bad block on the chain is gone; before it, it landed on host.
    states = [n.state if (n := node(mgr, k)) else None for k in keys("a", 3)]
    assert states == [NodeState.HOST] * failing_rank_block + [None] * (3 - failing_rank_block)
    while not (alloc := mgr.allocate("r", num_tokens=3 * BS)):
        answer(mgr, 0)
    assert alloc.num_cached_tokens == failing_rank_block * BS
    mgr.abort("r")
    answer(mgr, 0)
    stats = mgr.get_stats().storage
    assert stats.load_failures == 3 - failing_rank_block
    # Not looked up again until retry_after_s has passed.
    mgr.match("again", keys("a", 3), prompt(3))
    lookups = mgr.take_swap_metadata().lookups
    assert all(keys("a", 3)[failing_rank_block] not in q.block_hashes for q in lookups)
    mgr.abort("again")
    clock.now += 31
    mgr.match("later", keys("a", 3), prompt(3))
    (lookup,) = mgr.take_swap_metadata().lookups
    assert keys("a", 3)[failing_rank_block] in lookup.block_hashes
    mgr.abort("later")
    assert_no_leak(mgr)


def test_a_request_aborted_during_its_load_leaks_nothing() -> None:
    mgr = to_storage()
    mgr.match("r", keys("a", 3), prompt(3))
    answer(mgr, 3)  # the lookup: the load is planned
    load = mgr.take_swap_metadata().storage_load
    mgr.abort("r")  # mid-load
    for success in (False,):
        mgr.apply_results([TransferResult(load.transfer_id, success)])
    assert all(node(mgr, k) is None for k in keys("a", 3))
    assert_no_leak(mgr)


@pytest.mark.parametrize("policy", ["best_effort", "wait", "predicted"])
def test_each_prefetch_policy_keeps_its_bound(policy: str) -> None:
    """Slow storage: the load never lands. best_effort never waits; wait and
    predicted wait at most wait_s after the match, then compute the blocks."""
    clock = Clock()
    # predicted: 1 GB/s reads of 1 KiB blocks beat recomputing 4 tokens at 1 tok/s.
    mgr = to_storage(
        clock=clock,
        prefetch_policy=policy,
        wait_s=0.5,
        block_bytes=1024,
        recompute_tokens_per_s=1.0,
    )
    mgr.match("r", keys("a", 3), prompt(3))
    if policy == "best_effort":
        (lookup,) = answer(mgr, None).lookups  # its answer is slow to come
        while not (
            alloc := mgr.allocate("r", num_tokens=3 * BS)
        ):  # waits for room, never for storage
            assert answer(mgr, 0).lookups == ()
        assert alloc.num_cached_tokens == 0  # computes all three
        mgr.apply_results([LookupResult(lookup.lookup_id, 3)])  # too late: ignored
        assert answer(mgr, 0).storage_load is None
        mgr.finish("r")
        assert_no_leak(mgr)
        return
    answer(mgr, 3)
    slow = mgr.take_swap_metadata().storage_load  # never answered in time
    assert slow is not None
    assert mgr.allocate("r", num_tokens=3 * BS).status is AllocStatus.WAIT_FOR_TRANSFERS
    clock.now += 0.49
    assert mgr.allocate("r", num_tokens=3 * BS).status is AllocStatus.WAIT_FOR_TRANSFERS
    clock.now += 0.02
    while not (
        alloc := mgr.allocate("r", num_tokens=3 * BS)
    ):  # evictions for room, not storage
        answer(mgr, 0)
    assert alloc.num_cached_tokens == 0
    assert mgr.get_stats().storage.abandoned_loads == 3
    # The load still lands and serves a later request; nothing was reused early.
    mgr.apply_results([TransferResult(slow.transfer_id, True)])
    mgr.finish("r")
    hit = mgr.match("later", keys("a", 3), prompt(3))
    assert hit.num_host_hits == 3 or hit.num_device_hits + hit.num_host_hits == 3
    mgr.abort("later")
    assert_no_leak(mgr)


def test_predicted_skips_loads_slower_than_recomputing() -> None:
    mgr = to_storage(
        prefetch_policy="predicted",
        block_bytes=1 << 30,
        read_bytes_per_s=1e6,
        recompute_tokens_per_s=1e6,
    )
    mgr.match("r", keys("a", 3), prompt(3))
    answer(mgr, 3)
    assert answer(mgr, 0).storage_load is None
    assert mgr.get_stats().storage.skipped_loads == 3
    mgr.abort("r")
    assert_no_leak(mgr)


def test_a_failed_write_is_never_counted_as_stored() -> None:
    mgr = make(write_policy="write_through", device=4, host=8)
    admit(mgr, "r", keys("a", 2))
    mgr.commit("r", num_computed_tokens=2 * BS)
    mgr.finish("r")
    mgr.match("big", [], 1)
    while not mgr.allocate("big", num_tokens=4 * BS):
        answer(mgr, 0)
    mgr.abort("big")
    store = None
    while store is None:
        tasks = mgr.take_swap_metadata()
        done = [TransferResult(m.transfer_id, True) for m in (tasks.evict, tasks.swap_in) if m]
        store = tasks.storage_store
        mgr.apply_results(done)
    assert [node(mgr, k).storage for k in keys("a", 2)] == [1, 1]  # pinned while written
    failed_key = store.block_hashes[1]
    mgr.apply_results([TransferResult(store.transfer_id, False, "disk full", (1,))])
    assert {k: node(mgr, k).storage for k in keys("a", 2)} == {
        k: 0 if k == failed_key else 2 for k in keys("a", 2)
    }
    stats = mgr.get_stats().storage
    assert (stats.writes, stats.write_failures) == (1, 1)
    assert_no_leak(mgr)


def test_on_host_eviction_writes_a_block_and_frees_its_host_block_after() -> None:
    mgr = make(write_policy="on_host_eviction", device=2, host=2)
    for name in ("a", "b", "c", "d", "e", "f"):
        admit(mgr, name, [name])
        mgr.commit(name, num_computed_tokens=BS)
        mgr.finish(name)
        answer(mgr, 0)
    for _ in range(4):
        answer(mgr, 0)
    stats = mgr.get_stats()
    assert stats.storage.writes >= 1 and stats.host_evictions >= 1
    assert stats.host_pool.used <= 2
    assert_no_leak(mgr)


def test_a_full_host_tier_alone_does_not_keep_the_manager_busy() -> None:
    # A small host tier is always below the flush-ahead window; once the writes it
    # plans are done, nothing is in flight and `busy` must turn false, or every
    # drain loop and WAIT_FOR_TRANSFERS would spin forever.
    mgr = make(write_policy="on_host_eviction", device=8, host=4)
    for name in ("a", "b", "c", "d", "e"):
        admit(mgr, name, keys(name, 2))
        mgr.commit(name, num_computed_tokens=2 * BS)
        mgr.finish(name)
        answer(mgr, 0)
    for _ in range(8):
        if not mgr.busy:
            break
        answer(mgr, 0)
    assert mgr.host_pool.num_free < 16, "the host tier is inside the flush-ahead window"
    assert not mgr.busy
    mgr.match("x", [], 1)
    for _ in range(8):
        if mgr.allocate("x", num_tokens=1 * BS):
            break
        assert mgr.busy, "WAIT_FOR_TRANSFERS only while transfers are in flight"
        answer(mgr, 0)
    assert mgr.is_active("x") and mgr.num_blocks("x") == 1
    mgr.abort("x")
    assert_no_leak(mgr)


def test_after_hits_writes_a_block_once_it_is_hot() -> None:
    mgr = make(write_policy="after_hits", write_after_hits=2, device=2, host=4)
    admit(mgr, "r", ["hot"])
    mgr.commit("r", num_computed_tokens=BS)
    mgr.finish("r")
    mgr.match("big", [], 1)  # hot goes to host (write_back)
    while not mgr.allocate("big", num_tokens=2 * BS):
        answer(mgr, 0)
    mgr.abort("big")
    answer(mgr, 0)
    for i in range(2):
        mgr.match(f"h{i}", ["hot"], prompt(1))
        tasks = answer(mgr, 0)
        mgr.abort(f"h{i}")
        if i == 0:
            assert tasks.storage_store is None
    assert mgr.get_stats().storage.writes == 1
    assert node(mgr, "hot").storage == 2
    assert_no_leak(mgr)


def test_a_match_counts_one_hit_when_both_hit_policies_read_it() -> None:
    # write_through_selective and storage after_hits both read `hits`: one match
    # is one hit for each, or both thresholds would be halved.
    config = CacheConfig(
        block_size=BS,
        num_device_blocks=4,
        num_host_blocks=8,
        write_policy="write_through_selective",
        selective_threshold=2,
        storage=StorageConfig(write_policy="after_hits", write_after_hits=3),
    )
    mgr = Checked(CacheManager(config, clock=Clock()))
    admit(mgr, "r", keys("a", 2))
    mgr.commit("r", num_computed_tokens=2 * BS)
    mgr.finish("r")
    mgr.match("h0", keys("a", 2), prompt(2))
    assert [node(mgr, k).hits for k in keys("a", 2)] == [1, 1]
    tasks = answer(mgr, 0)
    assert tasks.evict is None, "one hit is below the selective threshold of 2"
    mgr.abort("h0")
    assert_no_leak(mgr)


def test_storage_needs_a_host_tier() -> None:
    with pytest.raises(ValueError, match="storage: needs a host tier"):
        CacheConfig(num_host_blocks=0, storage=StorageConfig())
    with pytest.raises(ValueError, match="prefetch_policy"):
        StorageConfig(prefetch_policy="sometimes")
    with pytest.raises(ValueError, match="wait_s"):
        StorageConfig(wait_s=-1)


def test_keys_of_failed_loads_are_remembered_within_a_bound_of_count_and_age() -> None:
    # 8,000 requests with unique prompts whose loads all fail: the tier used to keep
    # every key (32,000 here, 3.6 MB) until the same key was looked up again.
    clock = Clock()
    mgr = CacheManager(
        CacheConfig(
            block_size=BS,
            num_device_blocks=4,
            num_host_blocks=8,
            storage=StorageConfig(write_policy="none", retry_after_s=30),
        ),
        clock=clock,
    )
    remembered = mgr._storage._retry_after

    def unique(rid: str, n: int) -> list[bytes]:  # (keys() would remember the names)
        return [hashlib.sha256(f"{rid}/{j}".encode()).digest() for j in range(n)]

    tracemalloc.start()
    try:
        for i in range(8000):
            rid = f"r{i}"
            mgr.match(rid, unique(rid, 4), prompt(4))
            (lookup,) = mgr.take_swap_metadata().lookups
            mgr.apply_results([LookupResult(lookup.lookup_id, 4)])
            load = mgr.take_swap_metadata().storage_load
            mgr.apply_results([TransferResult(load.transfer_id, False, "io")])
            mgr.abort(rid)
            assert len(remembered) <= MAX_RETRY_KEYS
            if i == 2000:  # past the bound
                base, _ = tracemalloc.get_traced_memory()
            clock.now += 0.001
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert mgr.get_stats().storage.load_failures == 32000
    assert len(remembered) == MAX_RETRY_KEYS
    assert grown - base < 256 * 1024, "memory kept growing with every failed prompt"
    # The newest keys are still held back; once retry_after_s has passed since the
    # last failure, one more failure forgets every key but its own.
    mgr.match("again", unique("r7999", 4), prompt(4))
    assert mgr.take_swap_metadata().lookups == ()
    mgr.abort("again")
    clock.now += 31
    mgr.match("late", unique("late", 1), prompt(1))
    (lookup,) = mgr.take_swap_metadata().lookups
    mgr.apply_results([LookupResult(lookup.lookup_id, 1)])
    load = mgr.take_swap_metadata().storage_load
    mgr.apply_results([TransferResult(load.transfer_id, False, "io")])
    mgr.abort("late")
    assert list(remembered) == unique("late", 1)


def test_take_storage_reads_takes_lookups_and_loads_and_leaves_the_rest() -> None:
    """An engine that sends storage reads on a route of their own takes only them;
    device copies stay for the step's `take_swap_metadata`, no read is taken twice."""
    mgr = make(device=4, host=8)
    assert mgr.take_storage_reads() == (None, ())
    mgr.match("big", [], 1)
    assert mgr.allocate("big", num_tokens=4 * BS)  # every device block
    hit = mgr.match("q", keys("b", 2), prompt(2))
    assert hit.storage_lookup
    load, (lookup,) = mgr.take_storage_reads()
    assert load is None and list(lookup.block_hashes) == keys("b", 2)
    mgr.apply_results([LookupResult(lookup.lookup_id, 2)])
    load, lookups = mgr.take_storage_reads()
    assert lookups == () and list(load.block_hashes) == keys("b", 2)
    mgr.abort("big")
    admit(mgr, "c", keys("c", 2))
    mgr.commit("c", num_computed_tokens=2 * BS)
    tasks = mgr.take_swap_metadata()
    assert tasks.storage_load is None and not tasks.lookups  # taken once, above
    mgr.apply_results([TransferResult(load.transfer_id, True)])
    mgr.finish("q")
    mgr.finish("c")
    assert_no_leak(mgr)
