"""Shared pieces of the storage tests: a host cache laid out like the worker's, and
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
    """One allocation carved into a region per cache tensor, as CacheController does:
    block b of tensor i sits at `region[i] + b * lengths[i]`.

    Args:
        misalign: bytes added to every region start (addresses that O_DIRECT
            cannot take directly).
    """

    def __init__(self, layout: BlockLayout, num_blocks: int, misalign: int = 0) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        sizes = [_align(n * num_blocks + misalign) for n in layout.segment_lengths]
        self._map = mmap.mmap(-1, sum(sizes))
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self.array.ctypes.data
        self.nbytes = self.array.nbytes
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.regions = [int(o) + misalign for o in offsets]

    def segments(self, block: int) -> list[tuple[int, int]]:
        return [
            (self.base + r + block * n, n)
            for r, n in zip(self.regions, self.layout.segment_lengths, strict=True)
        ]

    def views(self, block: int) -> list[np.ndarray]:
        return [
            self.array[r + block * n : r + (block + 1) * n]
            for r, n in zip(self.regions, self.layout.segment_lengths, strict=True)
        ]

    def read(self, block: int) -> bytes:
        return b"".join(v.tobytes() for v in self.views(block))

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
