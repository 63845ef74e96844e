"""ResourceManagerV1's extend-table path (text-to-image), made the way it makes it:
counts as numpy int32 (they come from an IPC signal), a decode allocation then the
extend allocation of the same request in one step, the extend blocks freed by
`request_finish` (then `recycle_gpu_blocks`)."""

from __future__ import annotations

import numpy as np
import pytest
from fd_standins import FDCacheConfig, FDConfig, ModelConfig, Request, get_request_block_hasher

from fastkv.integrations import fastdeploy as fd

BS = 4


def _manager(channel: str, blocks: int = 16) -> fd.CacheManager:
    cfg = FDConfig(FDCacheConfig(BS, total_block_num=blocks), ModelConfig(num_hidden_layers=2))
    return fd.CacheManager(cfg, channel_name=channel)


def _admitted(cm: fd.CacheManager, rid: str, tokens: list[int], blocks: int) -> Request:
    r = Request(rid, tokens, 8)
    r.set_block_hasher(get_request_block_hasher(BS))
    r.use_extend_tables = True
    cm.match_prefix(r, skip_storage=True)  # as ResourceManagerV1 calls it
    r.block_tables = list(r.match_result.device_block_ids)
    r.block_tables += cm.allocate_gpu_blocks(r, np.int32(blocks))
    return r


def _decode_and_extend(cm: fd.CacheManager, r: Request, n: np.int32) -> None:
    """`_allocate_decode_and_extend` of resource_manager_v1.py, its calls in order."""
    assert cm.can_allocate_gpu_blocks(2 * n)
    r.block_tables.extend(cm.allocate_gpu_blocks(r, n))
    reuse = r.num_total_tokens // BS
    r.extend_block_tables = r.block_tables[:reuse]
    r.extend_block_tables.extend(cm.allocate_gpu_blocks(r, n))


@pytest.mark.parametrize("prompt_len", [3 * BS + 1, BS - 1])  # reuse 3 blocks, and 0
def test_extend_blocks_stay_off_the_table_and_come_back_at_finish(
    channel: str, prompt_len: int
) -> None:
    cm = _manager(channel)
    try:
        r = _admitted(cm, "img", list(range(prompt_len)), -(-prompt_len // BS))
        r.output_token_ids = [7]
        free_before = cm.num_free_device_blocks
        table_before = list(r.block_tables)
        _decode_and_extend(cm, r, np.int32(2))
        reuse = r.num_total_tokens // BS
        extend = r.extend_block_tables[reuse:]
        assert len(r.block_tables) == len(table_before) + 2
        assert len(extend) == 2 and not set(extend) & set(r.block_tables)
        assert r.extend_block_tables[:reuse] == r.block_tables[:reuse]
        assert cm.num_free_device_blocks == free_before - 4
        # fastkv's table is FastDeploy's: the next decode allocation is served.
        assert list(cm.manager.block_table("img").block_ids) == r.block_tables
        r.output_token_ids += [8, 9]
        more = cm.allocate_gpu_blocks(r, np.int64(1))
        assert len(more) == 1 and cm.get_stats()["table_mismatches"] == 0
        r.block_tables += more
        cm.check_and_add_pending_backup()
        cm.request_finish(r)  # _free_blocks: request_finish, then recycle extend
        cm.recycle_gpu_blocks(extend, "img")
        assert cm.num_free_device_blocks + cm.manager.num_evictable_device_blocks == 16
        assert not cm.manager.active_request_ids()
        cm.manager.check_invariants()
    finally:
        cm.close()


def test_extend_blocks_are_never_matched(channel: str) -> None:
    cm = _manager(channel)
    try:
        prompt = list(range(2 * BS + 1))
        r = _admitted(cm, "a", prompt, 3)
        r.output_token_ids = [5, 6, 7, 8, 9]
        _decode_and_extend(cm, r, np.int32(2))
        extend = set(r.extend_block_tables[r.num_total_tokens // BS :])
        cm.check_and_add_pending_backup()
        cm.request_finish(r)
        b = Request("b", [*prompt, 5, 6, 7, 8, 9, 1, 2, 3], 4)
        b.set_block_hasher(get_request_block_hasher(BS))
        cm.match_prefix(b)
        assert b.match_result.device_block_ids  # the request's own blocks hit
        assert not extend & set(b.match_result.device_block_ids)
    finally:
        cm.close()


@pytest.mark.parametrize("bad", [True, np.bool_(True), 2.0, np.float32(2), "2"])
def test_counts_refuse_bools_and_floats(channel: str, bad: object) -> None:
    cm = _manager(channel)
    try:
        r = Request("r", list(range(5)), 4)
        with pytest.raises(ValueError, match="num_blocks: must be an int"):
            cm.can_allocate_gpu_blocks(bad)
        with pytest.raises(ValueError, match="num_blocks: must be an int"):
            cm.allocate_gpu_blocks(r, bad)
        assert not cm.manager.active_request_ids()
    finally:
        cm.close()


def test_numpy_counts_are_taken_by_the_scheduler_api() -> None:
    from fastkv.config import CacheConfig
    from fastkv.scheduler import CacheManager

    mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=8, num_host_blocks=0))
    mgr.match("r", [], np.int64(6))
    assert mgr.allocate("r", num_tokens=np.int32(6))
    assert mgr.num_obtainable_device_blocks(np.uint8(3)) == 3
    mgr.commit("r", num_computed_tokens=np.int16(0))
    assert len(mgr.block_table("r", np.int32(1)).block_ids) == 1
    with pytest.raises(ValueError, match="num_tokens: must be an int"):
        mgr.allocate("r", num_tokens=np.bool_(True))
    with pytest.raises(ValueError, match="num_tokens: -1 is negative"):
        mgr.allocate("r", num_tokens=np.int32(-1))


def test_the_worker_takes_numpy_counts_and_refuses_bools(channel: str) -> None:
    pytest.importorskip("paddle", reason="the worker's CacheController needs paddle")
    from fd_standins import AttentionBackend

    cfg = FDConfig(FDCacheConfig(BS, total_block_num=8, num_cpu_blocks=4), ModelConfig(2))
    with pytest.raises(ValueError, match="local_rank: must be an int"):
        fd.CacheController(cfg, np.bool_(False), 0, channel_name=channel)
    worker = fd.CacheController(cfg, np.int64(0), np.int32(0), channel_name=channel)
    try:
        backend = AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS)
        with pytest.raises(ValueError, match="num_gpu_blocks: must be an int"):
            worker.initialize_kv_cache(attn_backend=backend, num_gpu_blocks=8.0)
        caches = worker.initialize_kv_cache(attn_backend=backend, num_gpu_blocks=np.int32(8))
        mtp = worker.initialize_mtp_kv_cache(backend, np.int32(8), np.int64(1), np.int32(2))
        assert len(caches) == 4 and len(mtp) == 2
    finally:
        worker.free_cache()
