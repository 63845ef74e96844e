"""Which slot of the local-disk backend's file holds which block: the LRU index,
the free slots, the reads in flight per slot, and the file's growth a slab at a
time (fastkv.storage.local_disk keeps one `SlotTable`).

Every method runs under the backend's lock. Nothing here reads or writes a block:
eviction only forgets a key (its slot's next write overwrites it), never takes a
slot a read is using, and a slot dropped from the index while read goes back to
the free list when its last read ends. The only I/O is growing the file.
"""

from __future__ import annotations

import array
import errno
import os
import time
from collections import OrderedDict

SLAB_BYTES = 1 << 30
"""The file grows by this much at a time (or as much as the filesystem has room for)."""

GROW_RETRY_S = 1.0
"""After the file failed to grow, puts fail fast (no I/O) this long before it tries again."""


class SlotTable:
    """The slots of one backend's file.

    Attributes:
        capacity: the most slots the file may hold.
        index: key (`StorageKey.packed`) -> (slot, seq), least recently used first.
        free: slots to write next (the last first).
        pins: reads in flight per slot.
        retired: slots dropped from the index while read: free once unpinned.
        allocated: slots the file holds (preallocated).
        held: slots of blocks signed by keys the ring lacks: never reused.
        evictions: blocks evicted to make room (counted for the backend's stats).
        grow_error: why the file last failed to grow (None once it grew).
    """

    def __init__(self, capacity: int, fd: int, slot_bytes: int) -> None:
        self.capacity = capacity
        self.index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.free: list[int] = []
        # an array of C ints (4 bytes a slot, as numpy's, but its items are plain
        # ints: no numpy scalar per look on the put path)
        self.pins = array.array("i", bytes(4 * capacity))
        self.retired: set[int] = set()
        self.allocated = 0
        self.held = 0
        self.evictions = 0
        self.grow_error: OSError | None = None
        self._fd = fd
        self._slot_bytes = slot_bytes
        self._slab_slots = max(1, SLAB_BYTES // slot_bytes)
        self._grow_retry_at = 0.0

    def release(self, slot: int) -> None:
        """Return a slot no longer in the index: free now, or when its last read ends."""
        if self.pins[slot] == 0:
            self.free.append(slot)
        else:
            self.retired.add(slot)

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        if self.pins[slot] == 0 and slot in self.retired:
            self.retired.discard(slot)
            self.free.append(slot)

    def take(self) -> int | None:
        """A slot to write: a free one, else one more slab of the file (below
        capacity; when the filesystem is full, None: puts fail fast rather than
        evict, the configured capacity is not there), else the least recently used
        block not being read (evicted). None when there is none."""
        if self.free:
            return self.free.pop()
        if self.allocated < self.capacity:
            return self.free.pop() if self._grow() else None
        for key, (slot, _) in self.index.items():
            if self.pins[slot] == 0:
                del self.index[key]
                self.evictions += 1
                return slot
        return None

    def _grow(self) -> bool:
        """Preallocate more slots: a slab, or as much of one as the filesystem has
        room for (halving down to one slot). After a failure, False without I/O
        for `GROW_RETRY_S` before the next attempt."""
        if time.monotonic() < self._grow_retry_at:
            return False
        step = min(self._slab_slots, self.capacity - self.allocated)
        start = self.allocated * self._slot_bytes
        while step >= 1:
            length = step * self._slot_bytes
            try:
                os.posix_fallocate(self._fd, start, length)
                break
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    os.ftruncate(self._fd, start + length)  # no preallocation: sparse
                    break
                if e.errno != errno.ENOSPC or step == 1:
                    self.grow_error = e
                    self._grow_retry_at = time.monotonic() + GROW_RETRY_S
                    return False
                step //= 2
        new = self.allocated + step
        self.free.extend(range(new - 1, self.allocated - 1, -1))
        self.allocated = new
        self.grow_error = None
        return True


__all__ = ["GROW_RETRY_S", "SLAB_BYTES", "SlotTable"]
