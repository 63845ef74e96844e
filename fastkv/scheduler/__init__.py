"""Scheduler half: block pools, the radix tree and the cache manager.

Imports neither paddle nor cupy; talks to the worker through `fastkv.metadata`.
"""

from fastkv.scheduler.block_pool import BlockPool, OutOfBlocksError, PoolStats
from fastkv.scheduler.cache_manager import (
    Allocation,
    AllocStatus,
    CacheManager,
    MatchResult,
    Rollback,
    StalledTransfer,
    SwapTasks,
)
from fastkv.scheduler.radix_tree import NodeState, RadixTree, TreeNode
from fastkv.scheduler.stats import CacheStats, StorageTierStats
from fastkv.scheduler.table import BlockTable, Slot

__all__ = [
    "AllocStatus",
    "Allocation",
    "BlockPool",
    "BlockTable",
    "CacheManager",
    "CacheStats",
    "MatchResult",
    "NodeState",
    "OutOfBlocksError",
    "PoolStats",
    "RadixTree",
    "Rollback",
    "Slot",
    "StalledTransfer",
    "StorageTierStats",
    "SwapTasks",
    "TreeNode",
]
