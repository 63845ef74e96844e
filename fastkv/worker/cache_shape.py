"""What a worker's KV cache is, however it was made: its shapes and dtype
(`KVCacheSpec`, `CacheShape`), the memory it takes (`MemoryPlan`), and the checks an
engine's own cache tensors pass before a controller adopts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastkv.config import CacheConfig, ModelKVShape, check_identity, check_int
from fastkv.ops import core, paddle_ops

paddle = paddle_ops.paddle

KV_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "fp8": "uint8"}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shapes of one worker's KV cache (`from_config` derives it from the cache's
    identity, `CacheConfig` and `ModelKVShape`).

    Per layer (model layers, then extra speculative-decoding layers) the cache holds
    K and V tensors `[num_device_blocks, num_kv_heads, block_size, head_dim]`; with
    `dtype="fp8"` they are uint8 and each has a float32 scale tensor
    `[num_device_blocks, num_kv_heads]` that moves with its block.

    Raises:
        ValueError: a field is out of range (the message names it).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    dtype: str = "bfloat16"
    num_extra_layers: int = 0

    def __post_init__(self) -> None:
        for name, low in (
            ("num_layers", 1),
            ("num_kv_heads", 1),
            ("head_dim", 1),
            ("block_size", 1),
            ("num_device_blocks", 1),
            ("num_host_blocks", 0),
            ("num_extra_layers", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(KV_DTYPES)}")

    @classmethod
    def from_config(cls, config: CacheConfig, model_kv: ModelKVShape) -> KVCacheSpec:
        """The spec of the cache `config` (block size, block counts, KV dtype) and
        `model_kv` (layers, KV heads of this rank, head size, extra layers) name.

        Raises:
            ValueError: `config` is not a CacheConfig, `model_kv` not a ModelKVShape,
                or `config.kv_dtype` is not a dtype the worker stores.
        """
        check_identity(config, model_kv)
        if config.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype: {config.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}"
            )
        return cls(
            num_layers=model_kv.num_layers,
            num_kv_heads=model_kv.num_kv_heads,
            head_dim=model_kv.head_dim,
            block_size=config.block_size,
            num_device_blocks=config.num_device_blocks,
            num_host_blocks=config.num_host_blocks,
            dtype=config.kv_dtype,
            num_extra_layers=model_kv.num_extra_layers,
        )

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_extra_layers

    @property
    def tensors_per_layer(self) -> int:
        return 4 if self.dtype == "fp8" else 2

    def shape(self) -> CacheShape:
        return CacheShape(
            self.total_layers,
            self.tensors_per_layer,
            self.num_device_blocks,
            self.num_host_blocks,
            self.block_size,
            self.dtype,
        )

    def make_tensors(self, place: str) -> list[paddle.Tensor]:
        """Zeroed cache tensors on `place` ("cpu", "gpu:N"), layer-major: K, V (and
        for fp8 the K and V scales) of each layer."""
        kv_shape = [self.num_device_blocks, self.num_kv_heads, self.block_size, self.head_dim]
        scale_shape = [self.num_device_blocks, self.num_kv_heads]
        dtype = KV_DTYPES[self.dtype]
        caches = []
        for _ in range(self.total_layers):
            caches.append(paddle.zeros(kv_shape, dtype=dtype, device=place))
            caches.append(paddle.zeros(kv_shape, dtype=dtype, device=place))
            if self.dtype == "fp8":
                caches.append(paddle.zeros(scale_shape, dtype="float32", device=place))
                caches.append(paddle.zeros(scale_shape, dtype="float32", device=place))
        return caches

    def block_bytes(self) -> list[int]:
        """Bytes of one block of each cache tensor, in `caches` order."""
        kv = self.num_kv_heads * self.block_size * self.head_dim * _DTYPE_BYTES[self.dtype]
        per_layer = [kv, kv] + ([4 * self.num_kv_heads] * 2 if self.dtype == "fp8" else [])
        return per_layer * self.total_layers


@dataclass(frozen=True, slots=True)
class CacheShape:
    """What the controller needs to know of its cache, however it was made.

    Attributes:
        num_layers: layers with cache tensors (model layers, then extra layers).
        tensors_per_layer: cache tensors per layer (K, V; plus scales for fp8; one
            latent tensor for MLA).
        num_device_blocks: block ids the scheduler hands out (every tensor has at
            least this many blocks).
        num_host_blocks: blocks of the host tier.
        block_size: tokens per block.
        dtype: the KV dtype name (CacheConfig.kv_dtype's vocabulary).
    """

    num_layers: int
    tensors_per_layer: int
    num_device_blocks: int
    num_host_blocks: int
    block_size: int
    dtype: str

    def check_against(self, config: CacheConfig) -> None:
        """The one shape contract between the halves: the scheduler's CacheConfig
        and the worker's cache agree on block size, block counts and dtype.

        Raises:
            ValueError: they disagree; the message names the field and both values.
        """
        for name, mine, theirs in (
            ("block_size", self.block_size, config.block_size),
            ("num_device_blocks", self.num_device_blocks, config.num_device_blocks),
            ("num_host_blocks", self.num_host_blocks, config.num_host_blocks),
            ("kv_dtype", self.dtype, config.kv_dtype),
        ):
            if mine != theirs:
                raise ValueError(
                    f"{name}: the worker's cache has {mine!r}, the scheduler's CacheConfig "
                    f"{theirs!r}; build both from one configuration"
                )


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The memory a controller takes, stated (and checked) before it takes it.

    Attributes:
        device_bytes: KV tensors (already allocated by the engine when adopted).
        host_bytes: the host tier, one allocation.
        allocates_device: whether the controller allocates the device tensors.
    """

    device_bytes: int
    host_bytes: int
    allocates_device: bool

    @classmethod
    def of(
        cls,
        block_bytes: Sequence[int],
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        allocates_device: bool,
    ) -> MemoryPlan:
        """The plan of a cache whose tensors have blocks of `block_bytes` each."""
        return cls(
            sum(block_bytes) * num_device_blocks,
            host_block_bytes(block_bytes) * num_host_blocks,
            allocates_device,
        )

    def describe(self) -> str:
        """One line for the log, e.g. "device KV 4.50 MiB (allocated by fastkv now),
        host tier 48.02 MiB": sizes in the largest binary unit under which they are
        at least 1; the KV tensors are allocated by the controller now, or the
        engine's own tensors, adopted as they are (nothing new on the device)."""
        made = (
            "allocated by fastkv now"
            if self.allocates_device
            else "the engine's own, adopted: nothing new allocated"
        )
        host = f"host tier {_size(self.host_bytes)}" if self.host_bytes else "no host tier"
        return f"device KV {_size(self.device_bytes)} ({made}), {host}"


def _size(nbytes: int) -> str:
    """`nbytes` in B, KiB, MiB or GiB: the largest unit it is at least 1 of."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def host_block_bytes(block_bytes: Sequence[int]) -> int:
    """Bytes of one host block: every cache tensor's block, back to back in tensor
    order (no padding), so a host block is one contiguous region."""
    return sum(block_bytes)


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def check_memory(plan: MemoryPlan, gpu_index: int | None) -> None:
    """Refuses a plan that cannot fit before anything is allocated.

    Raises:
        ValueError: more host memory than is available, or more device memory than
            Paddle has free on the GPU; the message names the block count to lower.
    """
    needed = plan.host_bytes + (
        plan.device_bytes if plan.allocates_device and gpu_index is None else 0
    )
    available = _available_host_bytes()
    if available is not None and needed > available:
        raise ValueError(
            f"num_host_blocks: the cache needs {needed / 2**30:.2f} GiB of host memory "
            f"({plan.describe()}), {available / 2**30:.2f} GiB is available; lower "
            "num_host_blocks (or num_device_blocks on the CPU)"
        )
    if gpu_index is not None and plan.allocates_device:
        cuda = paddle.device.cuda
        total = cuda.get_device_properties(gpu_index).total_memory
        free = total - cuda.memory_reserved(gpu_index)
        if plan.device_bytes > free:
            raise ValueError(
                f"num_device_blocks: the KV tensors need {plan.device_bytes / 2**30:.2f} GiB "
                f"on gpu:{gpu_index}, {free / 2**30:.2f} GiB is free for Paddle there"
            )


def adopted_shape(
    caches: list[paddle.Tensor],
    config: CacheConfig,
    tensors_per_layer: int,
    num_extra_layers: int,
    block_axis: int,
) -> tuple[CacheShape, list[int], str]:
    """Validates an engine's cache tensors against the scheduler's config.

    Returns:
        (the cache's shape, bytes of one block of each tensor, the place name of
        them all: "cpu" or "gpu:N").

    Raises:
        ValueError: the first problem found, naming the tensor and the bound (see
            `CacheController.adopt`); nothing is changed.
    """
    num_layers = _adopted_layers(
        caches, config, tensors_per_layer, num_extra_layers, block_axis
    )
    first_extra = (num_layers - num_extra_layers) * tensors_per_layer
    places = set()
    block_bytes = []
    for i, t in enumerate(caches):
        places.add(_checked_place(i, t))
        _check_blocks(i, list(t.shape), config, i < first_extra, block_axis)
        if _holds_kv(i % tensors_per_layer, tensors_per_layer):
            _check_kv_dtype(i, t, config)
        block_bytes.append(_checked_block_bytes(i, t))
    if len(places) != 1:
        raise ValueError(f"caches: tensors on several places {sorted(places)}; need one")
    shape = CacheShape(
        num_layers,
        tensors_per_layer,
        config.num_device_blocks,
        config.num_host_blocks,
        config.block_size,
        config.kv_dtype,
    )
    return shape, block_bytes, places.pop()


def _adopted_layers(
    caches: list[paddle.Tensor],
    config: CacheConfig,
    tensors_per_layer: int,
    num_extra_layers: int,
    block_axis: int,
) -> int:
    """The number of layers `caches` holds, once the counts and the config's dtype
    are checked."""
    for name, value, low in (
        ("tensors_per_layer", tensors_per_layer, 1),
        ("num_extra_layers", num_extra_layers, 0),
        ("block_axis", block_axis, 1),
    ):
        check_int(name, value, low)
    if not caches or len(caches) % tensors_per_layer:
        raise ValueError(
            f"caches: {len(caches)} tensors is not a positive multiple of "
            f"tensors_per_layer={tensors_per_layer}"
        )
    num_layers = len(caches) // tensors_per_layer
    if num_extra_layers >= num_layers:
        raise ValueError(
            f"num_extra_layers: {num_extra_layers} leaves no model layer of {num_layers}"
        )
    if config.kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: {config.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return num_layers


def _checked_place(i: int, tensor: object) -> str:
    """The place name of `caches[i]`, once it is a contiguous tensor of >= 2 dims."""
    if not isinstance(tensor, paddle.Tensor):
        raise ValueError(f"caches[{i}]: expected a paddle.Tensor, got {type(tensor).__name__}")
    shape = list(tensor.shape)
    if len(shape) < 2 or not tensor.is_contiguous():
        raise ValueError(
            f"caches[{i}]: must be a contiguous tensor of >= 2 dims, got shape {shape}"
            f"{'' if tensor.is_contiguous() else ' (not contiguous)'}"
        )
    return _place_name(tensor)


def _check_blocks(
    i: int, shape: list[int], config: CacheConfig, model_layer: bool, block_axis: int
) -> None:
    """A model layer's tensor has exactly the scheduler's block count, an extra
    layer's at least as many; the block axis (where there is one) holds
    `block_size` tokens."""
    blocks = shape[0]
    if blocks < config.num_device_blocks or (
        model_layer and blocks != config.num_device_blocks
    ):
        want = "exactly" if model_layer else "at least"
        raise ValueError(
            f"caches[{i}]: {blocks} blocks, the scheduler hands out "
            f"{config.num_device_blocks} (num_device_blocks): need {want} that many"
        )
    if len(shape) > block_axis and shape[block_axis] != config.block_size:
        raise ValueError(
            f"caches[{i}]: axis {block_axis} is {shape[block_axis]} tokens, the "
            f"scheduler's block_size is {config.block_size}"
        )


def _holds_kv(role: int, tensors_per_layer: int) -> bool:
    """Whether a layer's tensor number `role` is K or V (or MLA's latent), not a
    scale: K and V come first where a layer has 2 or 4 tensors."""
    return role == 0 or (role == 1 and tensors_per_layer in (2, 4))


def _check_kv_dtype(i: int, tensor: paddle.Tensor, config: CacheConfig) -> None:
    kv_dtype = KV_DTYPES[config.kv_dtype]
    dtype = str(tensor.dtype).removeprefix("paddle.")
    if dtype != kv_dtype:
        raise ValueError(
            f"caches[{i}]: dtype {dtype}, the scheduler's kv_dtype {config.kv_dtype!r} "
            f"stores {kv_dtype}"
        )


def _checked_block_bytes(i: int, tensor: paddle.Tensor) -> int:
    nbytes = tensor_block_bytes(tensor)
    if nbytes % core.MIN_ACCESS_BYTES:
        raise ValueError(
            f"caches[{i}]: a block is {nbytes} bytes, not a multiple of "
            f"{core.MIN_ACCESS_BYTES} (the copy kernels' narrowest access)"
        )
    return nbytes


def _place_name(tensor: paddle.Tensor) -> str:
    place = tensor.place
    if place.is_cpu_place():
        return "cpu"
    if place.is_gpu_place():
        return f"gpu:{place.gpu_device_id()}"
    raise ValueError(f"caches: tensor on {place}, which is neither the CPU nor a GPU")


def tensor_block_bytes(tensor: paddle.Tensor) -> int:
    """Bytes of one block (one `[b, ...]` slice) of a cache tensor."""
    return int(np.prod(tensor.shape[1:])) * tensor.element_size()


__all__ = ["KV_DTYPES", "CacheShape", "KVCacheSpec", "MemoryPlan"]
