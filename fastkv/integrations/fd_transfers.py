"""fastkv transfers in FastDeploy's `CacheSwapMetadata` shape, and back.

FastDeploy's `BatchRequest.add_request` merges the swap metadata of every request
in a step into ONE host-to-device and ONE device-to-host `CacheSwapMetadata`: it
concatenates `src_block_ids`, `dst_block_ids` and `hash_values` in order and drops
everything else. Its metadata has no transfer id, so nothing could tell the
scheduler which copy a result belongs to. fastkv keeps its transfer ids through
that merge by tagging every `hash_values` entry: `f"{transfer_id}:{block_hash}"`.
The worker regroups a merged metadata by those tags (`parse_merged`) and reports
one result per scheduler transfer id.

FastDeploy's own classes are used when `fastdeploy` is importable (its BatchRequest
builds its merged metadata with them); otherwise the FastDeploy-shaped stand-ins
below, which have the same fields.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastkv.metadata import CacheLevel, CacheSwapMetadata

FASTDEPLOY_METADATA_MODULE = "fastdeploy.cache_manager.v1.metadata"


class FDCacheLevel(enum.Enum):
    """FastDeploy's `CacheLevel` values (used when fastdeploy is not importable)."""

    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


@dataclass
class FDCacheSwapMetadata:
    """FastDeploy's `CacheSwapMetadata` fields (used when fastdeploy is not
    importable)."""

    src_block_ids: list[int] = field(default_factory=list)
    dst_block_ids: list[int] = field(default_factory=list)
    src_type: Any = None
    dst_type: Any = None
    hash_values: list[str] = field(default_factory=list)
    success: bool = False
    error_message: str | None = None
    async_handler: Any = None


def fastdeploy_metadata_types() -> tuple[type, Any]:
    """FastDeploy's (CacheSwapMetadata, CacheLevel) when importable, else the
    stand-ins of this module."""
    try:
        import importlib

        module = importlib.import_module(FASTDEPLOY_METADATA_MODULE)
        return module.CacheSwapMetadata, module.CacheLevel
    except (ImportError, AttributeError):
        return FDCacheSwapMetadata, FDCacheLevel


def tag(transfer_id: int, block_hash: Hashable) -> str:
    """One `hash_values` entry: the transfer id, a colon, the block hash (hex for
    bytes)."""
    text = block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)
    return f"{transfer_id}:{text}"


def transfer_id_of(entry: object) -> int:
    """The transfer id a `hash_values` entry was tagged with.

    Raises:
        ValueError: the entry carries no fastkv tag (metadata fastkv did not make).
    """
    if isinstance(entry, str):
        head, sep, _ = entry.partition(":")
        if sep and head.isdigit():
            return int(head)
    raise ValueError(
        f"hash_values: entry {entry!r:.60} has no fastkv transfer tag "
        "('<transfer_id>:<hash>'); was this metadata made by fastkv's cache manager?"
    )


def transfer_ids(meta: Any) -> list[int]:
    """The distinct transfer ids of a (possibly merged) FastDeploy metadata, in
    order of first appearance.

    Raises:
        ValueError: an untagged entry.
    """
    seen: dict[int, None] = {}
    for entry in getattr(meta, "hash_values", None) or ():
        seen[transfer_id_of(entry)] = None
    return list(seen)


def to_fastdeploy(meta: CacheSwapMetadata, swap_cls: type, levels: Any) -> Any:
    """A fastkv transfer as FastDeploy metadata, every hash tagged with its id."""
    src = levels.DEVICE if meta.src_level == CacheLevel.DEVICE else levels.HOST
    dst = levels.HOST if meta.dst_level == CacheLevel.HOST else levels.DEVICE
    hashes = meta.block_hashes or [""] * meta.num_blocks
    return swap_cls(
        src_block_ids=list(meta.src_block_ids),
        dst_block_ids=list(meta.dst_block_ids),
        src_type=src,
        dst_type=dst,
        hash_values=[tag(meta.transfer_id, h) for h in hashes],
    )


def level_name(level: object) -> str:
    """'device', 'host' or 'storage' for FastDeploy's enum, fastkv's, or a string
    (FastDeploy's first v1 draft used strings)."""
    if isinstance(level, CacheLevel):
        return level.name.lower()
    value = getattr(level, "value", level)
    if isinstance(value, str):
        return value.lower()
    name = getattr(level, "name", None)
    if isinstance(name, str):
        return name.lower()
    raise ValueError(f"cache level: {level!r} is not a device/host/storage level")


@dataclass(frozen=True, slots=True)
class MergedTransfer:
    """A step's merged metadata for one direction, regrouped.

    Attributes:
        src_block_ids, dst_block_ids: the merged id lists, as given.
        transfer_ids: the scheduler transfers in it, in order.
    """

    src_block_ids: list[int]
    dst_block_ids: list[int]
    transfer_ids: tuple[int, ...]


def parse_merged(meta: Any, src: str, dst: str) -> MergedTransfer | None:
    """Validate a step's (merged) FastDeploy metadata for one direction.

    Args:
        meta: FastDeploy `CacheSwapMetadata` (or None).
        src, dst: the expected levels, 'device' / 'host'.

    Returns:
        The regrouped transfer, or None when `meta` is None or moves no block.

    Raises:
        ValueError: wrong levels, id lists of different lengths, ids that are not
            ints, or hash entries that are not one per block or carry no tag.
    """
    if meta is None:
        return None
    got = (level_name(meta.src_type), level_name(meta.dst_type))
    if got != (src, dst):
        raise ValueError(f"src_type/dst_type: expected {src}->{dst}, got {got[0]}->{got[1]}")
    src_ids = _ids("src_block_ids", meta.src_block_ids)
    dst_ids = _ids("dst_block_ids", meta.dst_block_ids)
    hashes = list(meta.hash_values or ())
    if not (len(src_ids) == len(dst_ids) == len(hashes)):
        raise ValueError(
            f"block lists: {len(src_ids)} src ids, {len(dst_ids)} dst ids and "
            f"{len(hashes)} hash_values; fastkv metadata has one of each per block"
        )
    if not src_ids:
        return None
    return MergedTransfer(src_ids, dst_ids, tuple(transfer_ids(meta)))


def _ids(name: str, ids: Sequence[int]) -> list[int]:
    out = list(ids or ())
    for i, value in enumerate(out):
        if isinstance(value, bool) or not isinstance(value, int):
            try:
                out[i] = int(value.__index__())  # numpy integers
            except (AttributeError, TypeError):
                raise ValueError(f"{name}[{i}]: {value!r} is not an int") from None
    return out


__all__ = [
    "FDCacheLevel",
    "FDCacheSwapMetadata",
    "MergedTransfer",
    "fastdeploy_metadata_types",
    "level_name",
    "parse_merged",
    "tag",
    "to_fastdeploy",
    "transfer_id_of",
    "transfer_ids",
]
