"""The storage tier behind host memory: one backend interface (`base`), a local-disk
backend (`local_disk`, the embedded default), Mooncake Store (the `mooncake`
package, failing fast through `circuit_breaker`, its calls bounded by
`deadline_pool` and `busy_ranges`) and the worker-side I/O engine (`io_engine`)."""

from fastkv.storage.base import (
    BlockLayout,
    KeyResult,
    KeyStatus,
    Segment,
    StorageBackend,
    StorageKey,
    StorageNamespace,
    StorageStats,
    deadline_after,
)

__all__ = [
    "BlockLayout",
    "KeyResult",
    "KeyStatus",
    "Segment",
    "StorageBackend",
    "StorageKey",
    "StorageNamespace",
    "StorageStats",
    "deadline_after",
]
