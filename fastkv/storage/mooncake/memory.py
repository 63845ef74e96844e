"""The memory Mooncake reads and writes for a `MooncakeBackend`: every range
registered with the store, and the backend's own registered areas, split among
the calls it runs at once.

Mooncake moves bytes only between its pool and memory registered with
`register_buffer`. A zero-copy transfer reads and writes the caller's host cache
directly, so that must be registered (`register_host`, once for the whole cache),
and every block a call names must lie inside a registered range (`check_inside`).

The backend's own memory, mapped and registered once, has a share for each
concurrent call, an arena; a call takes one (`take`, waiting until its deadline)
and gives it back when Mooncake has returned it (a call left behind at its
deadline keeps it until then). An arena holds:
  - `max_batch` header slots: a zero-copy put seals each block's 128-byte header
    there, a zero-copy get reads it there (the segments go straight to or from
    the host cache);
  - staged mode only (the default; `staging_bytes` != 0), `max_batch` object slots of the
    staging area: each object (header, then segments) is gathered there before a
    put and read there before it is scattered into the caller's block;
  - `verify_slots` object slots where a put reads objects back (what it met
    under its keys, and with `verify_puts` what it stored): up to
    `VERIFY_AREA_BYTES` of objects (at least one), read in batches that size.
"""

from __future__ import annotations

import mmap
import threading
import time

import numpy as np

from fastkv.storage.base import INT64_MAX, BlockLayout
from fastkv.storage.block_header import HEADER_BYTES

VERIFY_AREA_BYTES = 16 << 20
"""Per concurrent call, the most object bytes a put reads back in one Mooncake call."""


class MooncakeMemory:
    """Registered memory: the ranges Mooncake may touch, and the backend's arenas.

    Args:
        store: the Mooncake store to register with.
        layout: the blocks' segment lengths (an object is a header and them).
        calls: concurrent calls, one arena each.
        max_batch: keys per call, one header slot (staged: one object slot) each.
        staged: map a staging area too.

    Attributes:
        object_bytes: the size of one stored object (header + payload).
        layout, staged, max_batch: as given.
        verify_slots: objects a put reads back per Mooncake call.
        payload_offsets: where each segment starts in an object.

    Raises:
        RuntimeError: Mooncake refused to register the backend's own memory.
    """

    def __init__(
        self, store: object, layout: BlockLayout, calls: int, max_batch: int, staged: bool
    ) -> None:
        self.layout = layout
        self.object_bytes = HEADER_BYTES + layout.payload_bytes
        self.staged = staged
        self.max_batch = max_batch
        self._store = store
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []  # every range registered
        self._host_regions: list[tuple[int, int]] = []  # register_host's alone
        self._free = list(range(calls))
        self._arena_ready = threading.Condition(self._lock)
        self._headers = self._map(max(4096, calls * max_batch * HEADER_BYTES))
        self._headers_addr = _address(self._headers)
        self._staging_addr = 0
        if staged:
            self._staging = self._map(calls * max_batch * self.object_bytes)
            self._staging_addr = _address(self._staging)
        self.verify_slots = max(1, min(max_batch, VERIFY_AREA_BYTES // self.object_bytes))
        self._verify = self._map(calls * self.verify_slots * self.object_bytes)
        self.verify_addr = _address(self._verify)
        self.payload_offsets = np.concatenate(
            [[HEADER_BYTES], HEADER_BYTES + np.cumsum(layout.segment_lengths)[:-1]]
        ).astype(np.int64)

    # -- registered ranges ------------------------------------------------------

    def register_host(self, address: int, nbytes: int) -> None:
        """Registers host memory for zero-copy transfers.

        Raises:
            ValueError: a bad address or size, or overlap with a registered range.
            RuntimeError: Mooncake refused the registration.
        """
        if isinstance(address, bool) or not isinstance(address, int) or address <= 0:
            raise ValueError(f"address: must be a positive int, got {address!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: must be a positive int, got {nbytes!r}")
        if address > INT64_MAX - nbytes:  # the range check compares ends as int64s
            raise ValueError(
                f"nbytes: [{address:#x}, +{nbytes}) ends past 2**63 - 1, the largest address"
            )
        with self._lock:
            for start, length in self._regions:
                if address < start + length and start < address + nbytes:
                    raise ValueError(
                        f"address: [{address:#x}, +{nbytes}) overlaps a registered range"
                    )
        self._register(address, nbytes, host=True)

    def check_inside(self, pairs: bytes | bytearray, nseg: int) -> None:
        """Raises ValueError naming the first segment of a call's blocks not inside
        a range registered by `register_host` (the backend's own areas are
        registered too, but a block there would be written under a call using
        them). `pairs`: their (address, length) pairs as int64s,
        `nseg` per block (`_disk_io.check_pack`). Staged: no check (Mooncake
        touches only the staging area)."""
        if self.staged or not len(pairs):
            return
        with self._lock:
            regions = sorted(self._host_regions)
        starts = np.array([s for s, _ in regions] or [0], dtype=np.int64)
        ends = np.array([s + n for s, n in regions] or [0], dtype=np.int64)  # none: [0, 0)
        segs = np.frombuffer(pairs, dtype=np.int64).reshape(-1, 2)
        idx = np.searchsorted(starts, segs[:, 0], side="right") - 1
        # the length against the room left in the range: start + length could
        # wrap past 2**63 as int64s and pass for inside
        room = ends[np.maximum(idx, 0)] - segs[:, 0]
        inside = (idx >= 0) & (segs[:, 1] <= room)
        if not inside.all():
            bad = int(np.argmin(inside))
            raise ValueError(
                f"blocks[{bad // nseg}][{bad % nseg}]: not inside memory registered with "
                "register_host_memory"
            )

    def _map(self, nbytes: int) -> mmap.mmap:
        area = mmap.mmap(-1, nbytes)
        self._register(_address(area), nbytes)
        return area

    def _register(self, address: int, nbytes: int, host: bool = False) -> None:
        rc = self._store.register_buffer(address, nbytes)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake register_buffer({address:#x}, {nbytes}) answered {rc}"
            )
        with self._lock:
            self._regions.append((address, nbytes))
            if host:
                self._host_regions.append((address, nbytes))

    # -- arenas -----------------------------------------------------------------

    def take(self, deadline: float) -> int | None:
        """A free arena, waiting for one until `deadline`; None if none came."""
        with self._arena_ready:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._arena_ready.wait(left)
            return self._free.pop()

    def give(self, arena: int) -> None:
        """Returns an arena taken with `take` (Mooncake no longer touches it)."""
        with self._arena_ready:
            self._free.append(arena)
            self._arena_ready.notify()

    def header_addr(self, arena: int, j: int) -> int:
        """Where key j of a call holding `arena` has its header slot."""
        return self._headers_addr + (arena * self.max_batch + j) * HEADER_BYTES

    def header_view(self, arena: int, j: int) -> memoryview:
        """Header slot j of `arena`, writable."""
        off = (arena * self.max_batch + j) * HEADER_BYTES
        return memoryview(self._headers)[off : off + HEADER_BYTES]

    def object_addr(self, arena: int, j: int) -> int:
        """Staged mode: where object j of a call holding `arena` is assembled."""
        return self._staging_addr + (arena * self.max_batch + j) * self.object_bytes

    def verify_offset(self, arena: int, i: int) -> int:
        """Where verify slot i of `arena` starts, from `verify_addr`."""
        return (arena * self.verify_slots + i) * self.object_bytes

    def verify_header(self, offset: int) -> memoryview:
        """The header of the object read back at `offset` of the verify area."""
        return memoryview(self._verify)[offset : offset + HEADER_BYTES]


def _address(area: mmap.mmap) -> int:
    return int(np.frombuffer(area, dtype=np.uint8).ctypes.data)


__all__ = ["VERIFY_AREA_BYTES", "MooncakeMemory"]
