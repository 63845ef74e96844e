"""fastkv settings read from a FastDeploy `FDConfig`, the same way on both halves.

Fields read (everything else is ignored):
- `cache_config`: `block_size`, `total_block_num` (device blocks), `num_cpu_blocks`
  (host blocks; 0 or None disables the host tier), `enable_prefix_caching`,
  `write_policy`, `write_through_threshold`, `kvcache_storage_backend` ("file":
  fastkv's storage tier on local disk, see `storage_config_from_fastdeploy`);
- `model_config`: `dtype`, `model` (namespace only), `num_hidden_layers` (worker);
- `quant_config.kv_cache_quant_type` / `cache_config.kv_cache_quant_type`: any
  quantized cache is stored as uint8 ("fp8" in fastkv's vocabulary);
- `parallel_config`: `tensor_parallel_size`, `engine_worker_queue_port`,
  `local_data_parallel_id` (the results channel's name).

Write policies keep FastDeploy's meaning: its "write_through" backs a block up to
host after its first hit (v1 rewrites it to write_through_selective with threshold
1), "write_through_selective" after `write_through_threshold` hits, "write_back"
copies a block to host when it is evicted.
"""

from __future__ import annotations

import os
from typing import Any

from fastkv.config import CacheConfig, StorageConfig, WritePolicy, check_int

CHANNEL_ENV = "FASTKV_RESULTS_CHANNEL"
STORAGE_BACKEND_FILE = "file"
STORAGE_DIR_ENV = "FASTKV_STORAGE_DIR"
STORAGE_WRITE_POLICY_ENV = "FASTKV_STORAGE_WRITE_POLICY"
STORAGE_CAPACITY_ENV = "FASTKV_STORAGE_CAPACITY_BLOCKS"
DEFAULT_WRITE_POLICY = "write_back"
_MODEL_DTYPES = ("bfloat16", "float16", "float32")


def _section(fd_config: Any, name: str) -> Any:
    section = getattr(fd_config, name, None)
    if section is None:
        raise ValueError(f"fd_config.{name}: missing; fastkv reads its cache settings there")
    return section


def _field(section: Any, name: str, default: Any = None) -> Any:
    value = getattr(section, name, default)
    return default if value is None else value


def kv_cache_quant_type(fd_config: Any) -> str | None:
    """FastDeploy's KV quantization (quant_config's, else cache_config's), or None."""
    quant = getattr(getattr(fd_config, "quant_config", None), "kv_cache_quant_type", None)
    quant = quant or getattr(
        getattr(fd_config, "cache_config", None), "kv_cache_quant_type", None
    )
    return str(quant) if quant else None


def model_dtype(fd_config: Any) -> str:
    """The model's dtype (FastDeploy's unquantized KV dtype).

    Raises:
        ValueError: not one of bfloat16, float16, float32.
    """
    dtype = str(getattr(getattr(fd_config, "model_config", None), "dtype", "bfloat16"))
    dtype = dtype.removeprefix("paddle.")
    if dtype not in _MODEL_DTYPES:
        raise ValueError(
            f"fd_config.model_config.dtype: {dtype!r} is not one of {_MODEL_DTYPES}"
        )
    return dtype


def kv_dtype_of(fd_config: Any) -> str:
    """The KV storage dtype in fastkv's vocabulary ('fp8' = uint8 storage)."""
    return "fp8" if kv_cache_quant_type(fd_config) else model_dtype(fd_config)


def tensor_parallel_size(fd_config: Any) -> int:
    size = _field(getattr(fd_config, "parallel_config", None), "tensor_parallel_size", 1)
    check_int("fd_config.parallel_config.tensor_parallel_size", size, 1)
    return size


def prefix_caching_enabled(fd_config: Any) -> bool:
    return bool(_field(_section(fd_config, "cache_config"), "enable_prefix_caching", True))


def cache_config_from_fastdeploy(
    fd_config: Any,
    *,
    cache_config: Any | None = None,
    num_device_blocks: int | None = None,
    kv_dtype: str | None = None,
) -> CacheConfig:
    """The fastkv CacheConfig of a FastDeploy deployment (reuse_evicted_blocks on:
    FastDeploy allocates synchronously).

    Args:
        fd_config: FastDeploy's FDConfig.
        cache_config: a FastDeploy cache config to use instead of
            `fd_config.cache_config` (update_cache_config).
        num_device_blocks: instead of `cache_config.total_block_num` (the worker
            passes the block count it made tensors for).
        kv_dtype: instead of the one derived from the model and quant configs.

    Raises:
        ValueError: a field missing or out of range; the message names FastDeploy's
            field.
    """
    cc = cache_config if cache_config is not None else _section(fd_config, "cache_config")
    block_size = _field(cc, "block_size")
    total = (
        num_device_blocks if num_device_blocks is not None else _field(cc, "total_block_num")
    )
    for name, value in (("block_size", block_size), ("total_block_num", total)):
        if value is None:
            raise ValueError(f"fd_config.cache_config.{name}: missing")
    host = _field(cc, "num_cpu_blocks", 0)
    policy = str(_field(cc, "write_policy", DEFAULT_WRITE_POLICY))
    threshold = _field(cc, "write_through_threshold", 2)
    if policy == "write_through":  # FastDeploy's meaning: after the first hit
        policy, threshold = WritePolicy.WRITE_THROUGH_SELECTIVE.value, 1
    model = getattr(getattr(fd_config, "model_config", None), "model", None)
    try:
        return CacheConfig(
            block_size=block_size,
            num_device_blocks=total,
            num_host_blocks=host,
            write_policy=policy,
            selective_threshold=threshold,
            model_id=str(model) if model else "fastdeploy",
            kv_dtype=kv_dtype or kv_dtype_of(fd_config),
            tp_size=tensor_parallel_size(fd_config),
            reuse_evicted_blocks=True,
            storage=storage_config_from_fastdeploy(fd_config, cache_config=cc),
        )
    except ValueError as e:
        raise ValueError(f"fd_config.cache_config: {e}") from None


def storage_config_from_fastdeploy(
    fd_config: Any, *, cache_config: Any | None = None
) -> StorageConfig | None:
    """The storage tier of a FastDeploy deployment, or None.

    On when `cache_config.kvcache_storage_backend` is "file" (FastDeploy's
    `--kvcache-storage-backend file`): every worker rank keeps its blocks in
    `$FASTKV_STORAGE_DIR/rank<r>` with fastkv's local disk backend. The storage
    write policy is `$FASTKV_STORAGE_WRITE_POLICY` (default write_through). Requests
    never wait for storage in `allocate` (prefetch policy best_effort): FastDeploy
    allocates right after `can_allocate_gpu_blocks` said yes; blocks come back from
    storage through `prefetch_storage` before a request's match.

    Raises:
        ValueError: another backend (mooncake, attention_store) or a bad write
            policy; the message names the field or variable.
    """
    cc = cache_config if cache_config is not None else _section(fd_config, "cache_config")
    backend = _field(cc, "kvcache_storage_backend")
    if backend is None or backend == "":
        return None
    if backend != STORAGE_BACKEND_FILE:
        raise ValueError(
            f"fd_config.cache_config.kvcache_storage_backend: {backend!r}; fastkv serves "
            f"{STORAGE_BACKEND_FILE!r} (its local disk backend) or None"
        )
    policy = os.environ.get(STORAGE_WRITE_POLICY_ENV) or "write_through"
    try:
        return StorageConfig(write_policy=policy, prefetch_policy="best_effort")
    except ValueError as e:
        raise ValueError(f"${STORAGE_WRITE_POLICY_ENV}: {e}") from None


def storage_directory(fd_config: Any, rank: int) -> str | None:
    """Where worker `rank` keeps its storage blocks, or None without a storage tier.

    Raises:
        ValueError: a storage tier is configured but $FASTKV_STORAGE_DIR is not set.
    """
    if storage_config_from_fastdeploy(fd_config) is None:
        return None
    root = os.environ.get(STORAGE_DIR_ENV)
    if not root:
        raise ValueError(
            f"${STORAGE_DIR_ENV}: not set; kvcache_storage_backend='file' needs the "
            "directory the workers keep their blocks in"
        )
    return os.path.join(root, f"rank{rank}")


def storage_capacity_blocks(num_host_blocks: int) -> int:
    """$FASTKV_STORAGE_CAPACITY_BLOCKS, default 4 x the host tier's blocks.

    Raises:
        ValueError: the variable is not an int >= 1.
    """
    raw = os.environ.get(STORAGE_CAPACITY_ENV)
    if not raw:
        return max(1, 4 * num_host_blocks)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${STORAGE_CAPACITY_ENV}: {raw!r} is not an int") from None
    check_int(f"${STORAGE_CAPACITY_ENV}", value, 1)
    return value


def results_channel_name(fd_config: Any) -> str:
    """The name the scheduler and every worker of one deployment share:
    $FASTKV_RESULTS_CHANNEL, else `fd-<engine_worker_queue_port>-dp<dp id>`.

    Raises:
        ValueError: neither is available (the message says to set the variable).
    """
    name = os.environ.get(CHANNEL_ENV)
    if name:
        return name
    parallel = getattr(fd_config, "parallel_config", None)
    port = getattr(parallel, "engine_worker_queue_port", None)
    dp = getattr(parallel, "local_data_parallel_id", 0) or 0
    if isinstance(port, (list, tuple)):  # one port per data-parallel rank
        port = port[dp] if dp < len(port) else (port[0] if port else None)
    if port is None or port == "":
        raise ValueError(
            "results channel: fd_config.parallel_config.engine_worker_queue_port is not "
            f"set; set {CHANNEL_ENV} to the same name for the engine and its workers"
        )
    return f"fd-{port}-dp{dp}"


__all__ = [
    "CHANNEL_ENV",
    "STORAGE_BACKEND_FILE",
    "STORAGE_CAPACITY_ENV",
    "STORAGE_DIR_ENV",
    "STORAGE_WRITE_POLICY_ENV",
    "cache_config_from_fastdeploy",
    "kv_cache_quant_type",
    "kv_dtype_of",
    "model_dtype",
    "prefix_caching_enabled",
    "results_channel_name",
    "storage_capacity_blocks",
    "storage_config_from_fastdeploy",
    "storage_directory",
    "tensor_parallel_size",
]
