"""Blocking calls run on threads of their own, so that their callers return by a
deadline even when a call does not.

A remote store's client call can block for seconds (a Mooncake call took 4.3 s
against a dead master), longer than any caller may wait. A backend therefore
submits each such call to a `DeadlinePool` and waits for it until its deadline
plus `margin_s`; a call still running then is left behind: its caller answers
TIMEOUT for the keys it had, and what the call holds stays held until it really
ends (`wait`'s `release`: its arena or lookup slot, and its thread). Every call
is counted in flight from submit until it ends, so closing can wait for all of
them (`drain`), those left behind included.

What a call left behind may still do to its caller's memory is bounded here:
  - the backend's own copies into or out of the caller's memory (a staged put's
    gather, a staged get's scatter) each hold the call's `Call.lock` and start
    only while `Call.abandoned` is False; `wait` sets it, under that lock, before
    the caller is answered, so none starts afterwards;
  - memory the store itself still writes (a zero-copy get) is named in `wait`'s
    `writes`: it stays in the pool's `BusyHostRanges` until the call ends.

A caller that owns the deadline itself (the storage I/O engine: it answers its
requests at their deadline without waiting for the call, and keeps the host
blocks a call touches from reuse until the call returns) gains nothing from the
hand-off and pays for it twice (two thread switches a call, 80-200 us measured on
2 busy cores): `run` runs the call on the caller's thread instead, to its end,
counted in flight (`drain` waits for it too) and in `overruns` when it ends past
its deadline plus the margin. Nothing is left behind, so nothing is abandoned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fastkv.storage.base import BlockSegments, KeyResult, KeyStatus
from fastkv.storage.busy_ranges import BusyHostRanges

LEFT_BEHIND = KeyResult(KeyStatus.TIMEOUT, "the caller was answered before this key was done")
"""What a call answers for its keys once it finds itself abandoned."""


class Call:
    """One batch on the pool: `abandoned` once its caller has been answered
    (TIMEOUT); the backend's own copies into or out of the caller's memory hold
    `lock` and start only while it is False."""

    __slots__ = ("abandoned", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False


class DeadlinePool:
    """A thread pool whose callers wait for a call until its deadline plus a
    margin, and no longer.

    Args:
        workers: threads (the most calls on the pool at once, those left behind
            included; calls `run` on their callers' threads are not among them:
            bound all with what each call holds).
        margin_s: how long past its deadline a caller waits for a call.
        busy: where the memory a call left behind still writes is kept.
        name: the threads' name prefix.

    Attributes:
        margin_s: as given.
        busy: as given.
        overruns: calls left behind (still running at deadline + margin), and
            calls `run` on their caller's thread that ended past it.
    """

    def __init__(self, workers: int, margin_s: float, busy: BusyHostRanges, name: str) -> None:
        self.margin_s = margin_s
        self.busy = busy
        self.overruns = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as each call ends
        self._in_flight = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Runs fn(*args) on the pool, counted in flight until it ends."""
        with self._lock:
            self._in_flight += 1
        fut = self._pool.submit(fn, *args)

        def ended(_f: Future) -> None:
            with self._lock:
                self._in_flight -= 1
                self._idle.notify_all()

        fut.add_done_callback(ended)
        return fut

    def run(self, fn: Callable[..., Any], deadline: float, *args: Any) -> Any:
        """fn(*args) on this thread, to its end, counted in flight while it runs
        (and in `overruns` when it ends past `deadline` plus the margin): for a
        caller that owns the deadline (see the module docstring)."""
        with self._lock:
            self._in_flight += 1
        try:
            return fn(*args)
        finally:
            late = time.monotonic() > deadline + self.margin_s
            with self._lock:
                self._in_flight -= 1
                self.overruns += late
                self._idle.notify_all()

    def wait(
        self,
        fut: Future,
        deadline: float,
        release: Callable[[], None],
        call: Call | None = None,
        writes: Sequence[BlockSegments] = (),
    ) -> Any:
        """The result of a call submitted here, or None when it is still running at
        the deadline plus the margin (a call must not return None itself). Then the
        call is left behind: `release` (what it holds: an arena, a slot) runs when
        it ends, `call` is marked abandoned (its own copies into or out of the
        caller's memory stop) and the host memory of `writes` stays busy until it
        ends. On a result, `release` is not run: the caller still holds it."""
        try:
            return fut.result(max(0.0, deadline - time.monotonic()) + self.margin_s)
        except FutureTimeout:
            if call is not None:
                with call.lock:  # waits out at most one block's copy
                    call.abandoned = True
            with self._lock:
                self.overruns += 1
            token = self.busy.add(writes)

            def ended(_f: Future) -> None:
                try:
                    release()
                finally:
                    self.busy.release(token)

            fut.add_done_callback(ended)
            return None

    def drain(self, timeout: float) -> int:
        """Waits up to `timeout` s for every call in flight to end; how many are
        still running then."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._in_flight and time.monotonic() < end:
                self._idle.wait(end - time.monotonic())
            return self._in_flight

    def shutdown(self) -> None:
        """Takes no more calls; those running keep their threads until they end."""
        self._pool.shutdown(wait=False)


__all__ = ["LEFT_BEHIND", "Call", "DeadlinePool"]
