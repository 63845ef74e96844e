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
    SwapTasks,
)
from fastkv.scheduler.radix_tree import NodeState, RadixTree, TreeNode
from fastkv.scheduler.stats import CacheStats, StorageTierStats

__all__ = [
    "AllocStatus",
    "Allocation",
    "BlockPool",
    "CacheManager",
    "CacheStats",
    "MatchResult",
    "NodeState",
    "OutOfBlocksError",
    "PoolStats",
    "RadixTree",
    "Rollback",
    "StorageTierStats",
    "SwapTasks",
    "TreeNode",
]
