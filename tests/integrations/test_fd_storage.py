"""Storage behind FastDeploy, scheduler side: how a deployment turns it on
(`kvcache_storage_backend="file"`), how lookups, loads and writes ride through
BatchRequest's merge to the workers and split back, write_cache_to_storage writing
under write_through, and a prefetch whose blocks come back as storage hits
(swapped in like host hits) with `can_allocate_gpu_blocks` still exact. Results
come over the real results channel, as a worker sends them. The whole path with
the real workers and disk: tests/fastdeploy_real/test_real_fd_storage.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
from fd_standins import (
    BatchRequest,
    CacheLevel,
    CacheSwapMetadata,
    FDCacheConfig,
    FDConfig,
    ModelConfig,
    Request,
    get_request_block_hasher,
)

from fastkv.channel import ResultsSender
from fastkv.config import PrefetchPolicy, StorageWritePolicy
from fastkv.integrations import fastdeploy as fd
from fastkv.integrations import fd_config as fdc
from fastkv.integrations.fd_transfers import (
    parse_merged,
    split_storage,
    storage_ids,
    storage_tag_of,
    storage_to_fastdeploy,
    to_fastdeploy,
    transfer_ids,
)
from fastkv.metadata import CacheLevel as FK
from fastkv.metadata import CacheSwapMetadata as FKMeta
from fastkv.metadata import LookupResult, StorageLookup, TransferResult

BS = 4


@dataclass
class StorageCacheConfig(FDCacheConfig):
    kvcache_storage_backend: str | None = "file"


def config(**kw) -> FDConfig:
    cc = {"block_size": BS, "total_block_num": 8, "num_cpu_blocks": 4, **kw}
    return FDConfig(StorageCacheConfig(**cc), ModelConfig(num_hidden_layers=2))


def request(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, 1)
    r.set_block_hasher(get_request_block_hasher(BS))
    return r


def deliver(cm: fd.CacheManager, sender: ResultsSender, results: list, applied: int) -> None:
    """Send as a worker does; poll until the manager applied `applied` in all."""
    sender.send(results)
    deadline = time.monotonic() + 10
    while cm.get_stats()["results_applied"] < applied:
        assert time.monotonic() < deadline, cm.get_stats()
        sender.flush()
        cm.poll_results()
        time.sleep(0.002)


def test_a_deployment_turns_storage_on_with_the_file_backend(monkeypatch) -> None:
    plain = FDConfig(FDCacheConfig(block_size=BS, total_block_num=8, num_cpu_blocks=4))
    assert fdc.cache_config_from_fastdeploy(plain).storage is None
    assert fdc.storage_directory(plain, 0) is None
    monkeypatch.delenv(fdc.STORAGE_WRITE_POLICY_ENV, raising=False)
    storage = fdc.cache_config_from_fastdeploy(config()).storage
    assert storage is not None
    assert storage.write_policy is StorageWritePolicy.WRITE_THROUGH
    assert storage.prefetch_policy is PrefetchPolicy.BEST_EFFORT  # allocate never waits
    monkeypatch.setenv(fdc.STORAGE_WRITE_POLICY_ENV, "on_host_eviction")
    storage = fdc.cache_config_from_fastdeploy(config()).storage
    assert storage.write_policy is StorageWritePolicy.ON_HOST_EVICTION  # type: ignore[union-attr]
    monkeypatch.setenv(fdc.STORAGE_WRITE_POLICY_ENV, "sometimes")
    with pytest.raises(ValueError, match="FASTKV_STORAGE_WRITE_POLICY"):
        fdc.cache_config_from_fastdeploy(config())
    monkeypatch.delenv(fdc.STORAGE_WRITE_POLICY_ENV)
    with pytest.raises(
        ValueError, match=r"'attention_store'; fastkv serves 'file'.*'mooncake'"
    ):
        fdc.cache_config_from_fastdeploy(config(kvcache_storage_backend="attention_store"))
    with pytest.raises(ValueError, match="host tier"):
        fdc.cache_config_from_fastdeploy(config(num_cpu_blocks=0))
    monkeypatch.delenv(fdc.STORAGE_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match="FASTKV_STORAGE_DIR"):
        fdc.storage_directory(config(), 1)
    monkeypatch.setenv(fdc.STORAGE_DIR_ENV, "/srv/kv")
    assert fdc.storage_directory(config(), 1) == "/srv/kv/rank1"
    monkeypatch.setenv(fdc.STORAGE_CAPACITY_ENV, "0")
    with pytest.raises(ValueError, match="FASTKV_STORAGE_CAPACITY_BLOCKS"):
        fdc.storage_capacity_blocks(4)
    monkeypatch.delenv(fdc.STORAGE_CAPACITY_ENV)
    assert fdc.storage_capacity_blocks(4) == 16


def test_storage_work_survives_batchrequests_merge_and_splits_back() -> None:
    evict = to_fastdeploy(
        FKMeta(3, FK.DEVICE, FK.HOST, [4, 5], [0, 1], ["h4", "h5"]),
        CacheSwapMetadata,
        CacheLevel,
    )
    load = FKMeta(5, FK.STORAGE, FK.HOST, [], [2, 3], ["a", "b"])
    store = FKMeta(6, FK.HOST, FK.STORAGE, [0], [], ["c"])
    lookups = [StorageLookup(9, ["d", "e"])]
    first = storage_to_fastdeploy(load, store, lookups, CacheSwapMetadata, CacheLevel, evict)
    other = to_fastdeploy(
        FKMeta(7, FK.DEVICE, FK.HOST, [6], [3], ["h6"]), CacheSwapMetadata, CacheLevel
    )
    batch = BatchRequest()  # FastDeploy's merge: lists concatenated, levels of the first
    batch.append_evict_metadata([first, other])
    merged = batch.cache_evict_metadata
    assert transfer_ids(merged) == [3, 7]
    assert storage_ids(merged) == ([5, 6], [9])
    rest, work = split_storage(merged)
    copies = parse_merged(rest, "device", "host")
    assert copies is not None and copies.transfer_ids == (3, 7)
    assert (copies.src_block_ids, copies.dst_block_ids) == ([4, 5, 6], [0, 1, 3])
    assert work.loads == {5: [(2, "a"), (3, "b")]}
    assert work.writes == {6: [(0, "c")]}
    assert work.lookups == {9: ["d", "e"]}
    only = storage_to_fastdeploy(None, None, lookups, CacheSwapMetadata, CacheLevel)
    assert split_storage(only) == (None, split_storage(only)[1])
    assert split_storage(only)[1].lookups == {9: ["d", "e"]}
    assert storage_to_fastdeploy(None, None, (), CacheSwapMetadata, CacheLevel) is None
    bad = storage_to_fastdeploy(load, None, (), CacheSwapMetadata, CacheLevel)
    bad.dst_block_ids[0] = -1
    with pytest.raises(ValueError, match="no host block"):
        split_storage(bad)


def test_write_cache_to_storage_writes_its_blocks_under_write_through(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    sender = ResultsSender(channel, 0)
    try:
        r = request("a", list(range(10, 10 + 3 * BS + 1)))
        cm.match_prefix(r, skip_storage=True)
        r.block_tables = cm.allocate_gpu_blocks(r, 4)
        r.output_token_ids.append(7)  # a sampled token proves the prompt's KV
        r.num_computed_tokens = 3 * BS + 1
        cm.write_cache_to_storage(r)  # FastDeploy: before request_finish
        backup = cm.issue_pending_backup_to_batch_request()  # device-only: to host first
        assert backup is not None and len(backup.src_block_ids) == 3
        assert storage_ids(backup) == ([], [])
        (tid,) = transfer_ids(backup)
        deliver(cm, sender, [TransferResult(tid, True)], 1)
        writes = cm.issue_pending_backup_to_batch_request()  # the copies landed: write
        (wid,), _ = storage_ids(writes)
        _, work = split_storage(writes)
        assert [h for h, _ in work.writes[wid]] == sorted(set(backup.dst_block_ids))
        deliver(cm, sender, [TransferResult(wid, True)], 2)
        assert cm.manager.get_stats().storage.writes == 3
        cm.request_finish(r)
        cm.manager.check_invariants()
    finally:
        sender.close()
        cm.close()


class Preprocess:
    """`prefetch_storage` on a thread of its own, as upstream's preprocess pool
    calls it."""

    def __init__(self, cm: fd.CacheManager, r: Request) -> None:
        self.answer: list[bool] = []
        self.thread = threading.Thread(
            target=lambda: self.answer.append(cm.prefetch_storage(r))
        )
        self.thread.start()

    def result(self) -> bool:
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "prefetch_storage did not return"
        return self.answer[0]


def drain(cm: fd.CacheManager, count: int) -> list:
    """The engine loop's drains until `count` tasks came."""
    tasks: list = []
    deadline = time.monotonic() + 10
    while len(tasks) < count:
        assert time.monotonic() < deadline, tasks
        tasks += cm.drain_pending_prefetches()
        time.sleep(0.002)
    return tasks


def prefetch(
    cm: fd.CacheManager, sender: ResultsSender, r: Request, hits: int, applied: int = 0
) -> tuple[bool, list]:
    """Upstream's order: prefetch on the preprocess thread; the engine drains the
    lookup and a worker answers `hits`; then the loads it planned are drained."""
    pre = Preprocess(cm, r)
    (lookup,) = drain(cm, 1)
    assert lookup.request_id == r.request_id
    assert lookup.metadata.direction == "lookup" and lookup.host_block_ids == []
    _, (qid,) = storage_ids(lookup.metadata)
    deliver(cm, sender, [LookupResult(qid, hits)], applied + 1)
    found = pre.result()
    return found, cm.drain_pending_prefetches()


def test_prefetched_blocks_are_storage_hits_swapped_in_like_host_hits(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    sender = ResultsSender(channel, 0)
    try:
        r = request("p", list(range(50, 50 + 3 * BS + 1)))
        r._match_result = "stale"
        pre = Preprocess(cm, r)
        (lookup,) = drain(cm, 1)  # the lookup never rides a step
        assert [storage_tag_of(h)[2] for h in lookup.metadata.hash_values] == list(
            r.prompt_hashes
        )[:3]
        _, (qid,) = storage_ids(lookup.metadata)
        deliver(cm, sender, [LookupResult(qid, 2)], 1)  # storage holds the first two
        assert pre.result() is True
        assert r._match_result is None  # upstream: the scheduler matches afresh
        assert cm.prefetch_storage(r) is False  # one prefetch per request
        (load,) = cm.drain_pending_prefetches()
        assert load.request_id == "p" and load.metadata.direction == "load"
        assert load.metadata.block_ids == load.host_block_ids and len(load.host_block_ids) == 2
        assert cm.issue_pending_backup_to_batch_request() is None  # nothing rides a step
        (lid,), _ = storage_ids(load.metadata)
        deliver(cm, sender, [TransferResult(lid, True)], 2)
        cm.update_storage_blocks_to_host(load.host_block_ids)  # every rank reported
        cm.match_prefix(r, skip_storage=True)
        result = r.match_result
        assert (result.matched_device_nums, result.matched_host_nums) == (0, 0)
        assert result.matched_storage_nums == 2
        # The match itself looks nothing up (the request does not wait for it).
        assert cm.drain_pending_prefetches() == []
        assert cm.can_allocate_gpu_blocks(4)
        r.block_tables = cm.allocate_gpu_blocks(r, 4)
        assert len(r.block_tables) == 4  # the yes was exact
        (swap,) = r.cache_swap_metadata  # storage -> host -> device
        assert swap.dst_block_ids == r.block_tables[:2]
        assert cm.get_stats()["storage_hit_blocks"] == 2
        assert cm._figures()["prefix_ssd_cache_token_num"] == 2 * BS
        cm.request_finish(r)  # its swap-in never left: failed, blocks back
        cm.manager.check_invariants()
        assert cm.get_stats()["pending_prefetches"] == 0
    finally:
        sender.close()
        cm.close()


def test_a_failed_load_is_no_hit_and_abort_frees_its_blocks(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    sender = ResultsSender(channel, 0)
    try:
        r = request("f", list(range(90, 90 + 3 * BS + 1)))
        found, (load,) = prefetch(cm, sender, r, 3)
        assert found and len(load.host_block_ids) == 3
        with pytest.raises(ValueError, match=r"host_block_ids\[0\]"):
            cm.abort_prefetch_blocks([99])
        (lid,), _ = storage_ids(load.metadata)
        deliver(cm, sender, [TransferResult(lid, False, "disk", (1,))], 2)  # block 1 bad
        cm.abort_prefetch_blocks(load.host_block_ids)  # a rank reported the failure
        assert cm.get_stats()["pending_prefetches"] == 0
        assert cm.num_free_host_blocks == 4 - 1  # blocks 1 and 2 freed, block 0 loaded
        cm.match_prefix(r, skip_storage=True)
        assert r.match_result.matched_storage_nums == 1  # only what precedes the hole
        cm.request_finish(r)
        cm.manager.check_invariants()
    finally:
        sender.close()
        cm.close()


def test_prefetch_storage_waits_a_bounded_time_and_storage_without_the_prefix_is_false(
    channel: str,
) -> None:
    """Nobody drains: the preprocess thread gets False after the timeout, and the
    lookup it left is dropped (answered into nothing). Storage holding none of
    the blocks: False, and nothing is held."""
    cm = fd.CacheManager(config(), channel_name=channel, prefetch_lookup_timeout_s=0.05)
    sender = ResultsSender(channel, 0)
    try:
        r = request("t", list(range(300, 300 + 2 * BS + 1)))
        started = time.monotonic()
        assert cm.prefetch_storage(r) is False
        assert time.monotonic() - started < 5
        assert cm.get_stats()["pending_prefetches"] == 0
        (late,) = cm.drain_pending_prefetches()
        _, (qid,) = storage_ids(late.metadata)
        deliver(cm, sender, [LookupResult(qid, 2)], 1)
        assert cm.drain_pending_prefetches() == []  # no load for a lookup given up
        cm.prefetch_lookup_timeout_s = 5.0
        found, tasks = prefetch(cm, sender, r, 0, applied=1)
        assert (found, tasks) == (False, [])
        assert cm.get_stats()["pending_prefetches"] == 0
        cm.manager.check_invariants()
    finally:
        sender.close()
        cm.close()


def test_match_prefix_by_default_pins_nothing(channel: str) -> None:
    """Upstream's newer default (`skip_storage=False`): counts of what is cached
    now, nothing locked or registered; ResourceManagerV1's `True` locks."""
    cm = fd.CacheManager(config(), channel_name=channel)
    try:
        a = request("a", list(range(10, 10 + 2 * BS + 1)))
        cm.match_prefix(a, skip_storage=True)
        a.block_tables = cm.allocate_gpu_blocks(a, 3)
        a.output_token_ids.append(7)
        a.num_computed_tokens = 2 * BS + 1
        cm.request_finish(a)  # its two full blocks stay cached
        b = request("b", list(range(10, 10 + 2 * BS + 1)))
        free = cm.num_free_device_blocks
        cm.match_prefix(b)
        assert b.match_result.matched_device_nums == 2
        assert not cm.manager.is_active("b") and cm.manager.get_stats().active_requests == 0
        assert cm.num_free_device_blocks == free
        assert cm.drain_pending_prefetches() == []  # and no storage lookup
        cm.manager.check_invariants()
    finally:
        cm.close()


def test_a_worker_without_its_storage_directory_refuses_to_start(
    channel: str, monkeypatch
) -> None:
    monkeypatch.delenv(fdc.STORAGE_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match="FASTKV_STORAGE_DIR"):
        fd.CacheController(config(), 0, 0, channel_name=channel)


@pytest.mark.parametrize("epoch", [0, 3])
def test_the_worker_writes_looks_up_and_loads_through_its_disk(
    channel: str, tmp_path, monkeypatch, epoch: int
) -> None:
    """The worker half alone (real CPU tensors, real disk, real channel): storage
    entries in the step's eviction metadata are written, looked up and loaded, and
    the results come back with the scheduler's ids and cache epoch; the bytes come
    back."""
    pytest.importorskip("paddle", reason="the worker's CacheController needs paddle")
    from fastkv.channel import ResultsReceiver

    monkeypatch.setenv(fdc.STORAGE_DIR_ENV, str(tmp_path / "kv"))
    receiver = ResultsReceiver(channel, 1)
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    try:
        from fd_standins import AttentionBackend

        backend = AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS)
        worker.initialize_kv_cache(attn_backend=backend, num_gpu_blocks=8)
        ctrl = worker.controller
        for t in range(len(ctrl.caches)):
            ctrl.host_blocks(t)[0] = 0x5A  # host block 0: the bytes to keep
        write = FKMeta(40, FK.HOST, FK.STORAGE, [0], [], ["blk"], epoch=epoch)
        meta = storage_to_fastdeploy(None, write, (), CacheSwapMetadata, CacheLevel)

        def results(count: int) -> list:
            got: list = []
            deadline = time.monotonic() + 10
            while len(got) < count and time.monotonic() < deadline:
                worker.report_results()
                got += receiver.poll()
                time.sleep(0.005)
            return got

        assert worker.submit_swap_tasks(meta, None) is None
        assert results(1) == [TransferResult(40, True, "", (), epoch=epoch)]
        lookup = [StorageLookup(41, ["blk", "other"], epoch)]
        load = FKMeta(42, FK.STORAGE, FK.HOST, [], [3], ["blk"], epoch=epoch)
        meta = storage_to_fastdeploy(load, None, lookup, CacheSwapMetadata, CacheLevel)
        worker.submit_swap_tasks(meta, None)
        got = results(2)
        assert LookupResult(41, 1, epoch=epoch) in got
        assert TransferResult(42, True, "", (), epoch=epoch) in got
        for t in range(len(ctrl.caches)):
            assert (ctrl.host_blocks(t)[3] == 0x5A).all()
        assert worker.get_stats()["transfers_without_result"] == 0
    finally:
        worker.free_cache()
        receiver.close()


def test_the_first_request_to_hit_a_block_from_storage_counts_it(channel: str) -> None:
    """Blocks a prefetch brought back serve whichever request matches them first
    (here another one sharing the prefix): that hit is the storage hit, once."""
    cm = fd.CacheManager(config(), channel_name=channel)
    sender = ResultsSender(channel, 0)
    try:
        shared = list(range(200, 200 + 2 * BS))
        r = request("r", [*shared, 1, 2, 3])
        found, (load,) = prefetch(cm, sender, r, 2)
        assert found
        (lid,), _ = storage_ids(load.metadata)
        deliver(cm, sender, [TransferResult(lid, True)], 2)
        cm.update_storage_blocks_to_host(load.host_block_ids)
        cm.request_finish(r)  # r is dropped before its match: its blocks stay in host
        other = request("s", [*shared, 9, 9, 9, 9, 9])
        cm.match_prefix(other, skip_storage=True)
        assert other.match_result.matched_storage_nums == 2
        r2 = request("r2", [*shared, 1, 2, 3])
        cm.match_prefix(r2, skip_storage=True)  # the same blocks again: host hits, not storage
        assert (r2.match_result.matched_host_nums, r2.match_result.matched_storage_nums) == (
            2,
            0,
        )
        assert cm.get_stats()["storage_hit_blocks"] == 2
        cm.request_finish(other)
        cm.request_finish(r2)
        cm.manager.check_invariants()
    finally:
        sender.close()
        cm.close()


def test_the_worker_takes_a_drained_task_without_a_step(
    channel: str, tmp_path, monkeypatch
) -> None:
    """`prefetch_from_storage(task.metadata)`: a lookup and a load reach the disk
    with no step at all; metadata fastkv did not make is refused whole."""
    pytest.importorskip("paddle", reason="the worker's CacheController needs paddle")
    from fd_standins import AttentionBackend

    from fastkv.channel import ResultsReceiver
    from fastkv.integrations.fd_prefetch import FDStorageMetadata

    monkeypatch.setenv(fdc.STORAGE_DIR_ENV, str(tmp_path / "kv"))
    receiver = ResultsReceiver(channel, 1)
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    try:
        with pytest.raises(ValueError, match="direction"):
            worker.prefetch_from_storage(FDStorageMetadata(direction="evict"))
        worker.prefetch_from_storage(FDStorageMetadata(["Q1:blk"], [-1], "lookup"))
        got: list = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            worker.report_results()
            got += receiver.poll()
            time.sleep(0.005)
        assert got == [LookupResult(1, 0)]  # no cache yet: answered none
        worker.initialize_kv_cache(
            attn_backend=AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS),
            num_gpu_blocks=8,
        )
        ctrl = worker.controller
        for t in range(len(ctrl.caches)):
            ctrl.host_blocks(t)[0] = 0x3C
        write = FKMeta(40, FK.HOST, FK.STORAGE, [0], [], ["blk"])
        worker.submit_swap_tasks(
            storage_to_fastdeploy(None, write, (), CacheSwapMetadata, CacheLevel), None
        )
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:  # the write landed first
            worker.report_results()
            got += receiver.poll()
            time.sleep(0.005)
        assert got == [TransferResult(40, True, "", ())]
        with pytest.raises(ValueError, match="not fastkv storage loads"):
            worker.prefetch_from_storage(FDStorageMetadata(["blk"], [2], "load"))
        worker.prefetch_from_storage(
            FDStorageMetadata(["Q41:blk", "Q41:other"], [-1, -1], "lookup")
        )
        worker.prefetch_from_storage(FDStorageMetadata(["L42:blk"], [3], "load"))
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            worker.report_results()
            got += receiver.poll()
            time.sleep(0.005)
        assert LookupResult(41, 1) in got and TransferResult(42, True, "", ()) in got
        for t in range(len(ctrl.caches)):
            assert (ctrl.host_blocks(t)[3] == 0x3C).all()
    finally:
        worker.free_cache()
        receiver.close()


def test_a_prefetch_started_between_a_yes_and_its_allocation_takes_no_promised_block(
    channel: str,
) -> None:
    """ResourceManagerV1 asks `can_allocate_gpu_blocks`, then allocates, under its own
    lock; upstream's preprocess thread calls `prefetch_storage` without it. A
    prefetch whose match would lock the cached blocks the yes counted on waits for
    that allocation, so the allocation gets them (it found none: 1 run in 60 of the
    crowded-tiers real-code test)."""
    import threading

    cm = fd.CacheManager(config(), channel_name=channel, prefetch_lookup_timeout_s=1.0)
    try:
        head = list(range(2 * BS))
        a = request("a", [*head, 99])
        cm.match_prefix(a, skip_storage=True)
        a.block_tables = cm.allocate_gpu_blocks(a, 3)
        a.output_token_ids = [1]
        cm.request_finish(a)  # 2 cached blocks, evictable
        b = request("b", list(range(500, 500 + 6 * BS)))
        cm.match_prefix(b, skip_storage=True)
        b.block_tables = cm.allocate_gpu_blocks(b, 6)
        assert cm.num_free_device_blocks == 0
        r = request("r", list(range(900, 900 + 2 * BS)))
        cm.match_prefix(r, skip_storage=True)
        assert cm.can_allocate_gpu_blocks(2)  # by evicting a's 2 blocks
        # The preprocess thread: a prompt sharing a's blocks, with a tail to look up.
        p = request("p", [*head, *range(700, 700 + 3 * BS)])
        thread = threading.Thread(target=cm.prefetch_storage, args=(p,), daemon=True)
        thread.start()
        thread.join(0.3)  # its match ran by now, unless it waits for the allocation
        assert len(cm.allocate_gpu_blocks(r, 2)) == 2
        thread.join(5)
        assert not thread.is_alive()
    finally:
        cm.close()
