"""The storage tier behind host memory: one backend interface (`base`), a local-disk
backend (`local_disk`, the embedded default), Mooncake Store (`mooncake`, built
from `mooncake_options`, failing fast through `circuit_breaker`; its puts, gets,
registered memory and return codes in `mooncake_put`, `mooncake_get`,
`mooncake_memory` and `mooncake_codes`, its deadlines in `deadline_pool` and
`busy_ranges`) and the worker-side I/O engine (`io_engine`)."""

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
