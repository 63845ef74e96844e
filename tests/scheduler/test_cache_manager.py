"""CacheManager scenarios: the request lifecycle, allocation outcomes, the three write
policies, swap-ins from host, failed and reordered transfers, stats, and no leak at
the end. Every call on the manager is followed by `check_invariants()` (see
`Checked`), including calls that raise."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from fastkv import CacheConfig, CacheLevel, LookupResult, TransferResult
from fastkv.hashing import BlockHasher, namespace_root
from fastkv.scheduler import (
    Allocation,
    AllocStatus,
    CacheManager,
    Rollback,
    SwapTasks,
)
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.radix_tree import NodeState, TreeNode

BS = 4
POLICIES = ["write_back", "write_through", "write_through_selective"]


_NAMES: dict[bytes, str] = {}


def H(name: str) -> bytes:
    """The 32-byte digest a test names `name` (block hashes are digests)."""
    digest = hashlib.sha256(name.encode()).digest()
    _NAMES[digest] = name
    return digest


def names(hashes) -> list[str]:
    """The test names of digests, for readable comparisons."""
    return [_NAMES[h] for h in hashes]


def _digests(value):
    if isinstance(value, list | tuple) and any(isinstance(h, str) for h in value):
        return type(value)(H(h) if isinstance(h, str) else h for h in value)
    return value


class Checked:
    """The manager, with `check_invariants()` run after every method call, whether the
    call returned or raised. Attributes that are not methods pass through. Hash lists
    given to `match` and `append_hashes` may name blocks by string (`H`)."""

    def __init__(self, mgr: CacheManager) -> None:
        self.mgr = mgr

    def __getattr__(self, name: str):
        attr = getattr(self.mgr, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if name in ("match", "append_hashes") and len(args) >= 2:
                args = (args[0], _digests(args[1]), *args[2:])
            try:
                return attr(*args, **kwargs)
            finally:
                self.mgr.check_invariants()

        return call


def make(policy: str = "write_back", *, device: int = 4, host: int = 8, threshold: int = 2):
    return Checked(
        CacheManager(
            CacheConfig(
                block_size=BS,
                num_device_blocks=device,
                num_host_blocks=host,
                write_policy=policy,
                selective_threshold=threshold,
            )
        )
    )


def keys(prefix: str, n: int) -> list[bytes]:
    return [H(f"{prefix}{i}") for i in range(n)]


def node(mgr, key: str | bytes) -> TreeNode | None:
    key = H(key) if isinstance(key, str) else key
    return next((n for n in mgr.tree if n.key == key), None)


def table_ids(mgr, rid) -> list[int]:
    """The request's device blocks, position order."""
    return list(mgr.block_table(rid).block_ids)


def grow(mgr, rid, n: int) -> Allocation:
    """Allocate `n` fresh blocks past what the request's table and its matched blocks
    cover (the manager counts tokens: ask for that many positions' tokens)."""
    covered = max(mgr.num_blocks(rid), mgr.num_committed_blocks(rid))
    return mgr.allocate(rid, num_tokens=(covered + n) * BS)


def emitted(tasks: SwapTasks):
    return [m for m in (tasks.evict, tasks.swap_in) if m is not None]


def complete(mgr, success: bool = True) -> tuple[SwapTasks, list[Rollback]]:
    """One worker step: take what is planned and report every copy as done."""
    tasks = mgr.take_swap_metadata()
    rollbacks = mgr.apply_results(
        TransferResult(m.transfer_id, success) for m in emitted(tasks)
    )
    return tasks, rollbacks


def prompt(hashes: list[str]) -> int:
    """A prompt length for `hashes`: its full blocks and one more token, so that
    every block can hit (the last token is always computed)."""
    return len(hashes) * BS + 1


def table_after(mgr, rid, n: int) -> list[int]:
    """Allocate, which must succeed at once; the request's whole table after it."""
    before = mgr.num_blocks(rid)
    alloc = grow(mgr, rid, n)
    assert alloc, alloc
    table = table_ids(mgr, rid)
    assert alloc.num_new_blocks == len(table) - before
    return table


def allocate(mgr, rid, n: int, rounds: int = 16) -> list[int]:
    """Allocate, letting the worker complete transfers while allocation waits for
    them (the documented retry)."""
    for _ in range(rounds):
        alloc = grow(mgr, rid, n)
        if alloc:
            return table_ids(mgr, rid)
        assert alloc.status is AllocStatus.WAIT_FOR_TRANSFERS, alloc
        complete(mgr)
    raise AssertionError(f"allocate({rid!r}, {n}) still deferred after {rounds} steps")


def serve(mgr, rid, hashes: list[str]) -> list[int]:
    """A whole request: match, allocate the rest, run the step (its swaps complete),
    commit every block, finish."""
    hit = mgr.match(rid, hashes, prompt(hashes))
    table = allocate(mgr, rid, len(hashes) - hit.num_hits)
    complete(mgr)
    mgr.commit(rid, num_computed_tokens=len(hashes) * BS)
    mgr.finish(rid)
    complete(mgr)
    return table


def push_out(mgr) -> None:
    """Everything unlocked leaves the device: a request takes the whole device pool,
    then aborts. Under write_back every cached block ends on host."""
    mgr.match("filler", [], prompt([]))
    allocate(mgr, "filler", mgr.device_pool.capacity)
    mgr.abort("filler")
    complete(mgr)


def assert_no_leak(mgr) -> None:
    """After every request is done and every transfer completed: nothing locked, and
    the pools hold exactly the blocks of cached nodes."""
    for _ in range(8):
        tasks, _ = complete(mgr)
        if not emitted(tasks):
            break
    stats = mgr.get_stats()
    assert stats.active_requests == 0
    assert stats.inflight_transfers == 0 and stats.queued_blocks == 0
    nodes = list(mgr.tree)
    assert all(n.ref == 0 for n in nodes)
    assert mgr.device_pool.num_used == sum(n.device_block >= 0 for n in nodes)
    assert mgr.host_pool.num_used == sum(n.host_block >= 0 for n in nodes)
    for pool in (mgr.device_pool, mgr.host_pool):
        assert pool.num_free + pool.num_used == pool.capacity


def assert_reserved(mgr, meta) -> None:
    """Invariant 1: no block of an in-flight copy is free."""
    pools = {CacheLevel.DEVICE: mgr.device_pool, CacheLevel.HOST: mgr.host_pool}
    for level, ids in (
        (meta.src_level, meta.src_block_ids),
        (meta.dst_level, meta.dst_block_ids),
    ):
        assert all(pools[level].is_allocated(b) for b in ids), (level, ids)


# -- lifecycle ------------------------------------------------------------------


def test_lifecycle_counts_device_hits() -> None:
    mgr = make(device=8)
    hit = mgr.match("r1", keys("a", 4), prompt(keys("a", 4)))
    assert (hit.num_device_hits, hit.num_host_hits, hit.waiting_on_transfer) == (0, 0, False)
    t1 = table_after(mgr, "r1", 4)
    assert len(set(t1)) == 4
    mgr.commit("r1", num_computed_tokens=len(keys("a", 4)) * BS)
    mgr.finish("r1")

    hashes = [*keys("a", 2), "b2"]
    hit = mgr.match("r2", hashes, prompt(hashes))
    assert (hit.num_device_hits, hit.num_host_hits, hit.num_hits) == (2, 0, 2)
    assert table_ids(mgr, "r2") == t1[:2]  # device hits enter the table at match
    t2 = table_after(mgr, "r2", 1)
    assert t2[:2] == t1[:2] and t2[2] not in t1
    mgr.commit("r2", num_computed_tokens=len(hashes) * BS)
    mgr.finish("r2")

    stats = mgr.get_stats()
    assert (stats.lookup_blocks, stats.device_hit_blocks, stats.host_hit_blocks) == (7, 2, 0)
    assert stats.device_hit_tokens == 2 * BS and stats.hit_rate == pytest.approx(2 / 7)
    assert stats.cached_nodes == 5
    assert_no_leak(mgr)


def test_a_table_that_already_holds_everything_allocates_without_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = make(device=8)
    serve(mgr, "r1", keys("a", 4))
    hit = mgr.match("r2", keys("a", 4), prompt(keys("a", 4)))
    assert hit.num_device_hits == 4

    def no_pool(pool: BlockPool, n: int) -> list[int]:
        raise AssertionError("a full hit went to the pool")

    monkeypatch.setattr(BlockPool, "allocate", no_pool)
    for num_tokens in (4 * BS, 3 * BS + 1, 0):  # a full hit; asking for less
        alloc = mgr.allocate("r2", num_tokens=num_tokens)
        assert alloc and alloc.num_new_blocks == 0 and alloc.num_cached_tokens == 4 * BS
    assert mgr.request_state("r2").allocated
    monkeypatch.undo()
    alloc = mgr.allocate("r2", num_tokens=4 * BS + 1)  # one more position: the pool
    assert alloc and alloc.num_new_blocks == 1
    mgr.finish("r2")
    assert_no_leak(mgr)


def test_lifecycle_with_real_block_hashes() -> None:
    mgr = make(device=8)
    root = namespace_root(mgr.config.namespace_key())
    system = list(range(100, 100 + 2 * BS))

    h1 = BlockHasher(BS, root)
    h1.append([*system, 1, 2, 3, 4, 5])  # 3 full blocks and a partial one
    serve(mgr, "r1", h1.hashes)
    h2 = BlockHasher(BS, root)
    h2.append([*system, 9, 9, 9, 9])  # shares the two system-prompt blocks
    hit = mgr.match("r2", h2.hashes, prompt(h2.hashes))
    assert hit.num_device_hits == 2
    mgr.abort("r2")
    assert_no_leak(mgr)


def test_allocate_returns_the_whole_table_and_grows_it() -> None:
    mgr = make(device=8)
    first = serve(mgr, "r1", keys("a", 2))
    mgr.match("r2", keys("a", 3), prompt(keys("a", 3)))
    table = table_after(mgr, "r2", 2)
    assert len(table) == 4 and table[:2] == first
    assert table_ids(mgr, "r2") == table
    grown = table_after(mgr, "r2", 1)  # decode: one more block
    assert mgr.num_blocks("r2") == len(grown) == 5
    assert grown[:4] == table and len(grown) == 5
    assert grow(mgr, "r2", 0).num_new_blocks == 0 and table_ids(mgr, "r2") == grown
    assert len(set(grown)) == 5
    mgr.commit("r2", num_computed_tokens=len(keys("a", 3)) * BS)
    mgr.finish("r2")
    assert mgr.get_stats().cached_nodes == 3
    assert_no_leak(mgr)


def test_commit_is_incremental_and_idempotent_and_finish_frees_the_rest() -> None:
    mgr = make(device=8)
    mgr.match("r", keys("a", 4), prompt(keys("a", 4)))
    table = table_after(mgr, "r", 5)  # 4 full blocks + one being filled
    mgr.commit("r", num_computed_tokens=len(keys("a", 2)) * BS)
    assert [node(mgr, k).device_block for k in keys("a", 2)] == table[:2]
    mgr.commit("r", num_computed_tokens=len(keys("a", 3)) * BS)
    mgr.commit("r", num_computed_tokens=len(keys("a", 3)) * BS)
    with pytest.raises(ValueError, match=r"below the 12 tokens .* counts are tokens"):
        mgr.commit("r", num_computed_tokens=len(keys("a", 1)) * BS)  # a block count?
    assert mgr.get_stats().cached_nodes == 3
    with pytest.raises(ValueError, match="num_computed_tokens: 24 tokens fill 6 blocks"):
        mgr.commit("r", num_computed_tokens=len(keys("a", 6)) * BS)
    with pytest.raises(ValueError, match="only 4 block hashes"):
        mgr.commit("r", num_computed_tokens=5 * BS)  # allocated, but its hash is not known
    mgr.finish("r")
    # Three cached; the uncommitted two blocks went back to the pool.
    assert mgr.device_pool.num_used == 3
    assert {node(mgr, k).device_block for k in keys("a", 3)} == set(table[:3])
    assert_no_leak(mgr)


@pytest.mark.parametrize("release", ["finish", "abort"])
def test_release_keeps_committed_blocks_cached(release: str) -> None:
    mgr = make(device=8)
    mgr.match("r", keys("a", 3), prompt(keys("a", 3)))
    grow(mgr, "r", 3)
    mgr.commit("r", num_computed_tokens=len(keys("a", 2)) * BS)
    getattr(mgr, release)("r")
    assert mgr.device_pool.num_used == 2
    hit = mgr.match("again", keys("a", 3), prompt(keys("a", 3)))
    assert hit.num_device_hits == 2
    mgr.abort("again")
    assert_no_leak(mgr)


def test_match_of_an_active_id_raises_and_changes_nothing() -> None:
    mgr = make(device=8)
    serve(mgr, "r0", keys("a", 2))
    mgr.match("r", keys("a", 2), prompt(keys("a", 2)))
    before = mgr.get_stats()
    with pytest.raises(ValueError, match="already active"):
        mgr.match("r", keys("a", 2), prompt(keys("a", 2)))
    assert mgr.get_stats() == before
    assert [node(mgr, k).ref for k in keys("a", 2)] == [1, 1]
    mgr.finish("r")
    mgr.match("r", keys("a", 2), prompt(keys("a", 2)))  # a finished id may be used again
    mgr.finish("r")
    assert_no_leak(mgr)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.allocate("nope", num_tokens=1),
        lambda m: m.commit("nope", num_computed_tokens=0),
        lambda m: m.finish("nope"),
        lambda m: m.abort("nope"),
        lambda m: m.block_table("nope"),
    ],
    ids=["allocate", "commit", "finish", "abort", "block_table"],
)
def test_unknown_request_id_raises(call) -> None:
    mgr = make()
    serve(mgr, "done", ["a0"])
    before = mgr.get_stats()
    with pytest.raises(ValueError, match=r"request_id: 'nope' is not an active request"):
        call(mgr)
    assert mgr.get_stats() == before


def test_finished_request_is_unknown() -> None:
    mgr = make()
    serve(mgr, "r", ["a0"])
    for call in (mgr.finish, mgr.abort, mgr.block_table):
        with pytest.raises(ValueError, match="request_id"):
            call("r")


def test_negative_block_count_raises() -> None:
    mgr = make()
    mgr.match("r", [], prompt([]))
    with pytest.raises(ValueError, match=r"num_tokens: -4 is negative"):
        mgr.allocate("r", num_tokens=-4)
    assert table_ids(mgr, "r") == [] and mgr.device_pool.num_used == 0
    mgr.finish("r")


@pytest.mark.parametrize("policy", POLICIES)
def test_concurrently_computed_blocks_are_cached_once(policy: str) -> None:
    mgr = make(policy, device=6, host=8)
    hashes = keys("a", 2)
    for rid in ("r1", "r2"):
        assert mgr.match(rid, hashes, prompt(hashes)).num_hits == 0  # both miss: both compute
    t1 = table_after(mgr, "r1", 2)
    t2 = table_after(mgr, "r2", 2)
    mgr.commit("r1", num_computed_tokens=len(hashes) * BS)
    first = mgr.take_swap_metadata()
    mgr.commit(
        "r2", num_computed_tokens=len(hashes) * BS
    )  # already cached by r1: r2's copies stay private
    assert mgr.take_swap_metadata() == SwapTasks(None, None)  # no second backup
    assert [node(mgr, k).device_block for k in hashes] == t1
    mgr.apply_results(TransferResult(m.transfer_id, True) for m in emitted(first))
    mgr.finish("r2")
    assert not any(mgr.device_pool.is_allocated(b) for b in t2)
    mgr.finish("r1")
    assert mgr.device_pool.num_used == 2
    assert mgr.get_stats().backups == (2 if policy == "write_through" else 0)
    assert_no_leak(mgr)


def test_commit_gives_a_host_only_node_the_requests_device_copy() -> None:
    mgr = make("write_back", device=3, host=8)
    mgr.match("r1", ["a0"], prompt(["a0"]))
    mgr.match("r2", ["a0"], prompt(["a0"]))
    grow(mgr, "r1", 1)
    (mine,) = table_after(mgr, "r2", 1)
    mgr.commit("r1", num_computed_tokens=len(["a0"]) * BS)
    mgr.finish("r1")
    mgr.match("r3", keys("z", 2), prompt(keys("z", 2)))
    allocate(mgr, "r3", 2)  # pushes a0 out to host
    a0 = node(mgr, "a0")
    assert a0.state == NodeState.HOST
    mgr.commit(
        "r2", num_computed_tokens=len(["a0"]) * BS
    )  # r2 computed a0 too: its block becomes a0's copy
    assert (a0.state, a0.device_block) == (NodeState.DEVICE, mine) and a0.host_block >= 0
    mgr.finish("r2")
    assert mgr.device_pool.is_allocated(mine)
    hit = mgr.match("r4", ["a0"], prompt(["a0"]))
    assert (hit.num_device_hits, table_ids(mgr, "r4")) == (1, [mine])
    mgr.finish("r4")
    mgr.finish("r3")
    assert_no_leak(mgr)


def test_a_duplicate_folds_when_the_other_holder_finishes() -> None:
    # Issue 25 (a): r2 recomputed a0 while r1 held it cached, so r2's commit keeps
    # its own copy private. Once r1 is gone a0's copy is held by r2 alone: it gives
    # way to r2's, else r2 pins two blocks for one position and, alone, finds the
    # pool full forever.
    mgr = make("write_back", device=4, host=8)
    for rid in ("r1", "r2"):
        mgr.match(rid, ["a0"], prompt(["a0"]))
    table_after(mgr, "r1", 2)
    mine = table_after(mgr, "r2", 2)
    mgr.commit("r1", num_computed_tokens=BS)
    mgr.commit("r2", num_computed_tokens=BS)
    assert node(mgr, "a0").device_block != mine[0]  # r1 holds it: r2's copy stays private
    mgr.finish("r1")
    assert node(mgr, "a0").device_block == mine[0]
    assert mgr.device_pool.num_used == 2
    assert grow(mgr, "r2", 2)  # alone, it gets the whole pool
    mgr.finish("r2")
    assert_no_leak(mgr)


@pytest.mark.parametrize("other_leaves_first", [True, False])
def test_a_rolled_back_request_folds_a_copy_another_cached_meanwhile(
    other_leaves_first: bool,
) -> None:
    # Issue 25 (b): r's swap-in of a0, a1 failed; c swapped them in meanwhile and
    # leaves. Once r has recomputed them, the nodes' copies give way to r's (at its
    # commit, or when c leaves after it).
    mgr = on_host(device=6)
    hashes = [*keys("a", 2), "b2"]
    mgr.match("r", hashes, prompt(hashes))
    table = table_after(mgr, "r", 1)
    _, rollbacks = complete(mgr, success=False)
    assert rollbacks == [Rollback("r", (0, 1))]
    mgr.match("c", keys("a", 2), prompt(keys("a", 2)))
    allocate(mgr, "c", 0)
    complete(mgr)
    if other_leaves_first:
        mgr.finish("c")
    mgr.commit("r", num_computed_tokens=len(hashes) * BS)  # recomputed
    if not other_leaves_first:
        mgr.finish("c")
    assert [node(mgr, k).device_block for k in keys("a", 2)] == table[:2]
    assert mgr.device_pool.num_used == 3
    assert grow(mgr, "r", 3)  # alone, it gets the whole pool
    mgr.finish("r")
    assert_no_leak(mgr)


# -- allocation outcomes --------------------------------------------------------


def test_allocate_is_all_or_nothing() -> None:
    mgr = make(device=4)
    mgr.match("holder", keys("h", 3), prompt(keys("h", 3)))
    held = table_after(mgr, "holder", 3)  # locked, uncommitted: nothing to evict
    mgr.match("r", [], prompt([]))
    assert grow(mgr, "r", 2) == Allocation(AllocStatus.NO_SPACE)
    assert table_ids(mgr, "r") == []
    assert mgr.device_pool.num_free == 1
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    table = table_after(mgr, "r", 1)
    assert len(table) == 1 and table[0] not in held
    mgr.finish("r")
    mgr.finish("holder")
    assert_no_leak(mgr)


@pytest.mark.parametrize("held", [0, 2])
def test_demand_larger_than_the_device_raises(held: int) -> None:
    mgr = make(device=4)
    if held:
        serve(mgr, "r0", keys("a", held))
    # The request itself holds `held` blocks.
    mgr.match("r", keys("a", held), prompt(keys("a", held)))
    before = (table_ids(mgr, "r"), mgr.device_pool.stats())
    with pytest.raises(ValueError, match=r"num_tokens: .* more than the 4 device blocks"):
        grow(mgr, "r", 5 - held)
    assert (table_ids(mgr, "r"), mgr.device_pool.stats()) == before
    assert grow(mgr, "r", 4 - held)  # the most that can ever fit
    mgr.finish("r")
    assert_no_leak(mgr)


def test_allocate_waits_for_evictions_in_flight() -> None:
    mgr = make("write_back", device=4, host=8)
    tables = [serve(mgr, f"f{i}", [f"f{i}"])[0] for i in range(4)]
    mgr.match("r", keys("r", 2), prompt(keys("r", 2)))
    assert not grow(mgr, "r", 2)
    assert mgr.get_stats().queued_blocks == 2
    assert not grow(mgr, "r", 2)  # the copies already planned will do
    assert mgr.get_stats().queued_blocks == 2
    tasks = mgr.take_swap_metadata()
    meta = tasks.evict
    assert tasks.swap_in is None
    assert (meta.src_level, meta.dst_level) == (CacheLevel.DEVICE, CacheLevel.HOST)
    assert list(meta.src_block_ids) == tables[:2]  # least recently used first
    assert names(meta.block_hashes) == ["f0", "f1"]
    assert_reserved(mgr, meta)
    assert not grow(mgr, "r", 2)  # not before the result arrives
    assert_reserved(mgr, meta)
    assert mgr.apply_results([TransferResult(meta.transfer_id, True)]) == []
    table = table_after(mgr, "r", 2)
    assert sorted(table) == sorted(meta.src_block_ids)
    assert [node(mgr, k).state for k in ("f0", "f1")] == [NodeState.HOST] * 2
    mgr.finish("r")
    assert_no_leak(mgr)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_allocate_evicts_a_whole_chain_in_one_call(policy: str) -> None:
    mgr = make(policy, device=4, host=8)
    serve(mgr, "r1", keys("a", 4))
    mgr.match("r2", keys("b", 4), prompt(keys("b", 4)))
    alloc = grow(mgr, "r2", 4)
    if policy == "write_through":
        # Every block has a host copy: dropping the device copies needs no transfer.
        assert alloc and alloc.num_new_blocks == 4
    else:
        assert alloc == Allocation(AllocStatus.WAIT_FOR_TRANSFERS)
        assert mgr.get_stats().queued_blocks == 4


# -- write policies --------------------------------------------------------------


def test_write_back_copies_only_when_evicting() -> None:
    mgr = make("write_back", device=3, host=8)
    mgr.match("r1", keys("a", 2), prompt(keys("a", 2)))
    table = table_after(mgr, "r1", 2)
    mgr.commit("r1", num_computed_tokens=len(keys("a", 2)) * BS)
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    mgr.finish("r1")
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    assert all(node(mgr, k).host_block == -1 for k in keys("a", 2))
    push_out(mgr)
    stats = mgr.get_stats()
    assert stats.backups == 0 and stats.device_to_host_blocks == 2
    assert stats.device_evictions == 2
    assert [node(mgr, k).state for k in keys("a", 2)] == [NodeState.HOST] * 2
    assert mgr.device_pool.num_used == 0 and mgr.host_pool.num_used == 2
    assert not any(mgr.device_pool.is_allocated(b) for b in table)
    assert_no_leak(mgr)


def test_write_through_backs_up_every_committed_block() -> None:
    mgr = make("write_through", device=4, host=8)
    mgr.match("r1", keys("a", 3), prompt(keys("a", 3)))
    table = table_after(mgr, "r1", 3)
    mgr.commit("r1", num_computed_tokens=len(keys("a", 2)) * BS)
    backup = mgr.take_swap_metadata().evict
    assert (backup.src_level, backup.dst_level) == (CacheLevel.DEVICE, CacheLevel.HOST)
    assert list(backup.src_block_ids) == table[:2]
    assert list(backup.block_hashes) == keys("a", 2)
    assert len(set(backup.dst_block_ids)) == 2
    mgr.commit("r1", num_computed_tokens=len(keys("a", 3)) * BS)
    mgr.commit(
        "r1", num_computed_tokens=len(keys("a", 3)) * BS
    )  # already committed: no second backup
    tail = mgr.take_swap_metadata()
    assert tail.swap_in is None
    assert list(tail.evict.src_block_ids) == table[2:] and names(tail.evict.block_hashes) == [
        "a2"
    ]
    assert mgr.get_stats().backups == 3
    mgr.finish("r1")
    # While the backups are in flight their blocks stay pinned on the device.
    assert_reserved(mgr, backup)
    mgr.match("big", keys("z", 4), prompt(keys("z", 4)))
    assert not grow(mgr, "big", 4)
    assert mgr.get_stats().queued_blocks == 0
    mgr.apply_results(TransferResult(m.transfer_id, True) for m in (backup, tail.evict))
    for k, dst in zip(keys("a", 2), backup.dst_block_ids, strict=True):
        n = node(mgr, k)
        assert (n.state, n.host_block) == (NodeState.DEVICE, dst)
    mgr.abort("big")
    # A request matching them does not back them up again.
    mgr.match("r2", keys("a", 3), prompt(keys("a", 3)))
    mgr.finish("r2")
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    assert_no_leak(mgr)


def test_write_through_eviction_drops_the_device_copy_without_a_copy() -> None:
    mgr = make("write_through", device=3, host=8)
    for k in ("a", "b", "c"):
        serve(mgr, k, [k])
    hosts = {k: node(mgr, k).host_block for k in "abc"}
    assert all(h >= 0 for h in hosts.values())
    before = mgr.get_stats()
    mgr.match("r", keys("r", 2), prompt(keys("r", 2)))
    table = grow(mgr, "r", 2)  # no transfer to wait for
    assert table
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    after = mgr.get_stats()
    assert after.device_to_host_blocks == before.device_to_host_blocks
    assert after.device_evictions == before.device_evictions + 2
    for k in "ab":
        n = node(mgr, k)
        assert (n.state, n.device_block, n.host_block) == (NodeState.HOST, -1, hosts[k])
    assert node(mgr, "c").state == NodeState.DEVICE
    mgr.finish("r")
    assert_no_leak(mgr)


def test_failed_backup_frees_the_host_block_and_keeps_the_device_copy() -> None:
    mgr = make("write_through", device=2, host=4)
    mgr.match("r", ["a0"], prompt(["a0"]))
    (block,) = table_after(mgr, "r", 1)
    mgr.commit("r", num_computed_tokens=len(["a0"]) * BS)
    mgr.finish("r")
    tasks, _ = complete(mgr, success=False)
    assert tasks.evict is not None
    a0 = node(mgr, "a0")
    assert (a0.state, a0.device_block, a0.host_block) == (NodeState.DEVICE, block, -1)
    assert mgr.host_pool.num_used == 0
    assert mgr.get_stats().failed_transfers == 1
    # write_through owes it a host copy: evicting it makes the copy (the retry).
    push_out(mgr)
    assert node(mgr, "a0").state == NodeState.HOST
    stats = mgr.get_stats()
    assert (stats.backups, stats.backup_retries, stats.device_to_host_blocks) == (1, 1, 2)
    assert_no_leak(mgr)


def test_eviction_without_host_room_discards_leaves() -> None:
    mgr = on_host("write_back", device=2, host=1, chain=["a0"])
    mgr.match("holder", ["a0"], prompt(["a0"]))  # a0's host block cannot be given up
    for k in ("b0", "c0"):
        serve(mgr, k, [k])
    before = mgr.get_stats()
    mgr.match("r", ["n0"], prompt(["n0"]))
    table = table_after(mgr, "r", 1)
    assert table  # b0 is a leaf: discarded, no copy to wait for
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    assert node(mgr, "b0") is None and node(mgr, "c0").state == NodeState.DEVICE
    after = mgr.get_stats()
    assert after.device_evictions == before.device_evictions + 1
    assert after.device_to_host_blocks == before.device_to_host_blocks
    mgr.finish("r")
    mgr.finish("holder")
    assert_no_leak(mgr)


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_write_through_selective_backs_up_after_threshold_hits(threshold: int) -> None:
    mgr = make("write_through_selective", device=4, host=8, threshold=threshold)
    block = serve(mgr, "r0", ["hot"])[0]
    serve(mgr, "r1", ["cold"])
    assert mgr.get_stats().backups == 0
    for hit in range(1, threshold + 3):
        mgr.match(f"m{hit}", ["hot"], prompt(["hot"]))
        tasks = mgr.take_swap_metadata()
        if hit == threshold:
            assert tasks.evict is not None and tasks.swap_in is None
            assert list(tasks.evict.src_block_ids) == [block]
            assert names(tasks.evict.block_hashes) == ["hot"]
            mgr.apply_results([TransferResult(tasks.evict.transfer_id, True)])
        else:
            assert tasks == SwapTasks(None, None), f"backup at hit {hit}"
        mgr.finish(f"m{hit}")
    assert mgr.get_stats().backups == 1
    hot, cold = node(mgr, "hot"), node(mgr, "cold")
    assert hot.host_block >= 0 and cold.host_block == -1
    # Evicting both: the hot block keeps its host copy, the cold one is discarded.
    push_out(mgr)
    assert mgr.get_stats().device_to_host_blocks == 1  # only the backup ever copied
    assert node(mgr, "hot").state == NodeState.HOST
    assert node(mgr, "cold") is None
    assert_no_leak(mgr)


@pytest.mark.parametrize("policy", POLICIES)
def test_without_host_tier_evictions_discard_leaves(policy: str) -> None:
    mgr = make(policy, device=4, host=0)
    serve(mgr, "r1", keys("a", 3))  # a chain
    serve(mgr, "r2", ["b0"])
    for i in range(3):
        mgr.match(f"m{i}", ["b0"], prompt(["b0"]))  # enough hits for write_through_selective
        mgr.finish(f"m{i}")
    mgr.match("r3", keys("z", 4), prompt(keys("z", 4)))
    table = table_after(mgr, "r3", 4)
    assert table  # discarding needs no transfer
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    stats = mgr.get_stats()
    assert stats.cached_nodes == 0 and stats.device_evictions == 4
    assert stats.device_to_host_blocks == stats.backups == 0
    assert mgr.host_pool.num_used == 0
    mgr.finish("r3")
    hit = mgr.match("again", keys("a", 3), prompt(keys("a", 3)))
    assert hit.num_hits == 0
    mgr.finish("again")
    assert_no_leak(mgr)


# -- host hits and swap-ins -------------------------------------------------------


def on_host(policy: str = "write_back", *, device: int = 4, host: int = 8, chain=None):
    """A manager whose cache holds `chain` on host only."""
    chain = chain or keys("a", 2)
    mgr = make(policy, device=device, host=host)
    serve(mgr, "setup", chain)
    push_out(mgr)
    assert all(node(mgr, k).state == NodeState.HOST for k in chain)
    return mgr


def test_host_hit_is_swapped_in() -> None:
    mgr = on_host()
    hosts = [node(mgr, k).host_block for k in keys("a", 2)]
    hashes = [*keys("a", 2), "b2"]
    hit = mgr.match("r", hashes, prompt(hashes))
    assert (hit.num_device_hits, hit.num_host_hits) == (0, 2)
    assert table_ids(mgr, "r") == []  # host hits get device blocks from allocate
    table = table_after(mgr, "r", 1)
    assert len(table) == 3 and len(set(table)) == 3
    tasks = mgr.take_swap_metadata()
    meta = tasks.swap_in
    assert tasks.evict is None
    assert (meta.src_level, meta.dst_level) == (CacheLevel.HOST, CacheLevel.DEVICE)
    assert list(meta.src_block_ids) == hosts
    assert list(meta.dst_block_ids) == table[:2]
    assert list(meta.block_hashes) == keys("a", 2)
    assert [node(mgr, k).state for k in keys("a", 2)] == [NodeState.SWAP_TO_DEVICE] * 2
    assert_reserved(mgr, meta)
    assert mgr.apply_results([TransferResult(meta.transfer_id, True)]) == []
    for k, dev, host in zip(keys("a", 2), table[:2], hosts, strict=True):
        n = node(mgr, k)
        assert (n.state, n.device_block, n.host_block) == (NodeState.DEVICE, dev, host)
    mgr.commit("r", num_computed_tokens=len(hashes) * BS)
    mgr.finish("r")
    stats = mgr.get_stats()
    assert (stats.host_hit_blocks, stats.host_to_device_blocks) == (2, 2)
    assert stats.host_to_device_transfers == 1 and stats.host_hit_tokens == 2 * BS
    hit = mgr.match("r2", hashes, prompt(hashes))
    assert (hit.num_device_hits, hit.num_host_hits) == (3, 0)
    mgr.finish("r2")
    assert_no_leak(mgr)


def test_failed_swap_in_rolls_back_and_commit_readopts() -> None:
    mgr = on_host(chain=keys("a", 3))
    serve(mgr, "warm", ["a0"])  # a0 back on device; a1, a2 stay on host
    hashes = [*keys("a", 3), "b3"]
    hit = mgr.match("r", hashes, prompt(hashes))
    assert (hit.num_device_hits, hit.num_host_hits) == (1, 2)
    table = table_after(mgr, "r", 1)
    meta = mgr.take_swap_metadata().swap_in
    assert list(meta.dst_block_ids) == table[1:3]
    rollbacks = mgr.apply_results([TransferResult(meta.transfer_id, False, "h2d failed")])
    assert rollbacks == [Rollback("r", (1, 2))]
    # The request keeps its blocks (the engine recomputes into them); the nodes are
    # host-only again, with their host copies.
    assert table_ids(mgr, "r") == table
    for k in ("a1", "a2"):
        n = node(mgr, k)
        assert (n.state, n.device_block) == (NodeState.HOST, -1) and n.host_block >= 0
    stats = mgr.get_stats()
    assert (stats.failed_transfers, stats.rollbacks) == (1, 2)
    assert mgr.device_pool.num_used == 4
    # Recomputed and committed: the nodes take the request's blocks back.
    mgr.commit("r", num_computed_tokens=len(hashes) * BS)
    for k, block in zip(keys("a", 3), table, strict=False):
        n = node(mgr, k)
        assert (n.state, n.device_block) == (NodeState.DEVICE, block)
    mgr.finish("r")
    assert mgr.device_pool.num_used == 4  # a0..a2 and b3, nothing private left
    hit = mgr.match("r2", hashes, prompt(hashes))
    assert hit.num_device_hits == 4
    mgr.finish("r2")
    assert_no_leak(mgr)


def test_rolled_back_request_that_finishes_without_recomputing_frees_its_blocks() -> None:
    mgr = on_host()
    mgr.match("r", keys("a", 2), prompt(keys("a", 2)))
    grow(mgr, "r", 0)
    _, rollbacks = complete(mgr, success=False)
    assert rollbacks == [Rollback("r", (0, 1))]
    mgr.finish("r")
    assert mgr.device_pool.num_used == 0
    assert [node(mgr, k).state for k in keys("a", 2)] == [NodeState.HOST] * 2
    assert_no_leak(mgr)


@pytest.mark.parametrize("success", [True, False])
def test_swap_in_of_an_aborted_request_resolves_on_its_result(success: bool) -> None:
    mgr = on_host()
    mgr.match("r", keys("a", 2), prompt(keys("a", 2)))
    table = table_after(mgr, "r", 0)
    meta = mgr.take_swap_metadata().swap_in
    mgr.abort("r")
    assert_reserved(mgr, meta)  # still in flight: its blocks stay reserved
    assert mgr.device_pool.num_used == 2
    assert mgr.apply_results([TransferResult(meta.transfer_id, success)]) == []
    if success:  # the loaded blocks stay cached on device
        assert [node(mgr, k).device_block for k in keys("a", 2)] == table
        assert mgr.device_pool.num_used == 2
    else:  # garbage: freed
        assert [node(mgr, k).state for k in keys("a", 2)] == [NodeState.HOST] * 2
        assert mgr.device_pool.num_used == 0
    assert_no_leak(mgr)


def test_block_being_loaded_is_not_served_to_a_second_request() -> None:
    mgr = on_host(chain=["a0"])
    mgr.match("r1", ["a0"], prompt(["a0"]))
    grow(mgr, "r1", 0)
    meta = mgr.take_swap_metadata().swap_in
    hit = mgr.match("r2", ["a0"], prompt(["a0"]))
    rollbacks = mgr.apply_results([TransferResult(meta.transfer_id, False)])
    rolled_back = {rb.request_id for rb in rollbacks}
    assert hit.num_device_hits == 0 or "r2" in rolled_back


def test_second_request_with_the_host_hit_waits_for_the_first_swap_in() -> None:
    mgr = on_host(chain=["a0"])
    mgr.match("r1", ["a0"], prompt(["a0"]))
    mgr.match("r2", ["a0", "b1"], prompt(["a0", "b1"]))  # both see a0 on host
    t1 = table_after(mgr, "r1", 0)
    assert not grow(mgr, "r2", 1)  # r1 is loading a0
    meta = mgr.take_swap_metadata().swap_in
    assert meta.num_blocks == 1
    mgr.apply_results([TransferResult(meta.transfer_id, True)])
    t2 = table_after(mgr, "r2", 1)
    assert t2[0] == t1[0]  # shares the loaded block, no second swap-in
    assert mgr.take_swap_metadata().swap_in is None
    mgr.finish("r1")
    mgr.finish("r2")
    assert mgr.get_stats().host_to_device_transfers == 1
    assert_no_leak(mgr)


def test_commit_waits_for_the_swap_in_result() -> None:
    """Blocks computed on top of a swap-in are only valid if it succeeded, so commit
    is refused until its result is applied; after a failure the request recomputes
    and commits everything, and a later request is served the recomputed blocks."""
    mgr = on_host(chain=["a0"])
    mgr.match("r", ["a0", "b1"], prompt(["a0", "b1"]))
    grow(mgr, "r", 1)
    meta = mgr.take_swap_metadata().swap_in
    with pytest.raises(ValueError, match="swap-in without a result"):
        mgr.commit("r", num_computed_tokens=len(["a0", "b1"]) * BS)
    assert mgr.apply_results([TransferResult(meta.transfer_id, False)]) == [Rollback("r", (0,))]
    mgr.commit("r", num_computed_tokens=len(["a0", "b1"]) * BS)  # recomputed a0, computed b1
    mgr.finish("r")
    hit = mgr.match("r2", ["a0", "b1"], prompt(["a0", "b1"]))
    assert (hit.num_device_hits, hit.num_host_hits) == (2, 0)
    mgr.finish("r2")
    assert_no_leak(mgr)


# -- eviction results -------------------------------------------------------------


def _evicting(device: int = 2):
    """write_back with every device block cached by a single-block request, and an
    allocation that started evicting the least recently used one."""
    mgr = make("write_back", device=device, host=4)
    blocks = {f"c{i}": serve(mgr, f"c{i}", [f"c{i}"])[0] for i in range(device)}
    mgr.match("r", ["new"], prompt(["new"]))
    assert not grow(mgr, "r", 1)
    meta = mgr.take_swap_metadata().evict
    assert names(meta.block_hashes) == ["c0"] and list(meta.src_block_ids) == [blocks["c0"]]
    assert node(mgr, "c0").state == NodeState.SWAP_TO_HOST
    return mgr, meta, blocks


def test_failed_eviction_keeps_the_device_copy_and_frees_the_host_block() -> None:
    mgr, meta, blocks = _evicting()
    assert mgr.host_pool.num_used == 1
    assert mgr.apply_results([TransferResult(meta.transfer_id, False, "d2h")]) == []
    c0 = node(mgr, "c0")
    assert (c0.state, c0.device_block, c0.host_block) == (NodeState.DEVICE, blocks["c0"], -1)
    assert mgr.host_pool.num_used == 0 and mgr.device_pool.num_free == 0
    assert mgr.get_stats().failed_transfers == 1
    # It went back to the head of the list: the next attempt picks it again.
    assert not grow(mgr, "r", 1)
    retry = mgr.take_swap_metadata().evict
    assert names(retry.block_hashes) == ["c0"]
    mgr.apply_results([TransferResult(retry.transfer_id, True)])
    assert table_after(mgr, "r", 1) == [blocks["c0"]]
    mgr.finish("r")
    assert_no_leak(mgr)


def test_failed_evictions_return_to_the_head_in_their_lru_order() -> None:
    mgr = make("write_back", device=3, host=4)
    for k in ("c0", "c1", "c2"):
        serve(mgr, k, [k])
    mgr.match("r", keys("n", 2), prompt(keys("n", 2)))
    assert not grow(mgr, "r", 2)
    tasks, _ = complete(mgr, success=False)
    assert names(tasks.evict.block_hashes) == ["c0", "c1"]
    mgr.abort("r")
    for expected in ("c0", "c1", "c2"):  # the oldest first, as before the failure
        mgr.match(f"one-{expected}", ["x"], prompt(["x"]))
        assert not grow(mgr, f"one-{expected}", 1)
        meta = mgr.take_swap_metadata().evict
        assert names(meta.block_hashes) == [expected]
        mgr.apply_results([TransferResult(meta.transfer_id, False)])
        mgr.abort(f"one-{expected}")
        # Put it behind the others so the next one is up.
        mgr.match(f"touch-{expected}", [expected], prompt([expected]))
        mgr.finish(f"touch-{expected}")
    assert_no_leak(mgr)


@pytest.mark.parametrize("release_before_result", [False, True])
def test_eviction_revived_by_a_match_keeps_its_device_copy(release_before_result: bool) -> None:
    mgr, meta, blocks = _evicting()
    hit = mgr.match("reader", ["c0"], prompt(["c0"]))
    assert hit.num_device_hits == 1
    assert table_ids(mgr, "reader") == [blocks["c0"]]
    if release_before_result:
        mgr.finish("reader")
    mgr.apply_results([TransferResult(meta.transfer_id, True)])
    c0 = node(mgr, "c0")
    assert (c0.state, c0.device_block) == (NodeState.DEVICE, blocks["c0"])
    assert c0.host_block == meta.dst_block_ids[0]  # and it now has a host copy
    assert mgr.device_pool.is_allocated(blocks["c0"])
    if not release_before_result:
        mgr.finish("reader")
    # c0 was used after c1, so the waiting request gets c1's block.
    assert allocate(mgr, "r", 1) == [blocks["c1"]]
    assert node(mgr, "c0").device_block == blocks["c0"]
    mgr.finish("r")
    assert_no_leak(mgr)


def _three_transfers():
    """A D2H eviction, an H2D swap-in and a second eviction, all in flight."""
    mgr = on_host(chain=["h0"])
    for k in ("b0", "c0", "d0"):
        serve(mgr, k, [k])
    metas = []
    mgr.match("r1", keys("x", 2), prompt(keys("x", 2)))
    assert not grow(mgr, "r1", 2)  # evicts b0
    metas.append(mgr.take_swap_metadata().evict)
    mgr.match("r2", ["h0"], prompt(["h0"]))
    assert grow(mgr, "r2", 0)  # the last free block, swapped into
    metas.append(mgr.take_swap_metadata().swap_in)
    mgr.match("r3", keys("y", 2), prompt(keys("y", 2)))
    # One block is already on its way out (for r1); r3 evicts the one more it needs.
    assert not grow(mgr, "r3", 2)  # evicts c0
    metas.append(mgr.take_swap_metadata().evict)
    assert all(m is not None for m in metas)
    return mgr, metas


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_results_apply_in_any_order(order: tuple[int, ...]) -> None:
    mgr, metas = _three_transfers()
    pending = list(metas)
    for i in order:
        for m in pending:
            assert_reserved(mgr, m)
        assert mgr.apply_results([TransferResult(metas[i].transfer_id, True)]) == []
        pending.remove(metas[i])
    assert [node(mgr, k).state for k in ("b0", "c0")] == [NodeState.HOST] * 2
    assert node(mgr, "h0").state == NodeState.DEVICE
    assert sorted(table_after(mgr, "r1", 2)) == sorted(
        [*metas[0].src_block_ids, *metas[2].src_block_ids]
    )
    mgr.finish("r1")
    mgr.finish("r2")
    assert grow(mgr, "r3", 2)
    mgr.finish("r3")
    assert_no_leak(mgr)


def test_results_in_one_batch_in_reverse_order() -> None:
    mgr, metas = _three_transfers()
    mgr.apply_results(TransferResult(m.transfer_id, True) for m in reversed(metas))
    assert mgr.num_inflight_transfers == 0
    for rid in ("r1", "r2", "r3"):
        mgr.abort(rid)
    assert_no_leak(mgr)


def test_unknown_or_repeated_transfer_id_raises() -> None:
    mgr, metas = _three_transfers()
    with pytest.raises(ValueError, match=r"transfer_id: 999 is unknown or already applied"):
        mgr.apply_results([TransferResult(999, True)])
    assert mgr.num_inflight_transfers == 3
    mgr.apply_results([TransferResult(metas[0].transfer_id, True)])
    with pytest.raises(ValueError, match=rf"transfer_id: {metas[0].transfer_id} is unknown"):
        mgr.apply_results([TransferResult(metas[0].transfer_id, True)])
    with pytest.raises(ValueError, match="transfer_id"):
        mgr.apply_results([TransferResult(-1, False)])
    with pytest.raises(ValueError, match=rf"transfer_id: {metas[1].transfer_id} is unknown"):
        # Listed twice in one batch: the batch is refused as a whole.
        mgr.apply_results([TransferResult(metas[1].transfer_id, True)] * 2)
    assert mgr.num_inflight_transfers == 2
    mgr.apply_results([TransferResult(metas[1].transfer_id, True)])
    mgr.apply_results([TransferResult(metas[2].transfer_id, True)])
    for rid in ("r1", "r2", "r3"):
        mgr.abort(rid)
    assert_no_leak(mgr)


def test_a_lookup_answer_without_a_storage_tier_refuses_the_whole_batch() -> None:
    mgr, metas = _three_transfers()
    batch = [TransferResult(metas[0].transfer_id, True), LookupResult(0, 1)]
    with pytest.raises(ValueError, match="no storage tier"):
        mgr.apply_results(batch)
    assert mgr.num_inflight_transfers == 3, "the transfer before it was not applied"
    mgr.apply_results(TransferResult(m.transfer_id, True) for m in metas)
    for rid in ("r1", "r2", "r3"):
        mgr.abort(rid)
    assert_no_leak(mgr)


def test_batch_with_an_unknown_transfer_id_loses_no_rollback() -> None:
    mgr = on_host(chain=["a0"])
    mgr.match("r", ["a0"], prompt(["a0"]))
    grow(mgr, "r", 0)
    meta = mgr.take_swap_metadata().swap_in
    with pytest.raises(ValueError, match="transfer_id"):
        mgr.apply_results([TransferResult(meta.transfer_id, False), TransferResult(999, True)])
    # Either nothing was applied (the failure can be reported again) ...
    assert mgr.num_inflight_transfers == 1
    assert mgr.apply_results([TransferResult(meta.transfer_id, False)]) == [Rollback("r", (0,))]


def _run_step(mgr) -> list[int]:
    tasks = mgr.take_swap_metadata()
    metas = emitted(tasks)
    assert metas
    if tasks.evict and tasks.swap_in:
        assert tasks.evict.transfer_id != tasks.swap_in.transfer_id
    mgr.apply_results(TransferResult(m.transfer_id, True) for m in metas)
    return [m.transfer_id for m in metas]


def test_transfer_ids_are_unique_and_increasing() -> None:
    mgr = on_host("write_through", device=3, host=8, chain=keys("a", 2))
    ids = []
    for i in range(6):
        # Each round: a host hit to swap in, a new block to back up, and evictions.
        mgr.match(f"r{i}", ["a0", f"n{i}"], prompt(["a0", f"n{i}"]))
        table = allocate(mgr, f"r{i}", 1)
        assert table
        ids += _run_step(mgr)  # the swap-in and evictions
        mgr.commit(f"r{i}", num_computed_tokens=len(["a0", f"n{i}"]) * BS)
        ids += _run_step(mgr)  # the backup the commit planned
        mgr.finish(f"r{i}")
        push_out(mgr)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert_no_leak(mgr)


def test_empty_take_emits_nothing() -> None:
    mgr = make()
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    assert mgr.apply_results([]) == []
    assert mgr.num_inflight_transfers == 0


# -- stats ---------------------------------------------------------------------


def test_get_stats_figures() -> None:
    mgr = make("write_back", device=4, host=2)
    for k in ("a", "b", "c", "d"):
        serve(mgr, k, [k])
    s = mgr.get_stats()
    assert (s.lookup_blocks, s.device_hit_blocks, s.host_hit_blocks) == (4, 0, 0)
    assert s.device_pool.used == 4 and s.device_pool.usage == 1.0

    mgr.match("e", keys("e", 2), prompt(keys("e", 2)))
    assert not grow(mgr, "e", 2)  # evicts a and b
    s = mgr.get_stats()
    assert (s.queued_blocks, s.inflight_transfers, s.inflight_blocks) == (2, 0, 0)
    assert s.device_evictions == 2 and s.active_requests == 1
    evict = mgr.take_swap_metadata().evict
    s = mgr.get_stats()
    assert (s.queued_blocks, s.inflight_transfers, s.inflight_blocks) == (0, 1, 2)
    assert (s.device_to_host_blocks, s.device_to_host_transfers) == (2, 1)
    assert s.host_pool.used == 2
    mgr.apply_results([TransferResult(evict.transfer_id, True)])
    allocate(mgr, "e", 2)
    mgr.commit("e", num_computed_tokens=len(keys("e", 2)) * BS)
    mgr.finish("e")

    # a comes back from host; the host tier is full, so b's host copy is dropped to
    # make room for c's eviction, which makes room on the device for a.
    hit = mgr.match("a2", ["a"], prompt(["a"]))
    assert hit.num_host_hits == 1
    allocate(mgr, "a2", 0)
    assert node(mgr, "b") is None
    tasks, _ = complete(mgr)
    assert tasks.swap_in is not None
    s = mgr.get_stats()
    assert (s.lookup_blocks, s.device_hit_blocks, s.host_hit_blocks) == (7, 0, 1)
    assert s.hit_rate == pytest.approx(1 / 7) and s.host_hit_tokens == BS
    assert (s.device_to_host_blocks, s.device_to_host_transfers) == (3, 2)
    assert (s.host_to_device_blocks, s.host_to_device_transfers) == (1, 1)
    assert (s.device_evictions, s.host_evictions, s.backups) == (3, 1, 0)
    assert (s.failed_transfers, s.rollbacks) == (0, 0)
    assert (s.inflight_transfers, s.inflight_blocks, s.queued_blocks) == (0, 0, 0)
    assert s.active_requests == 1
    assert s.cached_nodes == 5  # a, c, d, e0, e1
    assert (s.device_pool.used, s.device_pool.capacity) == (4, 4)
    assert (s.host_pool.used, s.host_pool.capacity, s.host_pool.usage) == (2, 2, 1.0)
    assert s.block_size == BS
    mgr.finish("a2")
    assert_no_leak(mgr)


def test_failures_count_in_stats() -> None:
    mgr = on_host()
    mgr.match("r", keys("a", 2), prompt(keys("a", 2)))
    grow(mgr, "r", 0)
    complete(mgr, success=False)
    s = mgr.get_stats()
    assert (s.failed_transfers, s.rollbacks, s.host_to_device_transfers) == (1, 2, 1)
    mgr.finish("r")
    assert_no_leak(mgr)


# -- everything at once ----------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("host", [0, 3, 12])
def test_mixed_workload_leaves_no_leak(policy: str, host: int) -> None:
    mgr = make(policy, device=6, host=host)
    docs = [keys("s", 2) + keys(f"d{i}_", 2) for i in range(5)]
    outstanding = []
    for step, doc in enumerate(docs * 3):
        rid = f"q{step}"
        hit = mgr.match(rid, doc, prompt(doc))
        alloc = grow(mgr, rid, len(doc) - hit.num_hits)
        tasks = mgr.take_swap_metadata()
        outstanding += emitted(tasks)
        if not alloc or step % 4 == 3:
            mgr.abort(rid)
        else:
            try:
                mgr.commit(rid, num_computed_tokens=len(doc) * BS)
            except ValueError:  # its swap-in has no result yet: the step catches up
                results = [
                    TransferResult(m.transfer_id, (m.transfer_id % 3) != 0) for m in outstanding
                ]
                outstanding.clear()
                rollbacks = mgr.apply_results(results)
                assert {r.request_id for r in rollbacks} <= {rid}
                mgr.commit(
                    rid, num_computed_tokens=len(doc) * BS
                )  # recomputed, if its swap-in failed
            mgr.finish(rid)
        if step % 2:  # results arrive late, newest first, every third one failing
            results = [
                TransferResult(m.transfer_id, (m.transfer_id % 3) != 0)
                for m in reversed(outstanding)
            ]
            outstanding.clear()
            mgr.apply_results(results)
    mgr.apply_results(TransferResult(m.transfer_id, True) for m in outstanding)
    assert_no_leak(mgr)


# -- the API a user reaches for first ----------------------------------------------


@pytest.mark.parametrize(("extra_tokens", "hits"), [(0, 2), (1, 3), (BS - 1, 3)])
def test_full_hit_leaves_the_last_token_to_compute(extra_tokens: int, hits: int) -> None:
    """Every block of a block-aligned prompt is cached: the manager still leaves its
    last block to compute (its last token's logits start decoding)."""
    mgr = make(device=8)
    serve(mgr, "first", keys("a", 3))
    hit = mgr.match("again", keys("a", 3), 3 * BS + extra_tokens)
    assert (hit.num_device_hits, hit.num_cached_tokens) == (hits, hits * BS)
    assert hit.num_cached_tokens < 3 * BS + extra_tokens
    table = table_after(mgr, "again", 3 - hits + (extra_tokens > 0))
    mgr.commit(
        "again", num_computed_tokens=3 * BS + extra_tokens
    )  # the recomputed block stays private
    mgr.finish("again")
    assert mgr.get_stats().cached_nodes == 3 and len(table) == 3 + (extra_tokens > 0)
    assert mgr.match("empty", [], 0).num_hits == 0
    mgr.finish("empty")
    assert_no_leak(mgr)


def test_commit_takes_a_count_and_uses_the_hashes_the_manager_holds() -> None:
    """The decode loop of the README: the hashes of blocks completed by decoded
    tokens are appended, and commit caches them from a token count alone."""
    mgr = make(device=8)
    mgr.match("r", keys("a", 2), 2 * BS + 2)  # two full blocks and two more tokens
    assert grow(mgr, "r", 3)
    mgr.commit("r", num_computed_tokens=2 * BS + 2)
    assert mgr.get_stats().cached_nodes == 2
    # Decoding completes block 2: its hash arrives, and the next step computes it.
    mgr.append_hashes("r", ["a2"])
    mgr.commit("r", num_computed_tokens=2 * BS + 3)  # block 2 not full yet: nothing new
    assert mgr.get_stats().cached_nodes == 2
    mgr.commit("r", num_computed_tokens=3 * BS)
    assert node(mgr, "a2").device_block == table_ids(mgr, "r")[2]
    # Computed tokens past the known hashes: refused, with the cure in the message.
    assert grow(mgr, "r", 1)
    with pytest.raises(ValueError, match=r"only 3 block hashes .* append_hashes"):
        mgr.commit("r", num_computed_tokens=4 * BS)
    mgr.finish("r")
    hit = mgr.match("next", keys("a", 4), 4 * BS + 1)
    assert hit.num_device_hits == 3
    mgr.finish("next")
    assert_no_leak(mgr)


def test_a_hash_cached_under_another_prefix_is_refused_not_grafted() -> None:
    mgr = make(device=8)
    serve(mgr, "r0", ["x0", "x1"])
    mgr.match("r", ["a0"], BS + 1)
    assert grow(mgr, "r", 2)
    mgr.append_hashes("r", ["x1"])  # not a chained hash: x1 hangs under x0
    before = (mgr.get_stats(), [(n.key, n.ref) for n in mgr.tree])
    with pytest.raises(ValueError, match="already cached under another prefix"):
        mgr.commit("r", num_computed_tokens=2 * BS)
    assert (mgr.get_stats(), [(n.key, n.ref) for n in mgr.tree]) == before
    mgr.commit("r", num_computed_tokens=BS)  # the good part still commits
    mgr.finish("r")
    assert node(mgr, "x1").parent is node(mgr, "x0")
    assert_no_leak(mgr)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda m: m.match("n", ["a0", "a1", ["late"]], 13), TypeError),
        (lambda m: m.match("n", iter(["a0"]), 5), TypeError),
        (lambda m: m.match("n", ["a0", "a0"], 9), ValueError),
        (lambda m: m.match("n", ["a0", "a1"], 2 * BS - 1), ValueError),
        (lambda m: m.match("n", ["a0"], 5.0), ValueError),
        (lambda m: m.match("held", [], 1), ValueError),
        (lambda m: m.allocate("held", num_tokens=1.5), ValueError),
        (lambda m: m.allocate("held", num_tokens=True), ValueError),
        (lambda m: m.allocate("held", num_tokens="1"), ValueError),
        (lambda m: m.allocate("held", 4), TypeError),
        (lambda m: m.commit("held", num_computed_tokens=4.0), ValueError),
        (lambda m: m.commit("held", num_computed_tokens=True), ValueError),
        (lambda m: m.commit("held", 4), TypeError),
        (lambda m: m.commit("held", num_computed_tokens=1), ValueError),
        (lambda m: m.append_hashes("held", ["z", ["unhashable"]]), TypeError),
        (lambda m: m.append_hashes("held", "z"), TypeError),
        (lambda m: m.append_hashes("held", ["a0", "z"]), ValueError),
        (lambda m: m.append_hashes("held", [b"x"]), TypeError),
        (lambda m: m.match("n", [b"x"], 5), TypeError),
        (lambda m: m.match("n", [hash("a0")], 5), TypeError),
        (lambda m: m.match("n", [H("a0"), b"\0" * 31], 9), TypeError),
        (lambda m: m.append_tokens("held", [1, 2, 3]), ValueError),
        (lambda m: m.block_table("held", 2), ValueError),
        (lambda m: m.apply_results([None]), TypeError),
    ],
    ids=[
        "match-unhashable-late",
        "match-iterator",
        "match-repeated-hash",
        "match-hashes-past-num_tokens",
        "match-float-tokens",
        "match-active-id",
        "allocate-float",
        "allocate-bool",
        "allocate-str",
        "allocate-positional-count",
        "commit-float",
        "commit-bool",
        "commit-positional-count",
        "commit-below-the-cached-prefix",
        "append-unhashable",
        "append-str",
        "append-the-whole-list-again",
        "append-short-digest",
        "match-short-digest",
        "match-python-hash-int",
        "match-31-byte-digest",
        "append-tokens-to-a-hash-request",
        "table-start-past-the-end",
        "apply-non-result",
    ],
)
def test_a_refused_call_changes_nothing(call, error) -> None:
    from tests.scheduler.test_stateful import snapshot

    mgr = make(device=8)
    serve(mgr, "old", keys("a", 2))
    mgr.match("held", keys("a", 1), BS + 1)
    before = snapshot(mgr.mgr)
    with pytest.raises(error):
        call(mgr)
    assert snapshot(mgr.mgr) == before
    mgr.finish("held")
    assert_no_leak(mgr)


def test_allocate_says_wait_only_while_planned_transfers_will_free_the_blocks() -> None:
    mgr = make("write_back", device=4, host=8)
    for i in range(4):
        serve(mgr, f"f{i}", [f"f{i}"])
    mgr.match("r", [], 1)
    alloc = grow(mgr, "r", 3)
    assert alloc == Allocation(AllocStatus.WAIT_FOR_TRANSFERS)
    assert mgr.get_stats().queued_blocks == 3
    # The documented loop: send the planned swaps, apply the results, retry.
    while not (alloc := grow(mgr, "r", 3)):
        assert alloc.status is AllocStatus.WAIT_FOR_TRANSFERS
        complete(mgr)
    assert alloc.num_new_blocks == 3 and len(table_ids(mgr, "r")) == 3
    # A second request: the blocks are held by "r", not in flight.
    mgr.match("s", [], 1)
    assert grow(mgr, "s", 2) == Allocation(AllocStatus.NO_SPACE)
    assert mgr.take_swap_metadata() == SwapTasks(None, None)
    mgr.finish("r")
    assert grow(mgr, "s", 2)
    mgr.finish("s")
    assert_no_leak(mgr)


def test_device_blocks_below_a_host_hit_count_toward_what_can_never_fit() -> None:
    """A failed swap-in leaves X on host while another request's child Y of X stays
    on the device; a request matching [X, Y] holds Y's device block too, so asking
    for the rest of the pool can never fit and raises instead of waiting forever."""
    mgr = on_host("write_back", device=4, host=8, chain=["X"])
    mgr.match("C", ["X"], BS + 1)  # host hit: C loads X
    assert grow(mgr, "C", 0)
    load = mgr.take_swap_metadata().swap_in
    mgr.match("A", ["X", "Y"], 2 * BS + 1)  # stops at X while it loads
    assert grow(mgr, "A", 2)
    mgr.commit(
        "A", num_computed_tokens=2 * BS
    )  # A computed X itself; Y hangs under X on the device
    mgr.finish("A")
    mgr.apply_results([TransferResult(load.transfer_id, False)])  # X back to host only
    mgr.abort("C")
    x, y = node(mgr, "X"), node(mgr, "Y")
    assert (x.state, y.state, y.parent) == (NodeState.HOST, NodeState.DEVICE, x)
    hit = mgr.match("D", ["X", "Y", "Z"], 3 * BS + 1)
    # Y is on the device but below host-only X: allocate brings both into the table.
    assert (hit.num_host_hits, hit.num_device_hits) == (2, 0)
    before = mgr.get_stats()
    with pytest.raises(ValueError, match="would hold 5 device blocks"):
        grow(mgr, "D", 3)  # Y + X's swap-in + 3 new > 4
    assert mgr.get_stats() == before
    table = allocate(mgr, "D", 2)  # the most that fits, after the documented waits
    assert table[1] == y.device_block and len(table) == 4
    mgr.finish("D")
    assert_no_leak(mgr)


def test_backups_without_host_room_are_counted_and_retried_at_eviction() -> None:
    mgr = make("write_through", device=4, host=1)
    mgr.match("holder", ["h0"], BS + 1)
    assert grow(mgr, "holder", 1)
    mgr.commit("holder", num_computed_tokens=BS)  # takes the only host block
    complete(mgr)
    mgr.match("r", keys("a", 2), 2 * BS + 1)
    assert grow(mgr, "r", 2)
    mgr.commit("r", num_computed_tokens=2 * BS)
    stats = mgr.get_stats()
    assert (stats.backups, stats.backups_without_room) == (1, 2)
    mgr.finish("holder")  # its host copy may now be dropped
    mgr.finish("r")
    push_out(mgr)  # a1, then a0, get their owed copies as they are evicted
    stats = mgr.get_stats()
    assert (stats.backup_retries, stats.device_to_host_blocks) == (2, 3)
    # One host block: the last copy made (a0's) is the one kept.
    assert node(mgr, "a0").state == NodeState.HOST and node(mgr, "a1") is None
    assert_no_leak(mgr)


# -- reuse_evicted_blocks: FastDeploy's synchronous allocation ----------------------


def _reusing(device: int = 3):
    """write_back with reuse: a chain a0 <- a1 cached, then a request taking the
    whole pool gets a1's and a0's device blocks at once, their copies planned."""
    mgr = Checked(
        CacheManager(
            CacheConfig(
                block_size=BS,
                num_device_blocks=device,
                num_host_blocks=8,
                write_policy="write_back",
                reuse_evicted_blocks=True,
            )
        )
    )
    serve(mgr, "setup", keys("a", 2))
    mgr.match("big", [], 1)
    alloc = grow(mgr, "big", device)
    assert alloc, "reuse hands evicted blocks over without waiting"
    meta = mgr.take_swap_metadata().evict
    assert names(meta.block_hashes) == ["a1", "a0"]  # leaf first
    assert sorted(meta.src_block_ids) == sorted(table_ids(mgr, "big")[-2:])
    assert [node(mgr, k).state for k in ("a0", "a1")] == [NodeState.PENDING_HOST] * 2
    return mgr, meta


def test_reused_eviction_lands_on_host_and_is_not_read_before() -> None:
    mgr, meta = _reusing()
    hit = mgr.match("early", keys("a", 2), prompt(keys("a", 2)))
    assert (hit.num_hits, hit.waiting_on_transfer) == (0, True)  # not readable yet
    mgr.abort("early")
    mgr.apply_results([TransferResult(meta.transfer_id, True)])
    hit = mgr.match("late", keys("a", 2), prompt(keys("a", 2)))
    assert hit.num_host_hits == 2
    mgr.abort("late")
    mgr.abort("big")
    assert_no_leak(mgr)


def test_failed_reused_eviction_drops_the_lost_blocks_and_their_subtree() -> None:
    mgr, meta = _reusing()
    mgr.apply_results([TransferResult(meta.transfer_id, False)])
    assert node(mgr, "a0") is None and node(mgr, "a1") is None
    assert mgr.host_pool.num_used == 0
    assert mgr.match("again", keys("a", 2), prompt(keys("a", 2))).num_hits == 0
    mgr.abort("again")
    mgr.abort("big")
    assert_no_leak(mgr)


def test_a_recomputed_block_rescues_a_reused_eviction() -> None:
    """A request that computed a0 itself commits it while a0's copy is in flight:
    its device block becomes a0's copy, so a0 survives the copy failing."""
    mgr, meta = _reusing()
    mgr.abort("big")  # its blocks are free again; the copies still read them first
    mgr.match("r", ["a0"], BS + 1)  # stops at a0: in flight
    assert table_after(mgr, "r", 1)
    mgr.commit("r", num_computed_tokens=BS)
    assert node(mgr, "a0").state == NodeState.BACKUP_TO_HOST
    mgr.apply_results([TransferResult(meta.transfer_id, False)])
    a0 = node(mgr, "a0")
    assert (a0.state, a0.device_block) == (NodeState.DEVICE, table_ids(mgr, "r")[0])
    assert node(mgr, "a1") is None  # a1 had no other copy
    mgr.finish("r")
    assert_no_leak(mgr)


def test_pool_and_transfer_queries_answer_without_reaching_inside() -> None:
    mgr = make("write_back", device=4, host=4)
    assert mgr.free_device_block_ids() == [3, 2, 1, 0]  # the next allocated comes last
    assert mgr.num_free_host_blocks == 4
    mgr.match("a", keys("a", 3), 3 * BS + 1)
    assert mgr.allocate("a", num_tokens=3 * BS + 1)
    mgr.commit("a", num_computed_tokens=3 * BS)
    mgr.finish("a")
    assert mgr.free_device_block_ids() == [3]  # the uncommitted tail came back
    mgr.match("b", keys("b", 2), 2 * BS + 1)
    assert grow(mgr, "b", 2).status is AllocStatus.WAIT_FOR_TRANSFERS  # evictions planned
    evict = mgr.take_swap_metadata().evict
    assert evict is not None and mgr.is_inflight(evict.transfer_id)
    assert mgr.num_free_host_blocks == 4 - evict.num_blocks
    mgr.apply_results([TransferResult(evict.transfer_id, True)])
    assert not mgr.is_inflight(evict.transfer_id)
    assert not mgr.is_inflight(10**6)
