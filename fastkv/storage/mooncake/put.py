"""One batch of `MooncakeBackend` puts, and what it does about objects already
under its keys.

Zero-copy (the default), each block's header is sealed in the call's header slot
and Mooncake gathers the object from that slot and the block's own segments
(`batch_put_from_multi_buffers`): it reads the caller's memory until its call
returns, also for a put left behind at its deadline; memory changed meanwhile
makes the stored object fail verification, so it is never served. Staged, each
object is gathered (header, then segments) into the call's staging slot first,
under the call's lock and only while the caller still waits. A put refused for a
full pool (-200) is retried with a short backoff, at most `put_retries` times and
never past the deadline.

Objects already there: any client that reaches the master can put any key, and
keys are predictable, so an object under a key need not be this block. Mooncake
keeps the old value when a key is put again (answering 0 or -705), so a put first
asks which keys exist and reads those objects back: one that verifies is
ALREADY_STORED; one that does not (forged, or another deployment's) is removed at
once and the block put in its place, in the same call (counted in
`forged_puts`). The remove is forced: every existence check, size query and read
of a key renews Mooncake's read lease on it (measured: is_exist, get_size and get
all do), and a plain remove is refused (-706) while the lease runs, so on a key
in use (a shared system prompt, looked up every few hundred ms) a remove that
waited for the lease would never come. Forcing it is safe for fastkv: a reader
whose object vanishes mid-transfer reads bytes that fail verification (a miss),
never a wrong block. A -705 from the put itself (a key that appeared since the
existence check), or with verify_puts an object that does not verify after the
put, is removed the same way and answers FAILED: the next put stores the block.

What remains: this Mooncake answers 0 for a put of a key that already holds an
object (and keeps that object), so an object another client plants between the
existence check and the put passes for the block: that put counts as stored; its
reads still refuse it. It adds nothing to what any client can do anyway (replace
or delete any object at any time: misses, never wrong KV, as reads verify).
`verify_puts=True` closes it: every put is read back and counts as stored only if
the object verifies. It is off by default because a read-back costs a get (17-45 %
of put throughput measured over TCP loopback) and a get takes the master's read
lease (10 s by default), so objects just written cannot be evicted for that long:
on a pool smaller than write rate x lease, puts fail with -200.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from fastkv.storage import _disk_io
from fastkv.storage.base import (
    ALREADY_STORED,
    OK,
    BlockLayout,
    BlockSegments,
    KeyResult,
    KeyStatus,
    StorageKey,
)
from fastkv.storage.block_header import HEADER_BYTES, expected_header
from fastkv.storage.deadline_pool import LEFT_BEHIND, Call
from fastkv.storage.mooncake.codes import (
    BUFFER_TOO_SMALL,
    FATAL_CODES,
    OBJECT_EXISTS,
    OBJECT_NOT_FOUND,
    POOL_FULL,
    PUT_OK,
    describe_status,
)
from fastkv.storage.mooncake.memory import MooncakeMemory
from fastkv.storage.mooncake.options import MooncakeOptions


class MooncakePuts:
    """How a `MooncakeBackend` stores a batch of blocks in Mooncake.

    Args:
        store: the Mooncake store.
        layout: the blocks' segment lengths.
        ring: the key ring's bytes (`auth.ring_of`) objects are tagged and
            verified under.
        memory: the backend's registered memory (header, staging, verify slots).
        options: the backend's options (`put_retries`, `retry_backoff_s`,
            `verify_puts`).

    Attributes:
        verify_puts: read every stored object back (starts as `options.verify_puts`).
        forged_puts: objects found under a key that were not its block.
        pool_full_retries: keys put again after -200 (pool full).
        writes_host: False: Mooncake only reads the caller's blocks.
    """

    writes_host = False

    def __init__(
        self,
        store: object,
        layout: BlockLayout,
        ring: bytes,
        memory: MooncakeMemory,
        options: MooncakeOptions,
    ) -> None:
        self._store = store
        self._layout = layout
        self._ring = ring
        self._memory = memory
        self._staged = memory.staged
        self._object_bytes = memory.object_bytes
        self._lengths = [HEADER_BYTES, *layout.segment_lengths]
        self._retries = options.put_retries
        self._backoff_s = options.retry_backoff_s
        self.verify_puts = options.verify_puts
        self.forged_puts = 0
        self.pool_full_retries = 0
        self._lock = threading.Lock()  # the counters

    def part(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        arena: int,
        deadline: float,
        call: Call,
    ) -> tuple[list[KeyResult], str | None]:
        """One batch of puts: keys that already hold an object are read back (stored
        only if it is this block; an object that is not is removed and joins the
        puts); the others are sealed (or staged) and put, those the full pool
        refused retried; what the put met on the way, and with verify_puts what it
        stored, is read back. Returns the results and the fatal outcome (None if
        Mooncake's master answered every call)."""
        results: list[KeyResult | None] = [None] * len(keys)
        names = [k.text() for k in keys]
        exist = self._store.batch_is_exist(names)
        fatal_code = next((c for c in exist if c in FATAL_CODES), None)
        if fatal_code is not None:
            failed = KeyResult(KeyStatus.FAILED, f"Mooncake is_exist answered {fatal_code}")
            return [failed] * len(keys), f"is_exist answered {fatal_code}"
        pending = []
        met: list[int] = []  # keys holding an object: stored only if it is this block
        for j, code in enumerate(exist):
            (met if code == 1 else pending).append(j)
        removed: list[int] = []  # met an object that is not this block, removed it
        fatal = self._read_back(keys, met, results, arena, deadline, None, removed=removed)
        pending = sorted(pending + removed)
        ptrs = self._buffers(keys, blocks, pending, arena, call)
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

    def _buffers(
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
        nseg = self._layout.num_segments
        packed = memoryview(_disk_io.pack_segments([blocks[j] for j in pending], nseg))
        for i, j in enumerate(pending):
            key, segs = keys[j], blocks[j]
            seg_array = packed[16 * nseg * i : 16 * nseg * (i + 1)]
            if self._staged:
                header = bytearray(expected_header(key, self._layout, 0))
                with call.lock:  # the caller's block, while the caller still waits
                    if call.abandoned:
                        return None
                    _disk_io.stage_block(
                        self._memory.object_addr(arena, j), header, seg_array, self._ring
                    )
                ptrs[j] = self._memory.object_addr(arena, j)
                continue
            header_view = self._memory.header_view(arena, j)
            header_view[:] = expected_header(key, self._layout, 0)
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
        written: list[int] = []  # answered 0: stored, or met an object (see part)
        appeared: list[int] = []  # answered -705: met an object since is_exist
        for attempt in range(self._retries + 1):
            if not pending:
                break
            codes = self._objects([names[j] for j in pending], [ptrs[j] for j in pending])
            pending, fatal = self._sort_codes(pending, codes, results, written, appeared, fatal)
            if (
                not pending
                or attempt == self._retries
                or time.monotonic() + self._backoff_s >= deadline
            ):
                break
            with self._lock:
                self.pool_full_retries += len(pending)
            time.sleep(self._backoff_s)
        for j in pending:
            results[j] = KeyResult(
                KeyStatus.FAILED, "Mooncake pool full (-200) after every retry"
            )
        return written, appeared, fatal

    def _objects(self, names: list[str], ptrs: list[object]) -> list[int]:
        """One Mooncake put call for these objects; its codes."""
        if self._staged:
            return self._store.batch_put_from(names, ptrs, [self._object_bytes] * len(names))
        return self._store.batch_put_from_multi_buffers(
            names, ptrs, [self._lengths] * len(names)
        )

    def _sort_codes(
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
        removed: list[int] | None = None,
    ) -> str | None:
        """Reads the objects under keys[j] (j in `which`) back, a batch of verify
        slots per Mooncake call, and sets results[j]: `stored` for an object that is
        this block, else what _judge_existing says; keys whose object was not this
        block and is now removed are appended to `removed` (when given). Returns
        the fatal outcome."""
        size = self._object_bytes
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
            codes = self._store.batch_get_into(
                [keys[j].text() for j in part],
                [self._memory.verify_addr + off for off in offsets],
                [size] * len(part),
            )
            for j, off, code in zip(part, offsets, codes, strict=True):
                got, fatal = self._judge_existing(keys[j], off, code, fatal)
                results[j] = stored if got is ALREADY_STORED else got
                if removed is not None and got is _REMOVED:
                    removed.append(j)
        return fatal

    def _judge_existing(
        self, key: StorageKey, offset: int, code: int, fatal: str | None
    ) -> tuple[KeyResult, str | None]:
        """What a read-back of the object under `key` (into the verify area at
        `offset`, Mooncake answering `code`) means for a put: ALREADY_STORED if it
        is this block (its header and tag verify), `_REMOVED` for one that does not
        and is now removed (forced: see the module docstring), else FAILED."""
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
        if code == self._object_bytes:
            segs = np.stack(
                [addr + self._memory.payload_offsets, np.asarray(self._layout.segment_lengths)],
                axis=1,
            ).astype(np.int64)
            header = self._memory.verify_header(offset)
            want = expected_header(key, self._layout, 0)
            status = _disk_io.verify_block(header, want, segs, self._ring)
            if status == _disk_io.ST_OK:
                return ALREADY_STORED, fatal
            why = describe_status(status)
        elif code < 0 and code != BUFFER_TOO_SMALL:
            return KeyResult(KeyStatus.FAILED, f"Mooncake get answered {code}"), fatal
        else:
            why = "wrong size"
        removed = self._store.remove(name, force=True)
        with self._lock:
            self.forged_puts += 1
        if removed == 0:
            return _REMOVED, fatal
        return KeyResult(
            KeyStatus.FAILED,
            f"Mooncake holds an object under this key that is not this block ({why}): "
            f"not stored; its remove answered {removed}",
        ), fatal


_REMOVED = KeyResult(
    KeyStatus.FAILED,
    "Mooncake held an object under this key that was not this block: removed it; "
    "the next put stores the block",
)
"""What a read-back answers for an object it found to be another and removed (a
put that met it before putting puts the block in its place)."""


__all__ = ["MooncakePuts"]
