"""The FastDeploy adapters' surface: every name ResourceManagerV1 and the model runner
call, settings read from FDConfig as FastDeploy means them, inputs refused before
anything changes, state changes only when idle, the worker's tensors made through
the attention backend (MTP layers included), refused launches reported as failures,
and `install()` replacing FastDeploy's classes where FastDeploy looks them up."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import types
import weakref

import numpy as np
import pytest
from fd_standins import (
    AttentionBackend,
    CacheLevel,
    CacheSwapMetadata,
    FDCacheConfig,
    FDConfig,
    MLABackend,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    Request,
    UpstreamAttentionBackend,
    get_request_block_hasher,
    install_fake_fastdeploy,
)

from fastkv import metadata as fk
from fastkv.channel import ResultsReceiver, ResultsSender
from fastkv.config import WritePolicy
from fastkv.integrations import fastdeploy as fd
from fastkv.integrations import fd_transfers as fdt
from fastkv.integrations.fd_config import (
    CHANNEL_ENV,
    cache_config_from_fastdeploy,
    results_channel_name,
)
from fastkv.metadata import TransferResult

BS = 4

# What FastDeploy calls (notes §1, §2, §5) -> exists on the adapters.
SCHEDULER_API = [
    "can_allocate_gpu_blocks",
    "can_allocate_device_blocks",
    "allocate_gpu_blocks",
    "allocate_device_blocks",
    "match_prefix",
    "request_finish",
    "issue_pending_backup_to_batch_request",
    "check_and_add_pending_backup",
    "get_pending_backup_count",
    "gpu_free_block_list",
    "available_gpu_resource",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "num_free_device_blocks",
    "num_free_host_blocks",
    "update_cache_config",
    "reset_cache",
    "get_stats",
    "recycle_gpu_blocks",
    "write_cache_to_storage",
    "write_cache_to_storage_decode",
    "cache_output_blocks",
]
WORKER_API = [
    "initialize_kv_cache",
    "initialize_mtp_kv_cache",
    "submit_swap_tasks",
    "swap_layer_done_counter",
    "get_kv_caches",
    "get_host_cache_kvs_map",
    "reset_cache",
    "free_cache",
    "free_gpu_cache",
    "get_stats",
    "start",
    "stop",
    "transfer_manager",
]


def config(**cache_kw) -> FDConfig:
    kw = {"block_size": BS, "total_block_num": 8, "num_cpu_blocks": 8, **cache_kw}
    return FDConfig(FDCacheConfig(**kw), ModelConfig(num_hidden_layers=2))


def request(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, 1)
    r.set_block_hasher(get_request_block_hasher(BS))
    return r


def test_the_adapters_answer_every_call_fastdeploy_makes(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    try:
        for name in SCHEDULER_API:
            assert name in dir(cm), name
        assert (cm.num_gpu_blocks, cm.num_cpu_blocks) == (8, 8)
        assert len(cm.gpu_free_block_list) == 8 and sorted(cm.gpu_free_block_list) == list(
            range(8)
        )
        assert cm.available_gpu_resource == 1.0
    finally:
        cm.close()
    worker = fd.CacheController(config(), 0, 0, channel_name=channel)
    for name in WORKER_API:
        assert name in dir(worker), name  # (properties are not evaluated)
    worker.free_cache()
    assert fd.CacheManager is fd.FastDeployCacheManager
    assert fd.CacheController is fd.FastDeployCacheController


def test_settings_keep_fastdeploys_meaning() -> None:
    wt = cache_config_from_fastdeploy(config(write_policy="write_through"))
    assert (wt.write_policy, wt.selective_threshold) == (WritePolicy.WRITE_THROUGH_SELECTIVE, 1)
    sel = cache_config_from_fastdeploy(
        config(write_policy="write_through_selective", write_through_threshold=3)
    )
    assert (sel.write_policy, sel.selective_threshold) == (
        WritePolicy.WRITE_THROUGH_SELECTIVE,
        3,
    )
    wb = cache_config_from_fastdeploy(config(num_cpu_blocks=None))
    assert wb.write_policy == WritePolicy.WRITE_BACK and wb.num_host_blocks == 0
    assert wb.reuse_evicted_blocks  # FastDeploy allocates synchronously
    fp8 = config()
    fp8.quant_config = QuantConfig("block_wise_fp8")
    assert cache_config_from_fastdeploy(fp8).kv_dtype == "fp8"
    tp = config()
    tp.parallel_config = ParallelConfig(tensor_parallel_size=4)
    assert cache_config_from_fastdeploy(tp).tp_size == 4
    with pytest.raises(ValueError, match=r"fd_config.cache_config: num_device_blocks"):
        cache_config_from_fastdeploy(config(total_block_num=0))
    with pytest.raises(ValueError, match=r"fd_config.cache_config: write_policy"):
        cache_config_from_fastdeploy(config(write_policy="write_sometimes"))
    with pytest.raises(ValueError, match=r"fd_config.cache_config.total_block_num: missing"):
        cache_config_from_fastdeploy(config(total_block_num=None))


def test_channel_name_comes_from_the_environment_or_the_engine_port(monkeypatch) -> None:
    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    cfg = config()
    with pytest.raises(ValueError, match=CHANNEL_ENV):
        results_channel_name(cfg)
    cfg.parallel_config = ParallelConfig(
        engine_worker_queue_port=[8100, 8101], local_data_parallel_id=1
    )
    assert results_channel_name(cfg) == "fd-8101-dp1"
    monkeypatch.setenv(CHANNEL_ENV, "mine")
    assert results_channel_name(cfg) == "mine"


def test_scheduler_inputs_are_refused_before_anything_changes(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    try:
        r = request("r", list(range(9)))
        with pytest.raises(ValueError, match="num_blocks"):
            cm.allocate_gpu_blocks(r, 1.5)
        with pytest.raises(ValueError, match="num_blocks"):
            cm.can_allocate_gpu_blocks(True)
        assert cm.allocate_gpu_blocks(r, 0) == []
        r.block_tables = [5]  # not what fastkv gave it
        assert cm.allocate_gpu_blocks(r, 1) == [] and cm.get_stats()["table_mismatches"] == 1
        r.block_tables = []
        assert cm.allocate_gpu_blocks(r, 9) == []  # more than the pool: never fits
        assert cm.get_stats()["allocation_failures"] == 1
        with pytest.raises(ValueError, match=r"block_ids\[1\]"):
            cm.recycle_gpu_blocks([1, 99], "r")
        with pytest.raises(ValueError, match="request_finish first"):
            cm.recycle_gpu_blocks([1], "r")
        with pytest.raises(ValueError, match="block_size"):
            cm.cache_output_blocks(r, 8)
        cm.request_finish(r)
        cm.recycle_gpu_blocks([1], "r")  # freed at request_finish already
        cm.manager.check_invariants()
        assert cm.manager.num_free_device_blocks == 8
    finally:
        cm.close()


def test_a_request_that_holds_blocks_cannot_be_matched_again(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    try:
        r = request("r", list(range(9)))
        cm.match_prefix(r, skip_storage=True)
        r.block_tables = list(r.match_result.device_block_ids)
        r.block_tables += cm.allocate_gpu_blocks(r, 3)
        cm.match_prefix(r, skip_storage=True)  # logged, counted; the request keeps its blocks
        assert cm.get_stats()["match_failures"] == 1
        assert r.match_result.total_matched_blocks == 0
        assert list(cm.manager.block_table("r").block_ids) == r.block_tables
        stale = request("stale", list(range(9)))
        cm.match_prefix(
            stale, skip_storage=True
        )  # matched, then forgotten by the engine without a free
        cm.match_prefix(stale, skip_storage=True)  # released and matched again
        cm.request_finish(stale)
        cm.request_finish(r)
        cm.manager.check_invariants()
    finally:
        cm.close()


def test_prefix_caching_off_allocates_without_matching_or_caching(channel: str) -> None:
    cm = fd.CacheManager(config(enable_prefix_caching=False), channel_name=channel)
    try:
        r = request("r", list(range(9)))
        cm.match_prefix(r, skip_storage=True)
        assert r.match_result.total_matched_blocks == 0  # v1: an empty result
        r.block_tables += cm.allocate_gpu_blocks(r, 3)
        assert len(r.block_tables) == 3
        r.output_token_ids = [1, 2]
        cm.check_and_add_pending_backup()
        cm.request_finish(r)
        assert cm.manager.get_stats().cached_nodes == 0
        assert cm.manager.num_free_device_blocks == 8
    finally:
        cm.close()


def test_a_dropped_cache_manager_does_not_keep_the_channel_from_the_next(channel: str) -> None:
    # FastDeploy builds a new ResourceManagerV1 (and cache manager) on the same port
    # without closing the old one; the garbage collector must not be needed.
    gc.disable()
    try:
        old = fd.CacheManager(config(), channel_name=channel)
        old_receiver = old.results
        del old  # never closed; a reference cycle keeps it alive until a collection
        cm = fd.CacheManager(config(), channel_name=channel)
        assert old_receiver.closed and not cm.results.closed
        sender = ResultsSender(channel, 0)
        got: list = []
        deadline = time.monotonic() + 10
        sender.send([TransferResult(0, True)])
        while not got and time.monotonic() < deadline:
            sender.flush()  # as a worker's reporter does
            got += cm.results.poll()
        assert [(r.transfer_id, r.success) for r in got] == [(0, True)]
        sender.close()
        with cm:
            pass
        assert cm.results.closed
        fd.CacheManager(config(), channel_name=channel).close()  # the name is free
    finally:
        gc.enable()


def test_cache_config_changes_and_resets_only_when_idle(channel: str) -> None:
    cm = fd.CacheManager(config(), channel_name=channel)
    try:
        r = request("r", list(range(9)))
        cm.match_prefix(r, skip_storage=True)
        r.block_tables += cm.allocate_gpu_blocks(r, 3)
        assert cm.reset_cache() is False
        with pytest.raises(ValueError, match="idle"):
            cm.update_cache_config(FDCacheConfig(block_size=BS, total_block_num=16))
        assert cm.num_gpu_blocks == 8
        r.output_token_ids = [7]
        cm.request_finish(r)
        assert cm.manager.get_stats().cached_nodes == 2  # prompt's full blocks
        cm.update_cache_config(
            FDCacheConfig(block_size=BS, total_block_num=16, num_cpu_blocks=4)
        )
        assert (cm.num_gpu_blocks, cm.num_cpu_blocks) == (16, 4)
        assert cm.manager.get_stats().cached_nodes == 0
        with pytest.raises(ValueError, match="num_device_blocks"):
            cm.update_cache_config(FDCacheConfig(block_size=BS, total_block_num=-1))
        assert cm.num_gpu_blocks == 16
        assert cm.reset_cache() is True
    finally:
        cm.close()


@pytest.fixture
def paddle():
    return pytest.importorskip("paddle", reason="the worker's CacheController needs paddle")


def _received(worker, receiver: ResultsReceiver, count: int) -> list:
    """Poll until `count` results came (the worker re-sends what the channel could
    not take yet)."""
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        worker.report_results()
        got += receiver.poll()
        time.sleep(0.005)
    return got


def _names(layers, roles=("key_caches", "value_caches"), rank=0, device=1) -> list[str]:
    return [f"{r}_{i}_rank{rank}.device{device}" for i in layers for r in roles]


def test_worker_makes_the_caches_from_the_backends_shapes_as_the_runner_does(
    channel: str, paddle
) -> None:
    worker = fd.CacheController(config(), 3, 1, channel_name=channel, report_interval_s=0)
    backend = AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS)
    try:
        caches = worker.initialize_kv_cache(attn_backend=backend, num_gpu_blocks=8)
        assert backend.calls == [(8, None)]
        assert len(caches) == 4 and all(t.shape == [8, 2, BS, 4] for t in caches)
        assert all(str(t.dtype) == "paddle.bfloat16" for t in caches)
        kvs = worker.get_kv_caches()
        assert isinstance(kvs, dict) and list(kvs) == _names(range(2))
        assert list(kvs.values()) == caches  # the runner's flat list, same tensors
        assert worker.controller.caches == caches  # adopted, not copied
        host = worker.get_host_cache_kvs_map()
        assert list(host) == list(kvs) and len(set(host.values())) == 4
        with pytest.raises(RuntimeError, match="free_gpu_cache first"):
            worker.initialize_kv_cache(backend, 8)
    finally:
        worker.free_cache()


def test_block_wise_fp8_makes_uint8_caches_and_scales(channel: str, paddle) -> None:
    cfg = config()
    cfg.quant_config = QuantConfig("block_wise_fp8")
    worker = fd.CacheController(cfg, 0, 0, channel_name=channel, report_interval_s=0)
    try:
        caches = worker.initialize_kv_cache(AttentionBackend(2, 4, BS), 8)
        roles = ("key_caches", "value_caches", "key_cache_scales", "value_cache_scales")
        assert list(worker.get_kv_caches()) == _names(range(2), roles, device=0)
        assert [str(t.dtype) for t in caches[:4]] == ["paddle.uint8"] * 2 + [
            "paddle.float32"
        ] * 2
        assert caches[2].shape == [8, 2, BS]
        assert worker.controller.shape.tensors_per_layer == 4
    finally:
        worker.free_cache()


def test_mla_keeps_one_latent_tensor_per_layer(channel: str, paddle) -> None:
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    try:
        caches = worker.initialize_kv_cache(MLABackend(1, 8, BS), 8)
        assert len(caches) == 2 and caches[0].shape == [8, 1, BS, 8]
        assert list(worker.get_kv_caches()) == _names(range(2), ("key_caches",), device=0)
    finally:
        worker.free_cache()


def test_worker_takes_the_tensors_an_upstream_backend_makes(channel: str, paddle) -> None:
    cfg = config()
    cfg.quant_config = QuantConfig("block_wise_fp8")
    worker = fd.CacheController(cfg, 0, 0, channel_name=channel, report_interval_s=0)
    backend = UpstreamAttentionBackend(2, 4, BS)
    try:
        caches = worker.initialize_kv_cache(attn_backend=backend, num_gpu_blocks=8)
        assert backend.calls == [(8, "uint8", "block_wise_fp8", 0)]
        roles = ("key_caches", "value_caches", "key_cache_scales", "value_cache_scales")
        assert list(worker.get_kv_caches()) == _names(range(2), roles, device=0)
        assert list(worker.get_kv_caches().values()) == caches
        mtp = worker.initialize_mtp_kv_cache(
            attn_backend=backend, num_gpu_blocks=12, num_mtp_layers=1, layer_offset=2
        )
        assert backend.calls[-1] == (12, "uint8", "block_wise_fp8", 2)
        assert len(mtp) == 4 and list(worker.get_kv_caches())[-4:] == _names(
            [2], roles, device=0
        )
        assert worker.controller.shape.num_layers == 3
    finally:
        worker.free_cache()


class _PerLayerDraft:
    """The per-layer create_kv_cache of an earlier draft of the upstream change."""

    def create_kv_cache(self, max_num_blocks, cache_dtype="bfloat16", kv_cache_quant_type=None):
        raise AssertionError("never called")


class _DSABackend(AttentionBackend):
    def get_kv_cache_shape(self, max_num_blocks, kv_cache_quant_type=None):
        key = [max_num_blocks, 1, self.block_size, 656]
        return key, [], [max_num_blocks, self.block_size, 132]


class _OddRoles(UpstreamAttentionBackend):
    def create_kv_cache(self, num_layers, num_blocks, cache_dtype, **kw):
        made = super().create_kv_cache(num_layers, num_blocks, cache_dtype, **kw)
        made[("indexer", 0)] = made[("key", 0)]
        return made


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        (_PerLayerDraft(), r"_PerLayerDraft has create_kv_cache\(max_num_blocks"),
        (object(), "neither create_kv_cache nor get_kv_cache_shape"),
        (_DSABackend(1, 8, BS), "returned 3 shapes"),
        (_OddRoles(2, 4, BS), r"role 'indexer' \(layer 0\)"),
    ],
)
def test_a_backend_of_neither_api_is_refused_saying_what_it_has(
    channel: str, paddle, backend, message: str
) -> None:
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    try:
        with pytest.raises(ValueError, match=message):
            worker.initialize_kv_cache(backend, 8)
        assert worker.controller is None and worker.get_kv_caches() == {}
    finally:
        worker.free_cache()


def test_free_gpu_cache_lets_go_of_every_tensor_and_init_runs_again(
    channel: str, paddle
) -> None:
    # The runner's profile run: init, free (then it measures free memory), init.
    worker = fd.CacheController(config(), 0, 0, channel_name=channel)
    backend = AttentionBackend(2, 4, BS)
    try:
        for _ in range(2):
            caches = worker.initialize_kv_cache(attn_backend=backend, num_gpu_blocks=8)
            runner_map = worker.get_kv_caches()  # the runner keeps this dict
            out = CacheSwapMetadata([5], [2], CacheLevel.DEVICE, CacheLevel.HOST, ["0:a"])
            worker.submit_swap_tasks(out, None)  # a copy reading them, in flight
            refs = [weakref.ref(t) for t in caches]
            del caches
            worker.free_gpu_cache()
            assert runner_map == {} and worker.swap_layer_done_counter is None
            gc.collect()
            assert [r() for r in refs] == [None] * 4
            assert worker.get_stats()["transfers_without_result"] == 0
        worker.initialize_kv_cache(backend, 8)
        assert worker.controller is not None and len(worker.get_kv_caches()) == 4
    finally:
        assert worker.free_cache() is True


def test_calls_before_the_cache_exists_answer_as_fastdeploys_do(channel: str, paddle) -> None:
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        assert worker.reset_cache() is True
        assert worker.get_host_cache_kvs_map() == {}
        assert worker.get_kv_caches() == {}
        assert worker.submit_swap_tasks(None, None) is None
        swap = CacheSwapMetadata([0], [1], CacheLevel.HOST, CacheLevel.DEVICE, ["3:a"])
        counter = worker.submit_swap_tasks(None, swap)
        with pytest.raises(fd.SwapInFailedError, match="not initialized"):
            counter.wait_for_layer(0)
        got = _received(worker, receiver, 1)
        assert [(r.transfer_id, r.success) for r in got] == [(3, False)]
        worker.free_gpu_cache()  # nothing to free: no error
    finally:
        assert worker.free_cache() is True
        receiver.close()


def test_mtp_layers_move_with_their_blocks(channel: str, paddle) -> None:
    cfg = config()
    worker = fd.CacheController(cfg, 0, 0, channel_name=channel, report_interval_s=0)
    receiver = ResultsReceiver(channel, tp_size=1)
    backend = AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS)
    try:
        main = worker.initialize_kv_cache(backend, 8)
        mtp = worker.initialize_mtp_kv_cache(backend, 12, num_mtp_layers=1, layer_offset=2)
        assert len(mtp) == 2 and mtp[0].shape[0] == 12
        assert "key_caches_2_rank0.device0" in worker.cache_kvs_map
        assert worker.controller.shape.num_layers == 3
        for i, t in enumerate(main + mtp):
            t[5] = paddle.full(t.shape[1:], i + 1, dtype=t.dtype)
        out = CacheSwapMetadata([5], [2], CacheLevel.DEVICE, CacheLevel.HOST, ["0:a"])
        assert worker.submit_swap_tasks(out, None) is None
        assert worker.finish_step(10, wait_evictions=True) == frozenset()
        back = CacheSwapMetadata([2], [6], CacheLevel.HOST, CacheLevel.DEVICE, ["1:a"])
        counter = worker.submit_swap_tasks(None, back)
        for layer in range(3):
            counter.wait_for_layer(layer, timeout=10)
        worker.finish_step(10)
        for i, t in enumerate(main + mtp):  # every layer's block, the MTP layer's too
            assert float(t[6].astype("float32").mean()) == i + 1
        got = _received(worker, receiver, 2)
        assert sorted(r.transfer_id for r in got) == [0, 1] and all(r.success for r in got)
        with pytest.raises(RuntimeError, match="swaps already ran"):
            worker.initialize_mtp_kv_cache(backend, 12, 1, 3)
    finally:
        worker.free_cache()
        receiver.close()


class _MtpBackend(UpstreamAttentionBackend):
    """Makes the MTP layers wrong: float32 tensors, or an extra K scale per layer."""

    def __init__(self, *args, wrong: str) -> None:
        super().__init__(*args)
        self.wrong = wrong

    def create_kv_cache(self, num_layers, num_blocks, cache_dtype, **kw):
        import paddle

        if self.wrong == "dtype":
            cache_dtype = "float32"
        made = super().create_kv_cache(num_layers, num_blocks, cache_dtype, **kw)
        if self.wrong == "roles":
            for layer in range(kw["layer_offset"], kw["layer_offset"] + num_layers):
                made[("key_scale", layer)] = paddle.zeros([num_blocks, 2, BS], "float32")
        return made


@pytest.mark.parametrize(
    ("wrong", "message"), [("roles", "3 tensors each"), ("dtype", "dtype float32")]
)
def test_refused_mtp_layers_leave_the_main_cache_as_it_was(
    channel: str, paddle, wrong: str, message: str
) -> None:
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    receiver = ResultsReceiver(channel, tp_size=1)
    backend = AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS)
    try:
        main = worker.initialize_kv_cache(backend, 8)
        names = list(worker.cache_kvs_map)
        with pytest.raises(ValueError, match=message):
            worker.initialize_mtp_kv_cache(
                _MtpBackend(2, 4, BS, wrong=wrong), 12, num_mtp_layers=1, layer_offset=2
            )
        assert list(worker.cache_kvs_map) == names
        assert list(worker.get_kv_caches().values()) == main
        assert worker.controller is not None and worker.controller.caches == main
        assert worker.controller.shape.num_layers == 2
        assert list(worker.get_host_cache_kvs_map()) == names
        out = CacheSwapMetadata([5], [2], CacheLevel.DEVICE, CacheLevel.HOST, ["0:a"])
        assert worker.submit_swap_tasks(out, None) is None  # the host tier still works
        assert worker.finish_step(10, wait_evictions=True) == frozenset()
        got = _received(worker, receiver, 1)
        assert [(r.transfer_id, r.success) for r in got] == [(0, True)]
    finally:
        worker.free_cache()
        receiver.close()


def test_the_models_writes_wait_for_every_eviction_still_reading(channel: str, paddle) -> None:
    """The blocks the scheduler marked handed over (FastDeploy's synchronous
    allocation gives an evicted block to the allocating request at once) go to the
    controller as reused, with no write_block_ids: the controller orders the model's
    writes after their reads. On the CPU stand-in the submission returns once they
    are done."""
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    try:
        worker.initialize_kv_cache(AttentionBackend(2, 4, BS), 8)
        ctrl = worker.controller
        gate, wrap = threading.Event(), ctrl.faults.wrap

        def held(fn):  # copies run once the gate opens
            inner = wrap(fn)
            return lambda *a, **k: (gate.wait(10), inner(*a, **k))[1]

        ctrl.faults.wrap = held
        seen, submit = [], ctrl.submit_swap_tasks

        def spy(evict, swap_in, writes, compute=None):
            seen.append(
                (None if evict is None else sorted(evict.reused_block_ids), list(writes))
            )
            return submit(evict, swap_in, writes, compute)

        ctrl.submit_swap_tasks = spy
        tensors = range(len(ctrl.caches))
        before = [ctrl.device_blocks(t)[[5, 6]].copy() for t in tensors]
        lvl = CacheLevel
        threading.Timer(0.2, gate.set).start()
        worker.submit_swap_tasks(
            CacheSwapMetadata([5, 6], [2, 3], lvl.DEVICE, lvl.HOST, ["0:a:h", "0:b:h"]),
            CacheSwapMetadata([0], [7], lvl.HOST, lvl.DEVICE, ["1:a"]),
        )
        assert gate.is_set()  # returned only once the held eviction had read 5 and 6
        for t in tensors:  # the new owner writes at once, waiting for nothing
            ctrl.device_blocks(t)[[5, 6]] = 0xEE
        worker.submit_swap_tasks(None, None)
        worker.finish_step(10, wait_evictions=True)
        for t in tensors:
            assert np.array_equal(ctrl.host_blocks(t)[[2, 3]], before[t])
        assert seen == [([5, 6], []), (None, [])]
        assert ctrl.transfers.handed_over_blocks() == frozenset()  # retired
    finally:
        worker.free_cache()


def test_backups_and_unmarked_evictions_never_hold_the_model_up(channel: str, paddle) -> None:
    """Issue 13 item 4: a write-through backup (or an eviction whose block went to no
    one yet) is not handed over: the submission returns while its copy still waits,
    and only the marked block of a mixed eviction is ordered."""
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    try:
        worker.initialize_kv_cache(AttentionBackend(2, 4, BS), 8)
        ctrl = worker.controller
        gate, wrap = threading.Event(), ctrl.faults.wrap
        ctrl.faults.wrap = lambda fn: lambda *a, **k: (gate.wait(10), wrap(fn)(*a, **k))[1]
        seen, submit = [], ctrl.submit_swap_tasks

        def spy(evict, swap_in, writes, compute=None):
            seen.append(None if evict is None else list(evict.reused_block_ids))
            return submit(evict, swap_in, writes, compute)

        ctrl.submit_swap_tasks = spy
        lvl = CacheLevel
        worker.submit_swap_tasks(
            CacheSwapMetadata([5, 6], [2, 3], lvl.DEVICE, lvl.HOST, ["0:a", "0:b"]), None
        )
        assert not gate.is_set()  # the backup still waits: the model was not held up
        worker.submit_swap_tasks(
            CacheSwapMetadata([1, 4], [0, 1], lvl.DEVICE, lvl.HOST, ["1:c", "1:d:h"]), None
        )
        assert seen == [[], [4]]
        gate.set()
        worker.finish_step(10, wait_evictions=True)
    finally:
        gate.set()
        worker.free_cache()


def test_the_scheduler_marks_exactly_the_handed_over_blocks() -> None:
    meta = fdt.to_fastdeploy(
        fk.CacheSwapMetadata(
            3,
            fk.CacheLevel.DEVICE,
            fk.CacheLevel.HOST,
            [7, 8, 9],
            [0, 1, 2],
            [b"\x01" * 32] * 3,
            reused_block_ids=[8],
        ),
        fdt.FDCacheSwapMetadata,
        fdt.FDCacheLevel,
    )
    assert [h.endswith(fdt.HANDED_OVER) for h in meta.hash_values] == [False, True, False]
    merged = fdt.parse_merged(meta, "device", "host")
    assert merged.handed_over == (8,) and merged.transfer_ids == (3,)


def test_metadata_the_worker_cannot_run_is_refused_or_reported_failed(
    channel: str, paddle
) -> None:
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        worker.initialize_kv_cache(AttentionBackend(2, 4, BS), 8)
        untagged = CacheSwapMetadata([0], [1], CacheLevel.HOST, CacheLevel.DEVICE, ["beef"])
        with pytest.raises(ValueError, match="no fastkv transfer tag"):
            worker.submit_swap_tasks(None, untagged)
        backwards = CacheSwapMetadata([0], [1], CacheLevel.DEVICE, CacheLevel.HOST, ["4:a"])
        with pytest.raises(ValueError, match="host->device"):
            worker.submit_swap_tasks(None, backwards)
        assert worker.get_stats()["host_to_device_transfers"] == 0  # nothing launched
        # What fastkv tagged in a refused batch is reported failed: nothing stays reserved.
        (refused,) = _received(worker, receiver, 1)
        assert (refused.transfer_id, refused.success) == (4, False)
        assert "refused" in refused.error
        out_of_range = CacheSwapMetadata(
            [0, 1], [3, 42], CacheLevel.HOST, CacheLevel.DEVICE, ["4:a", "5:b"]
        )
        counter = worker.submit_swap_tasks(None, out_of_range)
        with pytest.raises(fd.SwapInFailedError) as failure:
            counter.wait_for_layer(0)
        assert failure.value.device_block_ids == {3, 42}
        assert failure.value.transfer_ids == (4, 5)
        assert worker.finish_step(10) == frozenset({3, 42})
        got = _received(worker, receiver, 2)
        assert sorted(r.transfer_id for r in got) == [4, 5]
        assert all(not r.success and "outside [0, 8)" in r.error for r in got)
    finally:
        worker.free_cache()
        receiver.close()


def test_an_eviction_that_started_before_a_launch_error_reports_its_own_result(
    channel: str, paddle, monkeypatch
) -> None:
    # The load fails to launch after the eviction started: the eviction must not
    # be reported failed (that frees host blocks it is still writing).
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        worker.initialize_kv_cache(AttentionBackend(2, 4, BS), 8)

        def launch_error(*args, **kwargs):
            raise RuntimeError("cudaErrorLaunchFailure")

        monkeypatch.setattr(worker.controller, "_submit_to_device", launch_error)
        evict = CacheSwapMetadata([2], [3], CacheLevel.DEVICE, CacheLevel.HOST, ["6:c"])
        swap = CacheSwapMetadata([0], [1], CacheLevel.HOST, CacheLevel.DEVICE, ["7:d"])
        counter = worker.submit_swap_tasks(evict, swap)
        with pytest.raises(fd.SwapInFailedError):
            counter.wait_for_layer(0)
        assert worker.finish_step(10, wait_evictions=True) == frozenset({1})
        got = {r.transfer_id: r for r in _received(worker, receiver, 2)}
        assert got[6].success, got[6]
        assert not got[7].success and "cudaErrorLaunchFailure" in got[7].error
        assert worker.get_stats()["transfers_without_result"] == 0
    finally:
        worker.free_cache()
        receiver.close()


def test_install_replaces_fastdeploys_classes_where_it_looks_them_up(monkeypatch) -> None:
    install_fake_fastdeploy(monkeypatch)

    class TheirManager:
        pass

    class TheirController:
        pass

    modules = {}
    for name, attrs in {
        "fastdeploy.cache_manager.v1.cache_manager": {"CacheManager": TheirManager},
        "fastdeploy.cache_manager.v1.cache_controller": {"CacheController": TheirController},
        "fastdeploy.engine.resource_manager": {"CacheManager": TheirManager, "other": 1},
        "fastdeploy.worker.gpu_model_runner": {"CacheController": TheirController},
    }.items():
        module = types.ModuleType(name)
        vars(module).update(attrs)
        modules[name] = module
        monkeypatch.setitem(sys.modules, name, module)
    v1 = sys.modules["fastdeploy.cache_manager.v1"]
    monkeypatch.setattr(v1, "CacheManager", TheirManager, raising=False)
    monkeypatch.setattr(v1, "CacheController", TheirController, raising=False)
    replaced = fd.install()
    assert set(replaced) == {
        "fastdeploy.cache_manager.v1.cache_manager.CacheManager",
        "fastdeploy.cache_manager.v1.cache_controller.CacheController",
        "fastdeploy.cache_manager.v1.CacheManager",
        "fastdeploy.cache_manager.v1.CacheController",
        "fastdeploy.engine.resource_manager.CacheManager",
        "fastdeploy.worker.gpu_model_runner.CacheController",
    }
    assert modules["fastdeploy.engine.resource_manager"].CacheManager is fd.CacheManager
    assert modules["fastdeploy.worker.gpu_model_runner"].CacheController is fd.CacheController
    assert fd.install() == []  # idempotent
    fd.uninstall()
    assert modules["fastdeploy.engine.resource_manager"].CacheManager is TheirManager
    assert v1.CacheController is TheirController


def test_a_live_cache_manager_keeps_its_channel_and_a_second_start_is_refused(
    channel: str,
) -> None:
    """Issue 24 section 3: two managers on one channel name in one process (one
    FASTKV_RESULTS_CHANNEL for two engines): the second start fails at once, naming
    the channel and the holder; the first keeps receiving its workers' results."""
    first = fd.CacheManager(config(), channel_name=channel)
    try:
        with pytest.raises(OSError, match=rf"{channel}.*live cache manager.*pid {os.getpid()}"):
            fd.CacheManager(config(), channel_name=channel)
        assert not first.results.closed
        sender = ResultsSender(channel, 0)
        got: list = []
        deadline = time.monotonic() + 10
        sender.send([TransferResult(4, True)])
        while not got and time.monotonic() < deadline:
            sender.flush()  # as a worker's reporter does
            got += first.results.poll()
        assert [(r.transfer_id, r.success) for r in got] == [(4, True)]
        sender.close()
    finally:
        first.close()
    fd.CacheManager(config(), channel_name=channel).close()  # closed: the name is free


@pytest.mark.parametrize(
    "bad", [True, False, np.bool_(True), -1, float("nan"), float("inf"), "1"]
)
def test_seconds_settings_refuse_bools_and_non_finite_values(channel: str, bad) -> None:
    """A bool is not a number of seconds (True would wait one second)."""
    with pytest.raises(ValueError, match=r"^reset_timeout_s: must be a finite number"):
        fd.CacheManager(config(), channel_name=channel, reset_timeout_s=bad)
    with pytest.raises(ValueError, match=r"^report_interval_s: must be a finite number"):
        fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=bad)
    cm = fd.CacheManager(config(), channel_name=channel, reset_timeout_s=np.float64(0.5))
    try:  # numpy's floats are seconds too; the channel's name was never held above
        assert cm.reset_timeout_s == 0.5 and type(cm.reset_timeout_s) is float
    finally:
        cm.close()


def test_every_worker_result_carries_the_epoch_its_tags_name(channel: str, paddle) -> None:
    """Transfer ids restart with each cache epoch: the worker stamps the epoch of a
    step's tags on every result of it, launched, refused or never started."""
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    receiver = ResultsReceiver(channel, tp_size=1)
    dh, hd = (CacheLevel.DEVICE, CacheLevel.HOST), (CacheLevel.HOST, CacheLevel.DEVICE)

    def epochs(count: int) -> set:
        got = _received(worker, receiver, count)
        assert len(got) == count
        return {
            (type(r).__name__, getattr(r, "transfer_id", None) or r.lookup_id, r.epoch)
            for r in got
        }

    try:
        # before the cache exists: the swap-in, the eviction's storage work fail
        swap = CacheSwapMetadata([0], [1], *hd, ["3.5:a"])
        evict = CacheSwapMetadata([-1, -1], [2, -1], *dh, ["L4.5:b", "Q6.5:c"])
        counter = worker.submit_swap_tasks(evict, swap)
        with pytest.raises(fd.SwapInFailedError, match="not initialized"):
            counter.wait_for_layer(0)
        assert epochs(3) == {
            ("TransferResult", 3, 5),
            ("TransferResult", 4, 5),
            ("LookupResult", 6, 5),
        }
        worker.initialize_kv_cache(
            AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS), 8
        )
        # launched: an eviction (epoch 7) and a swap-in (epoch 0, untagged epoch)
        worker.submit_swap_tasks(CacheSwapMetadata([1], [2], *dh, ["8.7:a"]), None)
        worker.finish_step(wait_evictions=True)
        assert epochs(1) == {("TransferResult", 8, 7)}
        worker.submit_swap_tasks(None, CacheSwapMetadata([2], [3], *hd, ["9:a"]))
        worker.finish_step(wait_evictions=True)
        assert epochs(1) == {("TransferResult", 9, 0)}
        # refused: one step of two epochs; each id fails in the epoch its tag names
        mixed = CacheSwapMetadata([1, 2], [2, 3], *dh, ["10.7:a", "11.8:b"])
        with pytest.raises(ValueError, match="one step has one epoch"):
            worker.submit_swap_tasks(mixed, CacheSwapMetadata([2], [3], *hd, ["12.8:a"]))
        assert epochs(3) == {
            ("TransferResult", 10, 7),
            ("TransferResult", 11, 8),
            ("TransferResult", 12, 8),
        }
        with pytest.raises(ValueError, match="one step has one epoch"):
            worker.submit_swap_tasks(
                CacheSwapMetadata([1], [2], *dh, ["13.7:a"]),
                CacheSwapMetadata([2], [3], *hd, ["14.8:a"]),
            )
        assert epochs(2) == {("TransferResult", 13, 7), ("TransferResult", 14, 8)}
        assert worker.get_stats()["device_to_host_transfers"] == 1  # no refused step ran
    finally:
        assert worker.free_cache() is True
        receiver.close()


def test_runner_timeouts_refuse_bools_before_waiting(channel: str, paddle) -> None:
    """The runner's wait timeouts are seconds (None as FastDeploy's Optional): a
    bool, NaN or a negative value is refused, naming `timeout`, before any wait."""
    worker = fd.CacheController(config(), 0, 0, channel_name=channel, report_interval_s=0)
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        swap = CacheSwapMetadata([0], [1], CacheLevel.HOST, CacheLevel.DEVICE, ["3:a"])
        counter = worker.submit_swap_tasks(None, swap)  # refused: no cache yet
        for bad in (True, np.bool_(False), float("nan"), -1.0):
            with pytest.raises(ValueError, match=r"^timeout: must be a finite number"):
                counter.wait_for_layer(0, bad)
            with pytest.raises(ValueError, match=r"^timeout: must be a finite number"):
                counter.wait_all(bad)
            with pytest.raises(ValueError, match=r"^timeout: must be a finite number"):
                worker.wait_for_layer(0, bad)
            with pytest.raises(ValueError, match=r"^timeout: must be a finite number"):
                worker.finish_step(bad)
        with pytest.raises(fd.SwapInFailedError, match="not initialized"):
            counter.wait_for_layer(0, None)  # None is FastDeploy's default
        with pytest.raises(fd.SwapInFailedError, match="not initialized"):
            counter.wait_all(np.float32(1.0))
    finally:
        assert worker.free_cache() is True
        receiver.close()
