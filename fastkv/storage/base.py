"""The storage tier's one backend interface, its keys and its per-key results.

A storage backend moves whole KV blocks between the host cache and a store (a local
directory, Mooncake Store). A block is addressed by a `StorageKey` and, in host
memory, is a list of (pointer, length) segments exactly as it sits in the host tier
(K and V of every layer, fp8 scales, extra layers): backends read into and write from
those segments, zero-copy where the medium allows.

Contract every backend keeps:
- batched calls with one result per key; a per-key failure is a result, never an
  exception (exceptions are for bad input, raised before anything changes);
- a deadline per call (absolute, `time.monotonic()` seconds): keys not started by
  then answer TIMEOUT;
- a block is served (OK) only if its header (namespace, hash, rank, layout) and its
  checksum verify; anything else is a MISS with a reason, counted, never served;
- a put answers OK only once the block is stored.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import IntEnum

from fastkv.config import CacheConfig, ModelKVShape, check_identity
from fastkv.metadata import DIGEST_BYTES

Segment = tuple[int, int]
"""(address, length in bytes) of one piece of a block in host memory."""

BlockSegments = Sequence[Segment]
"""One block's host memory, in one of two forms (every block of a call in the same
one, the first block's): the layout's segments, one per cache tensor with the
layout's lengths; or ONE contiguous segment of `layout.payload_bytes` holding them
back to back in order (the worker's host tier, whose block is one region). Both
store the same bytes under the same header: the layout is the block's, not the
form's."""

MAX_RANK = (1 << 16) - 1
INT64_MAX = (1 << 63) - 1  # the largest address or end a segment may have


@dataclass(frozen=True, slots=True)
class StorageNamespace:
    """Everything that changes a block's bytes; its digest roots every storage key,
    so two caches that differ in any field never share a hit. Build it with
    `StorageNamespace.of(config, model_kv)` from the cache's identity.

    Attributes:
        cache_namespace: the scheduler's namespace string (CacheConfig.namespace_key()).
        model_id, revision: the weights.
        kv_dtype: cache dtype ("bfloat16", "fp8", ...).
        block_size: tokens per block.
        tp_size: tensor-parallel world size (the rank is part of each key).
        num_layers, num_extra_layers: model layers and extra (speculative) layers.
        num_kv_heads: KV heads held by one rank.
        head_dim: head dimension.
        scale_format: how fp8 scales are laid out ("" when there are none).
        layout_version: bumped whenever fastkv changes how a block is laid out.

    Raises:
        ValueError: a field is empty or out of range (the message names it).
    """

    cache_namespace: str
    model_id: str
    kv_dtype: str
    block_size: int
    tp_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    revision: str = ""
    num_extra_layers: int = 0
    scale_format: str = ""
    layout_version: int = 1

    def __post_init__(self) -> None:
        for name in ("cache_namespace", "model_id", "kv_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
        for name in ("revision", "scale_format"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: must be a string, got {getattr(self, name)!r}")
        for name, low in (
            ("block_size", 1),
            ("tp_size", 1),
            ("num_layers", 1),
            ("num_kv_heads", 1),
            ("head_dim", 1),
            ("num_extra_layers", 0),
            ("layout_version", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")

    @classmethod
    def of(cls, config: CacheConfig, model_kv: ModelKVShape) -> StorageNamespace:
        """The namespace of the cache `config` and `model_kv` name: the scheduler's
        namespace key, model id, KV dtype, block size and TP size from `config`;
        layers, KV heads per rank, head size and extra layers from `model_kv`.
        `revision`, `scale_format` and `layout_version` keep their defaults.

        Raises:
            ValueError: `config` is not a CacheConfig or `model_kv` not a
                ModelKVShape.
        """
        check_identity(config, model_kv)
        return cls(
            cache_namespace=config.namespace_key(),
            model_id=config.model_id,
            kv_dtype=config.kv_dtype,
            block_size=config.block_size,
            tp_size=config.tp_size,
            num_layers=model_kv.num_layers,
            num_kv_heads=model_kv.num_kv_heads,
            head_dim=model_kv.head_dim,
            num_extra_layers=model_kv.num_extra_layers,
        )

    def digest(self) -> bytes:
        """32 bytes: SHA-256 of the fields as canonical JSON (sorted keys)."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"fastkv/storage-namespace\0" + text.encode()).digest()


@dataclass(frozen=True, slots=True)
class StorageKey:
    """One block of one rank in one namespace.

    Attributes:
        namespace: `StorageNamespace.digest()` (32 bytes).
        block_hash: the scheduler's chained block hash (32 bytes, fastkv.hashing).
        rank: the tensor-parallel rank whose shard this block is, in [0, 65535].

    Raises:
        ValueError: wrong digest length or rank out of range.
    """

    namespace: bytes
    block_hash: bytes
    rank: int = 0
    packed: bytes = field(init=False, repr=False, compare=False)
    """66 bytes that identify the key: namespace, hash, rank (little-endian u16);
    made once (an attribute, not a property: the disk index reads it several times
    per block)."""

    def __post_init__(self) -> None:
        ns, block_hash, rank = self.namespace, self.block_hash, self.rank
        if not (
            isinstance(ns, bytes)
            and len(ns) == DIGEST_BYTES
            and isinstance(block_hash, bytes)
            and len(block_hash) == DIGEST_BYTES
            and type(rank) is int
            and 0 <= rank <= MAX_RANK
        ):
            self._refuse()  # the checks below, one by one, for the message
        # made once: the disk index looks a key up by it several times per call
        object.__setattr__(self, "packed", ns + block_hash + rank.to_bytes(2, "little"))

    def _refuse(self) -> None:
        """Raises ValueError naming the first field out of bounds (when one is)."""
        for name in ("namespace", "block_hash"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != DIGEST_BYTES:
                raise ValueError(f"{name}: must be {DIGEST_BYTES} bytes, got {value!r:.80}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"rank: must be an int in [0, {MAX_RANK}], got {self.rank!r}")
        if not 0 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank: {self.rank} is outside [0, {MAX_RANK}]")

    def text(self) -> str:
        """A printable form (Mooncake object keys)."""
        return f"fkv1/{self.namespace.hex()}/{self.block_hash.hex()}/r{self.rank}"


class KeyStatus(IntEnum):
    """What happened to one key of a batched call."""

    OK = 0
    """Served (verified) or stored."""
    MISS = 1
    """Not there, or there but not provably this block (counted, never served)."""
    FAILED = 2
    """An error: I/O error, no space, the store unreachable, the breaker open."""
    TIMEOUT = 3
    """The call's deadline passed before this key was done."""


@dataclass(frozen=True, slots=True)
class KeyResult:
    status: KeyStatus
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == KeyStatus.OK


OK = KeyResult(KeyStatus.OK)
ALREADY_STORED = KeyResult(KeyStatus.OK, "already stored")
"""A put's answer for a key stored before (or earlier in the same call): OK, nothing
written."""


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The segment lengths of one block, in order; every block of a backend has it.

    Raises:
        ValueError: empty, or a length that is not a positive int.
    """

    segment_lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        lengths = tuple(self.segment_lengths)
        if not lengths:
            raise ValueError("segment_lengths: a block needs at least one segment")
        for i, n in enumerate(lengths):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"segment_lengths[{i}]: must be a positive int, got {n!r}")
        object.__setattr__(self, "segment_lengths", lengths)

    @property
    def num_segments(self) -> int:
        return len(self.segment_lengths)

    @property
    def payload_bytes(self) -> int:
        return sum(self.segment_lengths)

    def lengths_for(self, blocks: Sequence[BlockSegments]) -> tuple[int, ...]:
        """The segment lengths of a call's blocks (see `BlockSegments`): one
        contiguous segment of the payload when the first block is given as one
        segment, else the layout's (checked by `check_segments`)."""
        if self.num_segments > 1 and blocks:
            try:
                if len(blocks[0]) == 1:
                    return (self.payload_bytes,)
            except TypeError:
                pass
        return self.segment_lengths

    def in_segments(self, blocks: Sequence[BlockSegments]) -> Sequence[BlockSegments]:
        """The call's blocks (checked by `check_segments`) as the layout's segments:
        `blocks` itself when given so; each block given as one contiguous segment
        cut at the layout's lengths. A block's payload CRC is taken per layout
        segment, so a backend seals and verifies every block in this form: both
        forms of one block then store and accept the same object."""
        if len(self.lengths_for(blocks)) == self.num_segments:
            return blocks
        starts = [0, *itertools.accumulate(self.segment_lengths)][:-1]
        pairs = tuple(zip(starts, self.segment_lengths, strict=True))
        return [[(segs[0][0] + o, n) for o, n in pairs] for segs in blocks]

    def digest32(self) -> int:
        """A 32-bit fingerprint of the lengths (stored in each header)."""
        raw = b"".join(n.to_bytes(8, "little") for n in self.segment_lengths)
        return int.from_bytes(hashlib.sha256(raw).digest()[:4], "little")


@dataclass(slots=True)
class StorageStats:
    """Counters of one backend (monotonic since it was opened). Every key of every
    call counts once, repeats included: per get, gets = OK + misses + get_failures +
    its timeouts; per put, put_failures + put_already_stored <= puts."""

    puts: int = 0
    """Keys asked to store."""
    put_bytes: int = 0
    """Payload bytes written (keys already stored write nothing)."""
    put_failures: int = 0
    """Keys a put did not store (FAILED or TIMEOUT)."""
    put_already_stored: int = 0
    """Keys a put answered OK without writing them (`ALREADY_STORED`)."""
    gets: int = 0
    """Keys asked to read."""
    get_bytes: int = 0
    misses: int = 0
    corrupt: int = 0
    """Reads refused because the header or checksum did not verify (or the object had
    the wrong size): each is also a miss."""
    get_failures: int = 0
    timeouts: int = 0
    """Keys of gets and puts answered TIMEOUT."""
    evictions: int = 0
    stored_blocks: int = 0
    capacity_blocks: int = 0

    def count_gets(self, results: Sequence[KeyResult], payload_bytes: int) -> None:
        """Count a get_into call by its results (the caller holds the backend's
        lock; the backend counts `corrupt`)."""
        n = len(results)
        self.gets += n
        if results.count(OK) == n:  # identity first: no comparison for the usual answer
            self.get_bytes += n * payload_bytes
            return
        for r in results:
            if r.status == KeyStatus.OK:
                self.get_bytes += payload_bytes
            elif r.status == KeyStatus.MISS:
                self.misses += 1
            elif r.status == KeyStatus.FAILED:
                self.get_failures += 1
            elif r.status == KeyStatus.TIMEOUT:
                self.timeouts += 1

    def count_puts(self, results: Sequence[KeyResult], payload_bytes: int) -> None:
        """Count a put_from call by its results (the caller holds the lock)."""
        n = len(results)
        self.puts += n
        if results.count(OK) == n:  # identity first: no comparison for the usual answer
            self.put_bytes += n * payload_bytes
            return
        n_ok = already = 0
        for r in results:
            if r.status == KeyStatus.OK:
                n_ok += 1
                already += r is not OK and (r is ALREADY_STORED or r == ALREADY_STORED)
            elif r.status == KeyStatus.TIMEOUT:
                self.timeouts += 1
        self.put_failures += n - n_ok
        self.put_already_stored += already
        self.put_bytes += (n_ok - already) * payload_bytes


def deadline_after(timeout: float) -> float:
    """The absolute deadline `timeout` seconds from now (for the calls below).

    Raises:
        ValueError: timeout is a bool, negative or not finite.
    """
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout < 0
    ):
        raise ValueError(f"timeout: must be a finite number of seconds >= 0, got {timeout!r}")
    return time.monotonic() + timeout


class StorageBackend(ABC):
    """One store of KV blocks. Thread-safe: an I/O engine calls it from several
    threads at once.

    Every method validates its whole input first (raising ValueError that names the
    bad argument) and then answers per key.
    """

    layout: BlockLayout
    # Used by the shared stats() and counting below; a backend that keeps them sets
    # all three (a wrapper that overrides stats() needs none).
    _lock: threading.Lock
    _stats: StorageStats
    _closed: bool

    @abstractmethod
    def exists(self, keys: Sequence[StorageKey], deadline: float) -> list[bool]:
        """Which keys the store probably holds (a hint: a later get still verifies).

        Never blocks on I/O for the local disk; a remote store answers False for keys
        it could not ask about by the deadline.
        """

    @abstractmethod
    def get_into(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        """Read each key's block into its host segments and verify it.

        Args:
            keys: blocks to read.
            blocks: per key, the destination segments (`BlockSegments`: the
                layout's, or one contiguous segment of its payload).
            deadline: absolute `time.monotonic()` time.

        Returns:
            One result per key. On anything but OK the destination bytes are garbage.
        """

    @abstractmethod
    def put_from(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        """Store each key's block from its host segments.

        A key already stored answers OK without rewriting (keys name content).

        Returns:
            One result per key; OK means stored.
        """

    def busy_host_ranges(self) -> list[tuple[int, int]]:
        """Host memory [start, end) that a call which already returned (it answered
        TIMEOUT at its deadline) still writes: not to be read or reused until it
        leaves this list. Empty for a backend whose calls end when they return."""
        return []

    def wait_host_quiet(self, blocks: Sequence[BlockSegments], timeout: float | None) -> bool:
        """Waits until no call that already returned still writes the memory of
        `blocks` (at most `timeout` s; None: as long as it takes). True when none
        does.

        Raises:
            ValueError: bad blocks or timeout; nothing was waited for.
        """
        check_wait(blocks, timeout, self.layout)
        return True

    def run_calls_on_this_thread(self) -> None:
        """Declares that the calling thread owns the deadlines of the calls it makes
        on this backend: it answers its own requests at their deadline without
        waiting for a call, and keeps the host blocks a call touches from being
        read or reused until the call returns (as `StorageIOEngine`'s threads do).
        From then on the backend may run that thread's calls on it, to their end,
        rather than on threads of its own that let a call return by its deadline
        (a call may then return late; nothing it does outlives it). Other threads'
        calls are unchanged. Nothing for a backend whose calls already run on the
        caller's thread (the default)."""
        return None

    def stats(self) -> StorageStats:
        """A snapshot of the counters."""
        with self._lock:
            snap = replace(self._stats)
            self._live_stats(snap)
        return snap

    @abstractmethod
    def close(self) -> None:
        """Release files, locks and connections. Idempotent."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- shared bookkeeping -----------------------------------------------------

    def _live_stats(self, snap: StorageStats) -> None:
        """Fill in what the backend tracks outside `_stats` (called under `_lock`)."""
        return

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the storage backend is closed")

    def _count_gets(self, results: Sequence[KeyResult]) -> None:
        """Count a get_into call by its results (the backend counts `corrupt`)."""
        with self._lock:
            self._stats.count_gets(results, self.layout.payload_bytes)

    def _count_puts(self, results: Sequence[KeyResult]) -> None:
        """Count a put_from call by its results."""
        with self._lock:
            self._stats.count_puts(results, self.layout.payload_bytes)

    # -- shared validation ------------------------------------------------------

    def _check_batch(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments] | None,
        deadline: float,
    ) -> None:
        check_keys(keys)
        check_deadline(deadline)
        if blocks is None:
            return
        if len(blocks) != len(keys):
            raise ValueError(f"blocks: {len(blocks)} entries for {len(keys)} keys")
        check_segments(blocks, self.layout)


def check_keys(keys: Sequence[StorageKey]) -> None:
    """Raises ValueError unless `keys` is a sequence of StorageKey."""
    if not isinstance(keys, Sequence) or isinstance(keys, (str, bytes)):
        raise ValueError(f"keys: must be a sequence of StorageKey, not {type(keys).__name__}")
    for i, key in enumerate(keys):
        if not isinstance(key, StorageKey):
            raise ValueError(f"keys[{i}]: must be a StorageKey, got {type(key).__name__}")


def check_deadline(deadline: float) -> None:
    """Raises ValueError unless `deadline` is a number (a time.monotonic() value)."""
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise ValueError(f"deadline: must be a time.monotonic() value, got {deadline!r}")
    if math.isnan(deadline):
        raise ValueError("deadline: is NaN")


def check_wait(
    blocks: Sequence[BlockSegments], timeout: float | None, layout: BlockLayout
) -> None:
    """wait_host_quiet's arguments: blocks of `layout`, and None or seconds >= 0."""
    check_segments(blocks, layout)
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 <= timeout < math.inf
    ):
        raise ValueError(f"timeout: must be None or finite seconds >= 0, got {timeout!r}")


def check_segments(blocks: Sequence[BlockSegments], layout: BlockLayout) -> None:
    """Raises ValueError naming the first block or segment that does not match
    `layout` in the call's form (`BlockSegments`: count, lengths), has a null
    address, or ends past 2**63 - 1 (the largest address the native side holds)."""
    want = layout.lengths_for(blocks)
    for b, segs in enumerate(blocks):
        if len(segs) != len(want):
            form = "layout" if len(want) == layout.num_segments else "call (as blocks[0])"
            raise ValueError(f"blocks[{b}]: {len(segs)} segments, the {form} has {len(want)}")
        for s, seg in enumerate(segs):
            try:
                ptr, length = seg
            except (TypeError, ValueError):
                raise ValueError(
                    f"blocks[{b}][{s}]: must be an (address, length) pair"
                ) from None
            if type(ptr) is not int or ptr <= 0:  # a subclass could move its sums
                raise ValueError(
                    f"blocks[{b}][{s}]: address must be a positive int, got {ptr!r}"
                )
            if length != want[s]:
                raise ValueError(
                    f"blocks[{b}][{s}]: length {length} != layout length {want[s]}"
                )
            if ptr > INT64_MAX - want[s]:  # the end must be an address the C side can hold
                raise ValueError(
                    f"blocks[{b}][{s}]: address {ptr} + length {want[s]} ends past 2**63 - 1"
                )


__all__ = [
    "ALREADY_STORED",
    "OK",
    "BlockLayout",
    "BlockSegments",
    "KeyResult",
    "KeyStatus",
    "Segment",
    "StorageBackend",
    "StorageKey",
    "StorageNamespace",
    "StorageStats",
    "check_deadline",
    "check_keys",
    "check_segments",
    "check_wait",
    "deadline_after",
]
