"""The calls FastDeploy makes around a request's life and the engine's: the match
result it turns into a block table, the prefill role's `update_cache_blocks`, and
`reset_cache` at pause and sleep (every request aborted first, copies possibly still
in flight, backups planned but never sent)."""

from __future__ import annotations

import threading
import time

import pytest
from fd_standins import FDCacheConfig, FDConfig, ModelConfig, Request, get_request_block_hasher

from fastkv.channel import ResultsSender
from fastkv.integrations import fastdeploy as fd
from fastkv.integrations.fd_transfers import tagged_ids, transfer_ids
from fastkv.metadata import TransferResult

BS = 4


def config(**kw) -> FDConfig:
    cache = {"block_size": BS, "total_block_num": 8, "num_cpu_blocks": 4, **kw}
    return FDConfig(FDCacheConfig(**cache), ModelConfig(num_hidden_layers=2))


def request(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, 4)
    r.set_block_hasher(get_request_block_hasher(BS))
    return r


def cached(cm: fd.CacheManager, tokens: list[int], rid: str) -> None:
    """Run a request to its first token and finish it: its full blocks are cached."""
    r = request(rid, tokens)
    cm.match_prefix(r, skip_storage=True)
    r.block_tables = r.match_result.device_block_ids
    r.block_tables.extend(cm.allocate_gpu_blocks(r, -(-len(tokens) // BS)))
    r.output_token_ids = [1]
    cm.request_finish(r)


def test_the_match_result_stays_what_was_matched_as_the_table_grows(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    try:
        cached(cm, list(range(2 * BS + 1)), "first")
        r = request("r", list(range(2 * BS + 1)))
        cm.match_prefix(r, skip_storage=True)
        result = r.match_result
        # ResourceManagerV1: request.block_tables = match_result.device_block_ids,
        # then request.block_tables.extend(allocate_gpu_blocks(...)).
        r.block_tables = result.device_block_ids
        r.block_tables.extend(cm.allocate_gpu_blocks(r, 1))
        assert len(r.block_tables) == 3
        assert result.matched_device_nums == 2 and len(result.device_block_ids) == 2
        assert result.total_matched_blocks == 2
        cm.request_finish(r)
    finally:
        cm.close()


def test_update_cache_blocks_in_the_prefill_role_caches_only_proven_kv(channel: str) -> None:
    # preallocate_resource_in_p: match, allocate, update_cache_blocks(request,
    # block_size, need_prefill_tokens) before anything is computed.
    cm = fd.CacheManager(config(), channel_name=channel)
    try:
        r = request("p", list(range(2 * BS + 1)))
        cm.match_prefix(r, skip_storage=True)
        r.block_tables = r.match_result.device_block_ids
        r.block_tables.extend(cm.allocate_gpu_blocks(r, 3))
        cm.update_cache_blocks(r, BS, len(r.prompt_token_ids))
        assert r.num_cached_blocks == 0  # nothing computed yet: nothing cached
        peer = request("peer", list(range(2 * BS + 1)))
        cm.match_prefix(peer, skip_storage=True)
        assert peer.match_result.total_matched_blocks == 0
        cm.request_finish(peer)
        r.output_token_ids = [5]  # the prefill ran: its first token proves the KV
        cm.update_cache_blocks(r, BS, len(r.prompt_token_ids))
        assert r.num_cached_blocks == 2
        with pytest.raises(ValueError, match="block_size"):
            cm.update_cache_blocks(r, 2 * BS, 0)
        with pytest.raises(ValueError, match="num_computed_tokens"):
            cm.update_cache_blocks(r, BS, -1)
        cm.request_finish(r)
    finally:
        cm.close()


@pytest.mark.parametrize("earlier_resets", [0, 2])
def test_reset_at_pause_waits_for_copies_in_flight_and_drops_unsent_backups(
    channel: str, earlier_resets: int
) -> None:
    """Also in a later cache epoch: the backups never sent fail in the manager's
    epoch (one of another epoch would be dropped, leaving them in flight)."""
    cm = fd.CacheManager(config(write_policy="write_through"), channel_name=channel)
    sender = ResultsSender(channel, 0)
    try:
        for _ in range(earlier_resets):
            assert cm.reset_cache() is True
        assert cm.manager.epoch == earlier_resets
        # A hit makes cached blocks owe a backup (FastDeploy's write_through: after
        # one hit); the next schedule sends them: copies in flight.
        cached(cm, list(range(2 * BS + 1)), "a")
        hit = request("hit", list(range(2 * BS + 1)))
        cm.match_prefix(hit, skip_storage=True)
        sent = cm.issue_pending_backup_to_batch_request()
        assert sent is not None and len(sent.src_block_ids) == 2
        # More backups planned after the last schedule: never sent.
        cached(cm, list(range(100, 100 + 2 * BS + 1)), "b")
        hit2 = request("hit2", list(range(100, 100 + 2 * BS + 1)))
        cm.match_prefix(hit2, skip_storage=True)
        assert cm.get_pending_backup_count() == 2
        assert cm.reset_cache() is False  # requests still active: nothing reset
        # Pause: every request aborted and drained.
        for r in (hit, hit2):
            cm.request_finish(r)
        ((tid, epoch),), _, _ = tagged_ids(sent)
        assert epoch == earlier_resets

        def worker() -> None:  # the eviction's result comes 0.2 s later
            time.sleep(0.2)
            for _ in range(400):
                sender.send([TransferResult(tid, True, epoch=epoch)])
                time.sleep(0.005)

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        assert cm.reset_cache() is True
        thread.join(5)
        stats = cm.get_stats()
        assert stats["cached_nodes"] == 0 and stats["inflight_transfers"] == 0
        assert cm.num_free_device_blocks == 8 and cm.num_free_host_blocks == 4
        assert cm.manager.epoch == earlier_resets + 1
    finally:
        sender.close()
        cm.close()


def test_a_reset_whose_copy_outlasts_the_wait_is_owed_and_nothing_hits_meanwhile(
    channel: str,
) -> None:
    """FastDeploy ignores reset_cache's answer, then sleep frees and re-creates the
    workers' tensors: a cache left as it was would serve blocks that are gone. Until
    the stuck copy lands no request hits (its blocks stay reserved); then, with no
    request active, the owed reset forgets everything."""
    cm = fd.CacheManager(config(), channel_name=channel, reset_timeout_s=0.1)
    sender = ResultsSender(channel, 0)
    try:
        cached(cm, list(range(100, 100 + 4 * BS + 1)), "b")
        big = request("big", list(range(200, 200 + 6 * BS)))
        cm.match_prefix(big, skip_storage=True)
        big.block_tables = big.match_result.device_block_ids
        big.block_tables.extend(cm.allocate_gpu_blocks(big, 6))
        evict = big.pop_cache_evict_metadata()
        assert evict  # dispatched, not answered yet
        cm.request_finish(big)
        assert cm.reset_cache() is False  # the worker has not answered
        assert cm.get_stats()["inflight_transfers"] == 1  # its blocks stay reserved
        again = request("again", list(range(100, 100 + 4 * BS + 1)))
        cm.match_prefix(again, skip_storage=True)  # cached before the reset, but maybe gone now
        assert again.match_result.total_matched_blocks == 0
        cm.request_finish(again)
        (tid,) = transfer_ids(evict[0])
        deadline = time.monotonic() + 5
        while cm.get_stats()["cached_nodes"] and time.monotonic() < deadline:
            sender.send([TransferResult(tid, True)])
            cm.check_and_add_pending_backup()  # the scheduler loop polls
            time.sleep(0.01)
        stats = cm.get_stats()
        assert stats["cached_nodes"] == 0 and stats["inflight_transfers"] == 0
        assert cm.num_free_device_blocks == 8
        cached(cm, list(range(100, 100 + 4 * BS + 1)), "after")  # caching again
        hit = request("hit", list(range(100, 100 + 4 * BS + 1)))
        cm.match_prefix(hit, skip_storage=True)
        assert hit.match_result.total_matched_blocks == 4
        cm.request_finish(hit)
    finally:
        sender.close()
        cm.close()


def test_a_request_admitted_while_reset_waits_gets_no_hit_and_the_reset_still_happens(
    channel: str,
) -> None:
    """Found in review: the reset waits with the lock released; a match then hit the
    cache about to be forgotten, and a request still active when the copy landed made
    reset_cache give up with nothing owed. Now the reset is owed from its start."""
    cm = fd.CacheManager(config(), channel_name=channel, reset_timeout_s=0.5)
    sender = ResultsSender(channel, 0)
    try:
        prompt = list(range(100, 100 + 4 * BS + 1))
        cached(cm, prompt, "b")
        big = request("big", list(range(200, 200 + 6 * BS)))
        cm.match_prefix(big, skip_storage=True)
        big.block_tables = big.match_result.device_block_ids
        big.block_tables.extend(cm.allocate_gpu_blocks(big, 6))
        (evict,) = big.pop_cache_evict_metadata()
        cm.request_finish(big)
        answers: list[bool] = []
        waiting = threading.Thread(target=lambda: answers.append(cm.reset_cache()))
        waiting.start()
        time.sleep(0.1)  # reset_cache is waiting for the eviction
        late = request("late", prompt)
        cm.match_prefix(late, skip_storage=True)
        assert late.match_result.total_matched_blocks == 0
        late.block_tables = late.match_result.device_block_ids
        late.block_tables.extend(cm.allocate_gpu_blocks(late, 5))  # active meanwhile
        (tid,) = transfer_ids(evict)
        sender.send([TransferResult(tid, True)])
        deadline = time.monotonic() + 5
        while sender.flush() and time.monotonic() < deadline:  # as its reporter would
            time.sleep(0.005)
        waiting.join(5)
        assert answers == [False]  # a request was active: owed, not dropped
        cm.request_finish(late)
        cm.check_and_add_pending_backup()
        stats = cm.get_stats()
        assert stats["cached_nodes"] == 0 and stats["active_requests"] == 0
    finally:
        sender.close()
        cm.close()


def test_copies_planned_while_no_batch_goes_out_leave_with_the_drained_tasks(
    channel: str,
) -> None:
    """FastDeploy issues backups only into a batch with requests in it. A request
    waiting for room that only those copies free keeps every batch empty, so the
    copies no batch took since the last drain leave with the next drained tasks
    (FastDeploy's engine loop drains every iteration); while batches go out they
    carry them (ordered with their steps)."""
    from fastkv.integrations.fd_transfers import EVICT, IDLE_EVICT

    cm = fd.CacheManager(config(write_policy="write_through"), channel_name=channel)
    try:
        cached(cm, list(range(2 * BS + 1)), "a")
        hit = request("hit", list(range(2 * BS + 1)))
        cm.match_prefix(hit, skip_storage=True)  # the hit makes 2 blocks owe a backup
        assert cm.get_pending_backup_count() == 2
        sent = cm.issue_pending_backup_to_batch_request()  # a batch took them
        assert sent is not None and cm.drain_pending_prefetches() == []
        cm.request_finish(hit)
        cached(cm, list(range(100, 100 + 2 * BS + 1)), "b")
        hit2 = request("hit2", list(range(100, 100 + 2 * BS + 1)))
        cm.match_prefix(hit2, skip_storage=True)
        assert cm.get_pending_backup_count() == 2
        # No batch since the last drain (every schedule's batch empty): the drain.
        (task,) = cm.drain_pending_prefetches()
        assert task.metadata.direction == IDLE_EVICT and task.host_block_ids == []
        meta = task.metadata.extra_params[EVICT]
        assert len(meta.src_block_ids) == 2 and transfer_ids(meta)
        assert cm.get_pending_backup_count() == 0
        assert cm.get_stats()["inflight_transfers"] == 2  # this one and the batch's
        assert cm.drain_pending_prefetches() == []  # once
        assert cm.issue_pending_backup_to_batch_request() is None
    finally:
        cm.close()
