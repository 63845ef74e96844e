"""fastkv settings read from a FastDeploy `FDConfig`, the same way on both halves.

Fields read (everything else is ignored):
- `cache_config`: `block_size`, `total_block_num` (device blocks), `num_cpu_blocks`
  (host blocks; 0 or None disables the host tier), `enable_prefix_caching`,
  `write_policy`, `write_through_threshold`, `kvcache_storage_backend` ("file":
  fastkv's storage tier on local disk; "mooncake": on a Mooncake Store cluster,
  see `storage_config_from_fastdeploy`), `kvcache_storage_config` (mooncake);
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

import json
import math
import numbers
import os
import socket
from typing import Any

from fastkv.config import CacheConfig, StorageConfig, WritePolicy, as_int, check_int
from fastkv.storage.mooncake.options import MooncakeConnection

CHANNEL_ENV = "FASTKV_RESULTS_CHANNEL"
STORAGE_BACKEND_FILE = "file"
STORAGE_BACKEND_MOONCAKE = "mooncake"
STORAGE_BACKENDS = (STORAGE_BACKEND_FILE, STORAGE_BACKEND_MOONCAKE)
"""The `--kvcache-storage-backend` values fastkv serves (FastDeploy's third,
attention_store, is refused)."""
MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
MOONCAKE_ENV = {
    "master_server_addr": "MOONCAKE_MASTER_SERVER_ADDR",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_METADATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "protocol": "MOONCAKE_PROTOCOL",
    "rdma_devices": "MOONCAKE_RDMA_DEVICES",
}
"""FastDeploy's Mooncake settings and their variables (its MooncakeStorageConfig)."""
STORAGE_DIR_ENV = "FASTKV_STORAGE_DIR"
STORAGE_WRITE_POLICY_ENV = "FASTKV_STORAGE_WRITE_POLICY"
STORAGE_CAPACITY_ENV = "FASTKV_STORAGE_CAPACITY_BLOCKS"
DEFAULT_WRITE_POLICY = "write_back"
_MODEL_DTYPES = ("bfloat16", "float16", "float32")


def as_seconds(name: str, value: object) -> float:
    """`value` as seconds, for the adapter's durations and timeouts: a finite
    real number >= 0 (int, float, numpy's ints and floats). A bool (Python's or
    numpy's) is refused, as are NaN and infinity. Raises ValueError naming `name`."""
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and type(value).__name__ != "bool_"
        and math.isfinite(value)
        and value >= 0
    )
    if not ok:
        raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def as_timeout(name: str, value: object) -> float | None:
    """A runner's wait timeout: None as given (FastDeploy's counters take
    `Optional[float]`), else `as_seconds`. Raises ValueError naming `name`."""
    return None if value is None else as_seconds(name, value)


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


def storage_backend(fd_config: Any, *, cache_config: Any | None = None) -> str | None:
    """`cache_config.kvcache_storage_backend` if fastkv serves it, None when unset.

    Raises:
        ValueError: a backend fastkv does not serve (attention_store, anything
            else); the message names the accepted ones.
    """
    cc = cache_config if cache_config is not None else _section(fd_config, "cache_config")
    backend = _field(cc, "kvcache_storage_backend")
    if backend is None or backend == "":
        return None
    if backend not in STORAGE_BACKENDS:
        raise ValueError(
            f"fd_config.cache_config.kvcache_storage_backend: {backend!r}; fastkv serves "
            f"{STORAGE_BACKEND_FILE!r} (its local disk backend), "
            f"{STORAGE_BACKEND_MOONCAKE!r} (Mooncake Store) or None"
        )
    return str(backend)


def storage_config_from_fastdeploy(
    fd_config: Any, *, cache_config: Any | None = None
) -> StorageConfig | None:
    """The storage tier of a FastDeploy deployment, or None.

    On when `cache_config.kvcache_storage_backend` is "file" or "mooncake"
    (FastDeploy's `--kvcache-storage-backend`): with "file" every worker rank
    keeps its blocks in `$FASTKV_STORAGE_DIR/rank<r>` with fastkv's local disk
    backend; with "mooncake" every rank puts them in the Mooncake Store cluster
    FastDeploy's Mooncake settings name (`mooncake_connection`). The storage
    write policy is `$FASTKV_STORAGE_WRITE_POLICY` (default write_through).
    Requests never wait for storage in `allocate` (prefetch policy best_effort):
    FastDeploy allocates right after `can_allocate_gpu_blocks` said yes; blocks
    come back from storage through `prefetch_storage` before a request's match.

    Raises:
        ValueError: another backend (attention_store) or a bad write policy; the
            message names the field or variable.
    """
    if storage_backend(fd_config, cache_config=cache_config) is None:
        return None
    policy = os.environ.get(STORAGE_WRITE_POLICY_ENV) or "write_through"
    try:
        return StorageConfig(write_policy=policy, prefetch_policy="best_effort")
    except ValueError as e:
        raise ValueError(f"${STORAGE_WRITE_POLICY_ENV}: {e}") from None


def storage_directory(fd_config: Any, rank: int) -> str | None:
    """Where worker `rank` keeps its storage blocks, or None without a storage
    tier on local disk.

    Raises:
        ValueError: kvcache_storage_backend="file" but $FASTKV_STORAGE_DIR is not set.
    """
    if storage_backend(fd_config) != STORAGE_BACKEND_FILE:
        return None
    root = os.environ.get(STORAGE_DIR_ENV)
    if not root:
        raise ValueError(
            f"${STORAGE_DIR_ENV}: not set; kvcache_storage_backend='file' needs the "
            "directory the workers keep their blocks in"
        )
    return os.path.join(root, f"rank{rank}")


def storage_target(fd_config: Any, rank: int) -> str | MooncakeConnection | None:
    """Where worker `rank` keeps its storage blocks: a directory ("file"), a
    Mooncake connection ("mooncake"), or None without a storage tier.

    Raises:
        ValueError: as `storage_directory` and `mooncake_connection`.
    """
    if storage_backend(fd_config) == STORAGE_BACKEND_MOONCAKE:
        return mooncake_connection(fd_config)
    return storage_directory(fd_config, rank)


def mooncake_connection(fd_config: Any) -> MooncakeConnection:
    """The Mooncake Store connection of a worker, from FastDeploy's own Mooncake
    settings, looked up as FastDeploy looks them up: `cache_config.
    kvcache_storage_config` (a dict or JSON text), else the JSON file
    `$MOONCAKE_CONFIG_PATH`, else the variables in `MOONCAKE_ENV`, per setting.

    `master_server_addr` ("host:port") is required; `local_hostname` defaults to
    this host's address, `metadata_server` to "P2PHANDSHAKE", `protocol` to "tcp",
    `rdma_devices` to none, `global_segment_size` (bytes, or with a KB/MB/GB
    suffix; the memory each worker gives the pool) to 0: a pure client, the
    blocks then live on storage-node processes. FastDeploy's `local_buffer_size`
    is not read (fastkv registers its host tier instead). The key ring blocks are
    authenticated with is `$FASTKV_STORAGE_KEY_FILE` (required by the backend).

    Raises:
        ValueError: no master address, a setting of the wrong form, or an
            unreadable config; the message names the setting and its source.
    """
    cc = _section(fd_config, "cache_config")
    extra = _mooncake_extra(getattr(cc, "kvcache_storage_config", None))
    from_file = _mooncake_file()
    values: dict[str, tuple[str, Any]] = {}
    for key, env in MOONCAKE_ENV.items():
        for source, table in (
            ("fd_config.cache_config.kvcache_storage_config", extra),
            (f"${MOONCAKE_CONFIG_ENV}", from_file),
            (f"${env}", {key: os.environ.get(env)}),
        ):
            if table.get(key) not in (None, ""):
                values[key] = (f"{source}[{key!r}]", table[key])
                break
    if "master_server_addr" not in values:
        raise ValueError(
            "mooncake: no master address; kvcache_storage_backend='mooncake' needs "
            f"master_server_addr in kvcache_storage_config, ${MOONCAKE_CONFIG_ENV} or "
            f"${MOONCAKE_ENV['master_server_addr']}"
        )

    def text(key: str, default: str) -> str:
        return str(values[key][1]) if key in values else default

    segment = 0
    if "global_segment_size" in values:
        segment = _bytes_of(*values["global_segment_size"])
    try:
        return MooncakeConnection(
            master_address=text("master_server_addr", ""),
            local_hostname=text("local_hostname", "") or _host_address(),
            protocol=text("protocol", "tcp"),
            device_name=text("rdma_devices", ""),
            metadata_server=text("metadata_server", "P2PHANDSHAKE"),
            segment_bytes=segment,
        )
    except ValueError as e:
        raise ValueError(f"mooncake: {e}") from None


def _mooncake_extra(extra: Any) -> dict[str, Any]:
    if extra is None or extra == "":
        return {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"fd_config.cache_config.kvcache_storage_config: not JSON ({e})"
            ) from None
    if not isinstance(extra, dict):
        raise ValueError(
            "fd_config.cache_config.kvcache_storage_config: expected a dict, got "
            f"{type(extra).__name__}"
        )
    return extra


def _mooncake_file() -> dict[str, Any]:
    path = os.environ.get(MOONCAKE_CONFIG_ENV)
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"${MOONCAKE_CONFIG_ENV}: {path!r} unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"${MOONCAKE_CONFIG_ENV}: {path!r} holds no JSON object")
    return data


_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def _bytes_of(source: str, value: Any) -> int:
    """A byte count: an int, or text such as "1073741824", "64MB", "1 GB"."""
    if isinstance(value, str):
        raw = value.strip().upper().replace(" ", "")
        digits = raw.rstrip("KMGTB")
        unit = raw[len(digits) :]
        if digits.isdigit() and unit in _UNITS:
            return int(digits) * _UNITS[unit]
        raise ValueError(f"{source}: {value!r} is not a byte count (such as 1073741824 or 1GB)")
    return as_int(source, value, 0)


def _host_address() -> str:
    """This host's address as its hostname resolves (FastDeploy's default)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


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
    "MOONCAKE_CONFIG_ENV",
    "MOONCAKE_ENV",
    "STORAGE_BACKENDS",
    "STORAGE_BACKEND_FILE",
    "STORAGE_BACKEND_MOONCAKE",
    "STORAGE_CAPACITY_ENV",
    "STORAGE_DIR_ENV",
    "STORAGE_WRITE_POLICY_ENV",
    "as_seconds",
    "as_timeout",
    "cache_config_from_fastdeploy",
    "kv_cache_quant_type",
    "kv_dtype_of",
    "model_dtype",
    "mooncake_connection",
    "prefix_caching_enabled",
    "results_channel_name",
    "storage_backend",
    "storage_capacity_blocks",
    "storage_config_from_fastdeploy",
    "storage_directory",
    "storage_target",
    "tensor_parallel_size",
]
