"""fastkv: a PaddlePaddle-native hierarchical KV-cache manager for LLM serving.

The scheduler half (`fastkv.scheduler`) decides which blocks live where; the worker
half (`fastkv.worker`) moves the bytes. `fastkv.metadata` is their only contract.
Importing this package imports neither paddle nor cupy.
"""

from fastkv.config import (
    CacheConfig,
    ModelKVShape,
    PrefetchPolicy,
    StorageConfig,
    StorageWritePolicy,
    WritePolicy,
)
from fastkv.metadata import (
    CacheLevel,
    CacheSwapMetadata,
    LookupResult,
    StorageLookup,
    TransferResult,
)

__all__ = [
    "CacheConfig",
    "CacheLevel",
    "CacheSwapMetadata",
    "LookupResult",
    "ModelKVShape",
    "PrefetchPolicy",
    "StorageConfig",
    "StorageLookup",
    "StorageWritePolicy",
    "TransferResult",
    "WritePolicy",
]
__version__ = "0.1.0"
