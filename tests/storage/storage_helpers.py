"""Shared pieces of the storage tests: a host tier laid out like the worker's, and
block layouts shaped like real KV blocks."""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
from collections.abc import Sequence

import numpy as np

from fastkv import CacheConfig, ModelKVShape
from fastkv.storage import BlockLayout, StorageKey, StorageNamespace
from fastkv.storage.auth import StorageAuth

ALIGN = 4096

LAYOUTS = {
    # bf16, 4 layers: K and V of 64 KiB per layer (zero-copy O_DIRECT segments)
    "bf16": BlockLayout((64 << 10,) * 8),
    # fp8, 2 layers + 1 extra layer: K, V, K scale, V scale per layer (32-byte scales)
    "fp8": BlockLayout((32 << 10, 32 << 10, 32, 32) * 3),
    # lengths that are no multiple of 4096: everything goes through the bounce page
    "odd": BlockLayout((10_000, 10_000, 96, 3_000)),
}


class HostMemory:
    """One allocation laid out as CacheController's host tier: host block b is one
    contiguous region of S = `layout.payload_bytes` at `base + misalign + b * S`,
    every segment's bytes back to back in order, no padding.

    Args:
        misalign: bytes added to the tier's start (addresses that O_DIRECT cannot
            take directly).
    """

    def __init__(self, layout: BlockLayout, num_blocks: int, misalign: int = 0) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.stride = layout.payload_bytes
        self._map = mmap.mmap(-1, _align(self.stride * num_blocks + misalign))
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self.array.ctypes.data
        self.nbytes = self.array.nbytes
        self.start = misalign
        self.starts = [0, *np.cumsum(layout.segment_lengths)[:-1].tolist()]

    def segments(self, block: int) -> list[tuple[int, int]]:
        """Host block `block` as the worker hands it to a backend: one segment."""
        return [(self.base + self.start + block * self.stride, self.stride)]

    def tensor_segments(self, block: int) -> list[tuple[int, int]]:
        """The same bytes as the layout's segments, one per cache tensor."""
        at = self.base + self.start + block * self.stride
        return [
            (at + o, n) for o, n in zip(self.starts, self.layout.segment_lengths, strict=True)
        ]

    def views(self, block: int) -> list[np.ndarray]:
        at = self.start + block * self.stride
        return [
            self.array[at + o : at + o + n]
            for o, n in zip(self.starts, self.layout.segment_lengths, strict=True)
        ]

    def read(self, block: int) -> bytes:
        at = self.start + block * self.stride
        return self.array[at : at + self.stride].tobytes()

    def fill(self, block: int, seed: int) -> bytes:
        rng = np.random.default_rng(seed)
        for v in self.views(block):
            v[:] = rng.integers(0, 256, v.size, dtype=np.uint8)
        return self.read(block)

    def clear(self, block: int, value: int = 0) -> None:
        for v in self.views(block):
            v[:] = value


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def make_namespace(**changes: object) -> StorageNamespace:
    """The tests' namespace (a small model's cache), with `changes` to its fields."""
    config = CacheConfig(block_size=16, model_id="tiny-llama", namespace="test-ns")
    model_kv = ModelKVShape(num_layers=4, num_kv_heads=2, head_dim=64)
    return dataclasses.replace(StorageNamespace.of(config, model_kv), **changes)  # type: ignore[arg-type]


NAMESPACE = make_namespace().digest()

TEST_AUTH = StorageAuth([bytes.fromhex("5e" * 32)])
"""The tests' deployment key ring (a real deployment reads its own from a file)."""


def make_keys(n: int, start: int = 0, namespace: bytes = NAMESPACE, rank: int = 0) -> list:
    return [
        StorageKey(namespace, hashlib.sha256(f"block-{i}".encode()).digest(), rank)
        for i in range(start, start + n)
    ]


def statuses(results: Sequence) -> list[str]:
    return [r.status.name for r in results]
