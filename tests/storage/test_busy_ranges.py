"""BusyHostRanges on its own: merged intervals, overlap by block, waiting for quiet."""

from __future__ import annotations

import threading
import time

from fastkv.storage.busy_ranges import BusyHostRanges


def test_ranges_merge_and_leave_with_their_token() -> None:
    busy = BusyHostRanges()
    assert busy.add([]) is None and busy.ranges() == []
    first = busy.add([[(100, 50), (300, 10)]])
    second = busy.add([[(140, 60)]])
    assert busy.ranges() == [(100, 200), (300, 310)]
    busy.release(first)
    assert busy.ranges() == [(140, 200)]
    busy.release(first)  # twice, or None: nothing
    busy.release(None)
    busy.release(second)
    assert busy.ranges() == []


def test_touching_names_the_blocks_with_a_segment_in_busy_memory() -> None:
    busy = BusyHostRanges()
    assert busy.touching([[(1000, 10), (2000, 10)]]) == []
    busy.add([[(1000, 100)]])
    blocks = [
        [(900, 100), (5000, 10)],  # ends where the busy range starts: clear
        [(5000, 10), (1099, 1)],  # its second segment's last byte: busy
        [(1100, 10), (800, 10)],  # starts where it ends: clear
        [(950, 500), (800, 10)],  # covers it: busy
    ]
    assert busy.touching(blocks) == [1, 3]


def test_wait_quiet_returns_when_the_ranges_leave_or_at_the_timeout() -> None:
    busy = BusyHostRanges()
    token = busy.add([[(1000, 100)]])
    block = [[(1050, 10)]]
    assert busy.wait_quiet([[(2000, 10)]], 0) is True  # not busy: at once
    t0 = time.monotonic()
    assert busy.wait_quiet(block, 0.05) is False
    assert time.monotonic() - t0 >= 0.05
    threading.Timer(0.05, busy.release, (token,)).start()
    assert busy.wait_quiet(block, None) is True
