"""fastkv transfers in FastDeploy's `CacheSwapMetadata` shape, and back.

FastDeploy's `BatchRequest.add_request` merges the swap metadata of every request
in a step into ONE host-to-device and ONE device-to-host `CacheSwapMetadata`: it
concatenates `src_block_ids`, `dst_block_ids` and `hash_values` in order and drops
everything else. Its metadata has no transfer id, so nothing could tell the
scheduler which copy a result belongs to. fastkv keeps its transfer ids through
that merge by tagging every `hash_values` entry: `f"{transfer_id}:{block_hash}"`,
or `f"{transfer_id}.{epoch}:{block_hash}"` once the scheduler's cache epoch
(`fastkv.metadata.Epoch`) is not 0 (transfer ids restart with each epoch). The
worker regroups a merged metadata by those tags (`parse_merged`) and reports one
result per scheduler transfer id, stamped with the epoch its tags carry, so a late
report of an earlier epoch never completes a new transfer with the same id.
Storage loads, writes and lookups ride in the device-to-host metadata with
entries of their own (`storage_to_fastdeploy`, taken out again on the worker by
`split_storage`).

FastDeploy's own classes are used when `fastdeploy` is importable (its BatchRequest
builds its merged metadata with them); otherwise the FastDeploy-shaped stand-ins
below, which have the same fields.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastkv.metadata import MAX_EPOCH, CacheLevel, CacheSwapMetadata, Epoch, StorageLookup

FASTDEPLOY_METADATA_MODULE = "fastdeploy.cache_manager.v1.metadata"

EPOCH_0 = Epoch(0)
"""The first cache epoch: the one an untagged-epoch entry (`<id>:<hash>`) is of."""


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


def tag(transfer_id: int, block_hash: Hashable, epoch: int = 0) -> str:
    """One `hash_values` entry: the transfer id, `.epoch` unless the epoch is 0, a
    colon, the block hash (hex for bytes)."""
    text = block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)
    if epoch:
        return f"{transfer_id}.{epoch}:{text}"
    return f"{transfer_id}:{text}"


TaggedId = tuple[int, Epoch]
"""A scheduler id and the cache epoch it belongs to, as a tag carries them."""


MAX_TAGGED_ID = (1 << 63) - 1
"""The largest id a tag may carry (the results channel carries ids in 8 signed
bytes)."""


def _parse_head(head: str) -> TaggedId | None:
    """(id, epoch) of a tag's head, `<id>` or `<id>.<epoch>` (ASCII digits only,
    id at most MAX_TAGGED_ID, epoch at most MAX_EPOCH), None for anything else."""
    ident, dot, epoch = head.partition(".")
    tid = _decimal(ident, MAX_TAGGED_ID)
    if tid is None:
        return None
    if not dot:
        return tid, EPOCH_0
    found = _decimal(epoch, MAX_EPOCH)
    return None if found is None else (tid, Epoch(found))


def _decimal(text: str, most: int) -> int | None:
    """`text` as an int in [0, most] when it is ASCII digits only, else None (the
    length is checked first: Python refuses to convert very long digit strings)."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(most)):
        return None
    value = int(text)
    return value if value <= most else None


# Storage work rides in the step's device-to-host metadata (FastDeploy's BatchRequest
# carries no other list to the workers at this snapshot), tagged with a letter so no
# copy ever takes it for one of its blocks: "L<id>:<hash>" a block loaded from
# storage into host block dst (src -1), "W<id>:<hash>" a host block src written to
# storage (dst -1), "Q<id>:<hash>" a block of storage lookup <id> (src, dst -1).
STORAGE_LOAD, STORAGE_WRITE, STORAGE_LOOKUP = "L", "W", "Q"

# A drained task (`drain_pending_prefetches`) with this direction carries, in
# `extra_params[EVICT]`, the device-to-host metadata a batch would have carried had
# the engine sent one (it sends none when no request is scheduled).
IDLE_EVICT, EVICT = "evict", "fastkv_evict"
_STORAGE_KINDS = (STORAGE_LOAD, STORAGE_WRITE, STORAGE_LOOKUP)


def storage_tag_of(entry: object) -> tuple[str, int, str] | None:
    """(kind, id, block hash text) of a storage entry, None for any other entry."""
    found = _storage_tag(entry)
    return None if found is None else found[:3]


def _storage_tag(entry: object) -> tuple[str, int, str, Epoch] | None:
    """(kind, id, block hash text, epoch) of a storage entry, None for any other."""
    if isinstance(entry, str) and entry[:1] in _STORAGE_KINDS:
        head, sep, text = entry[1:].partition(":")
        parsed = _parse_head(head) if sep else None
        if parsed is not None:
            return entry[0], parsed[0], text, parsed[1]
    return None


def transfer_id_of(entry: object) -> int:
    """The transfer id a `hash_values` entry was tagged with.

    Raises:
        ValueError: the entry carries no fastkv tag (metadata fastkv did not make).
    """
    tid = _copy_id(entry)
    if tid is not None:
        return tid
    raise ValueError(
        f"hash_values: entry {entry!r:.60} has no fastkv transfer tag "
        "('<transfer_id>:<hash>'); was this metadata made by fastkv's cache manager?"
    )


def _copy_id(entry: object) -> int | None:
    """The transfer id of a copy's `hash_values` entry, None when it has no tag."""
    found = _copy_tag(entry)
    return None if found is None else found[0]


def _copy_tag(entry: object) -> TaggedId | None:
    """(transfer id, epoch) of a copy's `hash_values` entry, None without a tag."""
    if isinstance(entry, str):
        head, sep, _ = entry.partition(":")
        if sep:
            return _parse_head(head)
    return None


def epoch_of(meta: Any) -> Epoch:
    """The one cache epoch every fastkv tag of a (possibly merged) metadata
    carries; 0 when it carries none.

    Raises:
        ValueError: tags of two epochs (one step's metadata comes from one
            scheduler epoch; a mix is not fastkv's).
    """
    found: Epoch | None = None
    for i, entry in enumerate(getattr(meta, "hash_values", None) or ()):
        tagged = _storage_tag(entry)
        epoch = tagged[3] if tagged is not None else _copy_epoch(entry)
        if epoch is None:
            continue
        if found is not None and epoch != found:
            raise ValueError(
                f"hash_values[{i}]: entry {entry!r:.60} is of cache epoch {epoch}, "
                f"the entries before it of epoch {found}; one step has one epoch"
            )
        found = epoch
    return EPOCH_0 if found is None else found


def _copy_epoch(entry: object) -> Epoch | None:
    found = _copy_tag(entry)
    return None if found is None else found[1]


def transfer_ids(meta: Any) -> list[int]:
    """The distinct transfer ids of a (possibly merged) FastDeploy metadata, in
    order of first appearance.

    Raises:
        ValueError: an untagged entry.
    """
    seen: dict[int, None] = {}
    for entry in getattr(meta, "hash_values", None) or ():
        if storage_tag_of(entry) is None:
            seen[transfer_id_of(entry)] = None
    return list(seen)


def storage_ids(meta: Any) -> tuple[list[int], list[int]]:
    """The storage transfer ids and lookup ids a (possibly merged) metadata carries,
    in order of first appearance."""
    transfers: dict[int, None] = {}
    lookups: dict[int, None] = {}
    for entry in getattr(meta, "hash_values", None) or ():
        found = storage_tag_of(entry)
        if found is not None:
            (lookups if found[0] == STORAGE_LOOKUP else transfers)[found[1]] = None
    return list(transfers), list(lookups)


def tagged_ids(meta: Any) -> tuple[list[TaggedId], list[TaggedId], list[TaggedId]]:
    """Every fastkv id a (possibly merged, possibly malformed) metadata carries,
    each with the epoch its tag names, in order of first appearance: (copy
    transfer ids, storage transfer ids, storage lookup ids). Entries without a tag
    are skipped, so a batch refused for one foreign entry can still fail
    everything fastkv put in it (each in its own epoch). Never raises."""
    try:
        entries = list(getattr(meta, "hash_values", None) or ())
    except Exception:  # not even a list: nothing of ours can be found in it
        return [], [], []
    copies: dict[TaggedId, None] = {}
    stored: dict[TaggedId, None] = {}
    looked: dict[TaggedId, None] = {}
    for entry in entries:
        found = _storage_tag(entry)
        if found is not None:
            (looked if found[0] == STORAGE_LOOKUP else stored)[(found[1], found[3])] = None
            continue
        tagged = _copy_tag(entry)
        if tagged is not None:
            copies[tagged] = None
    return list(copies), list(stored), list(looked)


def storage_to_fastdeploy(
    load: CacheSwapMetadata | None,
    store: CacheSwapMetadata | None,
    lookups: Sequence[StorageLookup],
    swap_cls: type,
    levels: Any,
    evict: Any | None = None,
) -> Any | None:
    """The step's storage work appended to its device-to-host metadata `evict`
    (FastDeploy-shaped; a new one when None). Returns it, or None when there is
    nothing to carry."""
    src: list[int] = []
    dst: list[int] = []
    hashes: list[str] = []
    if load is not None:
        for host, key in zip(load.dst_block_ids, load.block_hashes, strict=True):
            src.append(-1)
            dst.append(host)
            hashes.append(STORAGE_LOAD + tag(load.transfer_id, key, load.epoch))
    if store is not None:
        for host, key in zip(store.src_block_ids, store.block_hashes, strict=True):
            src.append(host)
            dst.append(-1)
            hashes.append(STORAGE_WRITE + tag(store.transfer_id, key, store.epoch))
    for lookup in lookups:
        for key in lookup.block_hashes:
            src.append(-1)
            dst.append(-1)
            hashes.append(STORAGE_LOOKUP + tag(lookup.lookup_id, key, lookup.epoch))
    if not hashes:
        return evict
    if evict is None:
        return swap_cls(
            src_block_ids=src,
            dst_block_ids=dst,
            src_type=levels.DEVICE,
            dst_type=levels.HOST,
            hash_values=hashes,
        )
    evict.src_block_ids.extend(src)
    evict.dst_block_ids.extend(dst)
    evict.hash_values.extend(hashes)
    return evict


@dataclass(frozen=True, slots=True)
class StorageWork:
    """The storage work of one step, regrouped by id (worker side).

    Attributes:
        loads, writes: per scheduler transfer id, its (host block, hash text) pairs
            in order.
        lookups: per scheduler lookup id, its hash texts in order.
        epoch: the cache epoch their tags carry (echoed in their results).
    """

    loads: dict[int, list[tuple[int, str]]]
    writes: dict[int, list[tuple[int, str]]]
    lookups: dict[int, list[str]]
    epoch: Epoch = EPOCH_0

    def __bool__(self) -> bool:
        return bool(self.loads or self.writes or self.lookups)


def split_storage(meta: Any) -> tuple[Any, StorageWork]:
    """Take the storage entries out of a step's merged device-to-host metadata.

    Returns:
        (the metadata without them, or None when nothing else was in it; the
        storage work). `meta` itself is not changed.

    Raises:
        ValueError: id lists of different lengths, a storage entry whose host
            block is missing or is not an int, or tags of two epochs (nothing is
            returned then).
    """
    empty = StorageWork({}, {}, {})
    if meta is None:
        return None, empty
    hashes = list(meta.hash_values or ())
    if not any(storage_tag_of(h) is not None for h in hashes):
        return meta, empty
    epoch = epoch_of(meta)
    src = _ids("src_block_ids", meta.src_block_ids)
    dst = _ids("dst_block_ids", meta.dst_block_ids)
    if not (len(src) == len(dst) == len(hashes)):
        raise ValueError(
            f"block lists: {len(src)} src ids, {len(dst)} dst ids and {len(hashes)} "
            "hash_values; fastkv metadata has one of each per block"
        )
    work = StorageWork({}, {}, {}, epoch)
    rest: tuple[list[int], list[int], list[str]] = ([], [], [])
    for i, (s_id, d_id, entry) in enumerate(zip(src, dst, hashes, strict=True)):
        found = storage_tag_of(entry)
        if found is None:
            rest[0].append(s_id)
            rest[1].append(d_id)
            rest[2].append(entry)
            continue
        kind, ident, text = found
        if kind == STORAGE_LOOKUP:
            work.lookups.setdefault(ident, []).append(text)
            continue
        host = d_id if kind == STORAGE_LOAD else s_id
        if host < 0:
            raise ValueError(f"hash_values[{i}]: storage entry {entry!r:.60} has no host block")
        (work.loads if kind == STORAGE_LOAD else work.writes).setdefault(ident, []).append(
            (host, text)
        )
    if not rest[2]:
        return None, work
    return (
        FDCacheSwapMetadata(
            src_block_ids=rest[0],
            dst_block_ids=rest[1],
            src_type=meta.src_type,
            dst_type=meta.dst_type,
            hash_values=rest[2],
        ),
        work,
    )


# An eviction's block the scheduler has already handed to a new owner
# (`CacheSwapMetadata.reused_block_ids`) carries this suffix on its entry, so the
# worker orders the model's writes after that block's read only, not after every
# copy of the step (write-through backups never hold the model up).
HANDED_OVER = ":h"


def to_fastdeploy(meta: CacheSwapMetadata, swap_cls: type, levels: Any) -> Any:
    """A fastkv transfer as FastDeploy metadata, every hash tagged with its id (and
    handed-over blocks marked `HANDED_OVER`)."""
    src = levels.DEVICE if meta.src_level == CacheLevel.DEVICE else levels.HOST
    dst = levels.HOST if meta.dst_level == CacheLevel.HOST else levels.DEVICE
    hashes = meta.block_hashes or [""] * meta.num_blocks
    entries = [tag(meta.transfer_id, h, meta.epoch) for h in hashes]
    if meta.reused_block_ids:
        reused = set(meta.reused_block_ids)
        for i, block in enumerate(meta.src_block_ids):
            if block in reused:
                entries[i] += HANDED_OVER
    return swap_cls(
        src_block_ids=list(meta.src_block_ids),
        dst_block_ids=list(meta.dst_block_ids),
        src_type=src,
        dst_type=dst,
        hash_values=entries,
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
        handed_over: the source blocks whose entries are marked `HANDED_OVER`
            (distinct, in order).
        epoch: the cache epoch their tags carry (echoed in their results).
    """

    src_block_ids: list[int]
    dst_block_ids: list[int]
    transfer_ids: tuple[int, ...]
    handed_over: tuple[int, ...] = ()
    epoch: Epoch = EPOCH_0


def parse_merged(meta: Any, src: str, dst: str) -> MergedTransfer | None:
    """Validate a step's (merged) FastDeploy metadata for one direction.

    Args:
        meta: FastDeploy `CacheSwapMetadata` (or None).
        src, dst: the expected levels, 'device' / 'host'.

    Returns:
        The regrouped transfer, or None when `meta` is None or moves no block.

    Raises:
        ValueError: wrong levels, id lists of different lengths, ids that are not
            ints, or hash entries that are not one per block, carry no tag, or
            carry tags of two epochs.
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
    handed = {
        src_ids[i]: None
        for i, h in enumerate(hashes)
        if isinstance(h, str) and h.endswith(HANDED_OVER)
    }
    ids = tuple(transfer_ids(meta))
    return MergedTransfer(src_ids, dst_ids, ids, tuple(handed), epoch_of(meta))


def step_epoch(*parts: MergedTransfer | StorageWork | None) -> Epoch:
    """The one epoch of a step's parts (those that are not None or empty).

    Raises:
        ValueError: two parts of different epochs.
    """
    epochs = {p.epoch for p in parts if p}
    if len(epochs) > 1:
        raise ValueError(
            f"hash_values: the step's metadata carries cache epochs {sorted(epochs)}; "
            "one step has one epoch"
        )
    return epochs.pop() if epochs else EPOCH_0


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
    "EPOCH_0",
    "HANDED_OVER",
    "MAX_TAGGED_ID",
    "STORAGE_LOAD",
    "STORAGE_LOOKUP",
    "STORAGE_WRITE",
    "FDCacheLevel",
    "FDCacheSwapMetadata",
    "MergedTransfer",
    "StorageWork",
    "TaggedId",
    "epoch_of",
    "fastdeploy_metadata_types",
    "level_name",
    "parse_merged",
    "split_storage",
    "step_epoch",
    "storage_ids",
    "storage_tag_of",
    "storage_to_fastdeploy",
    "tag",
    "tagged_ids",
    "to_fastdeploy",
    "transfer_id_of",
    "transfer_ids",
]
