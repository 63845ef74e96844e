"""fastkv as FastDeploy's cache manager v1, driven by ResourceManagerV1's own call
sequences (fd_engine.Engine) with real CPU workers and the real results channel.

Every flow asserts block accounting after every step (`check_invariants` on the
underlying fastkv CacheManager) and, at the end, that nothing is active, in flight
or leaked; every position a request reads is checked against the bytes written for
it (fd_engine raises KVMismatch otherwise); and outputs equal a reference run with
prefix caching off and a pool large enough to never evict.
"""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("paddle", reason="the workers' CacheController needs paddle")

from fd_engine import Engine, make_engine, prompt
from fd_standins import BatchRequest, Request, install_fake_fastdeploy

from fastkv.integrations.fd_transfers import transfer_ids
from fastkv.integrations.fd_views import fd_digests
from fastkv.metadata import TransferResult
from fastkv.worker.faults import FaultInjector

SYSTEM = prompt(0, 8)  # two blocks many requests share


@pytest.fixture(autouse=True)
def fake_fastdeploy(monkeypatch):
    """FastDeploy's metadata classes importable, as in a deployment: the adapter
    emits them and BatchRequest merges them."""
    install_fake_fastdeploy(monkeypatch)


def run(engine: Engine, arrivals: dict[int, list[Request]], max_steps: int = 400):
    try:
        outputs = engine.run(arrivals, max_steps)
        engine.drain()
        return outputs
    finally:
        engine.close()


def reference(arrivals: dict[int, list[Request]]) -> dict[str, list[int]]:
    """The outputs without any cache: prefix caching off, no eviction ever."""
    fresh = {
        step: [Request(r.request_id, r.prompt_token_ids, r.max_tokens) for r in reqs]
        for step, reqs in arrivals.items()
    }
    engine = make_engine(f"ref-{uuid.uuid4().hex}", device_blocks=256, prefix_caching=False)
    outputs = run(engine, fresh)
    assert engine.cm.get_stats()["lookup_blocks"] == 0  # never matched
    return outputs


def copy(arrivals: dict[int, list[Request]]) -> dict[int, list[Request]]:
    return {
        s: [Request(r.request_id, r.prompt_token_ids, r.max_tokens) for r in reqs]
        for s, reqs in arrivals.items()
    }


def host_hit_workload() -> dict[int, list[Request]]:
    """a caches four blocks; b's eviction pushes a's leaf to host; c repeats a's
    prompt (and more): three device hits and one host hit."""
    return {
        0: [Request("a", SYSTEM + prompt(1, 8), 2)],
        4: [Request("b", prompt(2, 24), 2)],
        8: [Request("c", SYSTEM + prompt(1, 8) + prompt(3, 3), 2)],
    }


def test_admission_with_device_and_host_hits(channel: str) -> None:
    arrivals = host_hit_workload()
    engine = make_engine(channel, device_blocks=10, host_blocks=16)
    swaps = []

    def record(step, batch):
        if batch.cache_swap_metadata is not None:
            c = engine.requests["c"]
            swaps.append((list(batch.cache_swap_metadata.dst_block_ids), list(c.block_tables)))

    engine.step_hooks.append(record)
    outputs = run(engine, arrivals)
    assert engine.log.matches["c"] == [(3, 1)]
    (dst, table), *_ = swaps
    assert dst == table[3:4]  # the first matched_host_nums new blocks: swap-in targets
    stats = engine.cm.get_stats()
    assert (stats["device_hit_blocks"], stats["host_hit_blocks"]) == (3, 1)
    assert stats["device_to_host_blocks"] >= 1 and stats["host_to_device_blocks"] == 1
    assert engine.log.reads_checked > 0
    assert outputs == reference(host_hit_workload())


def test_full_prompt_hit_computes_the_last_block(channel: str) -> None:
    full = SYSTEM + prompt(4, 8)  # 16 tokens: four full blocks
    arrivals = {0: [Request("a", full, 1)], 3: [Request("again", full, 2)]}
    engine = make_engine(channel, device_blocks=16)
    prefills = []
    engine.step_hooks.append(
        lambda s, batch: prefills.extend(
            (r.request_id, r.prefill_start_index, r.prefill_end_index)
            for r in batch
            if isinstance(r, Request)
        )
    )
    outputs = run(engine, arrivals)
    # four blocks cached, three hit: the prompt's last token is always computed
    assert engine.log.matches["again"] == [(3, 0)]
    assert ("again", 12, 16) in prefills
    assert outputs["again"][0] == outputs["a"][0]
    assert outputs == reference({0: [Request("a", full, 1)], 3: [Request("again", full, 2)]})


def test_chunked_prefill_caches_nothing_before_a_token_proves_it(channel: str) -> None:
    long = SYSTEM + prompt(5, 12)  # 20 tokens, prefilled 8 per step
    arrivals = {
        0: [Request("a", long, 2)],
        1: [Request("b", long, 2)],
        6: [Request("c", long, 2)],
    }
    engine = make_engine(channel, device_blocks=24, max_num_batched_tokens=8)
    committed_during_prefill = []

    def watch(step: int) -> None:
        a = engine.requests["a"]
        if not a.output_token_ids and engine.cm.manager.is_active("a"):
            committed_during_prefill.append(engine.cm.manager.num_committed_blocks("a"))

    engine.after_schedule.append(watch)
    outputs = run(engine, arrivals)
    assert len(committed_during_prefill) >= 2 and set(committed_during_prefill) == {0}
    # b was admitted while a was still prefilling: a's blocks held no KV yet, so no hit
    assert engine.log.matches["b"][0] == (0, 0)
    assert engine.log.matches["c"] == [(4, 0)]  # after a's first token: 4 of 5 blocks
    assert outputs["a"] == outputs["b"] == outputs["c"]
    assert outputs == reference(copy(arrivals))


def test_decode_growth_caches_the_output_blocks(channel: str) -> None:
    engine = make_engine(channel, device_blocks=24)
    a = Request("a", prompt(6, 6), 13)
    try:
        engine.run({0: [a]})
        # prompt + 13 outputs - 1 tokens have KV: four full blocks are cached
        assert engine.log.decode_growths >= 3
        follow_up = Request("turn2", a.prompt_token_ids + a.output_token_ids + prompt(7, 3), 2)
        engine.run({engine.step: [follow_up]})
        engine.drain()
    finally:
        engine.close()
    assert engine.log.matches["turn2"] == [(4, 0)]
    expected = reference({0: [Request("turn2", follow_up.prompt_token_ids, 2)]})
    assert engine.outputs["turn2"] == expected["turn2"]


def test_preemption_is_lifo_and_readmission_hits_what_the_victim_computed(
    channel: str,
) -> None:
    arrivals = {0: [Request(f"r{i}", prompt(10 + i, 6), 12) for i in range(3)]}
    engine = make_engine(channel, device_blocks=10, host_blocks=16)
    preempting = []  # inside _trigger_preempt
    freed_by_preemption = []  # num_computed_tokens each victim reached request_finish with
    finish, trigger = engine.cm.request_finish, engine._trigger_preempt

    def spy_finish(request):
        if preempting:
            freed_by_preemption.append(request.num_computed_tokens)
        finish(request)

    def spy_trigger(*args):
        preempting.append(True)
        try:
            return trigger(*args)
        finally:
            preempting.pop()

    engine.cm.request_finish, engine._trigger_preempt = spy_finish, spy_trigger
    outputs = run(engine, arrivals)
    assert engine.log.preempted, "the pool was meant to be too small for all three"
    for victim, running_before, _ in engine.log.preempted:
        assert victim == running_before[-1]  # the last running request goes first
    assert len(freed_by_preemption) == len(engine.log.preempted)
    assert set(freed_by_preemption) == {0}  # reset before the blocks are freed
    victim = engine.log.preempted[0][0]
    readmissions = engine.log.matches[victim][1:]
    assert readmissions and sum(readmissions[0]) > 0  # its committed blocks were kept
    assert outputs == reference(copy(arrivals))


def test_match_then_free_without_allocation_releases_every_lock(channel: str) -> None:
    x_prompt = prompt(20, 8)
    arrivals = {
        0: [Request("x", x_prompt, 1)],
        3: [Request("y", prompt(21, 20), 4)],
        4: [Request("z", x_prompt + prompt(22, 12), 2)],
    }
    engine = make_engine(channel, device_blocks=10)  # x's 2 cached + y's up to 7
    refusals = []

    def watch(step: int) -> None:
        z = engine.requests.get("z")
        if z is not None and z in engine.waiting:  # matched, refused, freed
            mgr = engine.cm.manager
            refusals.append((mgr.is_active("z"), z.block_tables, z.match_result))

    engine.after_schedule.append(watch)
    outputs = run(engine, arrivals)
    assert refusals, "z was meant to wait for y's blocks"
    for active, table, match in refusals:
        assert not active and table == []  # nothing of z held while it waits
        assert match.matched_device_nums == 2  # it did hit x's blocks each time
    assert len(engine.log.matches["z"]) == len(refusals) + 1
    assert outputs == reference(copy(arrivals))


def pressure_workload() -> dict[int, list[Request]]:
    """Four topics asked twice (hits; the selective policies back them up), a flood
    of unrelated prompts that pushes them off the device (and, under write_back,
    overflows the host tier), then the topics again: host hits."""
    topics = [prompt(30 + i, 8) + prompt(50 + i, 5) for i in range(4)]
    arrivals: dict[int, list[Request]] = {}
    step = 0
    for name, prompts in (
        ("A", topics),
        ("B", topics),
        ("F", [prompt(70 + j, 20) for j in range(4)]),
        ("C", [t + prompt(90 + i, 2) for i, t in enumerate(topics)]),
    ):
        for i, tokens in enumerate(prompts):
            arrivals[step] = [Request(f"{name}{i}", tokens, 2)]
            step += 2
    return arrivals


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_write_back_pressure_hands_evicted_blocks_over_and_reads_them_back(
    channel: str, policy: str
) -> None:
    engine = make_engine(
        channel, device_blocks=12, host_blocks=10, write_policy=policy, threshold=1
    )
    reused = []

    def watch(step, batch):
        evict = batch.cache_evict_metadata
        if evict is not None:
            tables = {b for r in batch if isinstance(r, Request) for b in r.block_tables}
            reused.append(bool(tables.intersection(evict.src_block_ids)))

    engine.step_hooks.append(watch)
    outputs = run(engine, pressure_workload())
    stats = engine.cm.get_stats()
    assert stats["device_to_host_blocks"] > 0 and stats["host_hit_blocks"] > 0, stats
    if policy == "write_back":
        assert stats["host_evictions"] > 0, "the host tier was meant to overflow too"
        assert any(reused), "an evicted block went to its new owner in the same step"
    else:
        assert stats["backups"] > 0
    assert stats["failed_transfers"] == 0 and stats["commit_errors"] == 0
    assert outputs == reference(pressure_workload())


def fail_first_swap_in(engine: Engine, rank: int) -> list[int]:
    """Every copy `rank` launches in the first step with a swap-in fails."""
    failed_at: list[int] = []

    def inject(step, batch):
        if not failed_at and batch.cache_swap_metadata is not None:
            failed_at.append(step)
        rate = 1.0 if failed_at and failed_at[0] == step else 0.0
        engine.ranks[rank].worker.controller.faults = FaultInjector(rate)

    engine.step_hooks.append(inject)
    return failed_at


def test_tp2_one_rank_failing_a_swap_in_recomputes_to_identical_outputs(
    channel: str,
) -> None:
    ok = make_engine(f"{channel}-ok", device_blocks=10, host_blocks=16, tp=2)
    expected = run(ok, host_hit_workload())
    engine = make_engine(channel, device_blocks=10, host_blocks=16, tp=2)
    failed_at = fail_first_swap_in(engine, rank=1)
    errors = []
    apply = engine.cm.manager.apply_results

    def spy(results):
        errors.extend(r.error for r in results if not r.success)
        return apply(results)

    engine.cm.manager.apply_results = spy
    outputs = run(engine, host_hit_workload())
    assert failed_at and engine.log.failed_steps == [{"c"}]
    stats = engine.cm.get_stats()
    assert stats["rollback_blocks"] == 1 and stats["rewound_tokens"] > 0
    assert errors and all(e.startswith("rank 1:") for e in errors)  # rank 0 succeeded
    per_rank = [s["failed_transfers"] for s in engine.worker_stats]
    assert per_rank[0] == 0 and per_rank[1] > 0
    assert outputs == expected == reference(host_hit_workload())


def test_random_copy_failures_never_change_outputs(channel: str) -> None:
    engine = make_engine(channel, device_blocks=12, host_blocks=10, fail_rates=(0.3,))
    outputs = run(engine, pressure_workload())
    stats = engine.cm.get_stats()
    assert stats["failed_transfers"] > 0 and stats["rollback_blocks"] > 0, stats
    assert outputs == reference(pressure_workload())


def test_random_copy_failures_retried_by_the_worker_never_change_outputs(
    channel: str,
) -> None:
    engine = make_engine(
        channel, device_blocks=12, host_blocks=10, fail_rates=(0.3,), swap_in_retries=2
    )
    outputs = run(engine, pressure_workload())
    assert outputs == reference(pressure_workload())
    (worker,) = engine.worker_stats
    assert worker["swap_in_retries"] > 0 and worker["transfers_without_result"] == 0, worker


def test_finish_with_metadata_never_dispatched_fails_it_locally(channel: str) -> None:
    engine = make_engine(channel, device_blocks=10, host_blocks=16)
    try:
        engine.run(
            {0: [Request("a", SYSTEM + prompt(1, 8), 2)], 4: [Request("b", prompt(2, 24), 2)]}
        )
        cm = engine.cm
        c = Request("c", SYSTEM + prompt(1, 8) + prompt(3, 3), 2)
        engine.add_request(c)
        engine.waiting.remove(c)
        cm.match_prefix(c, skip_storage=True)
        assert (c.match_result.matched_device_nums, c.match_result.matched_host_nums) == (3, 1)
        c.block_tables = list(c.match_result.device_block_ids)
        new = cm.allocate_gpu_blocks(c, 2)  # the host hit's destination, one fresh block
        assert len(new) == 2 and c.cache_swap_metadata
        before = cm.get_stats()
        cm.request_finish(c)  # aborted before any BatchRequest took its metadata
        assert c.cache_swap_metadata == [] and c.cache_evict_metadata == []
        stats = cm.get_stats()
        assert stats["undispatched_transfers"] >= 1
        assert stats["inflight_transfers"] == 0 and stats["active_requests"] == 0
        assert stats["failed_transfers"] > before["failed_transfers"]
        cm.manager.check_invariants()
        # the host copy was never touched: the next request loads it again
        d = Request("d", c.prompt_token_ids, 2)
        engine.run({engine.step: [d]})
        engine.drain()
    finally:
        engine.close()
    assert engine.log.matches["d"] == [(3, 1)]
    expected = reference({0: [Request("d", c.prompt_token_ids, 2)]})
    assert engine.outputs["d"] == expected["d"]


def test_a_swap_in_planned_outside_allocation_fails_without_losing_the_backups(
    channel: str,
) -> None:
    """issue_pending_backup_to_batch_request takes every queued transfer: a swap-in
    among them (no adapter call plans one there) is failed through the result path,
    and the evictions taken with it still leave with the batch."""
    engine = make_engine(channel, device_blocks=10, host_blocks=16)
    try:
        engine.run(
            {0: [Request("a", SYSTEM + prompt(1, 8), 2)], 4: [Request("b", prompt(2, 24), 2)]}
        )
        cm, mgr = engine.cm, engine.cm.manager
        c = Request("c", SYSTEM + prompt(1, 8) + prompt(3, 3), 2)
        engine.add_request(c)  # hashed, never scheduled
        engine.waiting.remove(c)
        tokens = len(c.prompt_token_ids)
        hashes = fd_digests(list(c.prompt_hashes)[: tokens // 4])
        hit = mgr.match("c", hashes, tokens)  # not the adapter
        assert (hit.num_device_hits, hit.num_host_hits) == (3, 1)
        assert mgr.allocate("c", num_tokens=8 * 4)  # the host hit's swap-in, evictions
        host_used = mgr.get_stats().host_pool.used
        failed = cm.get_stats()["failed_transfers"]
        evict = cm.issue_pending_backup_to_batch_request()
        assert evict is not None and len(evict.src_block_ids) == 4  # not lost
        stats = cm.get_stats()
        assert stats["failed_transfers"] == failed + 1  # the swap-in
        assert stats["inflight_transfers"] == 1  # only the eviction
        mgr.check_invariants()
        (tid,) = transfer_ids(evict)
        mgr.apply_results([TransferResult(tid, False, "not sent in this test")])
        mgr.finish("c")
        mgr.check_invariants()
        assert mgr.get_stats().host_pool.used == host_used - 4  # nothing leaked
        assert cm.get_stats()["inflight_transfers"] == 0
    finally:
        engine.close()


def test_results_channel_is_the_only_way_results_arrive(channel: str) -> None:
    """With the workers' sender closed, transfers stay in flight (their blocks
    reserved): the scheduler never guesses a result."""
    engine = make_engine(channel, device_blocks=10, host_blocks=16)
    try:
        engine.run({0: [Request("a", SYSTEM + prompt(1, 8), 2)]})
        for rank in engine.ranks:
            rank.worker.stop()
            rank.worker.sender.close()
        engine.run({engine.step: [Request("b", prompt(2, 24), 2)]})
        assert engine.cm.manager.num_inflight_transfers > 0
    finally:
        engine.close()


def allocated_host_hit(engine: Engine) -> Request:
    """a and b run; c (never scheduled) matches device and host hits and gets its
    blocks: its metadata (the host hit's swap-in, evictions to make room) waits on
    it for a BatchRequest."""
    engine.run(
        {0: [Request("a", SYSTEM + prompt(1, 8), 2)], 4: [Request("b", prompt(2, 24), 2)]}
    )
    c = Request("c", SYSTEM + prompt(1, 8) + prompt(3, 3), 2)
    engine.add_request(c)
    engine.waiting.remove(c)
    engine.cm.match_prefix(c, skip_storage=True)  # as ResourceManagerV1 calls it
    c.block_tables = list(c.match_result.device_block_ids)
    engine.cm.allocate_gpu_blocks(c, 2)
    return c


def test_a_batch_refused_for_one_foreign_entry_fails_everything_merged_with_it(
    channel: str,
) -> None:
    """A step's merged metadata with one entry fastkv did not make is refused as a
    whole (nothing runs), and every transfer fastkv merged into it is reported
    failed, so no block stays reserved and the cache can still be reset."""
    engine = make_engine(channel, device_blocks=10, host_blocks=16)
    try:
        cm = engine.cm
        c = allocated_host_hit(engine)
        batch = BatchRequest()
        batch.add_request(c)
        swap, evict = batch.cache_swap_metadata, batch.cache_evict_metadata
        assert transfer_ids(swap) and transfer_ids(evict)  # copies of fastkv's in both
        swap.src_block_ids.append(0)  # one entry that is not fastkv's
        swap.dst_block_ids.append(1)
        swap.hash_values.append("beef")
        worker = engine.ranks[0].worker
        with pytest.raises(ValueError, match="no fastkv transfer tag"):
            worker.submit_swap_tasks(evict, swap)
        assert worker.get_stats()["host_to_device_transfers"] == 0  # nothing ran
        worker.report_results()
        deadline = time.monotonic() + 10
        while cm.manager.num_inflight_transfers and time.monotonic() < deadline:
            cm.poll_results()
            time.sleep(0.01)
        assert cm.manager.num_inflight_transfers == 0
        cm.manager.check_invariants()
        cm.request_finish(c)
        assert cm.reset_cache()
    finally:
        engine.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_report_from_before_a_reset_never_completes_the_new_epochs_transfer(
    channel: str, tp: int
) -> None:
    """Transfer ids restart after reset_cache. A worker's late report of transfer N
    from before the reset (here: rank 0 refusing a replay of that epoch's batch,
    which reports every transfer in it failed) carries the old epoch in its tags,
    so the scheduler drops it (tp 1) or never folds it into the new epoch's N
    (tp 2: a partial report waiting for rank 1): the new N is applied only from
    the workers' reports of the new epoch, and nothing fails or rolls back."""
    arrivals = {
        0: [Request("a", SYSTEM + prompt(1, 8), 2)],
        4: [Request("b", prompt(2, 24), 2)],
        8: [Request("c", SYSTEM + prompt(1, 8) + prompt(3, 3), 2)],
    }
    engine = make_engine(channel, device_blocks=10, host_blocks=16, tp=tp)
    try:
        first = dict(engine.run(copy(arrivals)))
        engine.drain()
        (old,) = [b for b in engine.log.batches if transfer_ids(b.cache_swap_metadata)]
        (n,) = transfer_ids(old.cache_swap_metadata)  # epoch 0's swap-in
        cm = engine.cm
        assert cm.manager.epoch == 0
        assert cm.reset_cache()
        assert cm.manager.epoch == 1
        replays = 0

        def late_report(step: int, batch: BatchRequest) -> None:
            nonlocal replays
            if n not in transfer_ids(batch.cache_swap_metadata):
                return  # not yet: the new epoch's transfer N is planned at this step
            replays += 1
            inflight = cm.manager.num_inflight_transfers
            swap = copy_meta(old.cache_swap_metadata)
            swap.src_block_ids.append(0)  # refused: every transfer of it fails
            swap.dst_block_ids.append(1)
            swap.hash_values.append("beef")
            with pytest.raises(ValueError, match="no fastkv transfer tag"):
                engine.ranks[0].worker.submit_swap_tasks(None, swap)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                cm.poll_results()
                if tp == 1 and cm.get_stats()["results_stale"]:
                    break
                if tp > 1 and cm.results.missing():
                    break
                time.sleep(0.01)
            assert cm.get_stats()["results_stale"] == (1 if tp == 1 else 0)
            assert cm.manager.num_inflight_transfers == inflight  # the new N still waits

        engine.step_hooks.append(late_report)
        engine.run(copy({engine.step + s: reqs for s, reqs in arrivals.items()}))
        engine.drain()
        stats = cm.get_stats()
    finally:
        engine.close()
    assert replays == 1
    assert stats["failed_transfers"] == 0 and stats["rollback_blocks"] == 0
    assert stats["results_unknown"] == 0
    assert engine.outputs == first  # the same prompts, served the same way
    assert engine.log.matches["c"] == [(3, 1), (3, 1)]  # a host hit in both epochs
    assert not engine.log.failed_steps


def copy_meta(meta):
    """A FastDeploy metadata with lists of its own."""
    return type(meta)(
        list(meta.src_block_ids),
        list(meta.dst_block_ids),
        meta.src_type,
        meta.dst_type,
        list(meta.hash_values),
    )


def test_metadata_never_dispatched_fails_every_tagged_id_in_a_later_epoch(channel: str) -> None:
    """A request that ends with metadata no worker got fails every fastkv id in it,
    also those after an entry that is not fastkv's, and in the epoch their tags
    name: after a reset the failures apply (one of epoch 0 would be dropped as
    stale, leaving the transfers in flight)."""
    engine = make_engine(channel, device_blocks=10, host_blocks=16)
    try:
        assert engine.cm.reset_cache() and engine.cm.manager.epoch == 1
        cm = engine.cm
        c = allocated_host_hit(engine)
        assert c.cache_swap_metadata and c.cache_evict_metadata
        for meta in (*c.cache_swap_metadata, *c.cache_evict_metadata):
            meta.src_block_ids.insert(0, 0)  # a foreign entry before fastkv's
            meta.dst_block_ids.insert(0, 1)
            meta.hash_values.insert(0, "beef")
        assert cm.manager.num_inflight_transfers >= 2
        cm.request_finish(c)
        stats = cm.get_stats()
        assert stats["inflight_transfers"] == 0 and stats["active_requests"] == 0
        assert stats["results_stale"] == 0 and stats["results_unknown"] == 0
        cm.manager.check_invariants()
        assert cm.reset_cache()
    finally:
        engine.close()
