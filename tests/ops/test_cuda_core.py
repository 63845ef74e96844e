"""The CUDA core's one-call entry point (fkv_swap_cuda) through its C ABI, driven
with CuPy device arrays and pinned host memory. Skipped (with the reason) where
there is no CUDA device or no CuPy; the first tests run everywhere and check the
no-GPU behaviour of the same entry points. Layouts, ordering and the rest of the
GPU matrix: test_cuda_gpu.py and tests/worker/test_gpu_ordering.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fastkv.ops import core

from .gpu_support import GPU_REASON, needs_gpu
from .gpu_support import gpu as gpu_marker
from .layout import (
    KINDS,
    HostBuffer,
    assert_bytes_equal,
    host_bytes_needed,
    make_cache,
    random_ids,
)

H2D, D2H = core.Direction.H2D, core.Direction.D2H
NEVER = 2**63 - 1


# ------------------------------------------------------- everywhere (no GPU needed)


@pytest.mark.skipif(core.cuda_device_count() > 0, reason="checks the no-GPU failure mode")
def test_swap_cuda_without_a_device_fails_clearly() -> None:
    dev = np.zeros((4, 64), np.uint8)
    host = np.zeros((4, 64), np.uint8)
    segs = [(dev.ctypes.data, host.ctypes.data, 64)]
    expected = "CUDA|cuda" if core.built_with_cuda() else "built without CUDA"
    with pytest.raises(RuntimeError, match=expected):
        core.swap_cuda(segs, 4, 4, [0], [1], D2H)
    assert not host.any()


def test_cuda_tuning_knobs_round_trip() -> None:
    before = core.get_cuda_tuning()
    try:
        core.set_cuda_tuning(memcpy_min_bytes=123456, max_ctas=7)
        assert core.get_cuda_tuning() == (123456, 7)
        core.set_cuda_tuning(max_ctas=9)
        assert core.get_cuda_tuning() == (123456, 9)
        with pytest.raises(ValueError, match="max_ctas: 0 must be > 0"):
            core.set_cuda_tuning(max_ctas=0)
        with pytest.raises(ValueError, match="memcpy_min_bytes: -5"):
            core.set_cuda_tuning(memcpy_min_bytes=-5)
        assert core._lib.fkv_cuda_set_tuning(-1, 0) == 1
        assert "max_ctas" in core._lib.fkv_last_error().decode()
    finally:
        core.set_cuda_tuning(*before)


def test_evict_launch_bound_round_trips_and_refuses_a_negative_bound() -> None:
    """The bound on one eviction launch's work (issue 26 item 2): 2 MiB unless the
    environment says otherwise, settable, 0 for no bound, never negative."""
    before = core.get_cuda_evict_launch_bytes()
    try:
        core.set_cuda_evict_launch_bytes(65536)
        assert core.get_cuda_evict_launch_bytes() == 65536
        core.set_cuda_evict_launch_bytes(0)
        assert core.get_cuda_evict_launch_bytes() == 0
        with pytest.raises(ValueError, match="nbytes: -1 must be >= 0"):
            core.set_cuda_evict_launch_bytes(-1)
        assert core.get_cuda_evict_launch_bytes() == 0
        assert core._lib.fkv_cuda_set_evict_launch_bytes(-3) == 1
        assert "evict_launch_bytes: -3" in core._lib.fkv_last_error().decode()
    finally:
        core.set_cuda_evict_launch_bytes(before)


# ------------------------------------------------------------------- GPU only


def gpu(test):
    """A GPU test: marked `gpu`, skipped with the reason where it cannot run."""
    return gpu_marker(needs_gpu(test))


if GPU_REASON is None:
    import cupy as cp
    import cupyx


@pytest.fixture
def tuning():
    """Restores the process-wide CUDA knobs after a test changes them."""
    before = core.get_cuda_tuning()
    yield core.set_cuda_tuning
    core.set_cuda_tuning(*before)


class GpuCache:
    """Device segments as CuPy arrays, host regions pinned (fastkv or CuPy)."""

    def __init__(self, kind: str, layers: int, ndev: int, nhost: int, seed: int, pinned: str):
        rng = np.random.default_rng(seed)
        self.nbytes = host_bytes_needed(kind, layers, nhost, heads=2, tokens=16, head_dim=64)
        self.ptr = None
        if pinned == "fastkv":
            self.ptr = core.host_alloc(self.nbytes, pin=True)
            buf = HostBuffer.at(self.ptr, self.nbytes)
        else:
            arr = cupyx.empty_pinned(self.nbytes + 256, dtype=np.uint8)
            off = (-arr.ctypes.data) % 256
            buf = HostBuffer(arr[off : off + self.nbytes], arr.ctypes.data + off, arr)
        self.np = make_cache(
            rng, kind, layers, ndev, nhost, buf, heads=2, tokens=16, head_dim=64
        )
        self.dev = [cp.asarray(d) for d in self.np.device]
        self.ndev, self.nhost = ndev, nhost

    def segments(self, selected=None):
        segs = self.np.segments([d.data.ptr for d in self.dev])
        return [segs[s] for s in (selected if selected is not None else range(len(segs)))]

    def device(self) -> list[np.ndarray]:
        return [cp.asnumpy(d) for d in self.dev]

    def free(self) -> None:
        if self.ptr is not None:
            core.host_free(self.ptr, self.nbytes, pinned=True)


@pytest.fixture
def gpu_cache():
    made: list[GpuCache] = []

    def make(kind="bf16", layers=3, ndev=64, nhost=80, seed=0, pinned="fastkv"):
        made.append(GpuCache(kind, layers, ndev, nhost, seed, pinned))
        return made[-1]

    yield make
    cp.cuda.Device().synchronize()
    for c in made:
        c.free()


def _reference(dev, host, selected, d_ids, h_ids, h2d):
    dev = [d.copy() for d in dev]
    host = [h.copy() for h in host]
    for s in selected:
        if h2d:
            dev[s][d_ids] = host[s][h_ids]
        else:
            host[s][h_ids] = dev[s][d_ids]
    return dev, host


def _check(c: GpuCache, dev_exp, host_exp):
    for s, (d, h) in enumerate(zip(c.device(), c.np.host, strict=True)):
        assert_bytes_equal(d, dev_exp[s], f"device segment {s}")
        assert_bytes_equal(h, host_exp[s], f"host segment {s}")


@gpu
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("path", ["kernel", "memcpy", "default"])
@pytest.mark.parametrize("pinned", ["fastkv", "cupy"])
def test_round_trip_is_bit_exact(gpu_cache, tuning, kind, path, pinned) -> None:
    tuning(memcpy_min_bytes={"kernel": NEVER, "memcpy": 0, "default": 1 << 20}[path])
    c = gpu_cache(kind, layers=4, seed=sum(map(ord, kind + path + pinned)), pinned=pinned)
    rng = np.random.default_rng(1)
    stream = cp.cuda.Stream(non_blocking=True)
    tpl = c.np.tensors_per_layer
    layers = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False).tolist())
    selected = [layer * tpl + k for layer in layers for k in range(tpl)]
    # Scattered ids plus one long run, so "default" mixes kernel and copy engine.
    d_src = np.r_[random_ids(rng, 10, 30), np.arange(30, 60)].astype(np.int64)
    h_ids = np.r_[random_ids(rng, 10, 40), np.arange(40, 70)].astype(np.int64)
    dev0, host0 = c.device(), [h.copy() for h in c.np.host]
    core.swap_cuda(c.segments(selected), 64, 80, d_src, h_ids, D2H, stream.ptr)
    stream.synchronize()
    dev_exp, host_exp = _reference(dev0, host0, selected, d_src, h_ids, False)
    _check(c, dev_exp, host_exp)

    d_dst = rng.permutation(64)[: d_src.size].astype(np.int64)
    core.swap_cuda(c.segments(selected), 64, 80, d_dst, h_ids, H2D, stream.ptr)
    stream.synchronize()
    dev_exp2, host_exp2 = _reference(dev_exp, host_exp, selected, d_dst, h_ids, True)
    _check(c, dev_exp2, host_exp2)
    for s in selected:
        assert_bytes_equal(c.device()[s][d_dst], dev0[s][d_src], f"round trip segment {s}")


@gpu
@pytest.mark.parametrize(("block_bytes", "offset"), [(4096, 0), (4104, 8), (4100, 4), (260, 4)])
def test_vector_width_fallbacks_are_exact(tuning, block_bytes: int, offset: int) -> None:
    """16-byte accesses need 16-byte aligned bases and block sizes; otherwise the
    kernel falls back to 8 or 4 bytes."""
    tuning(memcpy_min_bytes=NEVER)
    rng = np.random.default_rng(block_bytes)
    ndev, nhost = 32, 40
    dev_raw = cp.asarray(rng.integers(0, 256, ndev * block_bytes + 64, dtype=np.uint8))
    host_raw = cupyx.empty_pinned(nhost * block_bytes + 64, dtype=np.uint8)
    host_raw[:] = rng.integers(0, 256, host_raw.size, dtype=np.uint8)
    seg = [(dev_raw.data.ptr + offset, host_raw.ctypes.data + offset, block_bytes)]
    d_ids = random_ids(rng, 20, ndev)
    h_ids = random_ids(rng, 20, nhost)
    dev_view = lambda a: a[offset : offset + ndev * block_bytes].reshape(ndev, block_bytes)  # noqa: E731
    host_view = host_raw[offset : offset + nhost * block_bytes].reshape(nhost, block_bytes)
    expected_host = host_view.copy()
    expected_host[h_ids] = dev_view(cp.asnumpy(dev_raw))[d_ids]
    core.swap_cuda(seg, ndev, nhost, d_ids, h_ids, D2H, 0)
    cp.cuda.Device().synchronize()
    assert_bytes_equal(host_view, expected_host, "host after D2H")
    host_view[h_ids] = 0x5A
    expected_dev = dev_view(cp.asnumpy(dev_raw)).copy()
    expected_dev[d_ids] = 0x5A
    core.swap_cuda(seg, ndev, nhost, d_ids, h_ids, H2D, 0)
    cp.cuda.Device().synchronize()
    assert_bytes_equal(dev_view(cp.asnumpy(dev_raw)), expected_dev, "device after H2D")


@gpu
def test_staging_ring_survives_many_back_to_back_calls(gpu_cache, tuning) -> None:
    """Far more calls than ring slots, queued on one stream without a sync, with
    the caller rewriting its id buffer right after each call: every launch must
    read the ids it was given."""
    tuning(memcpy_min_bytes=NEVER)
    c = gpu_cache("fp16", layers=2, ndev=64, nhost=80, seed=3)
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(3)
    dev = c.device()
    host = [h.copy() for h in c.np.host]
    d_buf = np.empty(8, np.int64)
    h_buf = np.empty(8, np.int64)
    selected = list(range(len(c.dev)))
    for _ in range(300):
        h2d = bool(rng.integers(0, 2))
        d_buf[:] = random_ids(rng, 8, 64)
        h_buf[:] = random_ids(rng, 8, 80)
        core.swap_cuda(c.segments(), 64, 80, d_buf, h_buf, H2D if h2d else D2H, stream.ptr)
        dev, host = _reference(dev, host, selected, d_buf.copy(), h_buf.copy(), h2d)
        d_buf[:] = -1  # the core must already have staged the ids it needs
        h_buf[:] = -1
    stream.synchronize()
    _check(c, dev, host)


@gpu
def test_more_ids_than_one_staging_slot_holds(tuning) -> None:
    tuning(memcpy_min_bytes=NEVER)
    rng = np.random.default_rng(4)
    n, block = 30000, 64
    dev = cp.asarray(rng.integers(0, 256, (n, block), dtype=np.uint8))
    host = cupyx.empty_pinned((n, block), dtype=np.uint8)
    host[:] = 0
    d_ids = rng.permutation(n).astype(np.int64)
    h_ids = rng.permutation(n).astype(np.int64)
    core.swap_cuda([(dev.data.ptr, host.ctypes.data, block)], n, n, d_ids, h_ids, D2H, 0)
    cp.cuda.Device().synchronize()
    expected = np.empty_like(host)
    expected[h_ids] = cp.asnumpy(dev)[d_ids]
    assert_bytes_equal(host, expected, "host")


@gpu
def test_two_streams_from_two_threads(gpu_cache) -> None:
    c = gpu_cache("bf16", layers=2, ndev=64, nhost=80, seed=6)
    dev0, host0 = c.device(), [h.copy() for h in c.np.host]
    a_dev, a_host = np.arange(0, 64, 2, dtype=np.int64), np.arange(0, 32, dtype=np.int64)
    b_dev, b_host = np.arange(1, 64, 2, dtype=np.int64), np.arange(40, 72, dtype=np.int64)
    selected = list(range(len(c.dev)))
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(d, h, direction):
        try:
            s = cp.cuda.Stream(non_blocking=True)
            barrier.wait()
            for _ in range(50):
                core.swap_cuda(c.segments(), 64, 80, d, h, direction, s.ptr)
            s.synchronize()
        except BaseException as e:  # reported by the assert below
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(a_dev, a_host, D2H)),
        threading.Thread(target=run, args=(b_dev, b_host, H2D)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    dev_exp, host_exp = _reference(dev0, host0, selected, a_dev, a_host, False)
    dev_exp, host_exp = _reference(dev_exp, host_exp, selected, b_dev, b_host, True)
    _check(c, dev_exp, host_exp)


@gpu
def test_bad_inputs_raise_before_any_copy(gpu_cache) -> None:
    c = gpu_cache("fp16", layers=1, ndev=16, nhost=16, seed=8)
    pageable = np.zeros_like(c.np.host[0])
    pinned_other = cupyx.empty_pinned(c.np.host[0].shape, c.np.host[0].dtype)
    segs = c.segments()
    bb = segs[0][2]
    cases = [
        ([(segs[0][0], pageable.ctypes.data, bb), segs[1]], "host_base", "not pinned"),
        (
            [(pinned_other.ctypes.data, segs[0][1], bb), segs[1]],
            "device_base",
            "not CUDA device",
        ),
    ]
    dev0, host0 = c.device(), [h.copy() for h in c.np.host]
    for bad_segs, arg, message in cases:
        with pytest.raises(ValueError, match=f"segments\\[0\\].{arg}.*{message}"):
            core.swap_cuda(bad_segs, 16, 16, [1, 2], [3, 4], H2D, 0)
    for d_ids, h_ids, message in [
        ([1, 16], [3, 4], r"device_ids\[1\]=16 out of range \[0, 16\)"),
        ([1, 1], [3, 4], r"device_ids\[1\]: duplicate destination 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            core.swap_cuda(segs, 16, 16, d_ids, h_ids, H2D, 0)
    cp.cuda.Device().synchronize()
    _check(c, dev0, host0)


@gpu
def test_pci_bus_id_is_in_sysfs_spelling() -> None:
    import re

    bus = core.cuda_pci_bus_id(0)
    assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", bus), bus
