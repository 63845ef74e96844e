"""FastDeploy-shaped stand-ins (FastDeploy's engine is not installable here).

Each keeps exactly the attributes and behaviour FastDeploy's ResourceManagerV1 and
cache manager use (notes: /work/notes/fastdeploy.md §3-§4), written from those
facts, not copied:

- `CacheLevel`, `CacheSwapMetadata`: cache_manager/v1/metadata.py's shapes (enum
  levels, no transfer id, `success` / `error_message` per item);
- `Request`: the cache-related fields, `prompt_hashes` as a property over a block
  hasher (sha256 of pickle((parent hex, block tokens, extra keys)), complete blocks
  of prompt + output only), `_match_result` / `match_result`, the two metadata
  lists with their pop methods;
- `BatchRequest`: add_request moves a task's metadata lists into ONE swap-in and
  ONE eviction metadata, concatenating src / dst / hash_values and dropping the
  rest;
- `ScheduledDecodeTask`, `ScheduledPreemptTask`; `FDConfig` and its sections;
  attention backends of both cache APIs: the snapshot's `get_kv_cache_shape`
  (GQA `[blocks, kv_heads, block_size, head_dim]`, MLA's single latent tensor) and
  upstream's `create_kv_cache(num_layers, num_blocks, cache_dtype, ...)`.

`install_fake_fastdeploy(monkeypatch)` registers `fastdeploy.cache_manager.v1.
metadata` (and optionally `fastdeploy.metrics.metrics`) in sys.modules, so the
adapter finds "FastDeploy's" classes exactly as it would in a real deployment.
"""

from __future__ import annotations

import enum
import hashlib
import pickle
import sys
import types
from dataclasses import dataclass, field
from typing import Any


class CacheLevel(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


@dataclass
class CacheSwapMetadata:
    src_block_ids: list[int] = field(default_factory=list)
    dst_block_ids: list[int] = field(default_factory=list)
    src_type: CacheLevel | None = None
    dst_type: CacheLevel | None = None
    hash_values: list[str] = field(default_factory=list)
    success: bool = False
    error_message: str | None = None
    async_handler: Any = None

    @property
    def mapping(self) -> dict[int, int]:
        if not self.success:
            return {}
        return dict(zip(self.src_block_ids, self.dst_block_ids, strict=True))


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    gpu_cache_token_num: int = 0
    cpu_cache_token_num: int = 0
    storage_cache_token_num: int = 0


def get_request_block_hasher(block_size: int):
    """FastDeploy's cache_utils hasher: chained hex digests of complete blocks of
    prompt + output tokens not hashed yet."""

    def hasher(request: Request) -> list[str]:
        tokens = request.prompt_token_ids + request.output_token_ids
        done = request._prompt_hashes
        parent = done[-1] if done else ""
        new = []
        for b in range(len(done), len(tokens) // block_size):
            block = tuple(tokens[b * block_size : (b + 1) * block_size])
            parent = hashlib.sha256(pickle.dumps((parent, block, None))).hexdigest()
            new.append(parent)
        return new

    return hasher


class Request:
    """The fields FastDeploy's scheduler and cache manager touch."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_tables: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.need_prefill_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.metrics = RequestMetrics()
        self.cache_swap_metadata: list[CacheSwapMetadata] = []
        self.cache_evict_metadata: list[CacheSwapMetadata] = []
        self.has_been_preempted_before = False
        self.num_cached_blocks = 0
        self.cache_info: list[int] | None = None
        self.idx: int | None = None
        self.prefill_start_index = 0
        self.prefill_end_index = 0
        self.max_tokens = max_tokens
        self.use_extend_tables = False
        self.extend_block_tables: list[int] = []
        self._prompt_hashes: list[str] = []
        self._block_hasher = None
        self._match_result: Any = None

    def set_block_hasher(self, hasher) -> None:
        self._block_hasher = hasher

    @property
    def prompt_hashes(self) -> list[str]:
        if self._block_hasher is not None:
            self._prompt_hashes.extend(self._block_hasher(self))
        return self._prompt_hashes

    @property
    def match_result(self) -> Any:
        return self._match_result

    @property
    def num_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def pop_cache_swap_metadata(self) -> list[CacheSwapMetadata]:
        out, self.cache_swap_metadata = self.cache_swap_metadata, []
        return out

    def pop_cache_evict_metadata(self) -> list[CacheSwapMetadata]:
        out, self.cache_evict_metadata = self.cache_evict_metadata, []
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_block_hasher"] = None
        return state


@dataclass
class _ScheduledTask:
    idx: int | None
    request_id: str
    cache_swap_metadata: list[CacheSwapMetadata] = field(default_factory=list)
    cache_evict_metadata: list[CacheSwapMetadata] = field(default_factory=list)

    def pop_cache_swap_metadata(self) -> list[CacheSwapMetadata]:
        out, self.cache_swap_metadata = self.cache_swap_metadata, []
        return out

    def pop_cache_evict_metadata(self) -> list[CacheSwapMetadata]:
        out, self.cache_evict_metadata = self.cache_evict_metadata, []
        return out


@dataclass
class ScheduledDecodeTask(_ScheduledTask):
    block_tables: list[int] = field(default_factory=list)


@dataclass
class ScheduledPreemptTask(_ScheduledTask):
    pass


class BatchRequest:
    """One step's tasks and their merged swap metadata."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.cache_swap_metadata: CacheSwapMetadata | None = None
        self.cache_evict_metadata: CacheSwapMetadata | None = None

    def add_request(self, request: Any) -> None:
        self.requests.append(request)
        self.append_swap_metadata(request.pop_cache_swap_metadata())
        self.append_evict_metadata(request.pop_cache_evict_metadata())

    def append_swap_metadata(self, metas: list[CacheSwapMetadata]) -> None:
        self.cache_swap_metadata = _merge(
            self.cache_swap_metadata, metas, CacheLevel.HOST, CacheLevel.DEVICE
        )

    def append_evict_metadata(self, metas: list[CacheSwapMetadata]) -> None:
        self.cache_evict_metadata = _merge(
            self.cache_evict_metadata, metas, CacheLevel.DEVICE, CacheLevel.HOST
        )

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)


def _merge(
    merged: CacheSwapMetadata | None,
    metas: list[CacheSwapMetadata],
    src: CacheLevel,
    dst: CacheLevel,
) -> CacheSwapMetadata | None:
    for meta in metas:  # ids and hashes survive, in order; nothing else does
        if merged is None:
            merged = CacheSwapMetadata(src_type=src, dst_type=dst)
        merged.src_block_ids.extend(meta.src_block_ids)
        merged.dst_block_ids.extend(meta.dst_block_ids)
        merged.hash_values.extend(meta.hash_values)
    return merged


# -- configuration and the attention backend -------------------------------------


@dataclass
class FDCacheConfig:
    block_size: int
    total_block_num: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    write_policy: str = "write_back"
    write_through_threshold: int = 2
    kv_cache_quant_type: str | None = None


@dataclass
class ModelConfig:
    num_hidden_layers: int = 2
    dtype: str = "bfloat16"
    model: str = "standin-model"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    engine_worker_queue_port: Any = None
    local_data_parallel_id: int = 0


@dataclass
class QuantConfig:
    kv_cache_quant_type: str | None = None


@dataclass
class FDConfig:
    cache_config: FDCacheConfig
    model_config: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    quant_config: QuantConfig = field(default_factory=QuantConfig)


class AttentionBackend:
    """FastDeploy's append-attention backend as of the snapshot: it only says the
    shapes (`[blocks, kv_heads, block_size, head_dim]`, this rank's head shard; half
    the head dim for int4_zp); the runner (here: the controller) makes the tensors."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.calls: list[tuple[int, Any]] = []

    def get_kv_cache_shape(self, max_num_blocks: int, kv_cache_quant_type: str | None = None):
        self.calls.append((max_num_blocks, kv_cache_quant_type))
        shape = [max_num_blocks, self.num_kv_heads, self.block_size, self.head_dim]
        if kv_cache_quant_type == "int4_zp":
            shape[-1] = self.head_dim // 2
        return shape, shape


class MLABackend(AttentionBackend):
    """An MLA backend: one latent tensor per layer (an empty value shape)."""

    def get_kv_cache_shape(self, max_num_blocks: int, kv_cache_quant_type: str | None = None):
        self.calls.append((max_num_blocks, kv_cache_quant_type))
        return [max_num_blocks, 1, self.block_size, self.head_dim], []


class UpstreamAttentionBackend(AttentionBackend):
    """The upstream API since the snapshot: the backend allocates every layer's
    tensors in one call, keyed by (role, layer)."""

    def create_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        cache_dtype: str,
        kv_cache_quant_type: str | None = None,
        layer_offset: int = 0,
    ) -> dict[tuple[str, int], Any]:
        import paddle

        self.calls.append((num_blocks, cache_dtype, kv_cache_quant_type, layer_offset))
        shape = [num_blocks, self.num_kv_heads, self.block_size, self.head_dim]
        out = {}
        for layer in range(layer_offset, layer_offset + num_layers):
            out[("key", layer)] = paddle.zeros(shape, dtype=cache_dtype)
            out[("value", layer)] = paddle.zeros(shape, dtype=cache_dtype)
            if kv_cache_quant_type == "block_wise_fp8":
                for role in ("key_scale", "value_scale"):
                    out[(role, layer)] = paddle.zeros(shape[:3], dtype="float32")
        return out


# -- making them importable as fastdeploy ------------------------------------------


def install_fake_fastdeploy(monkeypatch, metrics: Any | None = None) -> types.ModuleType:
    """Register `fastdeploy.cache_manager.v1.metadata` (these classes) and, given a
    metrics object, `fastdeploy.metrics.metrics.main_process_metrics`."""
    modules: dict[str, types.ModuleType] = {}

    def package(name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = []  # a package, with nothing more to find on disk
        modules[name] = module
        return module

    package("fastdeploy")
    package("fastdeploy.cache_manager")
    package("fastdeploy.cache_manager.v1")
    metadata = types.ModuleType("fastdeploy.cache_manager.v1.metadata")
    metadata.CacheSwapMetadata = CacheSwapMetadata
    metadata.CacheLevel = CacheLevel
    modules[metadata.__name__] = metadata
    if metrics is not None:
        package("fastdeploy.metrics")
        module = types.ModuleType("fastdeploy.metrics.metrics")
        module.main_process_metrics = metrics
        modules[module.__name__] = module
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return metadata
