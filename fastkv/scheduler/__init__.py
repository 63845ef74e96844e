"""Scheduler half: what an engine's scheduler calls.

`CacheManager` is the one entry point; an engine reads back the types below and
nothing else (the radix tree, block pools, transfer book and tiers are the
manager's rooms, importable by path for tests and tools: `fastkv.scheduler.
radix_tree`, `.block_pool`, `.transfers`, `.tiers`). Imports neither paddle nor
cupy; talks to the worker through `fastkv.metadata`.
"""

from fastkv.scheduler.api import (
    Allocation,
    AllocStatus,
    MatchResult,
    Rollback,
    StalledTransfer,
    SwapTasks,
)
from fastkv.scheduler.block_pool import PoolStats
from fastkv.scheduler.cache_manager import CacheManager
from fastkv.scheduler.stats import CacheStats, StorageTierStats
from fastkv.scheduler.table import BlockTable, Slot

__all__ = [
    "AllocStatus",
    "Allocation",
    "BlockTable",
    "CacheManager",
    "CacheStats",
    "MatchResult",
    "PoolStats",
    "Rollback",
    "Slot",
    "StalledTransfer",
    "StorageTierStats",
    "SwapTasks",
]
