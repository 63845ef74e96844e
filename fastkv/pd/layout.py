"""One worker's KV memory as PD moves it: tensors, block strides, head slices, and
the digest P and D compare at the handshake; the tensor-parallel pairing of ranks;
the per-block checksum.

Every cache tensor is `[num_blocks, heads, ...]`, contiguous, layer-major
(K, V, and for block-wise fp8 their scales, of each layer, the extra speculative
layers last): a block of one tensor is `block_bytes` contiguous bytes and the
bytes of `heads / k` consecutive heads are a contiguous `block_bytes / k` of it.

Tensor parallelism: P has `p` ranks, D has `d`, `d % p == 0` (`d == p` included);
with `k = d / p`, D rank `r` holds the `r % k`-th of `k` head slices of P rank
`r // k`'s heads, and takes exactly those bytes from that rank. Other pairs are
refused (`check_tp`). A tensor with fewer heads than `k` (MLA's single latent) can
only pair with `k == 1`.

The layer checksum is storage's block checksum (`fastkv.storage._disk_io.
block_checksum`: crc32c-3way over segments) taken over one layer's segments of
every block of a transfer, the bytes D's rank holds for them: one per layer, so
D can verify a layer as soon as its writes settled. A layout knows whether its
memory is host memory (`device` None) or a GPU's (its CUDA ordinal): there the
same value is computed by a CUDA kernel of the fastkv core (`fastkv.ops.core.
crc3way_cuda`), so a P and a D on different kinds of memory agree.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TensorRegion:
    """One cache tensor of one rank: `num_blocks` blocks of `block_bytes` at `ptr`,
    each holding `num_heads` equal head slices."""

    ptr: int
    num_blocks: int
    block_bytes: int
    num_heads: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A rank's registered cache: `tensors` layer-major, `tensors_per_layer` each.

    Raises:
        ValueError: a count out of range, a block not split evenly into its heads,
            or a tensor count not a multiple of `tensors_per_layer`."""

    tensors: tuple[TensorRegion, ...]
    tensors_per_layer: int
    block_size: int
    num_blocks: int
    tp_rank: int = 0
    tp_size: int = 1
    device: int | None = None
    """None: every tensor is host memory; else the CUDA ordinal holding them all
    (not part of the digest: a P and a D on different memory pair)."""

    def __post_init__(self) -> None:
        if self.device is not None and (
            isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < 0
        ):
            raise ValueError(f"device: {self.device!r} must be None (host) or a CUDA ordinal")
        if not 1 <= self.tensors_per_layer <= 16 or len(self.tensors) % self.tensors_per_layer:
            raise ValueError(
                f"tensors_per_layer: {self.tensors_per_layer!r} must be in [1, 16] and "
                f"divide the {len(self.tensors)} tensors"
            )
        if not self.tensors or self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("tensors, block_size, num_blocks: must be non-empty / >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: {self.tp_rank} not in [0, tp_size={self.tp_size})")
        for i, t in enumerate(self.tensors):
            if t.num_heads < 1 or t.block_bytes % t.num_heads or t.num_blocks < self.num_blocks:
                raise ValueError(
                    f"tensors[{i}]: {t.block_bytes} bytes per block in {t.num_heads} heads, "
                    f"{t.num_blocks} blocks (need {self.num_blocks})"
                )

    @property
    def num_layers(self) -> int:
        return len(self.tensors) // self.tensors_per_layer

    def layer(self, layer: int) -> tuple[TensorRegion, ...]:
        n = self.tensors_per_layer
        return self.tensors[layer * n : (layer + 1) * n]

    def digest(self) -> bytes:
        """What both ends must share whatever their TP sizes: layers, tensors per
        layer, block size, and per tensor its dtype, global head count and bytes per
        head per block. P's and D's must be equal."""
        h = hashlib.sha256(b"fastkv-pd-layout-v1")
        h.update(struct.pack("<III", self.num_layers, self.tensors_per_layer, self.block_size))
        for t in self.tensors:
            h.update(t.dtype.encode() + b"\0")
            h.update(
                struct.pack("<QQ", t.num_heads * self.tp_size, t.block_bytes // t.num_heads)
            )
        return h.digest()

    @classmethod
    def of_controller(
        cls, controller: object, *, tp_rank: int = 0, tp_size: int = 1
    ) -> KVLayout:
        """The layout of a `fastkv.worker.CacheController`'s cache tensors (its
        public `caches`, `block_bytes` and `shape`), scales and extra layers included;
        `device` from the tensors' place (`device_of`). The controller must outlive
        every transfer that uses it.

        Raises:
            ValueError: the tensors are not all on one device (or all on the host)."""
        caches = controller.caches  # type: ignore[attr-defined]
        devices = {device_of(t) for t in caches}
        if len(devices) > 1:
            raise ValueError(
                f"controller.caches: on {sorted(map(str, devices))}: PD needs every cache "
                "tensor of a rank on one GPU or all on the host"
            )
        shape = controller.shape  # type: ignore[attr-defined]
        tensors = tuple(
            TensorRegion(
                int(t.data_ptr()),
                int(t.shape[0]),
                int(bb),
                int(t.shape[1]) if len(t.shape) > 1 else 1,
                str(t.dtype).removeprefix("paddle."),
            )
            for t, bb in zip(caches, controller.block_bytes, strict=True)  # type: ignore[attr-defined]
        )
        return cls(
            tensors,
            shape.tensors_per_layer,
            shape.block_size,
            shape.num_device_blocks,
            tp_rank,
            tp_size,
            devices.pop() if devices else None,
        )

    @classmethod
    def of_arrays(
        cls,
        arrays: Sequence[np.ndarray],
        *,
        tensors_per_layer: int,
        block_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> KVLayout:
        """The layout of contiguous numpy arrays `[blocks, heads, ...]` (tests, tools)."""
        tensors = []
        for i, a in enumerate(arrays):
            if not a.flags.c_contiguous or a.ndim < 2:
                raise ValueError(f"arrays[{i}]: must be C-contiguous with >= 2 dims")
            tensors.append(
                TensorRegion(
                    a.ctypes.data, a.shape[0], a.nbytes // a.shape[0], a.shape[1], str(a.dtype)
                )
            )
        return cls(
            tuple(tensors),
            tensors_per_layer,
            block_size,
            min(a.shape[0] for a in arrays),
            tp_rank,
            tp_size,
        )


def device_of(tensor: object) -> int | None:
    """The CUDA ordinal a tensor lives on, None for host memory: a Paddle tensor's
    `place`, a CuPy array's `device`, a PyTorch tensor's `device` (numpy: host)."""
    place = getattr(tensor, "place", None)
    if place is not None and hasattr(place, "is_gpu_place"):
        return int(place.gpu_device_id()) if place.is_gpu_place() else None
    if type(tensor).__module__.startswith("cupy"):
        return int(tensor.device.id)  # type: ignore[attr-defined]
    dev = getattr(tensor, "device", None)
    if getattr(dev, "type", None) == "cuda":
        return int(dev.index or 0)  # type: ignore[union-attr]
    return None


def check_tp(p_size: int, d_size: int) -> int:
    """How many D ranks each P rank serves (`d_size // p_size`).

    Raises:
        ValueError: not `d_size % p_size == 0` (D smaller than P, or not a multiple)."""
    if p_size < 1 or d_size < 1 or d_size % p_size:
        raise ValueError(
            f"tensor parallel sizes: P={p_size}, D={d_size}: D's must be a multiple of P's "
            "(equal, or each P rank's heads split evenly over D ranks)"
        )
    return d_size // p_size


def check_pair(p: KVLayout, d: KVLayout) -> int:
    """Check that D rank `d.tp_rank` can take its heads from P rank `p.tp_rank`;
    returns the index of its head slice in P's blocks.

    Raises:
        ValueError: layouts differ (digest), the TP pair is refused, D's rank is
            not served by this P rank, or a tensor's heads do not split."""
    if p.digest() != d.digest():
        raise ValueError("layout digest: P's and D's cache layouts differ; refused")
    k = check_tp(p.tp_size, d.tp_size)
    if d.tp_rank // k != p.tp_rank:
        raise ValueError(f"D rank {d.tp_rank} takes its heads from P rank {d.tp_rank // k}")
    for i, (pt, dt) in enumerate(zip(p.tensors, d.tensors, strict=True)):
        if pt.num_heads != dt.num_heads * k or pt.block_bytes != dt.block_bytes * k:
            raise ValueError(
                f"tensors[{i}]: P rank's {pt.num_heads} heads cannot be split into {k} "
                f"slices of D's {dt.num_heads}"
            )
    return d.tp_rank % k


def layer_checksum(
    tensors: Sequence[TensorRegion],
    block_ids: Sequence[int],
    *,
    slices: int = 1,
    index: int = 0,
    device: int | None = None,
) -> int:
    """The checksum of one layer's bytes of `block_ids`: storage's crc32c-3way over
    the segments block by block, in each block the layer's `tensors` in order, of
    each the `index`-th of `slices` equal head slices (the whole block by default):
    what D's rank `index` of a P rank's `slices` holds. One native call with the
    GIL released (another thread runs meanwhile). `device`: the tensors are on
    that GPU (`KVLayout.device`); the core's CUDA kernel computes the same value
    (bounded wait: `fastkv.ops.core.crc3way_cuda`).

    Raises:
        ValueError: no blocks, or `index` not in [0, slices).
        RuntimeError: `device` given and the core cannot run there (built without
            CUDA, no such device, a CUDA error or the wait ran out)."""
    if not block_ids or not 0 <= index < slices:
        raise ValueError(
            f"block_ids: {len(block_ids)} (need >= 1); index: {index} not in [0, {slices})"
        )
    size = np.array([t.block_bytes // slices for t in tensors], dtype=np.int64)
    bases = np.array([t.ptr for t in tensors], dtype=np.int64) + size * index
    strides = np.array([t.block_bytes for t in tensors], dtype=np.int64)
    ids = np.asarray(block_ids, dtype=np.int64)
    segs = np.empty((len(ids), len(tensors), 2), dtype=np.int64)
    segs[:, :, 0] = bases + ids[:, None] * strides
    segs[:, :, 1] = size
    if device is None:
        # Imported here: a GPU-only build (`make gpu-test`) has the core and not
        # storage's extension.
        from fastkv.storage import _disk_io

        return _disk_io.block_checksum(segs)
    from fastkv.ops import core

    return core.crc3way_cuda(device, segs.reshape(-1, 2))


__all__ = [
    "KVLayout",
    "TensorRegion",
    "check_pair",
    "check_tp",
    "device_of",
    "layer_checksum",
]
