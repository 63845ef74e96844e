"""Test helpers: KV-cache layouts (segments, device arrays, the host tier).

The host tier is the worker's: host block b is one contiguous region of S bytes
(every segment's block, in segment order, no padding), segment s's part at the sum
of the earlier segments' block sizes; `interleaved=False` carves a region per
segment instead (blocks back to back), which the core also accepts."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

# Per layer: (name, dtype, per-block shape suffix). bf16 travels as its uint16 bit
# pattern (numpy has no bfloat16); the copy is byte-exact, so that is the same test.
KINDS: dict[str, list[tuple[str, np.dtype, str]]] = {
    "bf16": [("k", np.dtype(np.uint16), "kv"), ("v", np.dtype(np.uint16), "kv")],
    "fp16": [("k", np.dtype(np.float16), "kv"), ("v", np.dtype(np.float16), "kv")],
    # Block-wise fp8: uint8 payload plus one float32 scale per (head, token).
    "uint8": [
        ("k", np.dtype(np.uint8), "kv"),
        ("v", np.dtype(np.uint8), "kv"),
        ("k_scale", np.dtype(np.float32), "scale"),
        ("v_scale", np.dtype(np.float32), "scale"),
    ],
    "fp32": [("k", np.dtype(np.float32), "kv"), ("v", np.dtype(np.float32), "kv")],
}


def random_blocks(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype
) -> np.ndarray:
    """Random bit patterns of `dtype` (any bytes, including NaN payloads)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)


@dataclass
class HostBuffer:
    """One host allocation, as numpy bytes; owns or borrows the memory."""

    array: np.ndarray
    ptr: int
    keepalive: object = None

    @classmethod
    def numpy(cls, nbytes: int) -> HostBuffer:
        raw = np.zeros(nbytes + 256, dtype=np.uint8)
        off = (-raw.ctypes.data) % 256
        arr = raw[off : off + nbytes]
        return cls(arr, arr.ctypes.data, raw)

    @classmethod
    def at(cls, ptr: int, nbytes: int) -> HostBuffer:
        arr = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=np.uint8)
        return cls(arr, ptr)


@dataclass
class Cache:
    """A layer-major list of cache segments with device arrays and host regions."""

    kind: str
    layers: int
    num_device_blocks: int
    num_host_blocks: int
    device: list[np.ndarray] = field(default_factory=list)
    host: list[np.ndarray] = field(default_factory=list)
    host_ptrs: list[int] = field(default_factory=list)
    host_stride: int = 0  # 0: a host region per segment
    host_tier: np.ndarray | None = None  # interleaved: [num_host_blocks, S] uint8

    @property
    def tensors_per_layer(self) -> int:
        return len(KINDS[self.kind])

    def segments(self, device_ptrs: list[int] | None = None) -> list[tuple[int, int, int, int]]:
        ptrs = device_ptrs or [d.ctypes.data for d in self.device]
        return [
            (p, h, d[0].nbytes, self.host_stride or d[0].nbytes)
            for p, h, d in zip(ptrs, self.host_ptrs, self.device, strict=True)
        ]

    def layer_slice(self, layer: int) -> slice:
        n = self.tensors_per_layer
        return slice(layer * n, (layer + 1) * n)


def host_bytes_needed(
    kind: str,
    layers: int,
    num_host_blocks: int,
    heads: int,
    tokens: int,
    head_dim: int,
    interleaved: bool = True,
) -> int:
    total = 0
    for _, dtype, role in KINDS[kind]:
        per_block = heads * tokens * (head_dim if role == "kv" else 1) * dtype.itemsize
        total += (
            num_host_blocks * per_block if interleaved else _align(num_host_blocks * per_block)
        )
    return total * layers


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def make_cache(
    rng: np.random.Generator,
    kind: str,
    layers: int,
    num_device_blocks: int,
    num_host_blocks: int,
    host: HostBuffer,
    heads: int = 2,
    tokens: int = 4,
    head_dim: int = 8,
    interleaved: bool = True,
) -> Cache:
    """Random device arrays and the host tier in `host` (which must hold
    `host_bytes_needed(...)` bytes), in layer-major order."""
    cache = Cache(kind, layers, num_device_blocks, num_host_blocks)
    if interleaved:
        return _make_interleaved(rng, cache, host, (heads, tokens, head_dim))
    offset = 0
    for _ in range(layers):
        for _, dtype, role in KINDS[kind]:
            suffix = (heads, tokens, head_dim) if role == "kv" else (heads, tokens)
            cache.device.append(random_blocks(rng, (num_device_blocks, *suffix), dtype))
            nbytes = num_host_blocks * int(np.prod(suffix)) * dtype.itemsize
            region = host.array[offset : offset + nbytes]
            region[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            cache.host.append(region.view(dtype).reshape(num_host_blocks, *suffix))
            cache.host_ptrs.append(host.ptr + offset)
            offset += _align(nbytes)
    assert offset <= host.array.size
    return cache


def _make_interleaved(
    rng: np.random.Generator, cache: Cache, host: HostBuffer, kv: tuple[int, int, int]
) -> Cache:
    n = cache.num_host_blocks
    suffixes = []
    for _ in range(cache.layers):
        for _, dtype, role in KINDS[cache.kind]:
            suffix = kv if role == "kv" else kv[:2]
            cache.device.append(random_blocks(rng, (cache.num_device_blocks, *suffix), dtype))
            suffixes.append((suffix, dtype))
    stride = sum(int(np.prod(sfx)) * dt.itemsize for sfx, dt in suffixes)
    tier = host.array[: n * stride].reshape(n, stride)
    tier[:] = rng.integers(0, 256, tier.shape, dtype=np.uint8)
    prefix = 0
    for suffix, dtype in suffixes:
        bb = int(np.prod(suffix)) * dtype.itemsize
        part = tier[:, prefix : prefix + bb].view(dtype).reshape(n, *suffix)
        assert np.shares_memory(part, tier)  # a view into the tier, never a copy
        cache.host.append(part)
        cache.host_ptrs.append(host.ptr + prefix)
        prefix += bb
    cache.host_stride = stride
    cache.host_tier = tier
    return cache


def snapshot(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [a.copy() for a in arrays]


def assert_bytes_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    a = np.ascontiguousarray(actual).view(np.uint8)
    e = np.ascontiguousarray(expected).view(np.uint8)
    if not np.array_equal(a, e):
        raise AssertionError(f"{what}: bytes differ")


def random_ids(
    rng: np.random.Generator, n: int, high: int, consecutive: bool = False
) -> np.ndarray:
    """n distinct ids in [0, high): a random run if consecutive, else scattered
    (shuffled, so neighbours in the array are rarely neighbours in memory)."""
    if consecutive:
        start = int(rng.integers(0, high - n + 1))
        return np.arange(start, start + n, dtype=np.int64)
    return rng.choice(high, size=n, replace=False).astype(np.int64)


def expected_after_swap(
    cache: Cache, device_ids: np.ndarray, host_ids: np.ndarray, h2d: bool, selected: list[int]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Reference result: numpy fancy indexing on copies of every segment."""
    dev = snapshot(cache.device)
    host = snapshot(cache.host)
    for s in selected:
        if h2d:
            dev[s][device_ids] = cache.host[s][host_ids]
        else:
            host[s][host_ids] = cache.device[s][device_ids]
    return dev, host
