"""One batch of `MooncakeBackend` puts, and what it does about objects already
under its keys.

Every batch is prepared on the caller's own thread before it goes to a pool
thread (`prepare`), so no copy from the caller's memory can start once the caller
has been answered: staged (the default), each object is gathered (header, then
segments) into the call's staging slot; zero-copy, each block's header is sealed
in the call's header slot and Mooncake gathers the object from that slot and the
block's own segments (`batch_put_from_multi_buffers`): it reads the caller's
memory until its call returns, also for a put left behind at its deadline; memory
changed meanwhile makes the stored object fail verification, so it is never
served. A batch whose caller was answered (TIMEOUT) before its pool thread got to
it puts nothing. A put refused for a full pool (-200) is retried with a short
backoff, at most `put_retries` times and never past the deadline.

Objects already there: any client that reaches the master can put any key, and
keys are predictable, so an object under a key need not be this block.

Staged, a put replaces whatever is under its keys (`batch_upsert_from`): a forged
object, or another deployment's, does not survive it, and nothing that was there is
read, let alone trusted. Measured on the venv's Mooncake (0.3.13.post1, real master,
tests/storage/test_mooncake.py): an upsert replaces an object of any size under a
read lease (which a plain remove must wait out, -706), and a put answers 0 for a key
that holds an object and keeps that object: with upsert that object cannot pass for
the block. The cost: a block already stored is sent again (no existence check, no
read-back), and a read of the key while it is replaced in place can see a mix of
old and new bytes, which fails verification: a miss, never a wrong block.

Zero-copy (Mooncake has no multi-buffer upsert), a put first asks which keys exist
and reads those objects back: one that verifies is ALREADY_STORED; one that does
not is removed at once and the block put in its place, in the same call (counted in
`forged_puts`). The remove is forced: every existence check, size query and read of
a key renews Mooncake's read lease on it (measured: is_exist, get_size and get all
do), and a plain remove is refused (-706) while the lease runs, so on a key in use
(a shared system prompt, looked up every few hundred ms) a remove that waited for
the lease would never come. Forcing it is safe for fastkv: a reader whose object
vanishes mid-transfer reads bytes that fail verification (a miss), never a wrong
block. A -705 from the put itself (a key that appeared since the existence check),
or with verify_puts an object that does not verify after the put, is removed the
same way and answers FAILED: the next put stores the block. What remains there: an
object another client plants between the existence check and the put passes for
the block (this Mooncake answers 0 and keeps it): that put counts as stored; its
reads still refuse it. It adds nothing to what any client can do anyway (replace
or delete any object at any time: misses, never wrong KV, as reads verify).

`verify_puts=True` (either way) reads every put back and counts it as stored only
if the object verifies. It is off by default because a read-back costs a get (17-45
% of put throughput measured over TCP loopback) and a get takes the master's read
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
        # Zero-copy buffer sizes per object: the header, then the block's segments
        # in either form (`BlockSegments`), told apart by their count.
        self._lengths = {
            1 + layout.num_segments: [HEADER_BYTES, *layout.segment_lengths],
            2: [HEADER_BYTES, layout.payload_bytes],
        }
        self._retries = options.put_retries
        self._backoff_s = options.retry_backoff_s
        self.verify_puts = options.verify_puts
        self.forged_puts = 0
        self.pool_full_retries = 0
        self._lock = threading.Lock()  # the counters

    def prepare(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        segs: memoryview,
        arena: int,
    ) -> list[object] | Exception:
        """On the caller's thread, before the batch goes to the pool: what Mooncake
        puts for each key (staged: the object gathered into the staging area;
        zero-copy: the header sealed in the arena, then the block's segments), or
        the error preparing raised (answered by `part` as a failure). `segs`: the
        pairs each block is sealed over, as int64s, block after block (the
        backend's `_seal_pairs`)."""
        try:
            return self._buffers(keys, blocks, segs, arena)
        except Exception as e:  # raised again on the pool thread, as a failed call
            return e

    def part(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        arena: int,
        deadline: float,
        call: Call,
        prep: list[object] | Exception,
    ) -> tuple[list[KeyResult], str | None]:
        """One batch of puts of the objects `prepare` made: staged, each replaces
        whatever is under its key; zero-copy, keys that already hold an object are
        read back first (stored only if it is this block; one that is not is
        removed and joins the puts). Those the full pool refused are retried; what
        a put met on the way, and with verify_puts what it stored, is read back.
        Returns the results and the fatal outcome (None if Mooncake's master
        answered every call)."""
        if isinstance(prep, Exception):
            raise RuntimeError(f"preparing the objects failed: {prep}") from prep
        results: list[KeyResult | None] = [None] * len(keys)
        names = [k.text() for k in keys]
        pending = list(range(len(keys)))
        fatal: str | None = None
        if not self._staged:
            found, fatal = self._existing(keys, names, results, arena, deadline)
            if found is None:  # is_exist answered a fatal code: every key failed
                return results, fatal  # type: ignore[return-value]
            pending = found
        with call.lock:
            if call.abandoned:  # the caller was answered: its put stores nothing
                return [LEFT_BEHIND] * len(keys), fatal
        written, appeared, fatal = self._put_with_retries(
            names, pending, prep, results, deadline, fatal
        )
        # 0 also answers a plain put that met an object: stored only if what is
        # there now is this block.
        fatal = self._read_back(keys, appeared, results, arena, deadline, fatal)
        fatal = self._read_back(keys, written, results, arena, deadline, fatal, stored=OK)
        return results, fatal  # type: ignore[return-value]

    def _existing(
        self,
        keys: Sequence[StorageKey],
        names: list[str],
        results: list[KeyResult | None],
        arena: int,
        deadline: float,
    ) -> tuple[list[int] | None, str | None]:
        """Zero-copy: which keys already hold an object; those are read back (results
        set: ALREADY_STORED when it is this block) and one that is not is removed.
        Returns the keys to put (None, every result FAILED, when is_exist answered
        a fatal code) and the fatal outcome."""
        exist = self._store.batch_is_exist(names)
        fatal_code = next((c for c in exist if c in FATAL_CODES), None)
        if fatal_code is not None:
            failed = KeyResult(KeyStatus.FAILED, f"Mooncake is_exist answered {fatal_code}")
            results[:] = [failed] * len(keys)
            return None, f"is_exist answered {fatal_code}"
        pending = []
        met: list[int] = []  # keys holding an object: stored only if it is this block
        for j, code in enumerate(exist):
            (met if code == 1 else pending).append(j)
        removed: list[int] = []  # met an object that is not this block, removed it
        fatal = self._read_back(keys, met, results, arena, deadline, None, removed=removed)
        return sorted(pending + removed), fatal

    def _buffers(
        self,
        keys: Sequence[StorageKey],
        blocks: Sequence[BlockSegments],
        segs: memoryview,
        arena: int,
    ) -> list[object]:
        """What Mooncake puts for each key: staged, the object gathered (header,
        then segments) into the staging area; zero-copy, the header sealed in the
        arena, then the block's own segments."""
        row = len(segs) // len(keys)
        memory, layout, ring = self._memory, self._layout, self._ring
        ptrs: list[object] = []
        for j, key in enumerate(keys):
            seg_array = segs[row * j : row * (j + 1)]
            if self._staged:
                addr = memory.object_addr(arena, j)
                header = bytearray(expected_header(key, layout, 0))
                _disk_io.stage_block(addr, header, seg_array, ring)
                ptrs.append(addr)
                continue
            header_view = memory.header_view(arena, j)
            header_view[:] = expected_header(key, layout, 0)
            _disk_io.seal_header(header_view, seg_array, ring)
            ptrs.append([memory.header_addr(arena, j), *(p for p, _ in blocks[j])])
        return ptrs

    def _put_with_retries(
        self,
        names: list[str],
        pending: list[int],
        ptrs: list[object],
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
        """One Mooncake put call for these objects (staged: replacing whatever is
        under their keys); its codes."""
        if self._staged:
            return self._store.batch_upsert_from(names, ptrs, [self._object_bytes] * len(names))
        return self._store.batch_put_from_multi_buffers(
            names,
            ptrs,
            [self._lengths[len(p)] for p in ptrs],  # type: ignore[arg-type]
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
