"""Host memory that a call already answered still writes: the book a backend keeps
of it, so that nothing reads or reuses that memory until the writer is done.

A backend whose calls can outlive their caller (MooncakeBackend's zero-copy gets,
answered TIMEOUT at their deadline while Mooncake still writes the caller's
blocks) adds each such call's [start, end) ranges here when it answers and
releases them when the call really ends. Meanwhile `ranges()` lists them (the
backend's `busy_host_ranges()`), `wait_quiet` waits for them (its
`wait_host_quiet`), and `touching` tells a new call which of its blocks overlap
them, so it can answer FAILED for those without touching them. The I/O engine
(fastkv.storage.io_engine) waits for them before it frees its host blocks.

The ranges are kept merged into sorted, disjoint intervals, so that an overlap
check costs one binary search per segment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from fastkv.storage.base import BlockSegments


class BusyHostRanges:
    """The host memory calls left behind still write, by the token of each call.

    Thread-safe: it owns its lock, and a condition on that lock that is notified
    whenever a call's ranges leave (what `wait_quiet` waits on).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self._by_token: dict[int, list[tuple[int, int]]] = {}
        self._tokens = 0
        # the merged intervals: [lo[i], hi[i]) sorted and disjoint
        self._lo = np.zeros(0, dtype=np.int64)
        self._hi = np.zeros(0, dtype=np.int64)

    def add(self, blocks: Sequence[BlockSegments]) -> int | None:
        """Marks the memory of `blocks` busy until `release(token)`.

        Returns:
            The token to release, or None when `blocks` holds no segment (nothing
            was marked; releasing None does nothing).
        """
        ranges = [(p, p + n) for segs in blocks for p, n in segs]
        if not ranges:
            return None
        with self._lock:
            self._tokens += 1
            token = self._tokens
            self._by_token[token] = ranges
            self._merge()
        return token

    def release(self, token: int | None) -> None:
        """The call behind `token` has ended: its memory is free again, and every
        `wait_quiet` re-checks. Releasing None or a released token does nothing."""
        if token is None:
            return
        with self._lock:
            if self._by_token.pop(token, None) is not None:
                self._merge()
            self._quiet.notify_all()

    def ranges(self) -> list[tuple[int, int]]:
        """The busy memory as sorted, disjoint [start, end) intervals."""
        with self._lock:
            return list(zip(self._lo.tolist(), self._hi.tolist(), strict=True))

    def touching(self, blocks: Sequence[BlockSegments]) -> list[int]:
        """Indexes of the blocks with a segment in busy memory (`blocks` as
        validated by the caller: the same number of segments each)."""
        with self._lock:
            return self._touching(blocks)

    def wait_quiet(self, blocks: Sequence[BlockSegments], timeout: float | None) -> bool:
        """Waits until no segment of `blocks` is busy, at most `timeout` s (None: as
        long as it takes; arguments as validated by the caller). True when none is."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._touching(blocks):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._quiet.wait(left)
            return True

    def _touching(self, blocks: Sequence[BlockSegments]) -> list[int]:
        """`touching`, the lock held."""
        if not len(self._lo) or not len(blocks):
            return []
        segs = np.asarray(blocks, dtype=np.int64).reshape(len(blocks), -1, 2)
        starts, ends = segs[..., 0], segs[..., 0] + segs[..., 1]
        # the last busy interval starting before a segment's end overlaps it iff
        # it ends after the segment's start (the intervals are disjoint)
        idx = np.searchsorted(self._lo, ends, side="left") - 1
        hit = (idx >= 0) & (self._hi[np.maximum(idx, 0)] > starts)
        return np.flatnonzero(hit.any(axis=1)).tolist()

    def _merge(self) -> None:
        """Rebuilds the sorted, disjoint intervals (the lock held)."""
        spans = sorted(r for ranges in self._by_token.values() for r in ranges)
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._lo = np.array([m[0] for m in merged], dtype=np.int64)
        self._hi = np.array([m[1] for m in merged], dtype=np.int64)


__all__ = ["BusyHostRanges"]
