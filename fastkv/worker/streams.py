"""Streams and events for the transfer manager: CuPy's on a GPU, and a CPU stand-in
with the same ordering semantics so the ordering logic runs (and is tested) on
machines without CUDA.

A stream runs the work launched on it in order. `record()` returns an event that
completes once everything launched before it has run; `wait_event(e)` makes work
launched on the stream afterwards wait for `e` (on a GPU, on the device, without
blocking the host). Host-side waits on events are always bounded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

Launch = Callable[[int], None]
"""A unit of work: called with the stream's native handle (cudaStream_t or 0)."""
OnError = Callable[[BaseException], None]


class Event(Protocol):
    def query(self) -> bool:
        """Has everything before this event completed?"""
        ...

    def synchronize(self, timeout: float) -> bool:
        """Block the calling thread until the event completes or `timeout` seconds
        pass; True if it completed."""
        ...


class Stream(Protocol):
    handle: int

    def launch(self, fn: Launch, on_error: OnError) -> None:
        """Enqueue `fn`. If it raises, `on_error` gets the exception (from whichever
        thread ran it) and the stream carries on with the next item."""
        ...

    def record(self) -> Event: ...

    def wait_event(self, event: Event) -> None: ...


# -- CPU stand-in ---------------------------------------------------------------


class HostEvent:
    """A completion flag set by the stream that recorded it."""

    __slots__ = ("_flag",)

    def __init__(self, done: bool = False) -> None:
        self._flag = threading.Event()
        if done:
            self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self, timeout: float) -> bool:
        return self._flag.wait(timeout)

    def set(self) -> None:
        self._flag.set()


DONE = HostEvent(done=True)
"""An event that has already completed."""

_STOP = object()


class HostStream:
    """One worker thread per stream running launched work in submission order: the
    stand-in for a CUDA stream on a machine without one.

    Args:
        name: thread name, for debugging.
        wait_limit: how long the worker may wait on another stream's event before
            it gives up, reports the failure to the next launched item's on_error
            and carries on (a stand-in for a device-side wait never hangs).
    """

    handle = 0

    def __init__(self, name: str, wait_limit: float = 600.0) -> None:
        self.name = name
        self._wait_limit = wait_limit
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wait_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def launch(self, fn: Launch, on_error: OnError) -> None:
        self._queue.put((fn, on_error))

    def record(self) -> HostEvent:
        event = HostEvent()
        self._queue.put(event)
        return event

    def wait_event(self, event: Event) -> None:
        if not event.query():
            self._queue.put(("wait", event))

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout=self._wait_limit)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, HostEvent):
                item.set()
            elif item[0] == "wait":  # type: ignore[index]
                event = item[1]  # type: ignore[index]
                if not event.synchronize(self._wait_limit):
                    self._wait_error = TimeoutError(
                        f"{self.name}: waited {self._wait_limit:.0f} s for another stream"
                    )
                    log.error("%s", self._wait_error)
            else:
                fn, on_error = item  # type: ignore[misc]
                try:
                    if self._wait_error is not None:
                        error, self._wait_error = self._wait_error, None
                        raise error
                    fn(0)
                except BaseException as e:  # reported, not lost: the stream goes on
                    on_error(e)


class InlineStream:
    """The CPU stand-in for the compute stream: the model runs on the calling
    thread, so work runs at once and a wait blocks the caller (bounded)."""

    handle = 0

    def __init__(self, wait_limit: float = 600.0) -> None:
        self._wait_limit = wait_limit

    def launch(self, fn: Launch, on_error: OnError) -> None:
        try:
            fn(0)
        except BaseException as e:
            on_error(e)

    def record(self) -> HostEvent:
        return DONE

    def wait_event(self, event: Event) -> None:
        if not event.synchronize(self._wait_limit):
            raise TimeoutError(f"compute waited {self._wait_limit:.0f} s for a copy")


# -- CUDA through CuPy ----------------------------------------------------------


class CudaEvent:
    """A CuPy event; host waits poll it so they can time out."""

    __slots__ = ("raw",)

    def __init__(self, raw: object) -> None:
        self.raw = raw

    def query(self) -> bool:
        return bool(self.raw.done)  # type: ignore[attr-defined]

    def synchronize(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        pause = 2e-5
        while not self.raw.done:  # type: ignore[attr-defined]
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True


class CudaStream:
    """A CuPy stream: work is launched asynchronously from the calling thread.

    Args:
        stream: a `cupy.cuda.Stream` or `cupy.cuda.ExternalStream`.
    """

    def __init__(self, stream: object) -> None:
        import cupy

        self._cupy = cupy
        self.stream = stream
        self.handle = int(stream.ptr)  # type: ignore[attr-defined]

    @classmethod
    def new(cls) -> CudaStream:
        import cupy

        return cls(cupy.cuda.Stream(non_blocking=True))

    @classmethod
    def external(cls, handle: int) -> CudaStream:
        import cupy

        return cls(cupy.cuda.ExternalStream(handle))

    def launch(self, fn: Launch, on_error: OnError) -> None:
        try:
            fn(self.handle)
        except BaseException as e:
            on_error(e)

    def record(self) -> CudaEvent:
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return CudaEvent(event)

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.stream.wait_event(event.raw)  # type: ignore[attr-defined]
        elif not event.query():  # a host event on a GPU stream: only DONE is expected
            raise TypeError("a CUDA stream can only wait on CUDA events")
