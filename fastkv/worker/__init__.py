"""Worker side of fastkv: owns the KV tensors and the host cache and moves blocks.

`CacheController` (`.cache_controller`) and `KVCacheSpec`, `CacheShape`,
`MemoryPlan` (`.cache_shape`) need Paddle and the built ops; they load on first use,
so `fastkv.worker.numa`, `.streams`, `.transfer_manager`, `.storage_bridge` and
`.stats` import without them.
"""

from __future__ import annotations

from typing import Any

from fastkv.worker.stats import ControllerStats

__all__ = ["CacheController", "CacheShape", "ControllerStats", "KVCacheSpec", "MemoryPlan"]

_SHAPES = {"CacheShape", "KVCacheSpec", "MemoryPlan"}


def __getattr__(name: str) -> Any:
    if name == "CacheController":
        from fastkv.worker import cache_controller

        return cache_controller.CacheController
    if name in _SHAPES:
        from fastkv.worker import cache_shape

        return getattr(cache_shape, name)
    raise AttributeError(f"module 'fastkv.worker' has no attribute {name!r}")
