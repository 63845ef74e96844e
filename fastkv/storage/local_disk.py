"""The embedded storage backend: fixed-size slots in one preallocated file.

Directory layout:

    LOCK                  flock'ed exclusively while a backend has the directory open
                          (read-only without it: the directory itself is flock'ed)
    fastkv-storage.json   format and slot geometry; a backend with another refuses
    blocks.fkv            slot i at i * slot_bytes, preallocated one slab at a time

The directory is private: it must be owned by the process's effective uid and
writable by no one else (otherwise it is refused), is made 0700 and every file in
it 0600 whatever the umask. It is opened once with O_DIRECTORY | O_NOFOLLOW and
every file is opened relative to it with O_NOFOLLOW (a symlink is refused, never
followed; a file with another owner or a second hard link is refused too; these
checks are fastkv.private_files', applied in `disk_dir`); temporary and probe
files are created with O_EXCL under unpredictable names.

Why slots in one file rather than a file per block (measured once, when this
layout was chosen, on the 2-core development VM and its virtual disk; the
file-per-block variant is not in the repository): writing a new file + rename per
block ran at 0.15 / 0.5 / 0.8 GB/s for 256 KiB / 2 MiB / 8 MiB blocks against
0.87 / 1.3 / 1.3-1.6 GB/s overwriting a slot; `unlink` on eviction cost 0.3-3 ms,
a slot costs nothing to evict (the index forgets it; its next write overwrites
it); a cold scan of 100k files took 2.7 s with `stat`, 22 s reading headers.
`tools/bench_storage.py` measures this layout against raw O_DIRECT I/O of the same
blocks. docs/storage.md has both sets of figures ("Why slots in one file").

A slot: [128-byte header | small segments packed | pad to 4 KiB][large segments].
Large segments (a multiple of 4096 bytes: K and V of a layer) move zero-copy between
host memory and the file with one pwritev/preadv per block, or per run of blocks
whose slots follow one another (up to 1 MiB: a call costs more than a small block's
bytes); small ones (fp8 scales) go through a per-thread bounce page with the
header. The file is opened with O_DIRECT when its slots are 64 KiB or more and a
probe write succeeds (page-cache copies halved write speed here), buffered otherwise
(small slots: an O_DIRECT write of a few KiB costs a device round trip; see
`DIRECT_MIN_SLOT_BYTES`). No fsync on the hot path:
every read verifies header and checksum, so a torn or lost write is a miss, never
garbage. A block a read rejects is read once more, into the backend's own memory,
before it is dropped: only when that read rejects it too (a first read can meet
bytes in motion); a partial read or write goes on from where it stopped.

The index (key -> slot, seq; LRU order) lives in memory. A new process on the same
directory scans slot headers in the background; until the scan reaches a slot, its
key answers miss and the slot is not reused. Eviction is index-only (no I/O) and
never takes a slot a read or write is using.

close() stops the calls in flight before it closes anything: a flag the C batch
reads before each block makes the blocks not yet started answer FAILED ("closed"),
and close() waits (bounded) for the block each call is moving. Should a call stay
stuck in the kernel past that bound, the files stay open until it returns (closed
by the last call out, with a warning): a file descriptor is never used after it
was closed, so nothing is ever written into a file the process opens later.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastkv.storage import _disk_io
from fastkv.storage.auth import ENV_KEY_FILE, StorageAuth, ring_of
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
    check_deadline,
    check_keys,
    check_segments,
)
from fastkv.storage.block_header import (
    HEADER_BYTES,
    header_parts,
    parse_header,
)
from fastkv.storage.disk_dir import (
    ALIGN,
    FILE_MODE,
    StorageDirectoryLocked,
    StorageDirectoryUnsafe,
    check_meta_matches,
    lock_directory,
    open_file,
    open_private_directory,
    probe_direct,
)
from fastkv.storage.disk_keys import (
    ENV_RECLAIM,
    FREE,
    HOLD,
    SlotKeys,
    StorageKeyMissing,
    reclaim_from_environment,
)
from fastkv.storage.disk_slots import SlotTable

log = logging.getLogger(__name__)

FORMAT = 2  # 1: block header version 1 (no key id, no tag)
DATA_FILE = "blocks.fkv"
META_FILE = "fastkv-storage.json"
_SCAN_CHUNK = 4096
_SCAN_THREADS = 8
_CLOSE_TIMEOUT_S = 30.0
DIRECT_MIN_SLOT_BYTES = 64 << 10
"""Slots smaller than this are written through the page cache (direct_io=None):
an O_DIRECT write of one is a device round trip for a few KiB (8 KiB: 76-87 us p50
here, against 4-5 us buffered; 64 KiB: 102 against 11), and the kernel's
write-back merges neighbouring slots into large writes. Larger slots (KV blocks of
real models: 256 KiB and up) move zero-copy with O_DIRECT, where page-cache copies
halved write speed."""


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """Where each segment of a block sits in its slot."""

    header_area: int
    slot_bytes: int
    segment_offsets: np.ndarray  # int64, one per segment
    large: np.ndarray  # bool, segments stored after the header area

    @classmethod
    def of(cls, layout: BlockLayout) -> SlotGeometry:
        lengths = layout.segment_lengths
        large = np.array([n % ALIGN == 0 for n in lengths], dtype=bool)
        offsets = np.zeros(len(lengths), dtype=np.int64)
        pos = HEADER_BYTES
        for i, n in enumerate(lengths):
            if not large[i]:
                offsets[i] = pos
                pos += n
        header_area = _align(pos)
        pos = header_area
        for i, n in enumerate(lengths):
            if large[i]:
                offsets[i] = pos
                pos += n
        return cls(header_area, pos, offsets, large)


class _Packed:
    """A call's blocks, checked: their (address, length) pairs as int64s, block
    after block (`_disk_io.check_pack`), and whether a segment that moves zero-copy
    is misaligned in any of them. (A plain class: a frozen dataclass took 1.5 us
    to make, a tenth of a one-block put's Python.)"""

    __slots__ = ("blocks", "misaligned", "pairs")

    def __init__(
        self, pairs: bytearray, misaligned: bool, blocks: Sequence[BlockSegments]
    ) -> None:
        self.pairs, self.misaligned, self.blocks = pairs, misaligned, blocks

    def rows(self, todo: list[int], n: int) -> bytes | bytearray:
        """The pairs of blocks `todo` (of `n`), in that order."""
        if len(todo) == n:
            return self.pairs
        row = len(self.pairs) // n
        view = memoryview(self.pairs)
        return b"".join(view[i * row : (i + 1) * row] for i in todo)


class LocalDiskBackend(StorageBackend):
    """Blocks in fixed-size slots of one file in `directory`.

    Args:
        directory: created if missing; locked exclusively while open.
        layout: the segment lengths of every block.
        capacity_blocks / capacity_bytes: exactly one; bytes are rounded down to
            whole slots. At least one slot.
        direct_io: True requires O_DIRECT, False never uses it, None: O_DIRECT
            for slots of `DIRECT_MIN_SLOT_BYTES` or more when a probe write takes
            it, buffered otherwise (smaller slots always).
        recover: scan what a previous process stored (in the background).
        io_delay_s: fault injection: sleep this long before each block's I/O (a slow
            disk, for tests of deadlines).
        auth: the key ring that tags every block written and verifies every block
            read (fastkv.storage.auth). None: `FASTKV_STORAGE_KEY_FILE` when set,
            else no tags (blocks carry a CRC only: anyone able to write the
            directory, i.e. this uid or root, could forge one).
        reclaim: give up the blocks signed by keys the ring lacks (their slots are
            reused); without it they are kept (fastkv.storage.disk_keys). None:
            `FASTKV_STORAGE_RECLAIM` ("1": reclaim; "0" or unset: keep).
        read_only: serve the blocks already there and write nothing (every put
            answers FAILED, counted in `stats().put_failures`; nothing in the
            directory changes, not even its metadata). None: read-only when the
            directory's filesystem is mounted read-only (logged), else not.

    Raises:
        ValueError: bad argument, or the directory holds another format or slot
            geometry (the message names the difference), or it is read-only and
            holds no cache.
        StorageKeyMissing: the directory holds blocks signed by keys of which the
            ring (or the lack of one) verifies none, and `reclaim` is off.
        StorageDirectoryUnsafe: the directory or a file in it is not private.
        StorageDirectoryLocked: the directory is in use.
        OSError: the directory cannot be created or opened, or O_DIRECT was
            required and the filesystem refuses it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        layout: BlockLayout,
        capacity_blocks: int | None = None,
        capacity_bytes: int | None = None,
        direct_io: bool | None = None,
        recover: bool = True,
        io_delay_s: float = 0.0,
        auth: StorageAuth | None = None,
        reclaim: bool | None = None,
        read_only: bool | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = True  # until opened
        self._users = 0  # calls (and the recovery scan) using the files
        self._release_when_idle = False
        self._fd = self._lock_fd = self._dir_fd = -1
        if auth is not None and not isinstance(auth, StorageAuth):
            raise ValueError(f"auth: must be a StorageAuth or None, got {type(auth).__name__}")
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"layout: must be a BlockLayout, got {type(layout).__name__}")
        self.layout = layout
        self.geometry = SlotGeometry.of(layout)
        self._large_segments = [int(s) for s in np.flatnonzero(self.geometry.large)]
        self._lengths = np.array(layout.segment_lengths, dtype=np.int64).tobytes()
        self._payload_bytes = layout.payload_bytes
        self._header_parts = header_parts(layout)
        capacity = _capacity(capacity_blocks, capacity_bytes, self.geometry.slot_bytes)
        if direct_io not in (None, True, False):
            raise ValueError(f"direct_io: must be None, True or False, got {direct_io!r}")
        if (
            isinstance(io_delay_s, bool)
            or not isinstance(io_delay_s, (int, float))
            or not 0 <= io_delay_s < 3600
        ):
            raise ValueError(f"io_delay_s: must be in [0, 3600) seconds, got {io_delay_s!r}")
        self.io_delay_s = float(io_delay_s)
        for name, value in (("reclaim", reclaim), ("read_only", read_only)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: must be None, True or False, got {value!r}")
        reclaim = reclaim_from_environment() if reclaim is None else reclaim
        self.auth = auth if auth is not None else StorageAuth.from_environment()
        self._ring = ring_of(self.auth)
        self._cancel = np.zeros(1, dtype=np.int32)  # read by the C batch before each block
        self._cancel_addr = self._cancel.ctypes.data
        self.directory = Path(directory)
        self._dir_fd = open_private_directory(self.directory)
        try:
            self._open_files(capacity, direct_io, recover, reclaim, read_only)
        except BaseException:
            self._release_files()
            raise
        if self.auth is None:
            log.info(
                "fastkv storage: %s: blocks are not authenticated (no key ring; set %s): "
                "whoever can write this directory could forge one",
                self.directory,
                "FASTKV_STORAGE_KEY_FILE",
            )
        self._file_gone = ""  # why puts fail: the slot file was deleted or replaced
        self._seq = time.time_ns()
        self._stats = StorageStats(capacity_blocks=capacity)
        self._local = threading.local()
        self._closed = False
        self._stop_scan = threading.Event()
        self._scan_done = threading.Event()
        self._scanner: threading.Thread | None = None
        if self._scan_slots_upto:
            self._users += 1  # the scan reads the file: close() waits for it too
            self._scanner = threading.Thread(
                target=self._scan, name="fastkv-disk-recovery", daemon=True
            )
            self._scanner.start()
        else:
            self._scan_done.set()

    # -- the interface ----------------------------------------------------------

    def exists(self, keys: Sequence[StorageKey], deadline: float) -> list[bool]:
        self._check_batch(keys, None, deadline)
        self._check_open()
        with self._lock:
            return [k.packed in self._slots.index for k in keys]

    def get_into(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        segs = self._checked(keys, blocks, deadline)
        return self._get_into(keys, segs, deadline)

    def _checked(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> _Packed:
        """The checks of `_check_batch` (keys, deadline, one block per key, each
        block's segments against the layout: the same errors), the segments packed
        for the C batch on the way."""
        # the common argument types checked inline; anything else goes through
        # check_keys / check_deadline (the same errors, one function call less
        # per check on the one-block path)
        if type(keys) is not list or (
            type(keys[0]) is not StorageKey if len(keys) == 1 else len(keys) > 1
        ):
            check_keys(keys)
        if type(deadline) is not float or deadline != deadline:
            check_deadline(deadline)
        if len(blocks) != len(keys):
            raise ValueError(f"blocks: {len(blocks)} entries for {len(keys)} keys")
        if len(self.layout.lengths_for(blocks)) != self.layout.num_segments:
            # One contiguous segment per block (the host tier's): checked as such,
            # then cut into the layout's segments, which the slot places apart
            # (misaligned ones go through the packing path as ever).
            check_segments(blocks, self.layout)
            blocks = self.layout.in_segments(blocks)
        packed, misaligned = _disk_io.check_pack(blocks, self._lengths)
        return _Packed(packed, misaligned, blocks)

    def _get_into(
        self, keys: Sequence[StorageKey], segs: _Packed, deadline: float
    ) -> list[KeyResult]:
        """A checked get: two sections under the lock, one before the reads (the
        call counted in, slots looked up and pinned) and one after (unpinned,
        answered, counted, counted out)."""
        results: list[KeyResult] = [OK] * len(keys)
        todo: list[int] = []
        where: list[tuple[int, int]] = []
        with self._lock:
            self._enter_held()
            index, pins = self._slots.index, self._slots.pins
            for i, key in enumerate(keys):
                entry = index.get(key.packed)
                if entry is None:
                    results[i] = KeyResult(KeyStatus.MISS, "not stored")
                    continue
                index.move_to_end(key.packed)
                pins[entry[0]] += 1
                todo.append(i)
                where.append(entry)
        statuses: list[int] = []
        rereads: list[int] = []
        answered = release = False
        try:
            statuses = self._run(False, keys, segs, todo, where, deadline) if todo else []
            rereads = self._reread_rejected(keys, todo, where, statuses, deadline)
            answered = True
        finally:
            with self._lock:
                for slot, _ in where:
                    self._slots.unpin(slot)
                if answered:
                    for k, (i, (slot, seq), status) in enumerate(
                        zip(todo, where, statuses, strict=True)
                    ):
                        if status != _disk_io.ST_OK:
                            again = rereads[k] if rereads else _disk_io.ST_OK
                            results[i] = self._read_result(keys[i], slot, seq, status, again)
                    self._stats.count_gets(results, self._payload_bytes)
                release = self._leave_held()
            if release:
                self._release_late()
        return results

    def _reread_rejected(
        self,
        keys: Sequence[StorageKey],
        todo: list[int],
        where: list[tuple[int, int]],
        statuses: list[int],
        deadline: float,
    ) -> list[int]:
        """Read the blocks a read rejected once more, into memory of the backend's
        own (still pinned), and return each one's status ([] when none was
        rejected; ST_OK for those not rejected). A block is dropped only when this
        second read rejects it too: the first may have met bytes that were moving
        (a read racing a write of the slot, a torn page, the caller's memory
        changed under the check), and a good block must not be lost to that."""
        bad = [k for k, st in enumerate(statuses) if st in _REJECTED]
        if not bad:
            return []
        lengths = self.layout.segment_lengths
        offsets = np.cumsum([0, *(_align(n) for n in lengths)])
        buf = mmap.mmap(-1, int(offsets[-1]) * len(bad))
        try:
            base = _address(buf)
            stride = int(offsets[-1])
            own = [
                [
                    (base + b * stride + int(o), n)
                    for o, n in zip(offsets, lengths, strict=False)
                ]
                for b in range(len(bad))
            ]
            blocks = [own[0]] * len(keys)
            for b, k in enumerate(bad):
                blocks[todo[k]] = own[b]
            packed, misaligned = _disk_io.check_pack(blocks, self._lengths)
            again = self._run(
                False,
                keys,
                _Packed(packed, misaligned, blocks),
                [todo[k] for k in bad],
                [where[k] for k in bad],
                deadline,
            )
        finally:
            buf.close()
        out = [_disk_io.ST_OK] * len(statuses)
        for k, st in zip(bad, again, strict=True):
            out[k] = st
        return out

    def put_from(
        self, keys: Sequence[StorageKey], blocks: Sequence[BlockSegments], deadline: float
    ) -> list[KeyResult]:
        if (  # a lone block, the latency-bound case
            type(keys) is list
            and len(keys) == 1
            and type(keys[0]) is StorageKey
            and type(deadline) is float
            and deadline == deadline
            and type(blocks) is list
            and len(blocks) == 1
            and not (self.read_only or self._file_gone)
        ):
            # in the host tier's form (one contiguous region), checked and cut at
            # the layout's segments in C; any other form, the general way below
            got = _disk_io.cut_pack(blocks, self._lengths)
            if got is not None and not (got[1] and self.direct_io):
                return self._put_one(keys, got[0], deadline)
        segs = self._checked(keys, blocks, deadline)
        gone = _READ_ONLY if self.read_only else self._file_gone
        if gone:
            self._enter()
            results = [KeyResult(KeyStatus.FAILED, gone)] * len(keys)
            self._leave(results)
            return results
        return self._put_from(keys, segs, deadline)

    def _put_one(
        self, keys: list[StorageKey], pairs: bytearray, deadline: float
    ) -> list[KeyResult]:
        """`_put_from` of a lone, checked block that moves zero-copy (the same
        sections, answers and counts), in fewer Python calls: a lone put is
        latency-bound, and its Python often runs on a CPU gone cold (after an I/O
        wait), where each call costs several times what it costs hot. A put of a
        stored key, or with no slot to take, touches no file: not counted in."""
        packed, slots = keys[0].packed, self._slots
        where: list[tuple[int, int]] = []  # the slot taken, once it is
        statuses = [-errno.EIO]  # as a write that raised: nothing stored
        answered = release = False
        try:  # a slot taken before a raise goes back in the finally (as `_put_from`)
            with self._lock:
                if self._closed:
                    raise RuntimeError("the storage backend is closed")
                if packed in slots.index:
                    slots.index.move_to_end(packed)
                    results = [ALREADY_STORED]
                else:
                    seq = max(self._seq + 1, time.time_ns())
                    slot = slots.free.pop() if slots.free else slots.take()
                    results = [OK] if slot is not None else [self._no_slot_result()]
                if results[0] is not OK:
                    self._stats.count_puts(results, self._payload_bytes)
                    return results
                # no call between the slot's taking and these three statements,
                # nor in them: an interrupt (KeyboardInterrupt) lands before the
                # taking returns or after the slot is in `where` and the call
                # counted in, never between (the window `_put_from` leaves too)
                where = [(slot, seq)]
                self._seq = seq
                self._users += 1
            statuses = self._move(True, keys, pairs, _ONE, where, deadline, False)
            answered = True
        finally:
            if where:
                with self._lock:
                    self._settle_writes(keys, _ONE, where, statuses, results)
                    if answered:  # a call that raises counts nothing (as `_put_from`)
                        self._stats.count_puts(results, self._payload_bytes)
                    release = self._leave_held()
                if release:
                    self._release_late()
        return results

    def _put_from(
        self, keys: Sequence[StorageKey], segs: _Packed, deadline: float
    ) -> list[KeyResult]:
        """A checked put: two sections under the lock, one before the writes (the
        call counted in, slots taken) and one after (settled, counted, counted
        out). The C batch checks after its writes that the slot file is still
        linked under its name (`_file_gone`)."""
        results: list[KeyResult] = [OK] * len(keys)
        todo: list[int] = []
        where: list[tuple[int, int]] = []
        first: dict[bytes, int] = {}
        repeats = False
        now_ns = time.time_ns()  # one clock read per call; seqs still rise by one per block
        statuses: list[int] = []
        entered = answered = release = False
        try:  # slots taken before a raise go back in the finally (settled as failed)
            with self._lock:
                self._enter_held()  # raises once closed: then not counted in, nor out
                entered = True
                index, free = self._slots.index, self._slots.free
                seq = max(self._seq, now_ns - 1)
                for i, key in enumerate(keys):
                    packed = key.packed
                    if packed in index:
                        index.move_to_end(packed)
                        results[i] = ALREADY_STORED
                        continue
                    if packed in first:  # a repeat: answered with its first occurrence below
                        repeats = True
                        continue
                    slot = free.pop() if free else self._slots.take()
                    if slot is None:
                        results[i] = self._no_slot_result()
                        continue
                    first[packed] = i
                    seq += 1
                    todo.append(i)
                    where.append((slot, seq))
                self._seq = seq
            statuses = self._run(True, keys, segs, todo, where, deadline) if todo else []
            answered = True
        finally:
            if not answered:  # raised: nothing was stored
                statuses = [-errno.EIO] * len(todo)
            with self._lock:
                self._settle_writes(keys, todo, where, statuses, results)
                if answered:
                    # repeats share their first occurrence's fate
                    for i, key in enumerate(keys if repeats else ()):
                        j = first.get(key.packed)
                        if j is not None and j != i:
                            results[i] = ALREADY_STORED if results[j].ok else results[j]
                    self._stats.count_puts(results, self._payload_bytes)
                release = entered and self._leave_held()
            if release:
                self._release_late()
        return results

    @property
    def recovering(self) -> bool:
        """True while the background scan has slots left."""
        return not self._scan_done.is_set()

    def wait_recovered(self, timeout: float) -> bool:
        """Wait (bounded) for the background scan; True when it has finished."""
        return self._scan_done.wait(timeout)

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> bool:
        """Stop the calls in flight, wait for them, then close the files and unlock
        the directory. Idempotent.

        Blocks a call has not started by now answer FAILED ("closed"); a block being
        written finishes (a put answered OK is in the file: on the device under
        O_DIRECT, in the page cache when buffered; never fsynced). Waits at most `timeout`
        seconds for the calls to return; if one is still stuck in the kernel then
        (a hung disk), logs what it waits for and returns False, and the files stay
        open (and the directory locked) until the last such call returns.

        Returns:
            True when everything was closed before returning.

        Raises:
            ValueError: timeout is negative or not a number.
        """
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not timeout >= 0
        ):
            raise ValueError(f"timeout: must be a number of seconds >= 0, got {timeout!r}")
        with self._lock:
            if self._closed:
                return self._fd < 0 and self._lock_fd < 0
            self._closed = True
            self._cancel[0] = 1
            self._stop_scan.set()
            end = time.monotonic() + timeout
            while self._users and time.monotonic() < end:
                self._idle.wait(max(0.0, end - time.monotonic()))
            if self._users:
                self._release_when_idle = True
                log.warning(
                    "fastkv storage: close of %s: %d call(s) still inside a disk read or "
                    "write after %.1f s; %s stays open and locked until they return",
                    self.directory,
                    self._users,
                    timeout,
                    DATA_FILE,
                )
                return False
        self._release_files()
        return True

    def _enter(self) -> None:
        """Count a call that uses the files (refused once closed)."""
        with self._lock:
            self._enter_held()

    def _enter_held(self) -> None:
        """`_enter`, the lock held."""
        if self._closed:
            raise RuntimeError("the storage backend is closed")
        self._users += 1

    def _settle_writes(
        self,
        keys: Sequence[StorageKey],
        todo: list[int],
        where: list[tuple[int, int]],
        statuses: list[int],
        results: list[KeyResult],
    ) -> None:
        """Index each written block, or give its slot back with the failure in
        `results` (lock held; one call per put, no call per block)."""
        index, free = self._slots.index, self._slots.free
        for i, entry, status in zip(todo, where, statuses, strict=True):
            packed = keys[i].packed
            if status != _disk_io.ST_OK:
                free.append(entry[0])
                results[i] = (
                    KeyResult(KeyStatus.FAILED, self._slot_file_gone(status))
                    if status in _FILE_GONE
                    else _write_failure(status)
                )
            elif packed in index:  # a concurrent put stored it first
                free.append(entry[0])
            else:
                index[packed] = entry

    def _leave(self, puts: list[KeyResult] | None = None) -> None:
        """Count a call out (and count the puts it answered, when given)."""
        with self._lock:
            if puts is not None:
                self._stats.count_puts(puts, self._payload_bytes)
            release = self._leave_held()
        if release:
            self._release_late()

    def _leave_held(self) -> bool:
        """Count a call out, the lock held; True when the caller must then (the lock
        released) close the files: close() gave up waiting for this last call."""
        self._users -= 1
        if self._users or not self._closed:  # only close() waits for the calls
            return False
        self._idle.notify_all()
        release = self._release_when_idle
        self._release_when_idle = False
        return release

    def _release_late(self) -> None:
        self._release_files()
        log.warning("fastkv storage: %s closed after its last call returned", self.directory)

    def _release_files(self) -> None:
        """Close the files (no call uses them any more) and unlock the directory."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def _slot_file_gone(self, status: int) -> str:
        """A write found blocks.fkv deleted or replaced under the backend (status
        ST_FILE_DELETED or ST_FILE_REPLACED: the name no longer names the file
        written, so no later process would find the block): why puts fail from now
        on (`_file_gone`, kept), logged once."""
        if not self._file_gone:
            deleted = status == _disk_io.ST_FILE_DELETED
            reason = "was deleted" if deleted else "was replaced by another file"
            self._file_gone = text = (
                f"the slot file {self.directory / DATA_FILE} {reason} while open: a block "
                "written now would be lost on restart; reopen the backend"
            )
            log.error("fastkv storage: %s (puts fail from now on; reads still verify)", text)
        return self._file_gone

    def _live_stats(self, snap: StorageStats) -> None:
        snap.stored_blocks = len(self._slots.index)
        snap.evictions = self._slots.evictions

    # -- slots --------------------------------------------------------------------

    def _no_slot_result(self) -> KeyResult:
        err = self._slots.grow_error
        if err is not None and self._slots.allocated < self._slots.capacity:
            reason = f"no space to grow the slot file: {err.strerror}"
        elif self.recovering:
            reason = "no free slot while recovery scans the directory"
        elif self._slots.held:
            reason = (
                f"every slot is being read or written, or holds a block signed by a key "
                f"the ring lacks ({self._slots.held} held; {ENV_RECLAIM}=1 frees them)"
            )
        else:
            reason = "every slot is being read or written"
        return KeyResult(KeyStatus.FAILED, reason)

    def _read_result(
        self, key: StorageKey, slot: int, seq: int, status: int, again: int
    ) -> KeyResult:
        """What a read of `key` from (slot, seq) that ended in `status` answers;
        `again`: the status of a second read of a rejected block (_reread_rejected).
        """
        if status == _disk_io.ST_OK:
            return OK
        if status == _disk_io.ST_TIMEOUT:
            return KeyResult(KeyStatus.TIMEOUT, "deadline passed before the read")
        if status == _disk_io.ST_CLOSED:
            return KeyResult(KeyStatus.FAILED, "the backend closed before the read")
        if status < 0 or status == _disk_io.ST_NO_BOUNCE:
            # An I/O error, or no staging buffer for this host memory (a local
            # condition, not bad data): the stored block stays indexed.
            return KeyResult(KeyStatus.FAILED, f"read failed: {_describe(status)}")
        if again not in _REJECTED:
            # Read again whole (or not read again: a deadline, an I/O error): not
            # proven bad, so it stays; this read is a miss.
            return KeyResult(
                KeyStatus.MISS,
                f"read did not verify ({_describe(status)}), a second read "
                + ("did" if again == _disk_io.ST_OK else f"ended in: {_describe(again)}")
                + "; the stored block is kept",
            )
        # Not provably this block: forget it (unless the slot was rewritten meanwhile).
        self._stats.corrupt += 1
        if self._slots.index.get(key.packed) == (slot, seq):
            del self._slots.index[key.packed]
            self._slots.release(slot)
        return KeyResult(KeyStatus.MISS, f"stored block rejected: {_describe(status)}")

    # -- I/O ----------------------------------------------------------------------

    def _run(
        self,
        write: bool,
        keys: Sequence[StorageKey],
        packed: _Packed,
        todo: list[int],
        where: list[tuple[int, int]],
        deadline: float,
    ) -> list[int]:
        segs = packed.rows(todo, len(keys))
        # Misaligned host memory under O_DIRECT stages whole slots, one at a time;
        # otherwise checksums are pipelined with the I/O, every block has a header
        # page of its own (a write stages the headers of blocks whose slots follow
        # one another, to move them in one call; a read keeps each until its
        # verification).
        full = packed.misaligned and self._needs_full_bounce(packed, todo)
        return self._move(write, keys, segs, todo, where, deadline, full)

    def _move(
        self,
        write: bool,
        keys: Sequence[StorageKey],
        segs: bytes | bytearray,
        todo: list[int],
        where: list[tuple[int, int]],
        deadline: float,
        full: bool,
    ) -> list[int]:
        """The C batch over blocks `todo` of `keys`, their segment pairs `segs`, in
        slots `where`; `full`: a block stages its whole slot (`_run`)."""
        g = self.geometry
        # The C batch makes each block's header (the layout's parts around the key's
        # packed form, then its seq) and slot offset from these, in one pass.
        headers = (*self._header_parts, keys, todo, where)
        bounce = self._bounce(g.slot_bytes if full else g.header_area * len(todo))
        call = _disk_io.write_batch if write else _disk_io.read_batch
        return call(
            self._fd,
            self.direct_io,
            headers,
            None,
            segs,
            g.segment_offsets,
            g.header_area,
            g.slot_bytes,
            bounce[0],
            bounce[1],
            deadline,
            self.io_delay_s,
            not full,
            self._ring,
            self._cancel_addr,
            self._file_check if write else None,
        )

    def _needs_full_bounce(self, packed: _Packed, todo: list[int]) -> bool:
        """Whether a block of `todo` cannot move zero-copy: a large segment not
        4096-aligned under O_DIRECT. The same test as `block_iovecs` in _disk_io.c
        (check_pack made it for every block of the call), made here for the blocks
        moved to size the bounce buffer; were they ever to disagree, the C side
        answers ST_NO_BOUNCE for that block (FAILED)."""
        if not (self.direct_io and packed.misaligned):
            return False
        if len(todo) == len(packed.blocks):
            return True
        blocks, large = packed.blocks, self._large_segments
        return any(blocks[i][s][0] % ALIGN for i in todo for s in large)

    def _bounce(self, nbytes: int) -> tuple[int, int]:
        """This thread's page-aligned staging buffer, at least `nbytes` long."""
        have = getattr(self._local, "bounce", None)  # (address, length, the map)
        if have is None or have[1] < nbytes:
            buf = mmap.mmap(-1, _align(nbytes))
            have = self._local.bounce = (_address(buf), len(buf), buf)
        return have[0], have[1]

    # -- recovery -------------------------------------------------------------------

    def _open_existing(self, recover: bool) -> None:
        slot_bytes = self.geometry.slot_bytes
        size = os.fstat(self._fd).st_size
        existing = min(size // slot_bytes, self._slots.capacity)
        if size > existing * slot_bytes and not self.read_only:
            os.ftruncate(self._fd, existing * slot_bytes)  # a partial slot, or past capacity
        self._slots.allocated = existing
        self._scan_slots_upto = existing if recover else 0
        if not recover:
            self._slots.free.extend(range(existing - 1, -1, -1))

    def _scan(self) -> None:
        try:
            self._scan_slots()
        except Exception:  # a failed scan leaves the rest unindexed (misses), never wrong
            log.exception("fastkv storage: recovery scan of %s stopped", self.directory)
        finally:
            self._scan_done.set()
            self._leave()

    def _scan_slots(self) -> None:
        g = self.geometry
        found_ids: set[int] = set()  # key ids of the blocks indexed or held
        held: dict[int, int] = {}  # key id -> slots held
        # Header reads are small and random: several in flight keep the disk busy.
        buffers = [mmap.mmap(-1, ALIGN) for _ in range(_SCAN_THREADS)]
        pool = ThreadPoolExecutor(_SCAN_THREADS, thread_name_prefix="fastkv-disk-scan")
        start = 0
        end = self._scan_slots_upto
        found = 0
        while start < end and not self._stop_scan.is_set():
            stop = min(end, start + _SCAN_CHUNK)
            offsets = np.arange(start, stop, dtype=np.int64) * g.slot_bytes
            out = bytearray(HEADER_BYTES * (stop - start))
            statuses = self._read_headers(pool, buffers, offsets, out)
            recovered, empty = self._sort_headers(out, statuses, start, found_ids, held)
            recovered.sort(reverse=True)  # newest first: each goes to the cold end
            with self._lock:
                slots = self._slots
                for seq, packed, slot in recovered:
                    have = slots.index.get(packed)
                    if have is not None and have[1] >= seq:
                        empty.append(slot)
                        continue
                    if have is not None:  # an older copy: keep ours
                        slots.release(have[0])
                    slots.index[packed] = (slot, seq)
                    slots.index.move_to_end(packed, last=False)
                    self._seq = max(self._seq, seq)
                    found += 1
                slots.free.extend(reversed(empty))
                slots.held = sum(held.values())
            start = stop
        log.info(
            "fastkv storage: recovered %d blocks from %s (%d slots scanned)",
            found,
            self.directory,
            start,
        )
        pool.shutdown()
        for buf in buffers:
            buf.close()
        self._scanned_keys(found_ids, held)

    def _sort_headers(
        self,
        out: bytearray,
        statuses: list[int],
        start: int,
        found_ids: set[int],
        held: dict[int, int],
    ) -> tuple[list[tuple[int, bytes, int]], list[int]]:
        """The scanned headers of slots start, start + 1, ...: the blocks to index
        as (seq, key, slot), and the free slots. Blocks signed by a key the ring
        lacks are held (counted in `held`, disk_keys); others it could never verify
        (another layout, torn, foreign) are free. Adds the key ids found."""
        want = (self.layout.num_segments, self.layout.digest32(), self.layout.payload_bytes)
        recovered: list[tuple[int, bytes, int]] = []
        empty: list[int] = []
        view = memoryview(out)
        for j, status in enumerate(statuses):
            if status < 0:  # an I/O error: what the slot holds is unknown; not reused
                continue
            parsed = None
            if status == _disk_io.ST_OK:
                parsed = parse_header(view[j * HEADER_BYTES : (j + 1) * HEADER_BYTES])
            if parsed is None or tuple(parsed[1:4]) != want:
                empty.append(start + j)
                continue
            key, seq, key_id = parsed[0], parsed[4], parsed[5]
            verdict = self._keys.verdict(key_id)
            if verdict == FREE:
                empty.append(start + j)
                continue
            found_ids.add(key_id)
            if verdict == HOLD:
                held[key_id] = held.get(key_id, 0) + 1
            else:
                recovered.append((seq, key.packed, start + j))
        return recovered, empty

    def _scanned_keys(self, found_ids: set[int], held: dict[int, int]) -> None:
        """After the scan: record the key ids found (a directory from before they
        were recorded), and say loudly what is held and how to let it go."""
        record = self._keys.to_record(found_ids | set(self._signing_ids()))
        if record != self._recorded and not self.read_only:
            self._write_meta(record)
        if held:
            log.warning(
                "fastkv storage: %s: %d slots hold blocks signed by key ids %s, which "
                "this backend's key ring lacks: kept, neither served nor reused; give "
                "the key back (%s), or set %s=1 to give them up",
                self.directory,
                sum(held.values()),
                ", ".join(f"{k:#010x}" for k in sorted(held)),
                ENV_KEY_FILE,
                ENV_RECLAIM,
            )

    def _read_headers(
        self,
        pool: ThreadPoolExecutor,
        buffers: list[mmap.mmap],
        offsets: np.ndarray,
        out: bytearray,
    ) -> list[int]:
        """scan_headers over `offsets`, split among the pool's threads."""
        bounds = np.linspace(0, len(offsets), len(buffers) + 1).astype(int)

        def run(k: int) -> list[int]:
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            part = bytearray(HEADER_BYTES * (hi - lo))
            buf = buffers[k]
            statuses = _disk_io.scan_headers(
                self._fd, offsets[lo:hi], part, _address(buf), ALIGN
            )
            out[lo * HEADER_BYTES : hi * HEADER_BYTES] = part
            return statuses

        return [s for part in pool.map(run, range(len(buffers))) for s in part]

    # -- setup ----------------------------------------------------------------------

    def _open_files(
        self,
        capacity: int,
        direct_io: bool | None,
        recover: bool,
        reclaim: bool,
        read_only: bool | None,
    ) -> None:
        """Lock the directory, check its metadata and open the slot file (read-only:
        all of it without changing anything)."""
        mounted_ro = bool(os.fstatvfs(self._dir_fd).f_flag & os.ST_RDONLY)
        if read_only is False and mounted_ro:
            raise OSError(
                errno.EROFS,
                f"directory: {self.directory} is on a read-only filesystem and "
                "read_only=False; give read_only=None (or True) to serve its blocks",
            )
        self.read_only = mounted_ro if read_only is None else read_only
        if mounted_ro and read_only is None:
            log.warning(
                "fastkv storage: %s is on a read-only filesystem: its blocks are served, "
                "every put fails",
                self.directory,
            )
        self._lock_fd = lock_directory(self._dir_fd, self.directory, self.read_only)
        self._keys = self._check_meta(reclaim)
        if self.read_only:
            self.direct_io = bool(direct_io)  # buffered reads need no probe file
            flags = os.O_RDONLY
        else:
            self.direct_io = (
                self.geometry.slot_bytes >= DIRECT_MIN_SLOT_BYTES
                and probe_direct(self._dir_fd, self.directory)
                if direct_io is None
                else direct_io
            )
            flags = os.O_RDWR | os.O_CREAT
        self._fd = open_file(self._dir_fd, self.directory, DATA_FILE, flags, self.direct_io)
        st = os.fstat(self._fd)
        # what each write checks after its blocks moved: the name still names this
        # very file (device and inode) only while it is linked there
        self._file_check = (self._dir_fd, DATA_FILE, st.st_ino, st.st_dev)
        self._slots = SlotTable(capacity, self._fd, self.geometry.slot_bytes)
        self._open_existing(recover)

    def _meta(self, key_ids: list[int] | None = None) -> dict:
        meta: dict = {
            "format": FORMAT,
            "slot_bytes": self.geometry.slot_bytes,
            "segment_lengths": list(self.layout.segment_lengths),
        }
        if key_ids is not None:
            meta["key_ids"] = key_ids
        return meta

    def _signing_ids(self) -> list[int]:
        return [] if self.auth is None else [self.auth.write_key_id]

    def _check_meta(self, reclaim: bool) -> SlotKeys:
        """Check the directory's metadata against this backend (writing it when
        missing) and decide what its slots are to this ring (disk_keys). Refuses
        the directory before anything in it changes."""
        path = self.directory / META_FILE
        try:
            fd = open_file(self._dir_fd, self.directory, META_FILE, os.O_RDONLY)
        except FileNotFoundError:
            if self.read_only:
                raise ValueError(
                    f"directory: {self.directory} is read-only and holds no fastkv "
                    f"storage ({META_FILE} is missing): nothing to serve"
                ) from None
            fd = -1
        recorded: frozenset[int] | None = frozenset()
        if fd >= 0:
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    raw = f.read(1 << 20)
            finally:
                os.close(fd)
            recorded = check_meta_matches(path, raw, self._meta())
        ring = frozenset(self.auth.key_ids) if self.auth is not None else frozenset()
        keys = SlotKeys(ring, recorded, reclaim)
        keys.check_open(self.directory)
        self._recorded: list[int] | None = None if recorded is None else sorted(recorded)
        record = keys.to_record(self._signing_ids())
        if (fd < 0 or record != self._recorded) and not self.read_only:
            self._write_meta(record)
        return keys

    def _write_meta(self, key_ids: list[int]) -> None:
        """Write the metadata file: under a fresh name no one can have planted,
        then renamed over."""
        tmp = f".{META_FILE}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            FILE_MODE,
            dir_fd=self._dir_fd,
        )
        try:
            os.fchmod(fd, FILE_MODE)
            os.write(fd, json.dumps(self._meta(key_ids)).encode())
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, META_FILE, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)
            raise
        self._recorded = key_ids


def set_lone_write_poll_us(us: int) -> int:
    """How long a lone block's write (slots up to 1 MiB, native AIO) polls for its
    completion before it sleeps, for every backend of the process. Default 1,000
    µs. Polling spends the put's thread's CPU while the device works (about twice
    a sleeping put's CPU at 256 KiB) for a lower latency (p50 about 15-25 % lower
    at 256 KiB on a VM); 0 always sleeps, for hosts whose cores are all busy.
    Returns the previous setting.

    Raises:
        ValueError: `us` not an int in [0, 1_000_000]."""
    if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= 1_000_000:
        raise ValueError(f"us: {us!r} must be an int in [0, 1000000]")
    return _disk_io.write_poll(us)[0]


def _capacity(blocks: int | None, nbytes: int | None, slot_bytes: int) -> int:
    if (blocks is None) == (nbytes is None):
        raise ValueError("capacity_blocks / capacity_bytes: give exactly one")
    if blocks is not None:
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks < 2**31:
            raise ValueError(f"capacity_blocks: must be an int in [1, 2**31), got {blocks!r}")
        return blocks
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < slot_bytes:
        raise ValueError(
            f"capacity_bytes: must be an int >= one slot ({slot_bytes} bytes), got {nbytes!r}"
        )
    return min(nbytes // slot_bytes, 2**31 - 1)


def _address(buf: mmap.mmap) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _write_failure(status: int) -> KeyResult:
    """What a put answers for a block whose write ended in `status` (not ST_OK)."""
    if status == _disk_io.ST_TIMEOUT:
        return KeyResult(KeyStatus.TIMEOUT, "deadline passed before the write")
    if status == _disk_io.ST_CLOSED:
        return KeyResult(KeyStatus.FAILED, "the backend closed before the write")
    return KeyResult(KeyStatus.FAILED, f"write failed: {_describe(status)}")


def _describe(status: int) -> str:
    if status < 0:
        return os.strerror(-status)
    return {
        _disk_io.ST_SHORT: "slot past the end of the file (truncated)",
        _disk_io.ST_BAD_HEADER: "header does not match the key",
        _disk_io.ST_BAD_CHECKSUM: "payload checksum mismatch",
        _disk_io.ST_NO_BOUNCE: "no staging buffer",
        _disk_io.ST_BAD_MAC: "authentication tag does not verify (forged or altered)",
        _disk_io.ST_UNKNOWN_KEY: "signed by a key this backend does not hold",
        _disk_io.ST_UNAUTHENTICATED: "not authenticated, and this backend requires it",
        _disk_io.ST_CLOSED: "the backend closed",
    }.get(status, f"status {status}")


_ONE = [0]
"""`todo` of a one-block call (read, never changed)."""

_READ_ONLY = "the cache directory is read-only: nothing is written"

_FILE_GONE = frozenset({_disk_io.ST_FILE_DELETED, _disk_io.ST_FILE_REPLACED})

_REJECTED = frozenset(
    {
        _disk_io.ST_SHORT,
        _disk_io.ST_BAD_HEADER,
        _disk_io.ST_BAD_CHECKSUM,
        _disk_io.ST_BAD_MAC,
        _disk_io.ST_UNKNOWN_KEY,
        _disk_io.ST_UNAUTHENTICATED,
    }
)
"""Read statuses that say the bytes read are not the block (rather than that the
read did not happen)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


__all__ = [
    "LocalDiskBackend",
    "SlotGeometry",
    "StorageDirectoryLocked",
    "StorageDirectoryUnsafe",
    "StorageKeyMissing",
    "set_lone_write_poll_us",
]
