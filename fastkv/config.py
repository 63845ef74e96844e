"""The one identity of a cache: `CacheConfig` (what the scheduler decides with) and
`ModelKVShape` (what one rank's KV of the model looks like).

Everything else that names a cache is derived from the two, never typed again:
the scheduler's hash namespace (`CacheConfig.namespace_key`), the worker's tensor
shapes (`fastkv.worker.KVCacheSpec.from_config`) and the storage namespace every
stored block is keyed under (`fastkv.storage.StorageNamespace.of`).
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
from dataclasses import dataclass
from enum import StrEnum

# Upper bounds exist to catch unit mistakes (bytes passed as blocks), not to limit
# real deployments: 2**31 blocks of even one token is far beyond any GPU or host.
_MAX_BLOCKS = 2**31 - 1
MAX_BLOCK_SIZE = 1 << 20


class WritePolicy(StrEnum):
    """When a device block gets a copy in host memory."""

    WRITE_THROUGH = "write_through"
    """Every new full block is backed up to host as soon as it is committed."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """A block is backed up once it has been hit `selective_threshold` times."""
    WRITE_BACK = "write_back"
    """A block is copied to host only when it is evicted from the device."""


class StorageWritePolicy(StrEnum):
    """When a block with a host copy is written to the storage tier."""

    NONE = "none"
    WRITE_THROUGH = "write_through"
    """As soon as it has a valid host copy."""
    ON_HOST_EVICTION = "on_host_eviction"
    """When its host copy is evicted (the host block is freed once written)."""
    AFTER_HITS = "after_hits"
    """Once it has been hit `write_after_hits` times (and has a host copy)."""


class PrefetchPolicy(StrEnum):
    """How long a request waits for blocks found in storage."""

    BEST_EFFORT = "best_effort"
    """Never waits: uses what has landed in host memory when it is allocated."""
    WAIT = "wait"
    """Waits for its lookup and loads, at most `wait_s` after its match."""
    PREDICTED = "predicted"
    """Loads only when loading is predicted faster than recomputing the blocks
    (read bandwidth measured on completed loads), then waits as WAIT does."""


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """The scheduler's view of the storage tier behind host memory.

    Args:
        write_policy: a `StorageWritePolicy` or its value.
        write_after_hits: hits before a block is written under AFTER_HITS.
        prefetch_policy: a `PrefetchPolicy` or its value.
        wait_s: the longest a request waits for its storage lookup and loads.
        timeout_s: the deadline the workers get for each storage transfer.
        retry_after_s: a block whose load failed is not looked up again for this long.
        block_bytes: KV bytes one rank reads per block (PREDICTED's cost model).
        read_bytes_per_s: storage read bandwidth per rank, the first estimate
            (PREDICTED; later ones come from completed loads).
        recompute_tokens_per_s: prefill throughput (PREDICTED).
        load_latency_s: fixed cost of one load (PREDICTED).

    Raises:
        ValueError: a field out of range; the message names it.
    """

    write_policy: StorageWritePolicy | str = StorageWritePolicy.WRITE_THROUGH
    write_after_hits: int = 2
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.WAIT
    wait_s: float = 0.2
    timeout_s: float = 5.0
    retry_after_s: float = 30.0
    block_bytes: int = 0
    read_bytes_per_s: float = 1e9
    recompute_tokens_per_s: float = 20_000.0
    load_latency_s: float = 0.002

    def __post_init__(self) -> None:
        for name, enum in (
            ("write_policy", StorageWritePolicy),
            ("prefetch_policy", PrefetchPolicy),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                allowed = ", ".join(p.value for p in enum)
                raise ValueError(f"{name}: {value!r} is not one of {allowed}") from None
        check_int("write_after_hits", self.write_after_hits, 1, 2**31 - 1)
        check_int("block_bytes", self.block_bytes, 0, 1 << 40)
        for name, low, high in (
            ("wait_s", 0.0, 3600.0),
            ("timeout_s", 0.001, 3600.0),
            ("retry_after_s", 0.0, 86400.0),
            ("read_bytes_per_s", 1.0, 1e13),
            ("recompute_tokens_per_s", 1e-3, 1e12),
            ("load_latency_s", 0.0, 60.0),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not low <= value <= high
            ):
                raise ValueError(f"{name}: must be a number in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Scheduler-side cache configuration, validated on construction.

    Args:
        block_size: tokens per KV block.
        num_device_blocks: capacity of the device (GPU) block pool.
        num_host_blocks: capacity of the host block pool; 0 disables the host tier.
        write_policy: a `WritePolicy` or its string value.
        selective_threshold: hits before a block is backed up under
            `write_through_selective`.
        model_id, kv_dtype, tp_rank, tp_size: parts of the cache namespace, so two
            models, dtypes or tensor-parallel shards never share a block hash.
        namespace: an explicit namespace string; replaces the parts above.
        reuse_evicted_blocks: False (default): a device block being evicted to host
            returns to the pool when its copy's result arrives. True: it goes to
            the next allocation at once and the worker orders the copy before the
            new owner's writes (FastDeploy v1's synchronous allocation); a failed
            copy then loses the block, and its descendants leave the cache.
        storage: the storage tier behind host memory (`StorageConfig`); None for
            none. It needs a host tier: blocks move storage <-> host <-> device.

    Raises:
        ValueError: a field is out of range; the message names the field and the
            allowed range.
    """

    block_size: int = 64
    num_device_blocks: int = 1024
    num_host_blocks: int = 0
    write_policy: WritePolicy | str = WritePolicy.WRITE_BACK
    selective_threshold: int = 2
    model_id: str = "default"
    kv_dtype: str = "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1
    namespace: str | None = None
    reuse_evicted_blocks: bool = False
    storage: StorageConfig | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("num_device_blocks", self.num_device_blocks, 1, _MAX_BLOCKS)
        check_int("num_host_blocks", self.num_host_blocks, 0, _MAX_BLOCKS)
        check_int("selective_threshold", self.selective_threshold, 1, 2**31 - 1)
        check_int("tp_size", self.tp_size, 1, 1 << 16)
        check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        try:
            policy = WritePolicy(self.write_policy)
        except ValueError:
            allowed = ", ".join(p.value for p in WritePolicy)
            raise ValueError(
                f"write_policy: {self.write_policy!r} is not one of {allowed}"
            ) from None
        object.__setattr__(self, "write_policy", policy)
        for name in ("model_id", "kv_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
        if not isinstance(self.reuse_evicted_blocks, bool):
            raise ValueError(
                f"reuse_evicted_blocks: must be a bool, got {self.reuse_evicted_blocks!r}"
            )
        if self.storage is not None:
            if not isinstance(self.storage, StorageConfig):
                raise ValueError(
                    f"storage: must be a StorageConfig or None, got {self.storage!r}"
                )
            if not self.num_host_blocks:
                raise ValueError("storage: needs a host tier (num_host_blocks > 0)")
        if self.namespace is not None and (
            not isinstance(self.namespace, str) or not self.namespace
        ):
            raise ValueError(
                f"namespace: must be None or a non-empty string, got {self.namespace!r}"
            )

    @property
    def has_host_tier(self) -> bool:
        return self.num_host_blocks > 0

    def namespace_key(self) -> str:
        """The string every block hash of this cache is rooted in: the explicit
        namespace, or a JSON list of the parts (JSON, so that no two different sets
        of parts can spell the same key)."""
        if self.namespace is not None:
            return self.namespace
        parts = ["fastkv/v1", self.model_id, self.kv_dtype, self.block_size]
        return json.dumps([*parts, self.tp_rank, self.tp_size])


@dataclass(frozen=True, slots=True)
class ModelKVShape:
    """The model's KV cache as one tensor-parallel rank holds it, per layer.

    With `CacheConfig` (block size, block counts, dtype, namespace) it is all a
    worker needs to shape its cache and all storage needs to key its blocks.

    Args:
        num_layers: model layers with a KV cache.
        num_kv_heads: KV heads held by one rank (the model's heads / tp_size).
        head_dim: the head dimension.
        num_extra_layers: speculative-decoding layers whose KV moves with the
            model's (MTP, draft layers); they follow the model layers.

    Raises:
        ValueError: a field is not an int in range; the message names it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_extra_layers: int = 0

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1, 1 << 16)
        check_int("num_kv_heads", self.num_kv_heads, 1, 1 << 16)
        check_int("head_dim", self.head_dim, 1, 1 << 16)
        check_int("num_extra_layers", self.num_extra_layers, 0, 1 << 16)

    @property
    def total_layers(self) -> int:
        """Layers with cache tensors: the model's, then the extra ones."""
        return self.num_layers + self.num_extra_layers


def check_identity(config: object, model_kv: object) -> None:
    """Raise ValueError unless `config` is a CacheConfig and `model_kv` a
    ModelKVShape: the two halves every derived description of a cache is built from."""
    if not isinstance(config, CacheConfig):
        raise ValueError(f"config: expected a CacheConfig, got {type(config).__name__}")
    if not isinstance(model_kv, ModelKVShape):
        raise ValueError(f"model_kv: expected a ModelKVShape, got {type(model_kv).__name__}")


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ValueError (naming `name`) unless `value` is an int, not a bool, in
    [low, high]; no upper bound when `high` is None."""
    if high is None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an int in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is outside the allowed range [{low}, {high}]")


def as_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` as a Python int, for counts and ids a caller passes: any integral
    type (`operator.index`: int, numpy's integers) is taken; a bool (Python's or
    numpy's) or a float is not. Raises ValueError (naming `name`) unless the value
    is in [low, high] (no upper bound when `high` is None)."""
    if not isinstance(value, int) and type(value).__name__ != "bool_":
        with contextlib.suppress(TypeError):  # not integral: refused below, named
            value = int(operator.index(value))  # type: ignore[arg-type]
    check_int(name, value, low, high)
    return value  # type: ignore[return-value]
