"""The Paddle custom ops on CPU tensors: exact round trips per dtype, one-layer
and all-layer swaps, validation in the op and in the core before any copy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="the Paddle ops need paddle")

from fastkv.ops import core  # noqa: E402
from fastkv.ops import paddle_ops as ops  # noqa: E402

from .layout import (  # noqa: E402
    KINDS,
    HostBuffer,
    assert_bytes_equal,
    host_bytes_needed,
    make_cache,
    random_ids,
    snapshot,
)

H2D, D2H = core.Direction.H2D, core.Direction.D2H


def _to_paddle(a: np.ndarray, kind: str) -> paddle.Tensor:
    t = paddle.to_tensor(a)
    # bf16 caches are real bfloat16 tensors; their bits come from the uint16 array.
    return t.view(paddle.bfloat16) if kind == "bf16" else t


def _bits(t: paddle.Tensor) -> np.ndarray:
    arr = t.numpy()
    return arr.view(np.uint16) if t.dtype == paddle.bfloat16 else arr


class PaddleCache:
    """A cache whose device side is Paddle CPU tensors and whose host tier comes
    from the host_alloc op."""

    def __init__(self, kind: str, layers: int, ndev: int, nhost: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.nbytes = host_bytes_needed(kind, layers, nhost, heads=2, tokens=4, head_dim=8)
        self.ptr = ops.host_alloc(self.nbytes, numa_node=-1, pin=False)
        self.np = make_cache(
            rng, kind, layers, ndev, nhost, HostBuffer.at(self.ptr, self.nbytes)
        )
        self.tensors = [_to_paddle(d, kind) for d in self.np.device]
        self.host_ptrs = ops.int64_tensor(self.np.host_ptrs, "host_ptrs")
        self.stride = self.np.host_stride  # the host tier's block: every tensor's, in order
        self.kind = kind

    def free(self) -> None:
        ops.host_free(self.ptr, self.nbytes, pinned=False)

    def device(self) -> list[np.ndarray]:
        return [_bits(t) for t in self.tensors]


@pytest.fixture
def make_cache_fixture():
    made: list[PaddleCache] = []

    def make(kind: str, layers: int = 3, ndev: int = 32, nhost: int = 40, seed: int = 0):
        made.append(PaddleCache(kind, layers, ndev, nhost, seed))
        return made[-1]

    yield make
    for c in made:
        c.free()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_all_layers_round_trip_is_bit_exact(make_cache_fixture, kind: str, seed: int) -> None:
    c = make_cache_fixture(kind, seed=seed)
    rng = np.random.default_rng(100 + seed)
    n = 9
    src = random_ids(rng, n, 32)
    hid = random_ids(rng, n, 40)
    original = [d[src].copy() for d in c.device()]
    host_before = snapshot(c.np.host)

    ops.swap_all_layers(c.tensors, src, hid, c.host_ptrs, 40, D2H, host_stride=c.stride)
    for s, h in enumerate(c.np.host):
        expected = host_before[s].copy()
        expected[hid] = original[s]
        assert_bytes_equal(h, expected, f"host segment {s}")

    dst = random_ids(rng, n, 32)
    dev_before = c.device()
    ops.swap_all_layers(
        c.tensors,
        paddle.from_dlpack(dst),
        paddle.from_dlpack(hid),
        c.host_ptrs,
        40,
        H2D,
        0,
        2,
        host_stride=c.stride,
    )
    for s, d in enumerate(c.device()):
        expected = dev_before[s].copy()
        expected[dst] = original[s]
        assert_bytes_equal(d, expected, f"device segment {s}")


@pytest.mark.parametrize("kind", ["bf16", "uint8"])
def test_layer_by_layer_swaps_touch_only_their_layer(make_cache_fixture, kind: str) -> None:
    c = make_cache_fixture(kind, layers=4, seed=5)
    rng = np.random.default_rng(5)
    tpl = c.np.tensors_per_layer
    layers = sorted(rng.choice(4, size=2, replace=False).tolist())
    dev = random_ids(rng, 6, 32)
    hid = random_ids(rng, 6, 40)
    dev_before, host_before = c.device(), snapshot(c.np.host)
    for layer in layers:
        ops.swap_layer(
            c.tensors, dev, hid, c.host_ptrs, layer, tpl, 40, D2H, host_stride=c.stride
        )
    touched = {layer * tpl + k for layer in layers for k in range(tpl)}
    for s, h in enumerate(c.np.host):
        expected = host_before[s].copy()
        if s in touched:
            expected[hid] = dev_before[s][dev]
        assert_bytes_equal(h, expected, f"host segment {s}")
    # And back into other device blocks, one layer at a time.
    dst = random_ids(rng, 6, 32)
    dev_mid = c.device()
    for layer in layers:
        ops.swap_layer(
            c.tensors, dst, hid, c.host_ptrs, layer, tpl, 40, H2D, 0, 1, host_stride=c.stride
        )
    for s, d in enumerate(c.device()):
        expected = dev_mid[s].copy()
        if s in touched:
            expected[dst] = dev_before[s][dev]
        assert_bytes_equal(d, expected, f"device segment {s}")


def test_consecutive_ids_are_copied_as_runs(make_cache_fixture) -> None:
    c = make_cache_fixture("fp16", layers=2, seed=9)
    dev = np.arange(4, 24, dtype=np.int64)
    hid = np.arange(20, 40, dtype=np.int64)
    before = c.device()
    ops.swap_all_layers(c.tensors, dev, hid, c.host_ptrs, 40, D2H, host_stride=c.stride)
    for s, h in enumerate(c.np.host):
        assert_bytes_equal(h[20:40], before[s][4:24], f"segment {s}")


# ---------------------------------------------------------------- validation


def _poisoned(c: PaddleCache) -> list[np.ndarray]:
    return [*c.device(), *snapshot(c.np.host)]


def _unchanged(c: PaddleCache, before: list[np.ndarray]) -> None:
    for i, (a, b) in enumerate(zip([*c.device(), *c.np.host], before, strict=True)):
        assert_bytes_equal(a, b, f"array {i} after a rejected call")


def _swap_cases(c: PaddleCache):
    good = {"device_ids": [1, 2], "host_ids": [3, 4], "host_ptrs": c.host_ptrs}
    t = c.tensors
    transposed = [x.transpose([1, 0, 2, 3]) if x.ndim == 4 else x for x in t]
    ragged = [*t[:-1], paddle.zeros([31, *t[-1].shape[1:]], dtype=t[-1].dtype)]
    odd_bytes = [paddle.zeros([32, 3], dtype="uint8")] * len(t)
    return [
        ("empty caches", {"caches": []}, "caches: empty"),
        ("non-contiguous cache", {"caches": transposed}, "caches[0]: must be contiguous"),
        ("block counts differ", {"caches": ragged}, "has 31 blocks"),
        ("block bytes not a multiple of 4", {"caches": odd_bytes}, "block_bytes: 3 is not"),
        (
            "float ids",
            {"device_ids": paddle.to_tensor([1.0, 2.0])},
            "device_ids: must be int64",
        ),
        ("2-D ids", {"host_ids": paddle.to_tensor([[3, 4]], dtype="int64")}, "must be 1-D"),
        (
            "length mismatch",
            {"host_ids": [3, 4, 5]},
            "host_ids: length 3 != device_ids length 2",
        ),
        (
            "device id out of range",
            {"device_ids": [1, 32]},
            "device_ids[1]=32 out of range [0, 32)",
        ),
        ("host id out of range", {"host_ids": [3, 40]}, "host_ids[1]=40 out of range [0, 40)"),
        ("duplicate destination", {"host_ids": [3, 3]}, "host_ids[1]: duplicate destination 3"),
        ("host_ptrs too short", {"host_ptrs": c.np.host_ptrs[:-1]}, "host_ptrs: length"),
        ("host_ptrs float", {"host_ptrs": paddle.to_tensor([1.0])}, "host_ptrs: must be int64"),
        ("null host pointer", {"host_ptrs": [0] * len(t)}, "caches[0].host_base: NULL"),
        ("direction", {"direction": 3}, "direction: 3 is neither"),
        ("num_threads", {"num_threads": -2}, "num_threads: -2 out of range"),
        ("num_host_blocks", {"num_host_blocks": -1}, "num_host_blocks: -1 is negative"),
        (
            "host regions overlap",
            {"host_ptrs": [c.np.host_ptrs[0]] * len(t)},
            "caches[1].host_base: host region overlaps the host region of caches[0]",
        ),
    ], good


@pytest.mark.parametrize("op", ["swap_all_layers", "swap_layer"])
def test_swap_ops_reject_bad_input_and_touch_nothing(make_cache_fixture, op: str) -> None:
    c = make_cache_fixture("uint8", layers=2, seed=3)
    cases, good = _swap_cases(c)
    # swap_layer checks only the layer it copies: use the last one, where the bad
    # tensors of the cases below sit, and expect them named by their cache index.
    per_layer = {
        "non-contiguous cache": "caches[4]: must be contiguous",
        "null host pointer": "caches[4].host_base: NULL",
        "empty caches": "caches: 0 tensors is not a positive multiple",
        "block bytes not a multiple of 4": "caches[4].block_bytes: 3 is not",
        "host regions overlap": (
            "caches[5].host_base: host region overlaps the host region of caches[4]"
        ),
    }
    for name, change, message in cases:
        args = {
            "caches": c.tensors,
            **good,
            "num_host_blocks": 40,
            "direction": D2H,
            "host_stride": c.stride,
        }
        args.update(change)
        before = _poisoned(c)
        with pytest.raises(ValueError) as info:
            if op == "swap_all_layers":
                ops.swap_all_layers(**args)
            else:
                message = per_layer.get(name, message)
                ops.swap_layer(**args, layer=1, tensors_per_layer=4)
        assert message in str(info.value), name
        assert str(info.value).startswith("fastkv[EINVAL]"), name
        _unchanged(c, before)


def test_swap_layer_rejects_bad_layer_arguments(make_cache_fixture) -> None:
    c = make_cache_fixture("fp16", layers=3, seed=4)
    base = {
        "device_ids": [1],
        "host_ids": [2],
        "host_ptrs": c.host_ptrs,
        "num_host_blocks": 40,
        "host_stride": c.stride,
    }
    cases = [
        ({"layer": 3, "tensors_per_layer": 2}, "layer: 3 out of range [0, 3)"),
        ({"layer": -1, "tensors_per_layer": 2}, "layer: -1 out of range"),
        ({"layer": 0, "tensors_per_layer": 0}, "tensors_per_layer: 0 must be > 0"),
        ({"layer": 0, "tensors_per_layer": 4}, "caches: 6 tensors is not a positive multiple"),
    ]
    for change, message in cases:
        before = _poisoned(c)
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
            ops.swap_layer(c.tensors, **base, **change, direction=D2H)
        _unchanged(c, before)


def test_host_alloc_and_free_ops() -> None:
    ptr = ops.host_alloc(3 << 20, numa_node=0, pin=False)
    try:
        assert ptr % (2 << 20) == 0
        assert core.numa_node_of(ptr) == 0
        HostBuffer.at(ptr, 3 << 20).array[:] = 7
    finally:
        ops.host_free(ptr, 3 << 20, pinned=False)
    with pytest.raises(ValueError, match="nbytes: 0 must be > 0"):
        ops.host_alloc(0, pin=False)
    with pytest.raises(ValueError, match="numa_node: 999 is not an online NUMA node"):
        ops.host_alloc(4096, numa_node=999, pin=False)
    with pytest.raises(ValueError, match="was not returned by fkv_host_alloc"):
        ops.host_free(ptr, 3 << 20, pinned=False)
    p2 = ops.host_alloc(8192, pin=False)
    with pytest.raises(ValueError, match="bytes: 4096 does not match"):
        ops.host_free(p2, 4096, pinned=False)
    with pytest.raises(ValueError, match="nbytes: -1 must be > 0"):
        ops.host_free(p2, -1, pinned=False)
    ops.host_free(p2, 8192, pinned=False)


@pytest.mark.skipif(core.cuda_device_count() > 0, reason="checks the no-GPU failure mode")
def test_host_alloc_op_pins_only_where_cuda_can() -> None:
    ptr = ops.host_alloc(1 << 20)  # pin=None: no device here, so unpinned
    ops.host_free(ptr, 1 << 20, pinned=False)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister|built without CUDA"):
        ops.host_alloc(1 << 20, pin=True)


def test_int64_tensor_is_zero_copy_and_checks_input() -> None:
    ids = np.arange(5, dtype=np.int64)
    t = ops.int64_tensor(ids)
    assert t.data_ptr() == ids.ctypes.data
    with pytest.raises(ValueError, match="ids: expected a 1-D integer array"):
        ops.int64_tensor(np.ones(3))


def test_paddle_ops_and_ctypes_share_one_core() -> None:
    """One thread pool, one staging ring and one allocation registry per process:
    memory from the ctypes binding is freed by the op and vice versa."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libfastkv_core.so" in line}
    assert len(paths) == 1, paths
    ptr = core.host_alloc(1 << 20)
    ops.host_free(ptr, 1 << 20, pinned=False)
    ptr = ops.host_alloc(1 << 20, pin=False)
    core.host_free(ptr, 1 << 20, pinned=False)


def _paddle_gpu_reason() -> str | None:
    from .gpu_support import paddle_gpu_skip_reason

    return paddle_gpu_skip_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_paddle_gpu_reason() is not None, reason=_paddle_gpu_reason() or "")
@pytest.mark.parametrize("kind", ["bf16", "uint8"])
def test_ops_on_gpu_tensors_round_trip(kind: str) -> None:
    """The Paddle ops on GPU tensors and a tier pinned on the tensors' GPU."""
    rng = np.random.default_rng(11)
    nbytes = host_bytes_needed(kind, 2, 40, heads=2, tokens=4, head_dim=8)
    ptr = ops.host_alloc(nbytes, pin=True, device=0)
    try:
        cache = make_cache(rng, kind, 2, 32, 40, HostBuffer.at(ptr, nbytes))
        tensors = [_to_paddle(d, kind).cuda() for d in cache.device]
        host_ptrs = ops.int64_tensor(cache.host_ptrs, "host_ptrs")
        src, hid, dst = random_ids(rng, 7, 32), random_ids(rng, 7, 40), random_ids(rng, 7, 32)
        stream = paddle.device.cuda.current_stream(0).cuda_stream
        ops.swap_all_layers(
            tensors, src, hid, host_ptrs, 40, D2H, stream, host_stride=cache.host_stride
        )
        paddle.device.cuda.synchronize(0)
        for s, h in enumerate(cache.host):
            assert_bytes_equal(h[hid], cache.device[s][src], f"host segment {s}")
        tpl = cache.tensors_per_layer
        for layer in range(2):
            ops.swap_layer(
                tensors,
                dst,
                hid,
                host_ptrs,
                layer,
                tpl,
                40,
                H2D,
                stream,
                host_stride=cache.host_stride,
            )
        paddle.device.cuda.synchronize(0)
        for s, t in enumerate(tensors):
            assert_bytes_equal(_bits(t.cpu())[dst], cache.device[s][src], f"device segment {s}")
    finally:
        paddle.device.cuda.synchronize(0)
        ops.host_free(ptr, nbytes, pinned=True)


def test_importing_the_ops_prints_no_ccache_warning() -> None:
    """Importing paddle looks for ccache and warns when there is none; registering
    prebuilt ops compiles nothing, so the ops module keeps that one warning quiet.
    A fresh process (paddle not yet imported) with no ccache on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PATH"] = str(Path(sys.executable).parent)  # no ccache, whatever the machine has
    proc = subprocess.run(
        [sys.executable, "-W", "always::UserWarning", "-c", "import fastkv.ops.paddle_ops"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "No ccache found" not in proc.stderr
