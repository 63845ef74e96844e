"""A fixed-capacity pool of integer block ids for one cache tier."""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable
from dataclasses import dataclass

MAX_BLOCKS = 2**31 - 1
"""The most blocks a pool holds: block ids are int32 (the tree's nodes and the
pool's free list store them so)."""


class OutOfBlocksError(RuntimeError):
    """Raised by `BlockPool.allocate` when fewer blocks are free than asked for."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    capacity: int
    used: int
    free: int
    peak_used: int
    allocated_total: int
    freed_total: int

    @property
    def usage(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


class BlockPool:
    """Block ids `0 .. capacity-1` of one tier; O(1) per id to allocate or free.

    Allocation is all-or-nothing and raises `OutOfBlocksError` when `n` exceeds the
    free count (the cache manager evicts first and asks only for what it can get).
    Freeing validates the whole batch before changing anything.

    Args:
        capacity: number of blocks, >= 0.
        name: tier name used in error messages.
    """

    __slots__ = (
        "_allocated",
        "_allocated_total",
        "_free",
        "_freed_total",
        "_num_used",
        "_peak",
        "capacity",
        "name",
    )

    def __init__(self, capacity: int, name: str = "pool") -> None:
        if not 0 <= capacity <= MAX_BLOCKS:
            raise ValueError(f"capacity: must be in [0, {MAX_BLOCKS}], got {capacity}")
        self.capacity = capacity
        self.name = name
        # Reversed so that a fresh pool hands out 0, 1, 2, ...: consecutive ids let
        # the worker coalesce copies. A C array of int32: 4 bytes per block, where a
        # list of ints held 8 and an int object (32) per id.
        self._free = array("i", range(capacity - 1, -1, -1))
        # One byte per block, 1 while allocated: far smaller (so cache-resident)
        # than a set of ids, which costs a hash-table probe per id.
        self._allocated = bytearray(capacity)
        self._num_used = 0
        self._peak = 0
        self._allocated_total = 0
        self._freed_total = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_used

    def allocate(self, n: int) -> list[int]:
        """Take `n` free block ids.

        Raises:
            ValueError: `n` is negative.
            OutOfBlocksError: fewer than `n` blocks are free; nothing is taken.
        """
        if n <= 0:
            if n < 0:
                raise ValueError(f"n: must be >= 0, got {n}")
            return []
        free = self._free
        if n > len(free):
            raise OutOfBlocksError(
                f"{self.name}: asked for {n} blocks, {len(free)} of {self.capacity} free"
            )
        ids = free[-n:].tolist()
        del free[-n:]
        ids.reverse()
        allocated = self._allocated
        for block_id in ids:
            allocated[block_id] = 1
        self._num_used += n
        self._allocated_total += n
        if self._num_used > self._peak:
            self._peak = self._num_used
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return allocated ids to the pool.

        Raises:
            ValueError: an id is not currently allocated (never allocated, freed
                already, or listed twice in `ids`); nothing is freed.
        """
        if not isinstance(ids, list):
            ids = list(ids)  # one pass over generators and arrays alike
        if not ids:
            return
        allocated = self._allocated
        for i, block_id in enumerate(ids):
            if not (0 <= block_id < self.capacity) or not allocated[block_id]:
                for undo in ids[:i]:  # leave the pool as it was
                    allocated[undo] = 1
                self._raise_bad_free(ids, block_id)
            allocated[block_id] = 0
        self._free.extend(ids)
        self._num_used -= len(ids)
        self._freed_total += len(ids)

    def recycled(self, n: int) -> None:
        """Count `n` blocks that an owner gave up and another took at once, without
        passing through the free list (evictions for an allocation)."""
        self._freed_total += n
        self._allocated_total += n

    def free_ids(self) -> list[int]:
        """The free ids (a copy, O(free blocks); the next allocation takes from the
        end)."""
        return list(self._free)

    def is_allocated(self, block_id: int) -> bool:
        return 0 <= block_id < self.capacity and bool(self._allocated[block_id])

    def allocated_ids(self) -> set[int]:
        """Every allocated id (O(capacity); for checks)."""
        return {i for i, flag in enumerate(self._allocated) if flag}

    def stats(self) -> PoolStats:
        return PoolStats(
            capacity=self.capacity,
            used=self._num_used,
            free=len(self._free),
            peak_used=self._peak,
            allocated_total=self._allocated_total,
            freed_total=self._freed_total,
        )

    def _raise_bad_free(self, ids: Collection[int], bad: int) -> None:
        if list(ids).count(bad) > 1 and self.is_allocated(bad):
            raise ValueError(f"{self.name}: block {bad} listed twice in one free")
        raise ValueError(f"{self.name}: block {bad} is not allocated")
