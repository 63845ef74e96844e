"""The worker's ordering on real CUDA streams, without Paddle: TransferManager over
the core's streams, events and a layout, with CuPy arrays for the cache and a CuPy
stream standing in for the model's compute stream.

- an eviction waits (on the device) for the model's late write of its block;
- layer-wise loads complete while the compute stream is held, and the compute
  stream's reads of a layer wait for that layer's load;
- the model's write of a block an in-flight eviction still reads waits for it;
- a failed layer fails its waits and the result, the layers before it are intact.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
from ops.gpu_support import GPU_REASON, StreamGate, gpu, needs_gpu

from fastkv.ops import core
from fastkv.worker.streams import CudaEventPool, CudaStream
from fastkv.worker.transfer_manager import TransferFailedError, TransferManager

pytestmark = [gpu, needs_gpu]

if GPU_REASON is None:
    import cupy as cp

DEVICE = 0
LAYERS = 4
BLOCK = 8192
NDEV, NHOST = 32, 32
H2D, D2H = core.Direction.H2D, core.Direction.D2H


def _waits(waits) -> tuple[object, int]:
    """A LayerWaits (or None) as Layout.swap's wait_events, waits_per_layer."""
    return (None, 0) if waits is None else waits.astuple()


class Rig:
    """K and V per layer as CuPy arrays, a pinned host tier, a layout, the worker's
    two streams and a CuPy compute stream."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.dev = [
            cp.asarray(rng.integers(0, 256, (NDEV, BLOCK), dtype=np.uint8))
            for _ in range(2 * LAYERS)
        ]
        self.host_bytes = 2 * LAYERS * NHOST * BLOCK
        self.host_ptr = core.host_alloc(self.host_bytes, pin=True, device=DEVICE)
        raw = np.frombuffer(
            (ctypes.c_uint8 * self.host_bytes).from_address(self.host_ptr), np.uint8
        )
        raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)
        self.host = [
            raw[i * NHOST * BLOCK : (i + 1) * NHOST * BLOCK].reshape(NHOST, BLOCK)
            for i in range(2 * LAYERS)
        ]
        segs = [
            (d.data.ptr, h.ctypes.data, BLOCK) for d, h in zip(self.dev, self.host, strict=True)
        ]
        self.layout = core.Layout(segs, 2, NDEV, NHOST, DEVICE)
        self.pool = CudaEventPool(DEVICE, prefill=16)
        self.input = CudaStream.new(DEVICE, self.pool, priority=1)
        self.output = CudaStream.new(DEVICE, self.pool, priority=-1)
        self.cupy_compute = cp.cuda.Stream(non_blocking=True)
        self.compute = CudaStream.external(DEVICE, self.cupy_compute.ptr, self.pool)
        self.tm = TransferManager(self.input, self.output, self.compute, LAYERS)
        self.native_loads: list[object] = []  # each native load call's LayerWaits

    def evict(self, tid: int, d: list[int], h: list[int], reused: list[int] | None = None):
        dev, host = np.asarray(d, np.int64), np.asarray(h, np.int64)

        def copy_layer(layer: int, s: int) -> None:
            self.layout.swap(dev, host, D2H, layer, 1, s)

        def all_layers(s: int, events, waits=None) -> None:
            self.layout.swap(dev, host, D2H, 0, LAYERS, s, events, 0, *_waits(waits))

        return self.tm.submit_to_host(
            tid, d, h, copy_layer, self.compute, all_layers, reused or ()
        )

    def load(self, tid: int, h: list[int], d: list[int], copy_layers=None):
        dev, host = np.asarray(d, np.int64), np.asarray(h, np.int64)

        def copy_layer(layer: int, s: int) -> None:
            self.layout.swap(dev, host, H2D, layer, 1, s)

        def all_layers(s: int, events, waits=None) -> None:
            self.native_loads.append(waits)
            self.layout.swap(dev, host, H2D, 0, LAYERS, s, events, 0, *_waits(waits))

        return self.tm.submit_to_device(
            tid, h, d, copy_layer, (), self.compute, copy_layers or all_layers
        )

    def close(self) -> None:
        cp.cuda.Device(DEVICE).synchronize()
        self.tm.wait_all(30)
        self.layout.close()
        self.input.close()
        self.output.close()
        core.host_free(self.host_ptr, self.host_bytes, pinned=True)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_an_eviction_waits_for_the_models_late_write(rig: Rig) -> None:
    gate = StreamGate(rig.cupy_compute.ptr, DEVICE).close()
    try:
        with rig.cupy_compute:
            for t in rig.dev:  # the model writes block 5 of every layer, late
                t[5] = 0xAB
        done = rig.evict(1, [5], [9])
        time.sleep(0.05)
        assert not done.query()  # held behind the model's write
    finally:
        gate.open()
    assert done.synchronize(30)
    for h in rig.host:
        assert (h[9] == 0xAB).all()
    (result,) = rig.tm.poll()
    assert result.success


def test_layer_loads_run_while_compute_is_held_and_compute_reads_wait_for_them(
    rig: Rig,
) -> None:
    expected = [h[[3, 4]].copy() for h in rig.host]
    in_gate = StreamGate(rig.input.handle, DEVICE).close()  # loads queued, not yet run
    counter = rig.load(2, [3, 4], [10, 11])
    seen = [cp.zeros((2, BLOCK), cp.uint8) for _ in rig.dev]
    with rig.cupy_compute:
        for layer in range(LAYERS):
            counter.wait_for_layer(layer)  # device-side by default: returns at once
            for k in (2 * layer, 2 * layer + 1):
                seen[k][:] = rig.dev[k][cp.asarray([10, 11])]
    time.sleep(0.05)
    probe = rig.compute.record()
    assert not probe.query()  # compute's reads wait for the held loads
    comp_gate = StreamGate(rig.cupy_compute.ptr, DEVICE).close()  # and hold compute too
    in_gate.open()
    try:
        counter.wait_for_layer(LAYERS - 1, timeout=30, on_device=False)  # loads finish
        assert counter.is_layer_done(0)
    finally:
        comp_gate.open()
    rig.cupy_compute.synchronize()
    for k, s in enumerate(seen):
        assert np.array_equal(cp.asnumpy(s), expected[k]), f"tensor {k}"


def test_the_models_write_waits_for_an_eviction_still_reading_the_block(rig: Rig) -> None:
    before = [cp.asnumpy(t[3]) for t in rig.dev]
    out_gate = StreamGate(rig.output.handle, DEVICE).close()
    try:
        rig.evict(3, [3], [20])
        guard = rig.tm.guard_writes([3], compute=rig.compute)
        for layer in range(LAYERS):
            guard.wait_for_layer(layer)  # the compute stream waits, the host does not
        with rig.cupy_compute:
            for t in rig.dev:
                t[3] = 0xEE  # the model's write of block 3
        time.sleep(0.05)
        assert not rig.compute.record().query()
    finally:
        out_gate.open()
    rig.cupy_compute.synchronize()
    rig.tm.wait_all(30)
    for k, t in enumerate(rig.dev):
        assert np.array_equal(rig.host[k][20], before[k]), "the eviction saw the new write"
        assert (cp.asnumpy(t[3]) == 0xEE).all()


def test_a_load_into_blocks_an_eviction_reads_waits_for_it_in_one_native_call(
    rig: Rig,
) -> None:
    """Issue 26, item 1: the eviction of block 3 is held on its stream; this step
    loads other KV into block 3. The load goes out as one native call with the
    eviction's per-layer events as waits, stages its ids in one slot (the ring does
    not grow), stays behind the held eviction, and lands after it read the block."""
    before = [cp.asnumpy(t[3]) for t in rig.dev]
    slots, _, grows = core.cuda_staging_stats(DEVICE)
    out_gate = StreamGate(rig.output.handle, DEVICE).close()
    try:
        rig.evict(5, [3], [20], reused=[3])  # per layer: block 3 has a new owner
        counter = rig.load(6, [7], [3])
        time.sleep(0.05)
        assert not counter.is_layer_done(0)  # behind the held eviction's layer 0
    finally:
        out_gate.open()
    counter.wait_all(timeout=30)
    assert len(rig.native_loads) == 1 and rig.native_loads[0].per_layer == 1
    now = core.cuda_staging_stats(DEVICE)
    assert (now[0], now[2]) == (slots, grows)
    rig.tm.wait_all(30)
    for k, t in enumerate(rig.dev):
        assert np.array_equal(rig.host[k][20], before[k]), "the eviction read the loaded bytes"
        assert np.array_equal(cp.asnumpy(t[3]), rig.host[k][7])


def test_a_failed_layer_fails_its_waits_and_keeps_earlier_layers(rig: Rig) -> None:
    from fastkv.ops.core import LayerCopyError

    dev, host = np.array([12, 13], np.int64), np.array([1, 2], np.int64)

    def fail_at_2(stream: int, events) -> None:
        # Layers 0-1 go through the real core; layer 2 "fails" the way the core
        # reports it, with the remaining events recorded so nothing hangs.
        first = (ctypes.c_void_p * 2)(events[0], events[1])
        rig.layout.swap(dev, host, H2D, 0, 2, stream, first)
        for e in list(events)[2:]:
            core.event_record(DEVICE, e, stream)
        raise LayerCopyError("fkv_layout_swap: injected failure", 2)

    counter = rig.load(4, [1, 2], [12, 13], copy_layers=fail_at_2)
    counter.wait_for_layer(1, timeout=30, on_device=False)
    with pytest.raises(TransferFailedError, match="injected failure"):
        counter.wait_for_layer(2, timeout=30, on_device=False)
    with pytest.raises(TransferFailedError):
        counter.wait_for_layer(3)  # the device-side wait raises a known failure too
    rig.cupy_compute.synchronize()
    for k in range(4):  # layers 0 and 1 loaded intact
        assert np.array_equal(cp.asnumpy(rig.dev[k][cp.asarray(dev)]), rig.host[k][host])
    (result,) = rig.tm.wait_all(30)
    assert (result.transfer_id, result.success) == (4, False)


def test_the_eviction_stream_yields_to_loads_by_priority(rig: Rig) -> None:
    assert rig.input.priority() < rig.output.priority()


# -- G1: fastkv beside an engine that captures CUDA graphs ---------------------------

CAPTURE_MODES = ("global", "thread_local")


def _capture_mode(name: str) -> int:
    rt = cp.cuda.runtime
    return {
        "global": rt.streamCaptureModeGlobal,
        "thread_local": rt.streamCaptureModeThreadLocal,
    }[name]


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_the_workers_calls_mid_capture_leave_the_engines_graph_valid(
    rig: Rig, mode: str
) -> None:
    """Between two captured steps the worker polls results, checks layers, drops
    events (finalizers) and, on its reporter thread, polls too: none of it may
    invalidate the graph the engine is capturing."""
    import threading

    x = cp.zeros(4096, cp.float32)
    engine = cp.cuda.Stream(non_blocking=True)
    with engine:
        x += 1  # the kernel is loaded before the capture
    engine.synchronize()
    in_gate = StreamGate(rig.input.handle, DEVICE).close()  # the load stays in flight
    try:
        counter = rig.load(1, [3], [10])
        rig.evict(2, [4], [21])
        dropped = [rig.compute.record() for _ in range(4)]
        with engine:
            engine.begin_capture(mode=_capture_mode(mode))
            try:
                x += 1
                rig.tm.poll()  # cudaEventQuery, this thread
                assert not counter.is_layer_done(0)
                del dropped  # finalizers: no CUDA call at all
                other = threading.Thread(target=rig.tm.poll)  # the reporter thread
                other.start()
                other.join(30)
                x += 1
            finally:
                graph = engine.end_capture()  # raises if the capture was invalidated
        graph.launch(stream=engine)
        engine.synchronize()
        assert float(x[0]) == 3.0  # 1 before, +2 replayed
    finally:
        in_gate.open()


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_a_layer_wait_inside_a_capture_is_refused_without_touching_it(
    rig: Rig, mode: str
) -> None:
    from fastkv.ops.core import CudaCaptureError

    x = cp.zeros(16, cp.float32)
    engine = cp.cuda.Stream(non_blocking=True)
    with engine:
        x += 1
    engine.synchronize()
    engine_stream = CudaStream.external(DEVICE, engine.ptr, rig.pool)
    in_gate = StreamGate(rig.input.handle, DEVICE).close()
    try:
        dev, host = np.array([11], np.int64), np.array([5], np.int64)
        counter = rig.tm.submit_to_device(
            7,
            [5],
            [11],
            lambda layer, s: rig.layout.swap(dev, host, H2D, layer, 1, s),
            (),
            engine_stream,
        )
        with engine:
            engine.begin_capture(mode=_capture_mode(mode))
            try:
                with pytest.raises(CudaCaptureError, match="still loading"):
                    counter.wait_for_layer(0)
                x += 1
            finally:
                graph = engine.end_capture()
        graph.launch(stream=engine)
        engine.synchronize()
        assert float(x[0]) == 2.0
    finally:
        in_gate.open()
    counter.wait_all(30)
    counter.wait_for_layer(0)  # loaded: outside a capture nothing is refused


def test_an_eviction_of_every_layer_in_one_launch_copies_every_byte(rig: Rig) -> None:
    """P2: a transfer of every layer with no layer events is one kernel launch per
    staged slot over the whole segment table (and the copy engine's runs)."""
    # Scattered ids and one run (20-23 -> 8-11), in case the copy engine takes it.
    dev = np.array([1, 5, 9, 20, 21, 22, 23, 30, 2, 17, 11, 26], np.int64)
    host = np.array([0, 3, 7, 8, 9, 10, 11, 15, 20, 25, 30, 31], np.int64)
    calls = []
    done = rig.tm.submit_to_host(
        9,
        dev.tolist(),
        host.tolist(),
        lambda layer, s: calls.append(layer),
        rig.compute,
        None,
        (),
        lambda s: rig.layout.swap(dev, host, D2H, 0, None, s),
    )
    assert done.synchronize(30) and calls == []
    for k, t in enumerate(rig.dev):
        assert np.array_equal(rig.host[k][host], cp.asnumpy(t[cp.asarray(dev)])), f"tensor {k}"
    (result,) = rig.tm.poll()
    assert result.success
