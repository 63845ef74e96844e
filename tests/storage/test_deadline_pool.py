"""DeadlinePool on its own: a call answered in time, one left behind at its deadline
(what it holds released, its memory busy, its Call abandoned only once it ends),
and close waiting for what is in flight."""

from __future__ import annotations

import threading
import time

from fastkv.storage.busy_ranges import BusyHostRanges
from fastkv.storage.deadline_pool import Call, DeadlinePool


def make_pool(margin_s: float = 0.02) -> DeadlinePool:
    return DeadlinePool(2, margin_s, BusyHostRanges(), "test-deadline-pool")


def test_a_call_answered_in_time_keeps_what_it_holds() -> None:
    pool = make_pool()
    released: list[int] = []
    fut = pool.submit(lambda x: [x * 2], 21)
    assert pool.wait(fut, time.monotonic() + 5, lambda: released.append(1)) == [42]
    assert released == [] and pool.overruns == 0
    assert pool.drain(1.0) == 0
    pool.shutdown()


def test_a_call_left_behind_holds_its_memory_until_it_ends() -> None:
    pool = make_pool()
    go = threading.Event()
    released = threading.Event()
    call = Call()
    fut = pool.submit(lambda: go.wait(5) and ["late"])
    t0 = time.monotonic()
    got = pool.wait(fut, t0 + 0.05, released.set, call, [[(4096, 64)]])
    took = time.monotonic() - t0
    assert got is None and 0.05 + 0.02 <= took < 1.0, took
    assert call.abandoned and pool.overruns == 1
    assert pool.busy.ranges() == [(4096, 4160)] and not released.is_set()
    assert pool.drain(0.01) == 1  # still inside
    go.set()
    assert pool.drain(5.0) == 0
    # what it held is released first, then its memory leaves the busy ranges
    assert pool.busy.wait_quiet([[(4096, 64)]], 5.0) and released.is_set()
    pool.shutdown()


def test_a_call_run_on_its_callers_thread_counts_in_flight_and_late() -> None:
    """`run`: on the calling thread, to its end; in flight meanwhile (drain waits
    for it), an overrun when it ends past its deadline plus the margin."""
    pool = make_pool(margin_s=0.01)
    inside = threading.Event()
    go = threading.Event()
    ran_on: list[str] = []

    def call(x: int) -> list[int]:
        ran_on.append(threading.current_thread().name)
        inside.set()
        assert go.wait(5)
        return [x]

    got: list = []
    caller = threading.Thread(
        target=lambda: got.append(pool.run(call, time.monotonic() + 0.02, 7)), name="caller"
    )
    caller.start()
    assert inside.wait(5)
    assert pool.drain(0.01) == 1
    time.sleep(0.05)  # past deadline + margin
    go.set()
    caller.join(5)
    assert got == [[7]] and ran_on == ["caller"]
    assert pool.drain(1.0) == 0 and pool.overruns == 1
    assert pool.run(lambda: "soon", time.monotonic() + 5) == "soon" and pool.overruns == 1
    pool.shutdown()
