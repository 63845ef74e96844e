"""The worker's storage work: lookups, loads (STORAGE -> HOST) and writes (HOST ->
STORAGE) of the scheduler's metadata, run on a `StorageIOEngine` over the host tier.

`StorageBridge` turns metadata into engine requests and engine completions back
into the scheduler's results. Every request carries a tag, `(kind, id)`: a lookup's
`lookup_id` or a transfer's `transfer_id`, which may repeat across kinds. The engine
is given ids of the bridge's own, so it never has to tell the kinds apart.

A transfer's result is held back while a storage read or write still touches one
of its host blocks (a request reported at its deadline may still be inside its
backend): the scheduler reuses a block as soon as its result arrives.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from fastkv.metadata import (
    CacheLevel,
    CacheSwapMetadata,
    Epoch,
    LookupResult,
    StorageLookup,
    TransferResult,
)
from fastkv.storage.base import BlockLayout, Segment, StorageBackend, StorageKey
from fastkv.storage.io_engine import (
    RequestKind,
    StorageCompletion,
    StorageIOEngine,
    Submission,
)
from fastkv.worker.stats import StorageCounters

DEFAULT_STORAGE_TIMEOUT_S = 30.0
"""A storage request's deadline when its metadata gives none (`timeout_s` 0)."""

_HELD_POLL_S = 0.005


class TagKind(Enum):
    """What a storage request's id numbers."""

    LOOKUP = "lookup"
    """A `StorageLookup.lookup_id`."""
    TRANSFER = "transfer"
    """A storage `CacheSwapMetadata.transfer_id` (a load or a write)."""


class Tag(NamedTuple):
    """One storage request as the scheduler names it (its epoch echoed in the
    result)."""

    kind: TagKind
    id: int
    epoch: Epoch = Epoch(0)


@dataclass(frozen=True, slots=True)
class HostTier:
    """Where the host tier's blocks are: host block b is one contiguous region of
    `stride` = sum(block_bytes) bytes at `base + b * stride`, every cache tensor's
    block in tensor order (the bytes a backend stores for it).

    Raises:
        ValueError: no tensors, or a block size that is not a positive int.
    """

    base: int
    block_bytes: tuple[int, ...]
    num_blocks: int
    stride: int = field(init=False)
    """Bytes of one host block (summed once: `segments` runs per block)."""

    def __post_init__(self) -> None:
        BlockLayout(self.block_bytes)  # validates the sizes
        object.__setattr__(self, "stride", sum(self.block_bytes))

    @property
    def layout(self) -> BlockLayout:
        """A host block's layout: one segment per cache tensor (the header's
        layout; a block is handed to a backend as one segment of all of them)."""
        return BlockLayout(self.block_bytes)

    def segments(self, block: int) -> list[Segment]:
        """Host block `block` as a backend takes it: one (address, length) segment."""
        return [(self.base + block * self.stride, self.stride)]


@dataclass(slots=True)
class _Request:
    tag: Tag
    host_blocks: list[int]  # a transfer's host blocks; none for a lookup


class StorageBridge:
    """The scheduler's storage metadata run on an I/O engine over the host tier.

    Args:
        engine: the I/O engine over this cache's backend (the bridge closes it).
        host: the host tier's blocks.
        namespace: `StorageNamespace.digest()` of this cache.
        tp_rank: this worker's rank, part of every key.
        clock: monotonic seconds (`time.monotonic`); the engine's deadlines are
            on the same clock.

    Raises:
        ValueError: `namespace` is not 32 bytes or `tp_rank` is out of range.
    """

    def __init__(
        self,
        engine: StorageIOEngine,
        host: HostTier,
        namespace: bytes,
        tp_rank: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        StorageKey(namespace, bytes(32), tp_rank)  # validates both
        self._engine = engine
        self._host = host
        self._namespace = namespace
        self._tp_rank = tp_rank
        self._clock = clock
        self._next_id = 0
        self._requests: dict[int, _Request] = {}  # engine request id -> what it is
        self._open: set[Tag] = set()  # submitted, result not yet reported
        self._held: list[StorageCompletion] = []  # done, but I/O still touches blocks
        self.counts = StorageCounters()

    @classmethod
    def open(
        cls,
        backend: StorageBackend,
        host: HostTier,
        namespace: bytes,
        tp_rank: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> StorageBridge:
        """A bridge over a new I/O engine on `backend`, once its layout is the host
        tier's.

        Raises:
            ValueError: the backend stores another block layout, or a bad
                namespace or rank; no engine is started.
        """
        if backend.layout != host.layout:
            raise ValueError(
                f"storage: the backend's block layout {backend.layout.segment_lengths} "
                f"is not this cache's {host.block_bytes}"
            )
        StorageKey(namespace, bytes(32), tp_rank)  # before a thread starts
        return cls(StorageIOEngine(backend), host, namespace, tp_rank, clock)

    def submit(
        self,
        load: CacheSwapMetadata | None,
        store: CacheSwapMetadata | None,
        lookups: Sequence[StorageLookup] = (),
    ) -> None:
        """Start lookups, then the load, then the write on the engine's threads
        (never waits); all of them or, when it raises, none.

        Raises:
            ValueError: wrong levels, host ids out of range, keys that are not
                32-byte block hashes, an id not an int or already outstanding, or
                host blocks two requests touch in a conflicting way.
            RuntimeError: the engine is closed.
        """
        transfers = [
            self._transfer(meta, src, dst)
            for meta, src, dst in (
                (load, CacheLevel.STORAGE, CacheLevel.HOST),
                (store, CacheLevel.HOST, CacheLevel.STORAGE),
            )
            if meta is not None
        ]
        requests = [
            (
                Tag(TagKind.LOOKUP, q.lookup_id, q.epoch),
                Submission(
                    RequestKind.LOOKUP, 0, self._keys(q.block_hashes), self._deadline(0.0)
                ),
            )
            for q in lookups
        ]
        requests += transfers
        self._check_tags([tag for tag, _ in requests])
        submissions = [
            dataclasses.replace(sub, request_id=self._next_id + i)
            for i, (_, sub) in enumerate(requests)
        ]
        # Known before the engine may complete them.
        for (tag, _), sub in zip(requests, submissions, strict=True):
            self._requests[sub.request_id] = _Request(tag, list(sub.host_ids))
            self._open.add(tag)
        try:
            self._engine.submit_all(submissions)  # all or nothing: a clash starts none
        except BaseException:
            for (tag, _), sub in zip(requests, submissions, strict=True):
                del self._requests[sub.request_id]
                self._open.discard(tag)
            raise
        self._next_id += len(submissions)
        for sub in submissions:
            if sub.kind is RequestKind.LOAD:
                self.counts.blocks_read += len(sub.host_ids)
            elif sub.kind is RequestKind.STORE:
                self.counts.blocks_written += len(sub.host_ids)

    def poll(self) -> list[TransferResult | LookupResult]:
        """Results finished since the last call (non-blocking)."""
        return self._results(self._engine.poll())

    def wait_all(self, timeout: float) -> list[TransferResult | LookupResult]:
        """Wait for every outstanding request (each bounded by its own deadline),
        then for the I/O still touching reported blocks, at most `timeout` seconds
        in all; return the results not yet reported."""
        end = self._clock() + timeout
        results = self._results(self._engine.wait_all(max(0.0, end - self._clock())))
        while self._held and self._clock() < end:  # I/O still touching host blocks
            time.sleep(_HELD_POLL_S)
            results += self._results([])
        return results

    def close(self, timeout: float) -> list[TransferResult | LookupResult]:
        """Stop the engine (queued I/O fails, running I/O gets `timeout` seconds)
        and return the results not yet reported; those whose blocks I/O still
        touches stay held (see `busy_host_blocks`)."""
        return self._results(self._engine.close(timeout))

    def busy_host_blocks(self) -> frozenset[int]:
        """Host blocks a storage read or write touches right now: not to be reused
        or freed yet."""
        return self._engine.busy_host_blocks()

    # -- internals ------------------------------------------------------------

    def _transfer(
        self, meta: CacheSwapMetadata, src: CacheLevel, dst: CacheLevel
    ) -> tuple[Tag, Submission]:
        """A storage transfer as a (tag, submission), checked; its engine id is set
        at submission."""
        if (meta.src_level, meta.dst_level) != (src, dst):
            raise ValueError(
                f"transfer {meta.transfer_id}: expected {src.name}->{dst.name}, got "
                f"{meta.src_level.name}->{meta.dst_level.name}"
            )
        host = list(meta.dst_block_ids if src == CacheLevel.STORAGE else meta.src_block_ids)
        limit = self._host.num_blocks
        bad = next((h for h in host if not 0 <= h < limit), None)
        if bad is not None:
            raise ValueError(
                f"transfer {meta.transfer_id}: host ids contain {bad}, outside [0, {limit})"
            )
        keys = self._keys(meta.block_hashes)
        kind = RequestKind.LOAD if dst == CacheLevel.HOST else RequestKind.STORE
        segments = [self._host.segments(h) for h in host]
        deadline = self._deadline(meta.timeout_s)
        return Tag(TagKind.TRANSFER, meta.transfer_id, meta.epoch), Submission(
            kind, 0, keys, deadline, segments, host
        )

    def _check_tags(self, tags: list[Tag]) -> None:
        """Each tag an int id, outstanding nowhere, named once in the batch."""
        seen: set[Tag] = set()
        for tag in tags:
            name = f"{tag.kind.value}_id"
            if isinstance(tag.id, bool) or not isinstance(tag.id, int):
                raise ValueError(f"{name}: must be an int, got {tag.id!r}")
            if tag in self._open or tag in seen:
                raise ValueError(f"{name}: {tag.id} is still outstanding on the storage tier")
            seen.add(tag)

    def _keys(self, hashes: Sequence[object]) -> list[StorageKey]:
        keys = []
        for i, h in enumerate(hashes):
            if not isinstance(h, bytes) or len(h) != 32:
                raise ValueError(f"block_hashes[{i}]: a storage key needs a 32-byte block hash")
            keys.append(StorageKey(self._namespace, h, self._tp_rank))
        return keys

    def _deadline(self, timeout_s: float) -> float:
        return self._clock() + (timeout_s or DEFAULT_STORAGE_TIMEOUT_S)

    def _results(
        self, completions: list[StorageCompletion]
    ) -> list[TransferResult | LookupResult]:
        """Completions as results; held back while I/O still touches their blocks."""
        pending = self._held + completions
        self._held = []
        busy = self._engine.busy_host_blocks() if pending else frozenset()
        out: list[TransferResult | LookupResult] = []
        for c in pending:
            request = self._requests[c.request_id]
            if busy and not busy.isdisjoint(request.host_blocks):
                self._held.append(c)
                continue
            del self._requests[c.request_id]
            self._open.discard(request.tag)
            if request.tag.kind is TagKind.LOOKUP:
                tag = request.tag
                out.append(LookupResult(tag.id, _leading_hits(c.hits), 1, tag.epoch))
            else:
                out.append(self._transfer_result(request.tag, c))
        return out

    def _transfer_result(self, tag: Tag, c: StorageCompletion) -> TransferResult:
        failed = tuple(i for i, r in enumerate(c.results) if not r.ok)
        error = ""
        if failed:
            first = c.results[failed[0]]
            error = (
                f"{len(failed)} of {len(c.results)} blocks: {first.status.name} {first.reason}"
            )
        self.counts.failed_transfers += bool(failed)
        return TransferResult(tag.id, not failed, error, failed, 1, tag.epoch)


def _leading_hits(hits: Sequence[bool]) -> int:
    return next((i for i, hit in enumerate(hits) if not hit), len(hits))


__all__ = ["DEFAULT_STORAGE_TIMEOUT_S", "HostTier", "StorageBridge", "Tag", "TagKind"]
