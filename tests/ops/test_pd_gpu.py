"""PD on GPU memory through the core (CuPy device arrays, no Paddle needed):
the layer checksum of device memory equals storage's crc32c-3way of the same
bytes on the host (so a GPU P and a CPU D agree), and a layer's write starts only
once the CUDA event recorded after the kernel that wrote it completed.

Marked `gpu`: skipped with the reason where there is no GPU or no CuPy; `make
gpu-test` runs them with skips turned into failures. Without a GPU the failure
modes are checked instead (last tests)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fastkv.metadata import Epoch
from fastkv.ops import core
from fastkv.pd.layout import KVLayout, TensorRegion, layer_checksum
from fastkv.pd.messages import SendPlan
from fastkv.pd.sender import PDSender
from fastkv.pd.transport import WriteState

from . import crc_reference
from .gpu_support import GPU_REASON, gpu, needs_gpu

if GPU_REASON is None:
    import cupy

SPIN_WRITE = r"""
extern "C" __global__ void spin_write(unsigned char* p, long long n, long long cycles,
                                      unsigned char v) {
  if (threadIdx.x == 0) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
  }
  __syncthreads();
  for (long long i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}
"""

SIZES = [1, 7, 8, 9, 24, 25, 191, 192, 1536, 1537, 4099, 65536 + 13]


@gpu
@needs_gpu
def test_device_checksum_equals_the_definitions_on_random_data() -> None:
    rng = np.random.default_rng(11)
    host = rng.integers(0, 256, size=(4 << 20) + 64, dtype=np.uint8)
    dev = cupy.asarray(host)
    base = dev.data.ptr

    def ref(spans: list[tuple[int, int]]) -> int:
        return crc_reference.checksum([host[o : o + n].tobytes() for o, n in spans])

    for n in [*SIZES, (1 << 20) + 5, (4 << 20) + 3]:  # up to 2,731 chunks a segment
        for off in (0, 1, 8, 13) if n < 1 << 20 else (5,):
            segs = np.array([[base + off, n]], np.int64)
            assert core.crc3way_cuda(0, segs) == ref([(off, n)]), (n, off)
    for _ in range(5):  # scattered segments, one call
        spans = [(int(rng.integers(0, 3 << 20)), int(rng.choice(SIZES))) for _ in range(20)]
        segs = np.array([[base + o, n] for o, n in spans], np.int64)
        assert core.crc3way_cuda(0, segs) == ref(spans)
    spans = [(0, 0), (5, 3)]  # an empty segment, trailing bytes only
    segs = np.array([[base + o, n] for o, n in spans], np.int64)
    assert core.crc3way_cuda(0, segs) == ref(spans)


@gpu
@needs_gpu
def test_layer_checksum_of_a_gpu_layout_equals_the_host_copys() -> None:
    rng = np.random.default_rng(5)
    host = [rng.integers(0, 256, size=(16, 4, 1024), dtype=np.uint8) for _ in range(4)]
    dev = [cupy.asarray(a) for a in host]
    regions = tuple(TensorRegion(int(d.data.ptr), 16, d.nbytes // 16, 4, "uint8") for d in dev)
    lay = KVLayout(regions, 2, 16, 16, device=0)
    ids = [3, 0, 15, 7, 8]
    for layer in range(2):
        for slices, index in ((1, 0), (2, 1), (4, 3)):
            per = 4 // slices  # heads per slice
            want = crc_reference.checksum(
                [
                    host[2 * layer + t][b, index * per : (index + 1) * per].tobytes()
                    for b in ids
                    for t in range(2)
                ]
            )
            got = layer_checksum(lay.layer(layer), ids, slices=slices, index=index, device=0)
            assert got == want, (layer, slices, index)


class _DeviceTransport:
    """Records what each write's source bytes hold when the write starts, read
    on a stream of its own (so it does not wait for the engine's kernel)."""

    device_memory = True
    address = "p"

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.reader = cupy.cuda.Stream(non_blocking=True)

    def register(self, addr: int, length: int) -> None:
        pass

    def write(self, peer, pieces):
        for p in pieces:
            mem = cupy.cuda.UnownedMemory(p.src, p.length, self)
            view = cupy.ndarray((p.length,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
            self.seen.append(cupy.asnumpy(view, stream=self.reader).tobytes())

        class Done:
            def state(self) -> WriteState:
                return WriteState.DONE

            def wait(self, timeout_s: float) -> WriteState:
                return WriteState.DONE

        return Done()

    def notify(self, peer: str, payload: bytes, timeout_s: float) -> None:
        pass

    def poll_notices(self) -> list[tuple[str, bytes]]:
        return []

    def close(self) -> None:
        pass


@gpu
@needs_gpu
def test_a_layers_write_starts_only_after_the_kernel_that_wrote_it() -> None:
    from fastkv.pd.fence import CudaFences

    kernel = cupy.RawKernel(SPIN_WRITE, "spin_write")
    caches = [cupy.zeros((8, 2, 256), cupy.uint8) for _ in range(2)]  # 1 layer, K and V
    regions = tuple(TensorRegion(int(c.data.ptr), 8, 512, 2, "uint8") for c in caches)
    lay = KVLayout(regions, 2, 4, 8, device=0)
    transport = _DeviceTransport()
    stream = cupy.cuda.Stream(non_blocking=True)
    sender = PDSender(transport, lay, fences=CudaFences(0, current_stream=lambda: stream.ptr))
    sender.connect("d", lay)
    sender.start(SendPlan(1, Epoch(0), b"k" * 32, (2,), (5,), 1, 30.0))
    with stream:
        for c in caches:  # ~0.3 s of spinning, then the layer's bytes
            kernel((1,), (256,), (c, np.int64(c.nbytes), np.int64(600_000_000), np.uint8(7)))
    t0 = time.monotonic()
    sender.after_layer(0)  # right after the launch, as an engine calls it
    hook_s = time.monotonic() - t0
    assert hook_s < 0.05, "the hook waited for the kernel"
    assert transport.seen == []
    end = time.monotonic() + 30
    while len(transport.seen) < 2 and time.monotonic() < end:
        time.sleep(0.001)
    assert [set(b) for b in transport.seen] == [{7}, {7}], "a write read KV not yet written"
    reports = []
    end = time.monotonic() + 30
    while not reports and time.monotonic() < end:  # settles: the device checksum
        reports = sender.poll()
        time.sleep(0.001)
    sender.close()
    stream.synchronize()
    assert [r.ok for r in reports] == [True], reports


@gpu
@needs_gpu
def test_a_fence_on_a_capturing_stream_is_refused() -> None:
    from fastkv.pd.fence import CudaFences

    stream = cupy.cuda.Stream(non_blocking=True)
    fences = CudaFences(0, current_stream=lambda: stream.ptr)
    stream.begin_capture()
    try:
        with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
            fences.record(None)
    finally:
        stream.end_capture()
    fence = fences.record(None)  # outside the capture: an event, complete at once
    assert fence.synchronize(5.0) and fence.query()


@pytest.mark.skipif(core.cuda_device_count() > 0, reason="checks the no-GPU failure mode")
def test_without_a_gpu_the_device_checksum_and_fences_say_why() -> None:
    host = np.zeros(64, np.uint8)
    segs = np.array([[host.ctypes.data, 64]], np.int64)
    with pytest.raises(RuntimeError, match=r"(?i)cuda"):
        core.crc3way_cuda(0, segs)
    lay = KVLayout.of_arrays([host.reshape(2, 2, 16)] * 2, tensors_per_layer=2, block_size=4)
    with pytest.raises(RuntimeError, match=r"(?i)cuda"):
        layer_checksum(lay.layer(0), [0], device=0)
    from fastkv.pd.fence import CudaFences

    with pytest.raises(RuntimeError, match="device 0: the fastkv core sees 0 CUDA device"):
        CudaFences(0, current_stream=lambda: 0)


def test_device_checksum_refuses_bad_segments_before_any_cuda_call() -> None:
    for bad in (np.zeros((0, 2), np.int64), np.zeros((3,), np.int64), np.array([[1, -1]])):
        with pytest.raises(ValueError, match="segments: shape"):
            core.crc3way_cuda(0, bad)
    with pytest.raises(ValueError, match="timeout"):
        core.crc3way_cuda(0, np.array([[1, 1]], np.int64), timeout=0)


def test_the_stub_core_says_it_was_built_without_cuda(tmp_path) -> None:
    import ctypes

    from .native_harness import build_harness

    lib = build_harness(tmp_path, None)
    host = np.zeros(8, np.uint8)
    segs = np.array([[host.ctypes.data, 8]], np.int64)
    out = ctypes.c_uint32(0)
    fn = lib.fkv_cuda_crc3way
    fn.argtypes = core._lib.fkv_cuda_crc3way.argtypes
    assert fn(0, segs.ctypes.data, 1, None, 10**9, ctypes.byref(out)) == 4  # FKV_ENOTBUILT
    lib.fkv_last_error.restype = ctypes.c_char_p
    assert b"built without CUDA" in lib.fkv_last_error()
