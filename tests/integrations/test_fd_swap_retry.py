"""A failed swap-in does not reach FastDeploy's unmodified runner when copying it
again works: the layer's wait retries the copy (bounded, counted) before it returns,
and the scheduler hears that the transfer succeeded; only a retry that fails too
raises `SwapInFailedError`."""

from __future__ import annotations

import time

import pytest
from fd_standins import AttentionBackend, CacheLevel, CacheSwapMetadata, FDCacheConfig, FDConfig

from fastkv.channel import ResultsReceiver
from fastkv.integrations import fastdeploy as fd
from fastkv.worker.faults import InjectedCopyError

paddle = pytest.importorskip("paddle", reason="the worker's CacheController needs paddle")

BS = 4
LAYERS = 2


def _worker(channel: str, **kw) -> fd.CacheController:
    cfg = FDConfig(FDCacheConfig(BS, total_block_num=8, num_cpu_blocks=8))
    cfg.model_config.num_hidden_layers = LAYERS
    worker = fd.CacheController(cfg, 0, 0, channel_name=channel, report_interval_s=0, **kw)
    caches = worker.initialize_kv_cache(AttentionBackend(2, 4, BS), 8)
    for i, t in enumerate(caches):  # block 5 of tensor i holds i + 1
        t[5] = paddle.full(t.shape[1:], i + 1, dtype=t.dtype)
    worker.submit_swap_tasks(
        CacheSwapMetadata([5], [2], CacheLevel.DEVICE, CacheLevel.HOST, ["0:a"]), None
    )
    worker.finish_step(10, wait_evictions=True)  # host block 2 holds block 5
    return worker


def _fail_calls(worker: fd.CacheController, failing: set[int]) -> list[int]:
    """Make the copy calls numbered in `failing` (from 1, from now on) raise."""
    calls: list[int] = []
    wrap = worker.controller.faults.wrap

    def wrapped(fn):
        inner = wrap(fn)

        def call(*args, **kwargs):
            calls.append(len(calls) + 1)
            if calls[-1] in failing:
                raise InjectedCopyError(f"injected (call {calls[-1]})")
            return inner(*args, **kwargs)

        return call

    worker.controller.faults.wrap = wrapped
    return calls


def _results(worker: fd.CacheController, receiver: ResultsReceiver, count: int) -> list:
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        worker.report_results()
        got += receiver.poll()
        time.sleep(0.005)
    return got


def _load(worker: fd.CacheController) -> object:
    return worker.submit_swap_tasks(
        None, CacheSwapMetadata([2], [6], CacheLevel.HOST, CacheLevel.DEVICE, ["7:a"])
    )


def test_a_failed_layer_is_copied_again_before_its_wait_returns(channel: str) -> None:
    worker = _worker(channel)
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        _results(worker, receiver, 1)  # the eviction's
        _fail_calls(worker, {1})  # the load's first layer
        counter = _load(worker)
        for layer in range(LAYERS):  # as attention does: no error reaches it
            counter.wait_for_layer(layer, timeout=10)
        assert not counter.failed
        assert worker.finish_step(10) == frozenset()
        for i, t in enumerate(worker.get_kv_caches().values()):
            assert float(t[6].astype("float32").mean()) == i + 1
        got = _results(worker, receiver, 1)
        assert [(r.transfer_id, r.success) for r in got] == [(7, True)]
        stats = worker.get_stats()
        assert (stats["swap_in_retries"], stats["swap_ins_recovered"]) == (1, 1)
        assert stats["transfers_without_result"] == 0
    finally:
        worker.free_cache()
        receiver.close()


@pytest.mark.parametrize("retries", [0, 2])
def test_a_swap_in_that_fails_again_raises_and_is_reported_failed(
    channel: str, retries: int
) -> None:
    worker = _worker(channel, swap_in_retries=retries)
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        _results(worker, receiver, 1)
        _fail_calls(worker, set(range(1, 100)))  # every copy from now on
        counter = _load(worker)
        with pytest.raises(fd.SwapInFailedError) as failure:
            counter.wait_for_layer(0, timeout=10)
        assert failure.value.device_block_ids == {6} and failure.value.transfer_ids == (7,)
        assert counter.failed
        assert worker.finish_step(10) == frozenset({6})
        got = _results(worker, receiver, 1)
        assert [(r.transfer_id, r.success) for r in got] == [(7, False)]
        stats = worker.get_stats()
        assert (stats["swap_in_retries"], stats["swap_ins_recovered"]) == (retries, 0)
    finally:
        worker.free_cache()
        receiver.close()


class _RecordingCounter:
    """fastkv's layer counter as the step counter sees it: records the waits."""

    failed = False

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_for_layer(self, layer: int, timeout: float) -> None:
        self.waited.append(layer)


def test_the_main_models_last_wait_also_waits_for_the_mtp_layers() -> None:
    # FastDeploy's MTP proposer (snapshot spec_decode/mtp_cuda.py) gives its
    # attention no layer_done_counter: nothing waits for the MTP layers' swap-in
    # unless the main model's last wait does.
    from fastkv.integrations.fd_step import StepHooks, StepLayerCounter

    inner = _RecordingCounter()
    reports: list[int] = []
    hooks = StepHooks(recover=lambda c, t: False, report=lambda: reports.append(1) or 0)
    counter = StepLayerCounter(hooks, inner, 5, [6], [7], model_layers=3)  # 2 MTP layers
    counter.wait_for_layer(0)
    counter.wait_for_layer(1)
    assert inner.waited == [0, 1] and not reports
    counter.wait_for_layer(2)
    assert inner.waited == [0, 1, 2, 3, 4] and reports == [1]
