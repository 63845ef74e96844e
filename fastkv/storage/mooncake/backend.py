"""Mooncake Store backend: blocks as objects in a distributed memory pool.

Object key: `StorageKey.text()` ("fkv1/<namespace digest>/<block hash>/r<rank>").
Object bytes: the 128-byte block header (fastkv.storage.block_header) followed by
the block's segments in order. By default (staged) each object is gathered into a
registered staging area of the backend's own and moved as one contiguous Mooncake
buffer (`batch_put_from` / `batch_get_into`, as Mooncake's own client moves it).
With `staging_bytes=0` (zero-copy) Mooncake gathers it from the host cache itself,
one buffer per segment of the call's blocks (`batch_put_from_multi_buffers`,
scattered back by `batch_get_into_multi_buffers`; the host cache must be
registered with `register_host_memory`, the headers live in a small registered
arena): the worker's host block is one contiguous segment, so two buffers per
object, the header and the block. The settings named
below (`put_retries`, `verify_puts`, ...) are fields of the `MooncakeOptions` a
backend is built from (fastkv.storage.mooncake.options).

`MooncakeBackend` validates each call, answers it by its deadline and splits it
into Mooncake calls of at most `max_batch` keys, each run by one of its rooms:

    mooncake/memory.py  registered memory: the host cache, and the header, staging
                        and verify areas, an arena per concurrent call
    mooncake/put.py     one batch of puts; objects already under its keys
    mooncake/get.py     one batch of gets; verification; the per-key quarantine
    mooncake/codes.py   what each Mooncake return code means
    deadline_pool.py    the threads Mooncake calls run on; deadline plus margin
    busy_ranges.py      host memory a zero-copy get left behind still writes
    circuit_breaker.py  the breaker and the per-key quarantine

Authentication: any client that reaches the master can put any key, and keys are
predictable (the namespace digest hashes public fields; block hashes chain from a
public root). Every object therefore carries a tag (HMAC-SHA256 under the
deployment's key ring, fastkv.storage.auth) that a get verifies before anything is
served; a backend without a ring must be asked for explicitly
(`allow_unauthenticated=True`) and then accepts whatever any client stored. What
a put does about an object already under its key (staged: replaced unread, in
the put itself; zero-copy: read back, and one that is not its block removed), the
window that remains for zero-copy and `verify_puts`, which closes it at a cost:
fastkv.storage.mooncake.put.

Failures stay local to what failed: a dead storage node fails its own keys (a
quarantine per key), only a failing master (or a binding that raises) opens the
breaker. While it is open every call fails fast without touching Mooncake; after
`breaker_cooldown_s` one call goes through as a probe and closes it on success (the
cooldown doubles while probes fail, up to `breaker_max_cooldown_s`, 4 s by default:
the breaker closes at most that long, plus the probe call, after the master is
back). `health_check()` answered 0 with the master dead, so the breaker learns from
real calls only.

Deadlines: every `exists`, `put_from` and `get_into` returns by its deadline plus
`deadline_margin_s` (50 ms), keys not done answering TIMEOUT, however long Mooncake
blocks (fastkv.storage.deadline_pool); the call that overran keeps its arena (and
thread) until Mooncake returns it. What a call left behind may still do to the
caller's memory:
  - zero-copy get: Mooncake writes it until its call returns. Those ranges are in
    `busy_host_ranges()` until then, `wait_host_quiet` waits for them, and a new
    call whose blocks overlap them answers FAILED for those keys without touching
    them (fastkv.storage.busy_ranges).
  - zero-copy put: Mooncake reads it until its call returns; memory changed
    meanwhile makes the stored object fail verification: never served.
  - staged calls: only this backend's own copies touch it, and none starts once
    the caller has been answered (a put gathers its blocks on the caller's thread
    before it waits; a get scatters under deadline_pool's `Call`).

A thread that owns its deadlines (`run_calls_on_this_thread`: the storage I/O
engine's threads, the worker's only path to the backend) has its calls run on
itself instead, to their end: the engine answers its requests at their deadline
without waiting, and keeps the call's host blocks busy until it returns, so the
hand-off to a pool thread (two thread switches a call) buys it nothing. Such a
call keeps its arena until it returns, counts in flight for `close`, and in
`overruns` when it ends past its deadline plus the margin; nothing is left
behind, so nothing reaches `busy_host_ranges`. Its results, counts and errors
are those of the pool path; only when they come differs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from fastkv.storage import _disk_io
from fastkv.storage.auth import StorageAuth, ring_of
from fastkv.storage.base import (
    BlockLayout,
    BlockSegments,
    KeyResult,
    KeyStatus,
    StorageBackend,
    StorageKey,
    StorageStats,
    check_deadline,
    check_keys,
    check_segments,
    check_wait,
)
from fastkv.storage.block_header import HEADER_BYTES
from fastkv.storage.busy_ranges import BusyHostRanges
from fastkv.storage.circuit_breaker import CircuitBreaker
from fastkv.storage.deadline_pool import Call, DeadlinePool
from fastkv.storage.mooncake.codes import FATAL_CODES
from fastkv.storage.mooncake.get import MooncakeGets
from fastkv.storage.mooncake.memory import MooncakeMemory
from fastkv.storage.mooncake.options import (
    STAGING_CALL_BYTES,
    MooncakeConnection,
    MooncakeOptions,
)
from fastkv.storage.mooncake.put import MooncakePuts

log = logging.getLogger(__name__)


class MooncakeBackend(StorageBackend):
    """Blocks in Mooncake Store.

    Args:
        layout: the segment lengths of every block.
        options: connection, failure handling, transfer and trust settings
            (`MooncakeOptions`, whose docstring explains each default: zero-copy
            or staged transfers, `verify_puts`, unauthenticated mode).
        store: an already set-up `MooncakeDistributedStore` to use instead of
            setting one up from `options.connection` (which is then not read).

    Attributes:
        options: what it was built from.
        auth: the key ring in use (`options.auth`, else the environment's), or None.
        staged: blocks go through the staging area (`options.staging_bytes` None,
            the default, or > 0).
        max_batch: keys per Mooncake call: `options.max_batch`, or fewer when a
            call's share of the staging area holds fewer objects.
        store: the Mooncake store in use.
        breaker: the circuit breaker every call goes through.
        verify_puts, deadline_margin_s: see the properties.
        forged_puts, pool_full_retries, overruns: counters (see the properties).

    Raises:
        ValueError: a bad argument: no key ring (neither `options.auth` nor
            `FASTKV_STORAGE_KEY_FILE`) without `options.allow_unauthenticated`; a
            staging area that holds less than one object per concurrent call;
            neither `options.connection` nor `store`.
        RuntimeError: Mooncake is not installed or its setup failed.
    """

    def __init__(
        self, layout: BlockLayout, options: MooncakeOptions, store: object | None = None
    ) -> None:
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"layout: must be a BlockLayout, got {type(layout).__name__}")
        if not isinstance(options, MooncakeOptions):
            raise ValueError(
                f"options: must be a MooncakeOptions, got {type(options).__name__}"
            )
        auth = options.auth if options.auth is not None else StorageAuth.from_environment()
        if auth is None and not options.allow_unauthenticated:
            raise ValueError(
                "auth: Mooncake Store lets every client that reaches its master write any "
                "key, so blocks must be authenticated: give a StorageAuth (or set "
                "FASTKV_STORAGE_KEY_FILE), or allow_unauthenticated=True to accept "
                "blocks any client could have forged"
            )
        object_bytes = HEADER_BYTES + layout.payload_bytes
        concurrency, staging_bytes = options.max_concurrency, options.staging_bytes
        if staging_bytes is None:  # staged, sized for the layout
            objects = min(options.max_batch, max(1, STAGING_CALL_BYTES // object_bytes))
            staging_bytes = concurrency * objects * object_bytes
        per_call = staging_bytes // concurrency
        if staging_bytes and per_call < object_bytes:
            raise ValueError(
                f"staging_bytes: {staging_bytes} holds less than one {object_bytes}-byte "
                f"object per concurrent call ({concurrency}); give at least "
                f"{concurrency * object_bytes}"
            )
        if store is None:
            if options.connection is None:
                raise ValueError(
                    "connection: None, and no store was given: give a MooncakeConnection "
                    "(master_address 'host:port') or a store already set up"
                )
            store = _setup_store(options.connection)  # after every check: it connects
        self.layout = layout
        self.options = options
        self.auth = auth
        self._ring = ring_of(auth)
        self.staged = staging_bytes > 0
        self.max_batch = options.max_batch
        if self.staged:
            self.max_batch = min(self.max_batch, per_call // object_bytes)
        self.breaker = CircuitBreaker(
            float(options.breaker_cooldown_s), float(options.breaker_max_cooldown_s)
        )
        self._busy = BusyHostRanges()  # what zero-copy gets left behind still write
        # transfers hold an arena each, lookups a slot of their own: both bounded
        self._calls = DeadlinePool(
            2 * concurrency, float(options.deadline_margin_s), self._busy, "fastkv-mooncake"
        )
        self._lookup_slots = threading.BoundedSemaphore(concurrency)
        self._here = threading.local()  # `on`: this thread's calls run on it
        self.store = store
        self._lock = threading.Lock()
        self._stats = StorageStats()
        self._memory = MooncakeMemory(store, layout, concurrency, self.max_batch, self.staged)
        self._gets = MooncakeGets(
            store,
            layout,
            self._ring,
            self._memory,
            float(options.breaker_cooldown_s),
            self._count_corrupt,
        )
        self._puts = MooncakePuts(store, layout, self._ring, self._memory, options)
        # int64 segment lengths of each form a call's blocks come in (`BlockSegments`)
        self._form_lengths = {
            n: np.asarray(lengths, dtype=np.int64).tobytes()
            for lengths in (layout.segment_lengths, (layout.payload_bytes,))
            for n in (len(lengths),)
        }
        self._closed = False

    @property
    def deadline_margin_s(self) -> float:
        """How long past its deadline a call may take (`options.deadline_margin_s`)."""
        return self._calls.margin_s

    @property
    def verify_puts(self) -> bool:
        """Whether every put is read back and counts as stored only if the object
        verifies (starts as `options.verify_puts`; may be changed between calls)."""
        return self._puts.verify_puts

    @verify_puts.setter
    def verify_puts(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"verify_puts: must be a bool, got {value!r}")
        self._puts.verify_puts = value

    @property
    def forged_puts(self) -> int:
        """Objects a put found under its key that were not its block (removed):
        zero-copy puts, and with verify_puts any put whose read-back failed (a
        staged put replaces what is under its key unread)."""
        return self._puts.forged_puts

    @property
    def pool_full_retries(self) -> int:
        """Keys put again after Mooncake answered -200 (pool full)."""
        return self._puts.pool_full_retries

    @property
    def overruns(self) -> int:
        """Calls still inside Mooncake past their deadline plus the margin (left
        behind on the pool, or run on a thread that owns its deadlines and ended
        past it)."""
        return self._calls.overruns

    def run_calls_on_this_thread(self) -> None:
        """This thread's calls run on it, to their end, not on the deadline pool
        (see the module docstring and `StorageBackend.run_calls_on_this_thread`)."""
        self._here.on = True

    def register_host_memory(self, address: int, nbytes: int) -> None:
        """Register host memory (the whole host cache, once) for zero-copy transfers
        (staged mode does not need it).

        Raises:
            ValueError: a bad address or size, or overlap with a registered range.
            RuntimeError: Mooncake refused the registration.
        """
        self._memory.register_host(address, nbytes)

    # -- the interface ----------------------------------------------------------

    def exists(self, keys: Sequence[StorageKey], deadline: float) -> list[bool]:
        self._check_batch(keys, None, deadline)
        self._check_open()
        found = [False] * len(keys)
        # a slot bounds the lookups inside Mooncake (a stuck one keeps its slot)
        if not self._lookup_slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return found
        abandoned = False
        here = getattr(self._here, "on", False)
        try:
            for start in range(0, len(keys), self.max_batch):
                if time.monotonic() >= deadline or not self.breaker.allow():
                    break
                names = [k.text() for k in keys[start : start + self.max_batch]]
                if here:
                    codes = self._calls.run(self._is_exist, deadline, names)
                else:
                    fut = self._calls.submit(self._is_exist, names)
                    codes = self._calls.wait(fut, deadline, self._lookup_slots.release)
                if codes is None:  # still inside Mooncake: "not found"
                    abandoned = True
                    break
                for j, code in enumerate(codes):
                    found[start + j] = code == 1
        finally:
            if not abandoned:
                self._lookup_slots.release()
        return found

    def _is_exist(self, names: list[str]) -> list[int]:
        """One is_exist call on a pool thread; reports its outcome to the breaker."""
        try:
            codes = self.store.batch_is_exist(names)
        except Exception as e:  # the binding raised: answer "not found"
            self.breaker.record(f"is_exist raised {type(e).__name__}: {e}")
            return [0] * len(names)
        fatal = next((c for c in codes if c in FATAL_CODES), None)
        self.breaker.record(None if fatal is None else f"is_exist answered {fatal}")
        return codes

    def busy_host_ranges(self) -> list[tuple[int, int]]:
        return self._busy.ranges()

    def wait_host_quiet(self, blocks: Sequence[BlockSegments], timeout: float | None) -> bool:
        check_wait(blocks, timeout, self.layout)
        return self._busy.wait_quiet(blocks, timeout)

    def get_into(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        results = self._checked_batch(keys, blocks, deadline, self._gets)
        self._count_gets(results)
        return results

    def put_from(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        results = self._checked_batch(keys, blocks, deadline, self._puts)
        self._count_puts(results)
        return results

    def _checked_batch(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        deadline: float,
        path: MooncakeGets | MooncakePuts,
    ) -> list[KeyResult]:
        """A get or put batch: every input checked (blocks inside registered memory,
        the backend open) before `path` touches anything."""
        packed = self._checked_pairs(keys, blocks, deadline)
        self._memory.check_inside(packed, len(self.layout.lengths_for(blocks)))
        self._check_open()
        segs = self._seal_pairs(blocks, packed)
        return self._clear_of_busy(keys, blocks, segs, deadline, path)

    def _checked_pairs(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> bytearray:
        """`_check_batch`'s checks, the blocks' in C (`_disk_io.check_pack`, a tenth
        of the Python check's time); their (address, length) pairs as int64s in
        the call's form. A block that fails is named by `check_segments`' message."""
        check_keys(keys)
        check_deadline(deadline)
        if len(blocks) != len(keys):
            raise ValueError(f"blocks: {len(blocks)} entries for {len(keys)} keys")
        lengths = self._form_lengths[len(self.layout.lengths_for(blocks))]
        try:
            return _disk_io.check_pack(blocks, lengths)[0]
        except ValueError:
            check_segments(blocks, self.layout)  # raises the Python check's message
            raise

    def _seal_pairs(
        self, blocks: Sequence[BlockSegments], packed: bytearray
    ) -> bytes | bytearray:
        """The pairs each block is sealed and verified over: with a key ring the
        call's own (the tag's GMAC runs over the payload's bytes in order, however
        they are cut), else the layout's segments (the CRC is taken per segment,
        `BlockLayout.in_segments`): either way both forms of one block store and
        accept the same object."""
        nseg = self.layout.num_segments
        if self._ring or len(packed) == 16 * nseg * len(blocks):
            return packed
        return _disk_io.pack_segments(self.layout.in_segments(blocks), nseg)

    def _clear_of_busy(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        segs: bytes | bytearray,
        deadline: float,
        path: MooncakeGets | MooncakePuts,
    ) -> list[KeyResult]:
        """The batch, less the keys whose host memory a get left behind still
        writes (those answer FAILED, untouched). `segs`: the pairs of `_seal_pairs`."""
        busy = self._busy.touching(blocks)
        if not busy:
            return self._batched(keys, blocks, segs, deadline, path)
        skip = set(busy)
        live = [j for j in range(len(keys)) if j not in skip]
        out = [
            KeyResult(
                KeyStatus.FAILED,
                "host memory still written by a Mooncake get that outlived its deadline "
                "(busy_host_ranges)",
            )
        ] * len(keys)
        row = len(segs) // len(keys)
        live_segs = b"".join(memoryview(segs)[row * j : row * (j + 1)] for j in live)
        got = self._batched(
            [keys[j] for j in live], [blocks[j] for j in live], live_segs, deadline, path
        )
        for j, r in zip(live, got, strict=True):
            out[j] = r
        return out

    def close(self, timeout: float = 10.0) -> bool:
        """Refuse new calls, wait up to `timeout` s for the calls still inside
        Mooncake (including those left behind at their deadline), then close the
        store. False when some call is still inside after `timeout`: the store is
        left open (closing it under a call is undefined) and that is logged."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout: must be seconds >= 0, got {timeout!r}")
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        stuck = self._calls.drain(timeout)
        self._calls.shutdown()
        if stuck:
            log.warning(
                "MooncakeBackend.close: %d call(s) still inside Mooncake after %.1f s; "
                "the store is left open until the process exits",
                stuck,
                timeout,
            )
            return False
        close = getattr(self.store, "close", None)
        if close is not None:
            close()
        return True

    # -- batching -----------------------------------------------------------------

    def _batched(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        segs: bytes | bytearray,
        deadline: float,
        path: MooncakeGets | MooncakePuts,
    ) -> list[KeyResult]:
        """Runs `path.part` for each batch of up to max_batch keys, holding one
        arena, while the deadline and the breaker allow: on the pool, or to its
        end on this thread when it owns its deadlines (`_part`). A put's batch
        is prepared first on this thread (`path.prepare`: staged into the arena,
        or its headers sealed): bounded work (one batch's copy), done before the
        caller can be answered. `segs`: each block's pairs to seal or verify over
        (`_seal_pairs`), block after block."""
        results: list[KeyResult] = [
            KeyResult(KeyStatus.TIMEOUT, "deadline passed before the call")
        ] * len(keys)
        if not keys:
            return results
        arena = self._memory.take(deadline)
        if arena is None:
            return results
        row = len(segs) // len(keys)
        abandoned = False
        try:
            for start in range(0, len(keys), self.max_batch):
                if time.monotonic() >= deadline:
                    break
                if not self.breaker.allow():
                    refused = KeyResult(
                        KeyStatus.FAILED, f"circuit breaker open ({self.breaker.reason})"
                    )
                    results[start:] = [refused] * (len(keys) - start)
                    break
                stop = min(len(keys), start + self.max_batch)
                call = Call()
                part_keys, part_blocks = keys[start:stop], blocks[start:stop]
                part_segs = memoryview(segs)[row * start : row * stop]
                prep = path.prepare(part_keys, part_blocks, part_segs, arena)  # this thread
                part = self._part(path, part_keys, part_blocks, arena, deadline, call, prep)
                if part is None:
                    abandoned = True
                    why = "deadline passed with the call still inside Mooncake"
                    if path.writes_host:
                        why += (
                            "; it writes these blocks' host memory until it returns "
                            "(busy_host_ranges, wait_host_quiet)"
                        )
                    results[start:stop] = [KeyResult(KeyStatus.TIMEOUT, why)] * (stop - start)
                    break
                results[start:stop] = part
        finally:
            if not abandoned:
                self._memory.give(arena)
        return results

    def _part(
        self,
        path: MooncakeGets | MooncakePuts,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        arena: int,
        deadline: float,
        call: Call,
        prep: object,
    ) -> list[KeyResult] | None:
        """One batch (`_run_part`) to its end on this thread when it owns its
        deadlines, else on the pool until the deadline plus the margin: None when
        it is still running then (left behind: it gives its arena back when it
        ends, and the blocks it writes stay busy)."""
        args = (path.part, keys, blocks, arena, deadline, call, prep)
        if getattr(self._here, "on", False):
            return self._calls.run(self._run_part, deadline, *args)
        fut = self._calls.submit(self._run_part, *args)
        writes = blocks if path.writes_host else ()
        return self._calls.wait(fut, deadline, lambda: self._memory.give(arena), call, writes)

    def _count_corrupt(self, n: int) -> None:
        with self._lock:
            self._stats.corrupt += n

    def _run_part(
        self,
        run_part: Callable[..., tuple[list[KeyResult], str | None]],
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        arena: int,
        deadline: float,
        call: Call,
        prep: object,
    ) -> list[KeyResult]:
        """One batch of Mooncake calls; reports its outcome to the breaker."""
        try:
            part, fatal = run_part(keys, blocks, arena, deadline, call, prep)
        except Exception as e:  # the binding raised: a failure, never a hang
            fatal = f"{type(e).__name__}: {e}"
            part = [KeyResult(KeyStatus.FAILED, f"Mooncake call raised {fatal}")] * len(keys)
        self.breaker.record(fatal)
        return part


def _setup_store(connection: MooncakeConnection) -> object:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise RuntimeError(
            f"Mooncake is not installed ({e}): pip install mooncake-transfer-engine-non-cuda"
        ) from e
    store = MooncakeDistributedStore()
    rc = store.setup(
        connection.local_hostname,
        connection.metadata_server,
        connection.segment_bytes,
        0,
        connection.protocol,
        connection.device_name,
        connection.master_address,
    )
    if rc != 0:
        raise RuntimeError(
            f"Mooncake setup with master {connection.master_address} answered {rc}"
        )
    return store


__all__ = ["MooncakeBackend"]
