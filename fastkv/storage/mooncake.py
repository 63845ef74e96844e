"""Mooncake Store backend: blocks as objects in a distributed memory pool.

Object key: `StorageKey.text()` ("fkv1/<namespace digest>/<block hash>/r<rank>").
Object bytes: the 128-byte block header (fastkv.storage.block_header) followed by
the block's segments in order, gathered zero-copy from the host cache by
`batch_put_from_multi_buffers` and scattered back by `batch_get_into_multi_buffers`
(both need the memory registered: `register_host_memory` once for the whole host
cache; the headers live in a small registered arena of the backend's own).
The settings named below (`put_retries`, `verify_puts`, ...) are fields of the
`MooncakeOptions` a backend is built from (fastkv.storage.mooncake_options).

Authentication: any client that reaches the master can put any key, and keys are
predictable (the namespace digest hashes public fields; block hashes chain from a
public root). Every object therefore carries a tag (HMAC-SHA256 under the
deployment's key ring, fastkv.storage.auth) that a get verifies before anything is
served; a backend without a ring must be asked for explicitly
(`allow_unauthenticated=True`) and then accepts whatever any client stored.
Mooncake keeps the old value when a key is put again (answering 0 or -705), so a
put first asks which keys exist and reads those back: one that verifies is
ALREADY_STORED, one that does not (forged, or another deployment's) answers
FAILED, never stored, and is removed so a later put can store the real block
(Mooncake refuses a remove during the read lease it just granted, -706: the key is
then remembered and removed by the next put of it once the lease has run out). A
-705 from the put itself (a key that appeared in between) is checked the same way.
What remains: an object planted between the existence check and the put (when
Mooncake answers 0) makes that put count as stored; its reads still refuse it.

Return codes: what each means to this backend is tabled in
fastkv.storage.mooncake_codes.

Failures stay local to what failed: a dead storage node fails its own keys (a
quarantine per key), only a failing master (or a binding that raises) opens the
breaker. While it is open every call fails fast without touching Mooncake; after
`breaker_cooldown_s` one call goes through as a probe and closes it on success (the
cooldown doubles while probes fail, up to `breaker_max_cooldown_s`, 4 s by default:
the breaker closes at most that long, plus the probe call, after the master is
back). `health_check()` answered 0 with the master dead, so the breaker learns from
real calls only.

Deadlines: a Mooncake call blocks (4.3 s measured against a dead master), so calls
run on the backend's own threads and the caller waits until the deadline plus
`deadline_margin_s` (50 ms): every `exists`, `put_from` and `get_into` returns by
then, keys not done answering TIMEOUT; the call that overran keeps its arena (and
thread) until Mooncake returns it. What a call left behind may still do to the
caller's memory:
  - zero-copy get: Mooncake writes it until its call returns. Those ranges are in
    `busy_host_ranges()` until then, `wait_host_quiet` waits for them, and a new
    call whose blocks overlap them answers FAILED for those keys without touching
    them; the I/O engine waits for them before it frees its host blocks.
  - zero-copy put: Mooncake reads it until its call returns. Memory changed
    meanwhile makes the stored object fail verification: never served.
  - staged calls: only this backend's own copies touch it (gathering a put's
    block, scattering a get's), each under the call's lock, and none starts once
    the caller has been answered.

A put first asks which keys exist and reads those objects back: one that is not
this block answers FAILED and is removed. This Mooncake answers 0 for a put of a
key that already holds an object (and keeps that object), so an object another
client plants between that existence check and the put passes for the block; it
adds nothing to what any client can do anyway (replace or delete any object at
any time: misses, never wrong KV, as reads verify). `verify_puts=True` closes it:
every put is read back and counts as stored only if the object verifies. It is off
by default because a read-back costs a get (17-45 % of put throughput measured
over TCP loopback) and a get takes the master's read lease (10 s by default), so
objects just written cannot be evicted for that long: on a pool smaller than
write rate x lease, puts fail with -200.
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
    ALREADY_STORED,
    OK,
    BlockLayout,
    BlockSegments,
    KeyResult,
    KeyStatus,
    StorageBackend,
    StorageKey,
    StorageStats,
    check_wait,
)
from fastkv.storage.block_header import HEADER_BYTES, expected_header
from fastkv.storage.busy_ranges import BusyHostRanges
from fastkv.storage.circuit_breaker import CircuitBreaker
from fastkv.storage.deadline_pool import LEFT_BEHIND, Call, DeadlinePool
from fastkv.storage.mooncake_codes import (
    BUFFER_TOO_SMALL,
    FATAL_CODES,
    LEASE_HELD,
    OBJECT_EXISTS,
    OBJECT_NOT_FOUND,
    POOL_FULL,
    PUT_OK,
    describe_status,
)
from fastkv.storage.mooncake_get import MooncakeGets
from fastkv.storage.mooncake_memory import MooncakeMemory
from fastkv.storage.mooncake_options import MooncakeConnection, MooncakeOptions

log = logging.getLogger(__name__)

_MAX_CONDEMNED = 4096


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
        staged: blocks go through the staging area (`options.staging_bytes` > 0).
        max_batch: keys per Mooncake call: `options.max_batch`, or fewer when a
            call's share of the staging area holds fewer objects.
        verify_puts: starts as `options.verify_puts`; may be changed between calls.
        breaker: the circuit breaker every call goes through.
        forged_puts, pool_full_retries, overruns: counters (see their comments).

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
        self.verify_puts = options.verify_puts
        self.max_batch = options.max_batch
        if self.staged:
            self.max_batch = min(self.max_batch, per_call // object_bytes)
        self.breaker = CircuitBreaker(
            float(options.breaker_cooldown_s), float(options.breaker_max_cooldown_s)
        )
        # transfers hold an arena each, lookups a slot of their own: both bounded
        self._calls = DeadlinePool(
            2 * concurrency,
            float(options.deadline_margin_s),
            BusyHostRanges(),  # what zero-copy gets left behind still write
            "fastkv-mooncake",
        )
        self._lookup_slots = threading.BoundedSemaphore(concurrency)
        self._expected_bytes = object_bytes
        self._lengths = [HEADER_BYTES, *layout.segment_lengths]
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
        self.forged_puts = 0
        self._condemned: dict[str, None] = {}  # objects to remove once their lease ends
        self.pool_full_retries = 0
        self._closed = False

    @property
    def deadline_margin_s(self) -> float:
        """How long past its deadline a call may take (`options.deadline_margin_s`)."""
        return self._calls.margin_s

    @property
    def overruns(self) -> int:
        """Calls still inside Mooncake past their deadline plus the margin."""
        return self._calls.overruns

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
        try:
            for start in range(0, len(keys), self.max_batch):
                if time.monotonic() >= deadline or not self.breaker.allow():
                    break
                names = [k.text() for k in keys[start : start + self.max_batch]]
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
        return self._calls.busy.ranges()

    def wait_host_quiet(self, blocks: Sequence[BlockSegments], timeout: float | None) -> bool:
        check_wait(blocks, timeout, self.layout)
        return self._calls.busy.wait_quiet(blocks, timeout)

    def get_into(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        self._check_batch(keys, blocks, deadline)
        self._memory.check_inside(blocks)
        self._check_open()
        results = self._clear_of_busy(
            keys, blocks, deadline, self._gets.part, self._gets.writes_host
        )
        self._count_gets(results)
        return results

    def put_from(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        self._check_batch(keys, blocks, deadline)
        self._memory.check_inside(blocks)
        self._check_open()
        results = self._clear_of_busy(keys, blocks, deadline, self._put_part)
        self._count_puts(results)
        return results

    def _clear_of_busy(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        deadline: float,
        run_part: Callable[..., tuple[list[KeyResult], str | None]],
        writes_host: bool = False,
    ) -> list[KeyResult]:
        """The batch, less the keys whose host memory a get left behind still
        writes (those answer FAILED, untouched)."""
        busy = self._calls.busy.touching(blocks)
        if not busy:
            return self._batched(keys, blocks, deadline, run_part, writes_host)
        skip = set(busy)
        live = [j for j in range(len(keys)) if j not in skip]
        out = [
            KeyResult(
                KeyStatus.FAILED,
                "host memory still written by a Mooncake get that outlived its deadline "
                "(busy_host_ranges)",
            )
        ] * len(keys)
        got = self._batched(
            [keys[j] for j in live], [blocks[j] for j in live], deadline, run_part, writes_host
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
        deadline: float,
        run_part: Callable[..., tuple[list[KeyResult], str | None]],
        writes_host: bool,
    ) -> list[KeyResult]:
        """Runs `run_part` on the pool for each batch of up to max_batch keys,
        holding one arena, while the deadline and the breaker allow. `writes_host`:
        Mooncake writes the caller's blocks (a zero-copy get) until it returns."""
        results: list[KeyResult] = [
            KeyResult(KeyStatus.TIMEOUT, "deadline passed before the call")
        ] * len(keys)
        if not keys:
            return results
        arena = self._memory.take(deadline)
        if arena is None:
            return results
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
                args = (run_part, keys[start:stop], blocks[start:stop], arena, deadline, call)
                fut = self._calls.submit(self._run_part, *args)
                writes = blocks[start:stop] if writes_host else ()
                part = self._calls.wait(
                    fut, deadline, lambda a=arena: self._memory.give(a), call, writes
                )
                if part is None:
                    abandoned = True
                    why = "deadline passed with the call still inside Mooncake"
                    if writes:
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
    ) -> list[KeyResult]:
        """One batch of Mooncake calls; reports its outcome to the breaker."""
        try:
            part, fatal = run_part(keys, blocks, arena, deadline, call)
        except Exception as e:  # the binding raised: a failure, never a hang
            fatal = f"{type(e).__name__}: {e}"
            part = [KeyResult(KeyStatus.FAILED, f"Mooncake call raised {fatal}")] * len(keys)
        self.breaker.record(fatal)
        return part

    def _put_part(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        arena: int,
        deadline: float,
        call: Call,
    ) -> tuple[list[KeyResult], str | None]:
        """One batch of puts: keys that already hold an object are read back (stored
        only if it is this block); the others are sealed (or staged) and put, those
        the full pool refused retried; what the put met on the way, and with
        verify_puts what it stored, is read back. Returns the results and the
        fatal outcome (None if Mooncake's master answered every call)."""
        results: list[KeyResult | None] = [None] * len(keys)
        names = [k.text() for k in keys]
        self._remove_condemned(names)
        exist = self.store.batch_is_exist(names)
        fatal_code = next((c for c in exist if c in FATAL_CODES), None)
        if fatal_code is not None:
            failed = KeyResult(KeyStatus.FAILED, f"Mooncake is_exist answered {fatal_code}")
            return [failed] * len(keys), f"is_exist answered {fatal_code}"
        pending = []
        met: list[int] = []  # keys holding an object: stored only if it is this block
        for j, code in enumerate(exist):
            (met if code == 1 else pending).append(j)
        fatal = self._read_back(keys, met, results, arena, deadline, None)
        ptrs = self._put_buffers(keys, blocks, pending, arena, call)
        if ptrs is None:  # the caller was answered before its blocks were staged
            return [LEFT_BEHIND] * len(keys), fatal
        written, appeared, fatal = self._put_with_retries(
            names, pending, ptrs, results, deadline, fatal
        )
        # 0 also answers a put that met an object: stored only if what is there now
        # is this block.
        fatal = self._read_back(keys, appeared, results, arena, deadline, fatal)
        fatal = self._read_back(keys, written, results, arena, deadline, fatal, stored=OK)
        return results, fatal  # type: ignore[return-value]

    def _put_buffers(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        pending: list[int],
        arena: int,
        call: Call,
    ) -> dict[int, object] | None:
        """What Mooncake puts for each key in `pending`: staged, the object gathered
        (header, then segments) into the staging area; zero-copy, the header
        sealed in the arena, then the block's own segments. None when `call` was
        answered before every block was staged (its blocks are the caller's again)."""
        ptrs: dict[int, object] = {}
        for j in pending:
            key, segs = keys[j], blocks[j]
            seg_array = np.asarray(segs, dtype=np.int64)
            if self.staged:
                header = bytearray(expected_header(key, self.layout, 0))
                with call.lock:  # the caller's block, while the caller still waits
                    if call.abandoned:
                        return None
                    _disk_io.stage_block(
                        self._memory.object_addr(arena, j), header, seg_array, self._ring
                    )
                ptrs[j] = self._memory.object_addr(arena, j)
                continue
            header_view = self._memory.header_view(arena, j)
            header_view[:] = expected_header(key, self.layout, 0)
            _disk_io.seal_header(header_view, seg_array, self._ring)
            ptrs[j] = [self._memory.header_addr(arena, j), *(p for p, _ in segs)]
        return ptrs

    def _put_with_retries(
        self,
        names: list[str],
        pending: list[int],
        ptrs: dict[int, object],
        results: list[KeyResult | None],
        deadline: float,
        fatal: str | None,
    ) -> tuple[list[int], list[int], str | None]:
        """Puts the objects of `pending`, again for those answered -200 (pool full)
        while retries are left and the pause ends before the deadline; sets
        results[j] for every key its answer settles. Returns the keys to read back
        (answered 0 under verify_puts; answered -705) and the fatal outcome."""
        written: list[int] = []  # answered 0: stored, or met an object (see _put_part)
        appeared: list[int] = []  # answered -705: met an object since is_exist
        for attempt in range(self.options.put_retries + 1):
            if not pending:
                break
            codes = self._put_objects([names[j] for j in pending], [ptrs[j] for j in pending])
            pending, fatal = self._sort_put_codes(
                pending, codes, results, written, appeared, fatal
            )
            if (
                not pending
                or attempt == self.options.put_retries
                or time.monotonic() + self.options.retry_backoff_s >= deadline
            ):
                break
            with self._lock:
                self.pool_full_retries += len(pending)
            time.sleep(self.options.retry_backoff_s)
        for j in pending:
            results[j] = KeyResult(
                KeyStatus.FAILED, "Mooncake pool full (-200) after every retry"
            )
        return written, appeared, fatal

    def _put_objects(self, names: list[str], ptrs: list[object]) -> list[int]:
        """One Mooncake put call for these objects; its codes."""
        if self.staged:
            return self.store.batch_put_from(names, ptrs, [self._expected_bytes] * len(names))
        return self.store.batch_put_from_multi_buffers(
            names, ptrs, [self._lengths] * len(names)
        )

    def _sort_put_codes(
        self,
        pending: list[int],
        codes: list[int],
        results: list[KeyResult | None],
        written: list[int],
        appeared: list[int],
        fatal: str | None,
    ) -> tuple[list[int], str | None]:
        """Files each key of a put call by its code: OK (results), to read back
        (`written`, `appeared`) or FAILED (results); returns those to retry (-200)
        and the fatal outcome."""
        retry = []
        for j, code in zip(pending, codes, strict=True):
            if code == PUT_OK and self.verify_puts:
                written.append(j)
            elif code == PUT_OK:
                results[j] = OK
            elif code == OBJECT_EXISTS:
                appeared.append(j)
            elif code == POOL_FULL:
                retry.append(j)
            else:
                if code in FATAL_CODES:
                    fatal = f"put answered {code}"
                results[j] = KeyResult(KeyStatus.FAILED, f"Mooncake put answered {code}")
        return retry, fatal

    def _read_back(
        self,
        keys: Sequence[StorageKey],
        which: list[int],
        results: list[KeyResult | None],
        arena: int,
        deadline: float,
        fatal: str | None,
        stored: KeyResult = ALREADY_STORED,
    ) -> str | None:
        """Reads the objects under keys[j] (j in `which`) back, a batch of verify
        slots per Mooncake call, and sets results[j]: `stored` for an object that is
        this block, else what _judge_existing says. Returns the fatal outcome."""
        size = self._expected_bytes
        for s in range(0, len(which), self._memory.verify_slots):
            part = which[s : s + self._memory.verify_slots]
            if time.monotonic() >= deadline:
                late = KeyResult(
                    KeyStatus.TIMEOUT, "deadline passed before the stored object was verified"
                )
                for j in which[s:]:
                    results[j] = late
                break
            offsets = [self._memory.verify_offset(arena, i) for i in range(len(part))]
            codes = self.store.batch_get_into(
                [keys[j].text() for j in part],
                [self._memory.verify_addr + off for off in offsets],
                [size] * len(part),
            )
            for j, off, code in zip(part, offsets, codes, strict=True):
                got, fatal = self._judge_existing(keys[j], off, code, fatal)
                results[j] = stored if got is ALREADY_STORED else got
        return fatal

    def _judge_existing(
        self, key: StorageKey, offset: int, code: int, fatal: str | None
    ) -> tuple[KeyResult, str | None]:
        """What a read-back of the object under `key` (into the verify area at
        `offset`, Mooncake answering `code`) means for a put: ALREADY_STORED if it
        is this block (its header and tag verify), else FAILED; an object that does
        not verify is removed (best effort) so a later put can store the real
        block."""
        name = key.text()
        addr = self._memory.verify_addr + offset
        if code in FATAL_CODES:
            return KeyResult(KeyStatus.FAILED, f"Mooncake get answered {code}"), (
                f"get answered {code}"
            )
        if code == OBJECT_NOT_FOUND:
            return KeyResult(
                KeyStatus.FAILED, "the existing object vanished before it was verified"
            ), fatal
        if code == self._expected_bytes:
            segs = np.stack(
                [addr + self._memory.payload_offsets, np.asarray(self.layout.segment_lengths)],
                axis=1,
            ).astype(np.int64)
            header = self._memory.verify_header(offset)
            want = expected_header(key, self.layout, 0)
            status = _disk_io.verify_block(header, want, segs, self._ring)
            if status == _disk_io.ST_OK:
                return ALREADY_STORED, fatal
            why = describe_status(status)
        elif code < 0 and code != BUFFER_TOO_SMALL:
            return KeyResult(KeyStatus.FAILED, f"Mooncake get answered {code}"), fatal
        else:
            why = "wrong size"
        removed = self.store.remove(name)
        with self._lock:
            self.forged_puts += 1
            if removed == LEASE_HELD:
                self._condemned[name] = None
                while len(self._condemned) > _MAX_CONDEMNED:
                    del self._condemned[next(iter(self._condemned))]
        if removed == 0:
            done = "removed it"
        elif removed == LEASE_HELD:
            done = "it is removed by a later put once Mooncake's read lease ends"
        else:
            done = f"remove answered {removed}"
        return KeyResult(
            KeyStatus.FAILED,
            f"Mooncake holds an object under this key that is not this block ({why}): "
            f"not stored; {done}",
        ), fatal

    def _remove_condemned(self, names: list[str]) -> None:
        """Remove objects found not to verify whose removal the read lease refused."""
        with self._lock:
            due = [n for n in names if n in self._condemned]
        for name in due:
            code = self.store.remove(name)
            if code != LEASE_HELD:
                with self._lock:
                    self._condemned.pop(name, None)


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
