"""The CacheController on real Paddle tensors and host memory (CPU build): bit-exact
round trips, per-layer loads, failure reporting, and a randomized ordering test
against a reference model of what every block must hold."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="the CacheController needs paddle")

from ops.gpu_support import paddle_gpu_skip_reason  # noqa: E402

from fastkv import CacheLevel, CacheSwapMetadata, StorageLookup  # noqa: E402
from fastkv.ops import core, paddle_ops  # noqa: E402
from fastkv.storage.base import OK, BlockLayout, StorageBackend, StorageStats  # noqa: E402
from fastkv.worker import CacheController, KVCacheSpec  # noqa: E402
from fastkv.worker.streams import HostStream, InlineStream  # noqa: E402
from fastkv.worker.transfer_manager import TransferFailedError  # noqa: E402

DTYPES = ["bfloat16", "float16", "float32", "fp8"]


def d2h(tid: int, device: list[int], host: list[int]) -> CacheSwapMetadata:
    return CacheSwapMetadata(tid, CacheLevel.DEVICE, CacheLevel.HOST, device, host)


def h2d(tid: int, host: list[int], device: list[int]) -> CacheSwapMetadata:
    return CacheSwapMetadata(tid, CacheLevel.HOST, CacheLevel.DEVICE, host, device)


def make(dtype: str = "bfloat16", *, device_blocks: int = 24, host_blocks: int = 40, **kw):
    spec = KVCacheSpec(
        num_layers=3,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        num_device_blocks=device_blocks,
        num_host_blocks=host_blocks,
        dtype=dtype,
        num_extra_layers=1,
    )
    return CacheController(spec, **kw)


def fill_random(ctrl: CacheController, rng: np.random.Generator) -> None:
    for i in range(len(ctrl.caches)):
        view = ctrl.device_blocks(i)
        view[:] = rng.integers(0, 256, size=view.shape, dtype=np.uint8)


def snapshot(ctrl: CacheController) -> tuple[list[np.ndarray], list[np.ndarray]]:
    n = len(ctrl.caches)
    return (
        [ctrl.device_blocks(i).copy() for i in range(n)],
        [ctrl.host_blocks(i).copy() for i in range(n)],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_is_bit_exact(dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with make(dtype) as ctrl:
        fill_random(ctrl, rng)
        original = [ctrl.device_blocks(i).copy() for i in range(len(ctrl.caches))]
        n = int(rng.integers(1, 12))
        src = rng.choice(24, n, replace=False).tolist()  # random, non-consecutive
        host = rng.choice(40, n, replace=False).tolist()
        dst = rng.choice(24, n, replace=False).tolist()
        ctrl.submit_swap_tasks(d2h(0, src, host), None)
        assert [r.success for r in ctrl.wait_all(5)] == [True]
        for i in range(len(ctrl.caches)):  # every tensor, scales and extra layer too
            np.testing.assert_array_equal(ctrl.host_blocks(i)[host], original[i][src])
            ctrl.device_blocks(i)[dst] = 0
        counter = ctrl.submit_swap_tasks(None, h2d(1, host, dst))
        layers = list(range(ctrl.spec.total_layers))
        random.Random(seed).shuffle(layers)
        per_layer = ctrl.spec.tensors_per_layer
        for layer in layers:  # a random layer order: each is usable once waited for
            counter.wait_for_layer(layer, timeout=5)
            for i in range(layer * per_layer, (layer + 1) * per_layer):
                np.testing.assert_array_equal(ctrl.device_blocks(i)[dst], original[i][src])
        assert [r.success for r in ctrl.wait_all(5)] == [True]
        stats = ctrl.get_stats()
        assert (stats.device_to_host_blocks, stats.host_to_device_blocks) == (n, n)
        assert stats.device_to_host_bytes == n * sum(ctrl.block_bytes)


def test_fp8_scales_and_extra_layers_are_allocated_and_move() -> None:
    with make("fp8") as ctrl:
        assert ctrl.spec.total_layers == 4 and len(ctrl.caches) == 16
        k, v, k_scale, v_scale = ctrl.layer_caches(3)  # the extra layer
        assert k.dtype == v.dtype == paddle.uint8
        assert k_scale.dtype == v_scale.dtype == paddle.float32
        assert list(k_scale.shape) == list(v_scale.shape) == [24, 2]
        k_scale[5] = paddle.to_tensor([1.5, -2.0])
        ctrl.submit_swap_tasks(d2h(0, [5], [9]), None)
        ctrl.wait_all(5)
        k_scale[5] = 0.0
        ctrl.submit_swap_tasks(None, h2d(1, [9], [5])).wait_all(timeout=5)
        np.testing.assert_array_equal(k_scale[5].numpy(), [1.5, -2.0])


@pytest.mark.parametrize(
    ("evict", "swap_in", "match"),
    [
        (h2d(0, [1], [1]), None, "expected DEVICE->HOST"),
        (None, d2h(0, [1], [1]), "expected HOST->DEVICE"),
        (d2h(0, [24], [1]), None, "device ids contain 24"),
        (d2h(0, [-1], [1]), None, "device ids contain -1"),
        (d2h(0, [1], [40]), None, "host ids contain 40"),
        (d2h(0, [1, 2], [3, 3]), None, "dst_block_ids lists block 3 more than once"),
        (None, h2d(0, [1, 2], [3, 3]), "dst_block_ids lists block 3 more than once"),
        (d2h(4, [1], [1]), h2d(4, [2], [2]), "transfer_id: 4 used by both"),
        (d2h(0, [1], [1]), h2d(1, [5], [24]), "device ids contain 24"),
    ],
)
def test_bad_metadata_raises_before_anything_moves(evict, swap_in, match) -> None:
    rng = np.random.default_rng(0)
    with make() as ctrl:
        fill_random(ctrl, rng)
        before = snapshot(ctrl)
        with pytest.raises(ValueError, match=match):
            ctrl.submit_swap_tasks(evict, swap_in)
        time.sleep(0.05)
        after = snapshot(ctrl)
        for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True):
            np.testing.assert_array_equal(a, b)
        assert ctrl.get_stats().inflight_transfers == 0


@pytest.mark.parametrize(
    ("writes", "match"),
    [
        ([3, 24], r"\[1\]: 24 is outside"),
        (["7"], r"\[0\]: expected a device block id, got '7'"),
    ],
)
def test_bad_write_ids_raise_before_the_eviction_starts(writes, match) -> None:
    # The eviction is launched before the load; a bad write id found after it
    # would leave a copy running that the caller was told never started.
    with make() as ctrl:
        with pytest.raises(ValueError, match=rf"write_block_ids{match}"):
            ctrl.submit_swap_tasks(d2h(0, [1], [1]), h2d(1, [2], [2]), writes)
        assert ctrl.get_stats().inflight_transfers == 0
        assert ctrl.get_stats().device_to_host_transfers == 0


def test_a_transfer_id_still_in_flight_is_refused() -> None:
    gate = HostStream("d2h")
    with make(streams=(HostStream("h2d"), gate, InlineStream())) as ctrl:
        import threading

        release = threading.Event()
        gate.launch(lambda _: release.wait(5), pytest.fail)  # hold the output stream
        ctrl.submit_swap_tasks(d2h(3, [1], [1]), None)
        assert ctrl.is_inflight(3) and not ctrl.is_inflight(4)
        with pytest.raises(ValueError, match="transfer_id: 3"):
            ctrl.submit_swap_tasks(None, h2d(3, [2], [2]))
        release.set()
        assert [r.transfer_id for r in ctrl.wait_all(5)] == [3]
        assert not ctrl.is_inflight(3)


def test_a_failed_load_is_reported_and_raises_at_its_layer(monkeypatch) -> None:
    real = paddle_ops.swap_layer

    def flaky(caches, device_ids, host_ids, host_ptrs, layer, *args, **kwargs):
        if layer == 2:
            raise RuntimeError("fastkv[ECUDA] injected")
        return real(caches, device_ids, host_ids, host_ptrs, layer, *args, **kwargs)

    monkeypatch.setattr(paddle_ops, "swap_layer", flaky)
    with make() as ctrl:
        counter = ctrl.submit_swap_tasks(None, h2d(5, [1, 2], [3, 4]))
        counter.wait_for_layer(1, timeout=5)
        with pytest.raises(TransferFailedError, match="injected"):
            ctrl.wait_for_layer(2, timeout=5)
        (result,) = ctrl.wait_all(5)
        assert (result.transfer_id, result.success) == (5, False)
        assert ctrl.get_stats().failed_transfers == 1


class StuckBackend(StorageBackend):
    """A store whose reads hang in the backend until released (a hung NFS mount, a
    stalled Mooncake transfer), then write into the host block they were given."""

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout
        self.release = threading.Event()
        self.wrote = threading.Event()

    def exists(self, keys, deadline):
        return [True] * len(keys)

    def get_into(self, keys, blocks, deadline):
        self.release.wait(30)
        for block in blocks:
            for address, length in block:
                ctypes.memset(address, 7, length)
        self.wrote.set()
        return [OK] * len(keys)

    def put_from(self, keys, blocks, deadline):
        return [OK] * len(keys)

    def stats(self) -> StorageStats:
        return StorageStats()

    def close(self) -> None:
        pass


def test_free_cache_keeps_the_host_tier_mapped_while_storage_io_still_writes_it(
    monkeypatch, caplog
) -> None:
    spec = KVCacheSpec(1, 1, 4, 4, num_device_blocks=2, num_host_blocks=2, dtype="float32")
    backend = StuckBackend(BlockLayout(tuple(spec.block_bytes())))
    ctrl = CacheController(spec, storage=backend, storage_namespace=bytes(32))
    freed = []
    real_free = paddle_ops.host_free
    monkeypatch.setattr(paddle_ops, "host_free", lambda *a: freed.append(a) or real_free(*a))
    load = CacheSwapMetadata(
        5, CacheLevel.STORAGE, CacheLevel.HOST, [], [1], [bytes(range(32))], timeout_s=0.1
    )
    ctrl.submit_storage_tasks(load, None)
    ctrl.free_cache(timeout=0.3)
    assert freed == [], "the host tier was freed under a read still in its backend"
    assert "still touches host blocks [1]" in caplog.text
    backend.release.set()  # the read returns and writes its block: still mapped
    assert backend.wrote.wait(10)


def test_a_storage_step_that_clashes_starts_nothing() -> None:
    spec = KVCacheSpec(1, 1, 4, 4, num_device_blocks=2, num_host_blocks=4, dtype="float32")
    backend = StuckBackend(BlockLayout(tuple(spec.block_bytes())))
    backend.release.set()
    key = bytes(range(32))
    load = CacheSwapMetadata(5, CacheLevel.STORAGE, CacheLevel.HOST, [], [1], [key])
    store = CacheSwapMetadata(6, CacheLevel.HOST, CacheLevel.STORAGE, [1], [], [key])
    lookup = StorageLookup(3, (key,))
    with CacheController(spec, storage=backend, storage_namespace=bytes(32)) as ctrl:
        with pytest.raises(ValueError, match="block 1 is used"):
            ctrl.submit_storage_tasks(load, store, [lookup])
        assert ctrl.wait_all(timeout=1) == [], "the lookup and the load did not start"
        assert ctrl.get_stats().storage_blocks_read == 0
        ctrl.submit_storage_tasks(load, None, [lookup])
        results = ctrl.wait_all(timeout=10)
        assert sorted(type(r).__name__ for r in results) == ["LookupResult", "TransferResult"]


def test_results_echo_their_metadatas_epoch() -> None:
    # A scheduler drops results of another epoch than its own: the worker must
    # give each result its metadata's, copies and storage work alike.
    spec = KVCacheSpec(1, 1, 4, 4, num_device_blocks=4, num_host_blocks=4, dtype="float32")
    backend = StuckBackend(BlockLayout(tuple(spec.block_bytes())))
    backend.release.set()
    key = bytes(range(32))
    with CacheController(spec, storage=backend, storage_namespace=bytes(32)) as ctrl:
        evict = CacheSwapMetadata(1, CacheLevel.DEVICE, CacheLevel.HOST, [0], [0], epoch=3)
        swap_in = CacheSwapMetadata(2, CacheLevel.HOST, CacheLevel.DEVICE, [1], [1])
        ctrl.submit_swap_tasks(evict, swap_in)
        load = CacheSwapMetadata(
            5, CacheLevel.STORAGE, CacheLevel.HOST, [], [2], [key], epoch=3
        )
        ctrl.submit_storage_tasks(load, None, [StorageLookup(4, (key,), epoch=3)])
        got = {
            (type(r).__name__, getattr(r, "transfer_id", -1)): r.epoch
            for r in ctrl.wait_all(10)
        }
        assert got == {
            ("TransferResult", 1): 3,
            ("TransferResult", 2): 0,
            ("TransferResult", 5): 3,
            ("LookupResult", -1): 3,
        }


def test_reset_zeroes_and_free_releases() -> None:
    ctrl = make()
    fill_random(ctrl, np.random.default_rng(0))
    ctrl.submit_swap_tasks(d2h(0, [1, 2], [3, 4]), None)
    assert [r.success for r in ctrl.reset_cache()] == [True]
    assert not any(ctrl.device_blocks(i).any() for i in range(len(ctrl.caches)))
    assert not any(ctrl.host_blocks(i).any() for i in range(len(ctrl.caches)))
    ctrl.free_cache()
    with pytest.raises(RuntimeError, match="freed"):
        ctrl.submit_swap_tasks(d2h(1, [1], [1]), None)
    assert ctrl.free_cache() == []  # idempotent


class JitterStream(HostStream):
    """A stand-in stream whose copies take random time, to shake out orderings."""

    def __init__(self, name: str, rng: random.Random) -> None:
        super().__init__(name)
        self._rng = rng

    def launch(self, fn, on_error) -> None:
        delay = self._rng.random() * 0.002

        def slow(handle: int) -> None:
            time.sleep(delay)
            fn(handle)

        super().launch(slow, on_error)


@pytest.mark.parametrize("seed", range(6))
def test_random_swaps_match_a_sequential_reference(seed: int) -> None:
    """Evictions are never waited for; loads, evictions and model writes touch the
    same blocks on purpose. The result must equal running every operation one after
    the other in submission order."""
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    streams = (JitterStream("h2d", rng), JitterStream("d2h", rng), InlineStream())
    with make(device_blocks=8, host_blocks=8, streams=streams) as ctrl:
        fill_random(ctrl, nprng)
        ref_device, ref_host = snapshot(ctrl)
        tensors = range(len(ctrl.caches))
        for step in range(40):
            evict = swap_in = None
            if rng.random() < 0.7:
                n = rng.randint(1, 4)
                src, dst = rng.choices(range(8), k=n), rng.sample(range(8), n)
                evict = d2h(2 * step, src, dst)
                for i in tensors:
                    ref_host[i][dst] = ref_device[i][src]
            if rng.random() < 0.7:
                n = rng.randint(1, 4)
                src, dst = rng.choices(range(8), k=n), rng.sample(range(8), n)
                swap_in = h2d(2 * step + 1, src, dst)
                for i in tensors:
                    ref_device[i][dst] = ref_host[i][src]
            writes = rng.sample(range(8), rng.randint(0, 2))
            counter = ctrl.submit_swap_tasks(evict, swap_in, write_block_ids=writes)
            for layer in range(ctrl.spec.total_layers):
                counter.wait_for_layer(layer, timeout=10)
            for block in writes:  # the model writes these blocks this step
                value = step % 251 + 1
                for i in tensors:
                    ctrl.device_blocks(i)[block] = value
                    ref_device[i][block] = value
            ctrl.poll_results()
        assert all(r.success for r in ctrl.wait_all(10))
        device, host = snapshot(ctrl)
        for i in tensors:
            np.testing.assert_array_equal(device[i], ref_device[i], err_msg=f"device {i}")
            np.testing.assert_array_equal(host[i], ref_host[i], err_msg=f"host {i}")


def test_a_gpu_controller_without_a_usable_gpu_says_why() -> None:
    if paddle.is_compiled_with_cuda() and core.cuda_device_count() > 0:
        pytest.skip("this machine can run a GPU controller")
    with pytest.raises(RuntimeError) as info:
        make(device="gpu:0")
    message = str(info.value)
    assert "device 'gpu:0'" in message
    assert "fastkv core:" in message and core.cuda_info().status in message


def test_a_cuda_stream_handle_is_refused_for_a_cpu_cache() -> None:
    with (
        make() as ctrl,
        pytest.raises(ValueError, match="compute_stream: 1234 is a CUDA stream"),
    ):
        ctrl.submit_swap_tasks(None, None, compute_stream=1234)


def test_the_compute_stream_can_be_handed_per_step() -> None:
    """Each step's copies and write guards follow the stream that step names."""

    class Recording(InlineStream):
        records = 0

        def record(self):
            Recording.records += 1
            return super().record()

    with make() as ctrl:
        fill_random(ctrl, np.random.default_rng(0))
        counter = ctrl.submit_swap_tasks(
            d2h(0, [1], [2]), h2d(1, [3], [4]), compute_stream=Recording()
        )
        assert Recording.records == 2  # one per transfer of this step
        counter.wait_all(timeout=5)
        assert all(r.success for r in ctrl.wait_all(5))


_GPU_REASON = paddle_gpu_skip_reason()
paddle_gpu = pytest.mark.skipif(_GPU_REASON is not None, reason=_GPU_REASON or "")


@pytest.mark.gpu
@paddle_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_on_gpu(dtype: str) -> None:
    with make(dtype, device="gpu:0") as ctrl:
        originals = []
        for tensor in ctrl.caches:
            src = paddle.randint(0, 100, tensor.shape).astype(tensor.dtype)
            paddle.assign(src, tensor)
            originals.append(tensor.numpy().copy())
        ctrl.submit_swap_tasks(d2h(0, [3, 1, 7], [10, 2, 31]), None)
        ctrl.wait_all(10)
        counter = ctrl.submit_swap_tasks(None, h2d(1, [10, 2, 31], [5, 6, 9]))
        for layer in range(ctrl.spec.total_layers):
            counter.wait_for_layer(layer)  # device-side: Paddle's stream waits
        for tensor, original in zip(ctrl.caches, originals, strict=True):
            np.testing.assert_array_equal(tensor.numpy()[[5, 6, 9]], original[[3, 1, 7]])
        counter.wait_all(timeout=10)


@pytest.mark.gpu
@paddle_gpu
def test_gpu_controller_initialises_at_construction_on_its_own_device() -> None:
    with make(device="gpu:0") as ctrl:
        slots, _, _ = core.cuda_staging_stats(0)
        assert slots >= 64  # the ring exists before the first swap
        assert ctrl._input.device == ctrl._output.device == 0
        assert ctrl._input.priority() < ctrl._output.priority()  # loads first
        handle = paddle.device.cuda.current_stream(0).cuda_stream
        counter = ctrl.submit_swap_tasks(d2h(0, [1], [2]), None, compute_stream=int(handle))
        counter.wait_all(timeout=10)
        assert [r.success for r in ctrl.wait_all(10)] == [True]


@pytest.mark.gpu
@paddle_gpu
def test_free_cache_behind_a_stuck_engine_stream_returns_within_its_bound() -> None:
    """Issue 26, item 9, through the controller itself (tests/ops/test_cuda_gpu.py
    probes the same release calls one by one where Paddle is absent): an engine
    kernel spins on its own stream; free_cache(timeout=2) must return within its
    documented bound (the layout's cudaFree gives up at the timeout) rather than
    wait in cudaHostUnregister, or anywhere, for the stuck stream."""
    import cupy as cp
    from ops.gpu_support import SpinningKernel

    ctrl = make(device="gpu:0")
    ctrl.submit_swap_tasks(d2h(0, [3, 1], [10, 2]), None)
    ctrl.wait_all(10)
    engine = cp.cuda.Stream(non_blocking=True)
    spin = SpinningKernel(limit=60.0).launch(engine.ptr, 0)
    time.sleep(0.2)  # the kernel is resident
    took: list[float] = []

    def free() -> None:
        start = time.monotonic()
        ctrl.free_cache(timeout=2.0)
        took.append(time.monotonic() - start)

    worker = threading.Thread(target=free, daemon=True)
    worker.start()
    worker.join(5.0)  # past the bound: let the kernel go so the test ends
    spin.release()
    worker.join(60.0)
    cp.cuda.Device(0).synchronize()
    assert took, "free_cache did not return even after the stuck kernel ended"
    print(f"\nfree_cache(timeout=2) behind a stuck stream: {took[0]:.2f} s")
    assert took[0] <= 3.0, f"free_cache waited {took[0]:.1f} s for the stuck stream"


class NativeHostStream(HostStream):
    """Launches all layers of a swap-in in one call, as a CUDA stream does (also
    when it is ordered after in-flight copies; `native_calls` lists how many copies
    each call waited for)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.native_calls: list[int] = []

    def launch_layers(self, num_layers, copy_layer, on_error, copy_layers=None, after=()):
        if copy_layers is None:
            return super().launch_layers(num_layers, copy_layer, on_error, after=after)
        import ctypes

        from fastkv.worker.streams import LayerWaits

        self.native_calls.append(len(after))
        handles = (ctypes.c_void_p * num_layers)()  # a CPU layout ignores events
        args = [handles]
        if after:  # a CPU layout ignores waits too: wait for every layer first
            for other in after:
                for event in other:
                    self.wait_event(event)
            per_layer = len(after)
            args.append(LayerWaits((ctypes.c_void_p * (num_layers * per_layer))(), per_layer))
        self.launch(
            lambda handle: copy_layers(handle, *args),
            lambda e: on_error(e, getattr(e, "failed_layer", 0)),
        )
        return [self.record() for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_the_gpu_controllers_layout_path_round_trips_on_a_cpu_layout(dtype: str) -> None:
    """The controller's GPU data path (a core layout: ids validated and staged once,
    every layer of a swap-in from one call) run over a CPU layout, so its Python
    side is checked where no GPU is."""
    streams = (NativeHostStream("h2d"), HostStream("d2h"), InlineStream())
    with make(dtype, streams=streams) as ctrl:
        ctrl._layout = ctrl._make_layout(-1)  # its GPU layout, on the CPU core
        try:
            rng = np.random.default_rng(3)
            fill_random(ctrl, rng)
            original = [ctrl.device_blocks(i).copy() for i in range(len(ctrl.caches))]
            ctrl.submit_swap_tasks(d2h(0, [3, 1, 7], [10, 2, 31]), None)
            assert [r.success for r in ctrl.wait_all(5)] == [True]
            counter = ctrl.submit_swap_tasks(None, h2d(1, [10, 2, 31], [5, 6, 9]))
            counter.wait_all(timeout=5)
            for i in range(len(ctrl.caches)):
                np.testing.assert_array_equal(
                    ctrl.device_blocks(i)[[5, 6, 9]], original[i][[3, 1, 7]]
                )
            assert [r.success for r in ctrl.wait_all(5)] == [True]
        finally:
            ctrl._layout.close()


def test_a_load_into_blocks_a_same_step_eviction_reads_is_one_call_on_the_layout_path() -> None:
    """Issue 26, item 1, on a CPU layout: the step evicts device blocks 5 and 6 and
    loads other KV into them. The load is ordered after the eviction per layer,
    and still goes out as one native call (it used to be one call per layer);
    the eviction reads the old bytes, the load lands the new ones."""
    load_stream = NativeHostStream("h2d")
    with make(streams=(load_stream, HostStream("d2h"), InlineStream())) as ctrl:
        ctrl._layout = ctrl._make_layout(-1)  # its GPU layout, on the CPU core
        try:
            fill_random(ctrl, np.random.default_rng(5))
            device = [ctrl.device_blocks(i).copy() for i in range(len(ctrl.caches))]
            host = [ctrl.host_blocks(i).copy() for i in range(len(ctrl.caches))]
            counter = ctrl.submit_swap_tasks(d2h(1, [5, 6], [20, 21]), h2d(2, [2, 31], [5, 6]))
            counter.wait_all(timeout=5)
            assert sorted(r.success for r in ctrl.wait_all(5)) == [True, True]
            assert load_stream.native_calls == [1]  # one call, after one eviction
            for i in range(len(ctrl.caches)):
                np.testing.assert_array_equal(ctrl.host_blocks(i)[[20, 21]], device[i][[5, 6]])
                np.testing.assert_array_equal(ctrl.device_blocks(i)[[5, 6]], host[i][[2, 31]])
        finally:
            ctrl._layout.close()


def test_fault_injection_fails_copies_before_they_touch_memory() -> None:
    """fail_rate=1: every copy call fails; the swap-in's result says so, the layer
    wait raises, and the destination blocks are left exactly as they were."""
    from fastkv.worker.faults import InjectedCopyError
    from fastkv.worker.transfer_manager import TransferFailedError

    spec = KVCacheSpec(2, 1, 4, 4, num_device_blocks=4, num_host_blocks=4, dtype="float32")
    with CacheController(spec, fail_rate=1.0) as ctrl:
        ctrl.host_blocks(0)[1] = 7
        before = [ctrl.device_blocks(t).copy() for t in range(len(ctrl.caches))]
        swap = CacheSwapMetadata(0, CacheLevel.HOST, CacheLevel.DEVICE, [1], [2])
        counter = ctrl.submit_swap_tasks(None, swap)
        with pytest.raises(TransferFailedError, match="injected copy failure"):
            counter.wait_for_layer(0, timeout=10)
        (result,) = ctrl.wait_all(timeout=10)
        assert not result.success and InjectedCopyError.__name__ in result.error
        assert all(np.array_equal(ctrl.device_blocks(t), before[t]) for t in range(len(before)))
        assert ctrl.faults.failures >= 1 and ctrl.get_stats().failed_transfers == 1
    with pytest.raises(ValueError, match="fail_rate"):
        CacheController(spec, fail_rate=1.5)


def test_transfer_listeners_hear_each_transfer_with_its_direction_and_size() -> None:
    spec = KVCacheSpec(2, 1, 4, 4, num_device_blocks=4, num_host_blocks=4, dtype="float32")
    heard = []
    with CacheController(spec) as ctrl:
        ctrl.add_transfer_listener(lambda *event: heard.append(event))
        started = time.monotonic()
        ctrl.submit_swap_tasks(
            CacheSwapMetadata(0, CacheLevel.DEVICE, CacheLevel.HOST, [0, 1], [2, 3]),
            CacheSwapMetadata(1, CacheLevel.HOST, CacheLevel.DEVICE, [0], [3]),
        )
        results = ctrl.wait_all(timeout=10)
        window = time.monotonic() - started
    assert sorted(r.transfer_id for r in results) == [0, 1]
    by_direction = {(src, dst): (n, ok) for src, dst, n, _, ok in heard}
    assert by_direction == {
        (CacheLevel.DEVICE, CacheLevel.HOST): (2, True),
        (CacheLevel.HOST, CacheLevel.DEVICE): (1, True),
    }
    # Each duration is the transfer's own, so it lies inside the window the test watched.
    assert all(0 <= seconds <= window for *_, seconds, _ in heard)


@pytest.mark.parametrize(("dtype", "heads"), [("bfloat16", 2), ("fp8", 1)])
@pytest.mark.parametrize("path", ["ops", "layout"])
def test_a_host_block_is_one_region_of_its_tensors_device_blocks(
    dtype: str, heads: int, path: str
) -> None:
    """The host tier's layout: host block h is ONE contiguous region, at
    base + h * host_stride, whose bytes are every tensor's device block in tensor
    order, no padding (what storage stores and checksums for it). fp8 with one
    head: 4-byte scale blocks, so tensor prefixes are only 4-byte aligned. Both
    data paths: the Paddle ops (CPU) and the GPU path's layout on the CPU core."""
    spec = KVCacheSpec(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=16,
        block_size=4,
        num_device_blocks=16,
        num_host_blocks=12,
        dtype=dtype,
    )
    streams = (NativeHostStream("h2d"), HostStream("d2h"), InlineStream())
    with CacheController(spec, streams=streams) as ctrl:
        if path == "layout":
            ctrl._layout = ctrl._make_layout(-1)
        try:
            sizes = ctrl.block_bytes
            if dtype == "fp8":
                assert 4 in sizes  # a 4-byte scale block: unaligned prefixes follow
            assert ctrl.host_stride == sum(sizes)
            starts = [p - ctrl.host_ptrs[0] for p in ctrl.host_ptrs]
            assert starts == [sum(sizes[:i]) for i in range(len(sizes))]
            fill_random(ctrl, np.random.default_rng(8))
            ctrl.submit_swap_tasks(d2h(0, [3, 9, 10, 0], [11, 4, 5, 0]), None)
            assert [r.success for r in ctrl.wait_all(5)] == [True]
            tier = ctrl.host_tier()
            assert tier.shape == (12, ctrl.host_stride)
            assert tier.ctypes.data == ctrl.host_ptrs[0]
            for d, h in ((3, 11), (9, 4), (10, 5), (0, 0)):
                want = b"".join(ctrl.device_blocks(i)[d].tobytes() for i in range(len(sizes)))
                assert tier[h].tobytes() == want, (d, h)
            before = [ctrl.device_blocks(i).copy() for i in range(len(sizes))]
            counter = ctrl.submit_swap_tasks(None, h2d(1, [11, 4], [1, 2]))
            counter.wait_all(timeout=5)
            assert [r.success for r in ctrl.wait_all(5)] == [True]
            for i in range(len(sizes)):
                np.testing.assert_array_equal(ctrl.device_blocks(i)[[1, 2]], before[i][[3, 9]])
        finally:
            if ctrl._layout is not None:
                ctrl._layout.close()
