"""Streams and events for the transfer manager: CUDA streams and events created by
the fastkv core on an explicit device, and a CPU stand-in with the same ordering
semantics so the ordering logic runs (and is tested) on machines without CUDA.

A stream runs the work launched on it in order. `record()` returns an event that
completes once everything launched before it has run; `wait_event(e)` makes work
launched on the stream afterwards wait for `e` (on a GPU, on the device, without
blocking the host). Host-side waits on events are always bounded.

On a GPU nothing here touches the calling thread's current device: every stream and
event belongs to one device, and the core makes that device current only for the
call (so a thread with no CUDA context keeps none, and no context appears on
device 0). Events are pooled per device: an event goes back to its pool as soon
as nothing references it, finished or not (re-recording an event does not affect
waits already enqueued on it), so steady-state submits create no events, and
dropping one never calls CUDA (nothing can reach CUDA from a finalizer in the
middle of an engine's graph capture).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

log = logging.getLogger(__name__)

Launch = Callable[[int], None]
"""A unit of work: called with the stream's native handle (cudaStream_t or 0)."""
OnError = Callable[[BaseException], None]
CopyLayer = Callable[[int, int], None]
"""`copy_layer(layer, stream_handle)`: enqueue (or run) one layer's copy."""
CopyLayers = Callable[..., None]
"""`copy_layers(stream_handle, events[, waits])`: enqueue every layer in one native
call, recording events[layer] after each and, given `waits` (a `LayerWaits`),
waiting for layer L's wait events before layer L; raises
`fastkv.ops.core.LayerCopyError` naming the first layer not enqueued intact. It is
called with `waits` only when there is something to wait for."""
OnLayerError = Callable[[BaseException, int], None]

MAX_WAITS_PER_LAYER = 1024
"""The core's FKV_MAX_WAITS_PER_LAYER: a copy ordered after more in-flight copies
than this goes layer by layer instead of in one native call."""


class LayerWaits:
    """What one native call waits for per layer: `handles` holds `per_layer`
    cudaEvent_t (or None: nothing to wait for) per layer, layer-major."""

    __slots__ = ("handles", "per_layer")

    def __init__(self, handles: ctypes.Array[ctypes.c_void_p], per_layer: int) -> None:
        self.handles = handles
        self.per_layer = per_layer

    def astuple(self) -> tuple[ctypes.Array[ctypes.c_void_p], int]:
        """(handles, per_layer): `Layout.swap`'s wait_events and waits_per_layer."""
        return self.handles, self.per_layer


class Event(Protocol):
    def query(self) -> bool:
        """Has everything before this event completed?"""
        ...

    def synchronize(self, timeout: float) -> bool:
        """Block the calling thread until the event completes or `timeout` seconds
        pass; True if it completed."""
        ...

    @property
    def known_done(self) -> bool:
        """Known complete without asking the device (a latched earlier answer)."""
        ...


class Stream(Protocol):
    handle: int
    on_device: bool
    """True for a CUDA stream: waits on it are device-side, the host goes on."""

    def launch(self, fn: Launch, on_error: OnError) -> None:
        """Enqueue `fn`. If it raises, `on_error` gets the exception (from whichever
        thread ran it) and the stream carries on with the next item."""
        ...

    def launch_layers(
        self,
        num_layers: int,
        copy_layer: CopyLayer,
        on_error: OnLayerError,
        copy_layers: CopyLayers | None = None,
        after: Sequence[Sequence[Event]] = (),
    ) -> list[Event]:
        """Enqueue a layer-by-layer copy; returns one event per layer, each complete
        once its layer is. Layer L starts after layer L's event of every copy in
        `after` (per-layer events of in-flight copies it conflicts with). A failure
        goes to `on_error(exc, layer)`; the events of the failed layer and later
        ones still complete (nothing waits forever)."""
        ...

    def record(self) -> Event: ...

    def wait_event(self, event: Event) -> None: ...

    def capturing(self) -> bool:
        """Is the stream capturing a CUDA graph (never, off a GPU)?"""
        ...


def _launch_layers_one_by_one(
    stream: Stream,
    num_layers: int,
    copy_layer: CopyLayer,
    on_error: OnLayerError,
    after: Sequence[Sequence[Event]] = (),
) -> list[Event]:
    events: list[Event] = []
    for layer in range(num_layers):
        for other in after:
            stream.wait_event(other[layer])
        stream.launch(
            lambda handle, layer=layer: copy_layer(layer, handle),
            lambda e, layer=layer: on_error(e, layer),
        )
        events.append(stream.record())
    return events


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

    @property
    def known_done(self) -> bool:
        return self._flag.is_set()

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
    on_device = False

    def __init__(self, name: str, wait_limit: float = 600.0) -> None:
        self.name = name
        self._wait_limit = wait_limit
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wait_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def launch(self, fn: Launch, on_error: OnError) -> None:
        self._queue.put((fn, on_error))

    def launch_layers(
        self,
        num_layers: int,
        copy_layer: CopyLayer,
        on_error: OnLayerError,
        copy_layers: CopyLayers | None = None,
        after: Sequence[Sequence[Event]] = (),
    ) -> list[Event]:
        """One queued item and one event per layer (`copy_layers` is for CUDA)."""
        return _launch_layers_one_by_one(self, num_layers, copy_layer, on_error, after)

    def record(self) -> HostEvent:
        event = HostEvent()
        self._queue.put(event)
        return event

    def wait_event(self, event: Event) -> None:
        if not event.query():
            self._queue.put(("wait", event))

    def capturing(self) -> bool:
        return False

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
    on_device = False

    def __init__(self, wait_limit: float = 600.0) -> None:
        self._wait_limit = wait_limit

    def launch(self, fn: Launch, on_error: OnError) -> None:
        try:
            fn(0)
        except BaseException as e:
            on_error(e)

    def launch_layers(
        self,
        num_layers: int,
        copy_layer: CopyLayer,
        on_error: OnLayerError,
        copy_layers: CopyLayers | None = None,
        after: Sequence[Sequence[Event]] = (),
    ) -> list[Event]:
        return _launch_layers_one_by_one(self, num_layers, copy_layer, on_error, after)

    def record(self) -> HostEvent:
        return DONE

    def wait_event(self, event: Event) -> None:
        if not event.synchronize(self._wait_limit):
            raise TimeoutError(f"compute waited {self._wait_limit:.0f} s for a copy")

    def capturing(self) -> bool:
        return False


# -- CUDA through the fastkv core -----------------------------------------------


class CudaEventPool:
    """cudaEvent_t handles of one device, reused instead of created and destroyed
    per record (creation costs microseconds on the launch path).

    A handle comes back as soon as its `CudaEvent` is dropped, complete or not:
    nothing refers to it any more, and CUDA lets an event be recorded again while
    waits enqueued on its earlier record stay as they were. So the pool holds as
    many events as were ever alive at once, and steady-state submits create none.

    Args:
        device: CUDA ordinal the events belong to.
        prefill: events to create now (at start-up, not mid-serving).
        core: the module with event_create / event_destroy (`fastkv.ops.core`).
    """

    def __init__(self, device: int, prefill: int = 0, core: object | None = None) -> None:
        if core is None:
            from fastkv.ops import core as fastkv_core

            core = fastkv_core
        self._core = core
        self.device = device
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._closed = False
        self.created = 0
        for _ in range(prefill):
            self._free.append(self._create())

    def _create(self) -> int:
        handle = self._core.event_create(self.device)  # type: ignore[attr-defined]
        self.created += 1
        return handle

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._create()

    def give(self, handle: int) -> None:
        """Pools a handle nothing refers to any more (list append: no CUDA call,
        safe from a finalizer); once the pool is closed, destroys it instead."""
        with self._lock:
            if not self._closed:
                self._free.append(handle)
                return
        self._core.event_destroy(self.device, handle)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Destroys the pooled events; events still held elsewhere are destroyed when
        they are given back."""
        with self._lock:
            self._closed = True
            handles, self._free = self._free, []
        for h in handles:
            self._core.event_destroy(self.device, h)  # type: ignore[attr-defined]


class CudaEvent:
    """A cudaEvent_t recorded once; returned to its pool when dropped.

    Completion is latched: once a query has seen it complete, later queries answer
    without calling CUDA. A CUDA error seen by a query (e.g. a sticky one from a
    fault) raises RuntimeError from `query`/`synchronize`; callers report it as a
    failed transfer.
    """

    __slots__ = ("_done", "device", "handle", "pool")

    def __init__(self, pool: CudaEventPool, handle: int) -> None:
        self.pool = pool
        self.device = pool.device
        self.handle = handle
        self._done = False

    def query(self) -> bool:
        if not self._done:
            self._done = self.pool._core.event_query(self.device, self.handle)
        return self._done

    def synchronize(self, timeout: float) -> bool:
        """Bounded, precise host wait (the core polls with the GIL released)."""
        if not self._done:
            self._done = self.pool._core.event_wait(self.device, self.handle, timeout)
        return self._done

    @property
    def known_done(self) -> bool:
        return self._done

    def settle(self) -> None:
        """Latch the event complete without recording it: for a handle taken for
        work that was never enqueued (its pooled handle's last record belongs to
        another transfer and must not be waited on)."""
        self._done = True

    def __del__(self) -> None:
        # Back to the pool, finished or not (see CudaEventPool): no CUDA call here,
        # so a reference dropped mid-capture cannot touch the engine's graph.
        with contextlib.suppress(Exception):  # interpreter shutdown, a dead context
            self.pool.give(self.handle)


def _layer_waits(num_layers: int, after: Sequence[Sequence[Event]]) -> LayerWaits | None:
    """`after` as one native call's per-layer waits, or None when nothing is left to
    wait for. An event known complete, or one a copy repeats for its next layer (an
    eviction launched whole gives every layer its one end event), is skipped: the
    stream already waits for it through the earlier layer."""
    per_layer = len(after)
    flat: list[int | None] = [None] * (num_layers * per_layer)
    for j, other in enumerate(after):
        previous: Event | None = None
        for layer in range(num_layers):
            event = other[layer]
            if event is previous:
                continue
            previous = event
            if isinstance(event, CudaEvent):
                if not event.known_done:
                    flat[layer * per_layer + j] = event.handle
            elif not event.query():  # a host event on a GPU stream: only DONE is expected
                raise TypeError("a CUDA stream can only wait on CUDA events")
    if not any(flat):
        return None
    return LayerWaits((ctypes.c_void_p * len(flat))(*flat), per_layer)


class CudaStream:
    """A CUDA stream of one device; work is launched asynchronously from the
    calling thread.

    Args:
        device: the stream's CUDA ordinal.
        handle: its cudaStream_t as an int.
        pool: where its events come from (one pool per device is plenty).
        owned: destroy the stream on `close()` (False for an engine's stream).
    """

    on_device = True

    def __init__(self, device: int, handle: int, pool: CudaEventPool, owned: bool) -> None:
        from fastkv.ops import core

        self._core = core
        self.device = device
        self.handle = handle
        self.pool = pool
        self.owned = owned

    @classmethod
    def new(cls, device: int, pool: CudaEventPool, priority: int = 0) -> CudaStream:
        """A new non-blocking stream; priority > 0: the device's highest, < 0: its
        lowest, 0: default."""
        from fastkv.ops import core

        return cls(device, core.stream_create(device, priority), pool, owned=True)

    @classmethod
    def external(cls, device: int, handle: int, pool: CudaEventPool) -> CudaStream:
        """An engine's stream (e.g. Paddle's compute stream), used but not owned."""
        return cls(device, handle, pool, owned=False)

    def launch(self, fn: Launch, on_error: OnError) -> None:
        try:
            fn(self.handle)
        except BaseException as e:
            on_error(e)

    def launch_layers(
        self,
        num_layers: int,
        copy_layer: CopyLayer,
        on_error: OnLayerError,
        copy_layers: CopyLayers | None = None,
        after: Sequence[Sequence[Event]] = (),
    ) -> list[Event]:
        """With `copy_layers`: one native call enqueues every layer, each after its
        waits in `after` (passed as a `LayerWaits`, so a load ordered after a
        same-step eviction is still one validation and one staging of its ids),
        and records one pooled event per layer; otherwise a wait per layer and
        copy, a launch and a record per layer.

        A pooled handle still carries its last record (another transfer's), so no
        event is handed out unless this call recorded it or latched it complete:
        when `copy_layers` fails with a `LayerCopyError` the core has recorded the
        events of the failed layer and the later ones on this stream (behind the
        layers it enqueued); any other failure (bad ids, a capturing stream, an
        injected fault) enqueued nothing, so every event is latched complete and a
        waiter sees the failure at once instead of an older transfer's record."""
        if copy_layers is None or len(after) > MAX_WAITS_PER_LAYER:
            return _launch_layers_one_by_one(self, num_layers, copy_layer, on_error, after)
        waits = _layer_waits(num_layers, after)
        events = [CudaEvent(self.pool, self.pool.take()) for _ in range(num_layers)]
        handles = (ctypes.c_void_p * num_layers)(*[e.handle for e in events])
        try:
            if waits is None:
                copy_layers(self.handle, handles)
            else:
                copy_layers(self.handle, handles, waits)
        except BaseException as e:
            failed = getattr(e, "failed_layer", None)
            if failed is None:  # refused before anything was enqueued or recorded
                for event in events:
                    event.settle()
            on_error(e, int(failed or 0))
        return events

    def record(self) -> CudaEvent:
        event = CudaEvent(self.pool, self.pool.take())
        self._core.event_record(self.device, event.handle, self.handle)
        return event

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            if not event._done:
                self._core.stream_wait_event(self.device, self.handle, event.handle)
        elif not event.query():  # a host event on a GPU stream: only DONE is expected
            raise TypeError("a CUDA stream can only wait on CUDA events")

    def capturing(self) -> bool:
        """Is the stream capturing a CUDA graph?"""
        return self._core.stream_capturing(self.device, self.handle)

    def priority(self) -> int:
        return self._core.stream_priority(self.device, self.handle)

    def close(self) -> None:
        """Destroys an owned stream (after its work is done)."""
        if self.owned and self.handle:
            self._core.stream_destroy(self.device, self.handle)
            self.handle = 0
