"""A CacheController over KV tensors an engine made itself (FastDeploy's layouts):
any per-block shape, MLA's single tensor per layer, block-wise fp8 with scales,
extra (speculative) layers with more blocks; bit-exact round trips through the host
tier sized from them; clear errors for tensors that cannot be swapped; one shape
contract with the scheduler's CacheConfig; memory stated before it is taken."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="the CacheController needs paddle")

from fastkv import CacheConfig, CacheLevel, CacheSwapMetadata  # noqa: E402
from fastkv.worker import CacheController, KVCacheSpec, MemoryPlan  # noqa: E402

N, BS, HOST = 6, 4, 8  # device blocks the scheduler hands out, tokens per block


def config(kv_dtype: str = "bfloat16", **kw) -> CacheConfig:
    kw = {"block_size": BS, "num_device_blocks": N, "num_host_blocks": HOST, **kw}
    return CacheConfig(kv_dtype=kv_dtype, **kw)


def gqa(layers: int, heads: int = 2, dim: int = 8, dtype: str = "bfloat16", blocks: int = N):
    return [paddle.zeros([blocks, heads, BS, dim], dtype=dtype) for _ in range(2 * layers)]


def fp8(layers: int, heads: int = 2, dim: int = 8):
    out = []
    for _ in range(layers):
        out += [paddle.zeros([N, heads, BS, dim], dtype="uint8") for _ in range(2)]
        out += [paddle.zeros([N, heads, BS], dtype="float32") for _ in range(2)]
    return out


def mla(layers: int, dim: int = 12, blocks: int = N):
    return [paddle.zeros([blocks, 1, BS, dim], dtype="bfloat16") for _ in range(layers)]


LAYOUTS = {
    "gqa": (lambda: gqa(3), "bfloat16", 2, 0),
    "gqa+mtp": (lambda: gqa(2) + gqa(1, blocks=N + 3), "bfloat16", 2, 1),
    "fp8": (lambda: fp8(2), "fp8", 4, 0),
    "mla+mtp": (lambda: mla(3) + mla(1, blocks=2 * N), "bfloat16", 1, 1),
    "float32_odd_dims": (lambda: gqa(2, heads=3, dim=5, dtype="float32"), "float32", 2, 0),
}


def blocks(tensor: paddle.Tensor) -> np.ndarray:
    """The tensor's first N blocks as [N, block_bytes] uint8, zero-copy (CPU)."""
    count = tensor.shape[0]
    per_block = int(np.prod(tensor.shape[1:])) * tensor.element_size()
    raw = (ctypes.c_uint8 * (count * per_block)).from_address(tensor.data_ptr())
    return np.ctypeslib.as_array(raw).reshape(count, per_block)[:N]


@pytest.mark.parametrize("name", LAYOUTS)
def test_adopted_tensors_round_trip_bit_exactly_through_the_host_tier(name: str) -> None:
    make, kv_dtype, per_layer, extra = LAYOUTS[name]
    caches = make()
    rng = np.random.default_rng(0)
    for t in caches:
        view = blocks(t)
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    original = [blocks(t).copy() for t in caches]
    ctrl = CacheController.adopt(
        caches, config(kv_dtype), tensors_per_layer=per_layer, num_extra_layers=extra
    )
    with ctrl:
        assert ctrl.caches == caches  # the engine's own tensors, not copies
        assert ctrl.shape.num_layers == len(caches) // per_layer
        block_bytes = [blocks(t).shape[1] for t in caches]
        assert ctrl.block_bytes == block_bytes
        assert ctrl.memory.device_bytes == sum(block_bytes) * N
        assert ctrl.memory.host_bytes == ctrl.get_stats().host_cache_bytes
        assert ctrl.memory.host_bytes >= sum(block_bytes) * HOST
        out = CacheSwapMetadata(0, CacheLevel.DEVICE, CacheLevel.HOST, [1, 4, 5], [7, 0, 3])
        ctrl.submit_swap_tasks(out, None)
        results = ctrl.wait_all(timeout=10)
        assert [r.success for r in results] == [True], results
        for t in caches:
            blocks(t)[:] = 0
        back = CacheSwapMetadata(1, CacheLevel.HOST, CacheLevel.DEVICE, [7, 0, 3], [2, 0, 1])
        counter = ctrl.submit_swap_tasks(None, back)
        counter.wait_all(timeout=10)
        assert all(r.success for r in ctrl.wait_all(timeout=10))
        for t, before in zip(caches, original, strict=True):
            got = blocks(t)
            assert np.array_equal(got[[2, 0, 1]], before[[1, 4, 5]])
            assert not got[[3, 4, 5]].any()  # nothing else was written


def test_adopt_refuses_tensors_that_cannot_be_swapped() -> None:
    cfg = config()
    strided = paddle.zeros([N, 2, BS, 16], dtype="bfloat16")[:, :, :, :8]
    cases = [
        ([*gqa(1)[:1], strided], 2, 0, "not contiguous"),
        (gqa(1, blocks=N + 1), 2, 0, r"7 blocks, .* exactly"),
        (gqa(1) + gqa(1, blocks=N - 1), 2, 1, r"5 blocks, .* at least"),
        ([paddle.zeros([N, 2, BS + 1, 8], dtype="bfloat16")] * 2, 2, 0, "block_size is 4"),
        (gqa(1, dtype="float16"), 2, 0, r"dtype float16, .* 'bfloat16'"),
        (gqa(1) + gqa(1)[:1], 2, 0, "not a positive multiple"),
        ([paddle.zeros([N, 3], dtype="uint8")] * 2, 2, 0, "3 bytes, not a multiple of 4"),
        ([paddle.zeros([N], dtype="bfloat16")] * 2, 2, 0, ">= 2 dims"),
        ([np.zeros((N, 2, BS, 8))] * 2, 2, 0, "expected a paddle.Tensor"),
        (gqa(2), 2, 2, "leaves no model layer"),
        (gqa(1), 0, 0, "tensors_per_layer"),
    ]
    for caches, per_layer, extra, message in cases:
        with pytest.raises(ValueError, match=message):
            CacheController.adopt(
                caches,
                cfg if "uint8" not in str(caches[0].dtype) else config("fp8"),
                tensors_per_layer=per_layer,
                num_extra_layers=extra,
            )
    with pytest.raises(ValueError, match=r"num_host_blocks: the cache needs .* GiB"):
        CacheController.adopt(gqa(1), config(num_host_blocks=2**31 - 1), tensors_per_layer=2)


def test_the_scheduler_config_and_the_workers_spec_cannot_disagree() -> None:
    spec = KVCacheSpec(2, 2, 8, BS, num_device_blocks=N, num_host_blocks=HOST)
    with CacheController(spec, config=config()) as ctrl:  # agree: fine
        assert ctrl.shape.block_size == BS
    for field, cfg in [
        ("block_size", config(block_size=8)),
        ("num_device_blocks", config(num_device_blocks=N + 1)),
        ("num_host_blocks", config(num_host_blocks=0)),
        ("kv_dtype", config("float16")),
    ]:
        with pytest.raises(ValueError, match=rf"{field}: the worker's cache has"):
            CacheController(spec, config=cfg)


def test_the_memory_a_controller_takes_is_stated_and_checked_first() -> None:
    spec = KVCacheSpec(2, 2, 8, BS, num_device_blocks=N, num_host_blocks=HOST)
    with CacheController(spec) as ctrl:
        per_block = sum(spec.block_bytes())
        assert per_block == sum(ctrl.block_bytes) == 4 * (2 * BS * 8 * 2)
        assert ctrl.memory.device_bytes == per_block * N and ctrl.memory.allocates_device
        # The host tier: HOST blocks of every tensor's block back to back, no padding.
        assert ctrl.memory.host_bytes == per_block * HOST == ctrl.host_stride * HOST
        assert ctrl.memory.describe() == (
            "device KV 3.00 KiB (allocated by fastkv now), host tier 4.00 KiB"
        )
    assert "GiB" in MemoryPlan(3 * 2**30, 0, allocates_device=False).describe()
    assert MemoryPlan(3 * 2**30, 0, allocates_device=False).describe() == (
        "device KV 3.00 GiB (the engine's own, adopted: nothing new allocated), no host tier"
    )
    huge = KVCacheSpec(2, 64, 128, 64, num_device_blocks=2**20, num_host_blocks=0)
    with pytest.raises(ValueError, match="GiB of host memory"):
        CacheController(huge)  # refused before a byte is allocated
