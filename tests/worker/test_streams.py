"""The CPU stand-in streams keep CUDA stream semantics: in-order execution,
events that complete after everything before them, cross-stream waits."""

from __future__ import annotations

import threading

import pytest

from fastkv.worker.streams import DONE, HostEvent, HostStream, InlineStream


@pytest.fixture
def streams():
    made: list[HostStream] = []

    def make(name: str, **kwargs) -> HostStream:
        made.append(HostStream(name, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_work_runs_in_submission_order(streams) -> None:
    stream = streams("s")
    seen: list[int] = []
    for i in range(200):
        stream.launch(lambda _, i=i: seen.append(i), pytest.fail)
    assert stream.record().synchronize(5)
    assert seen == list(range(200))


def test_event_completes_only_after_earlier_work(streams) -> None:
    stream = streams("s")
    gate = threading.Event()
    stream.launch(lambda _: gate.wait(5), pytest.fail)
    event = stream.record()
    assert not event.query()
    assert not event.synchronize(0.05)
    gate.set()
    assert event.synchronize(5)


def test_wait_event_orders_work_across_streams(streams) -> None:
    first, second = streams("first"), streams("second")
    gate = threading.Event()
    order: list[str] = []
    first.launch(lambda _: (gate.wait(5), order.append("first")), pytest.fail)
    second.wait_event(first.record())
    second.launch(lambda _: order.append("second"), pytest.fail)
    done = second.record()
    assert not done.synchronize(0.05)  # held back by the other stream
    gate.set()
    assert done.synchronize(5)
    assert order == ["first", "second"]


def test_a_failing_item_is_reported_and_the_stream_goes_on(streams) -> None:
    stream = streams("s")
    errors: list[BaseException] = []
    ran: list[int] = []
    stream.launch(lambda _: 1 / 0, errors.append)
    stream.launch(lambda _: ran.append(1), errors.append)
    assert stream.record().synchronize(5)
    assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)
    assert ran == [1]


def test_a_wait_that_runs_out_fails_the_next_item_instead_of_reordering(streams) -> None:
    stream = streams("s", wait_limit=0.05)
    never = HostEvent()
    errors: list[BaseException] = []
    ran: list[int] = []
    stream.wait_event(never)
    stream.launch(lambda _: ran.append(1), errors.append)
    assert stream.record().synchronize(5)
    assert ran == [] and isinstance(errors[0], TimeoutError)


def test_inline_stream_runs_at_once_and_bounds_its_waits() -> None:
    stream = InlineStream(wait_limit=0.05)
    ran: list[int] = []
    stream.launch(lambda _: ran.append(1), pytest.fail)
    assert ran == [1]
    assert stream.record() is DONE
    stream.wait_event(DONE)
    with pytest.raises(TimeoutError):
        stream.wait_event(HostEvent())


class FakeCudaCore:
    """The few core calls CudaStream/CudaEvent make, on plain counters: checks the
    Python side's bookkeeping (pooling, latching, failed layers) without a GPU. The
    real calls run in tests/worker/test_gpu_ordering.py on a GPU."""

    def __init__(self) -> None:
        self.next = 100
        self.pending: set[int] = set()
        self.destroyed: list[int] = []
        self.recorded: list[tuple[int, int]] = []
        self.waits: list[tuple[int, int]] = []
        self.queries = 0

    def event_create(self, device: int) -> int:
        self.next += 1
        return self.next

    def event_destroy(self, device: int, event: int) -> None:
        self.destroyed.append(event)

    def event_record(self, device: int, event: int, stream: int) -> None:
        self.recorded.append((event, stream))
        self.pending.add(event)

    def event_query(self, device: int, event: int) -> bool:
        self.queries += 1
        return event not in self.pending

    def event_wait(self, device: int, event: int, timeout: float) -> bool:
        return self.event_query(device, event)

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        self.waits.append((stream, event))


@pytest.fixture
def fake_cuda():
    from fastkv.worker import streams as mod

    fake = FakeCudaCore()
    pool = mod.CudaEventPool(3, core=fake)
    stream = mod.CudaStream.__new__(mod.CudaStream)
    stream._core, stream.device, stream.handle, stream.pool, stream.owned = (
        fake,
        3,
        77,
        pool,
        False,
    )
    return fake, pool, stream


def test_cuda_events_are_latched_and_pooled(fake_cuda) -> None:
    fake, pool, stream = fake_cuda
    event = stream.record()
    assert fake.recorded == [(event.handle, 77)] and not event.query()
    fake.pending.clear()  # the GPU reached it
    assert event.query() and event.query()
    assert fake.queries == 2  # latched: the second answer needs no CUDA call
    handle = event.handle
    del event
    assert pool.take() == handle  # a completed, dropped event is reused


def test_a_pending_event_dropped_goes_back_to_the_pool_without_a_cuda_call(fake_cuda) -> None:
    fake, pool, stream = fake_cuda
    pending = stream.record()
    handle = pending.handle
    queries = fake.queries
    del pending  # still pending on the device: nothing refers to it any more
    assert fake.queries == queries and fake.destroyed == []  # no CUDA from a finalizer
    assert pool.take() == handle  # recorded again later; earlier waits are unaffected


def test_steady_state_records_create_no_events(fake_cuda) -> None:
    fake, pool, stream = fake_cuda
    for step in range(50):  # each step keeps a few events alive, then drops them
        events = [stream.record() for _ in range(6)]
        if step % 2:
            fake.pending.clear()  # half the steps' events complete before the drop
        del events
    assert pool.created == 6  # the most alive at once, created once
    assert fake.destroyed == []


def test_events_given_back_to_a_closed_pool_are_destroyed(fake_cuda) -> None:
    fake, pool, stream = fake_cuda
    held = stream.record()  # e.g. the controller's counter, still held at close
    pooled = stream.record()
    fake.pending.clear()
    held_handle, pooled_handle = held.handle, pooled.handle
    del pooled  # back in the pool before it closes
    pool.close()
    assert fake.destroyed == [pooled_handle]
    del held  # completed, handed back after the close: destroyed, not pooled
    assert fake.destroyed == [pooled_handle, held_handle]
    assert pool._free == []


def test_cuda_stream_launches_layers_in_one_call_and_names_the_failed_layer(fake_cuda) -> None:
    from fastkv.ops.core import LayerCopyError

    _fake, _pool, stream = fake_cuda
    calls: list[tuple[int, list[int]]] = []
    failures: list[tuple[str, int]] = []

    def copy_layers(handle, events) -> None:
        calls.append((handle, list(events)))
        raise LayerCopyError("layer 2 failed", 2)

    events = stream.launch_layers(
        4,
        lambda layer, h: pytest.fail("per-layer path used"),
        lambda e, layer: failures.append((str(e), layer)),
        copy_layers,
    )
    assert len(calls) == 1 and calls[0][0] == 77
    assert calls[0][1] == [e.handle for e in events] and len(events) == 4
    assert failures == [("layer 2 failed", 2)]


def test_a_cuda_stream_skips_waits_on_completed_events(fake_cuda) -> None:
    fake, _pool, stream = fake_cuda
    event = stream.record()
    stream.wait_event(event)
    fake.pending.clear()
    event.query()
    stream.wait_event(event)
    assert fake.waits == [(77, event.handle)]
    stream.wait_event(DONE)  # a completed host event needs no wait
    with pytest.raises(TypeError):
        stream.wait_event(HostEvent())


@pytest.mark.parametrize("refusal", ["bad ids", "capturing stream", "injected fault"])
def test_a_refused_native_call_hands_out_no_event_still_carrying_an_older_record(
    fake_cuda, refusal: str
) -> None:
    """Pooled handles keep their last record. When copy_layers is refused before the
    core records anything, the events handed out must read complete at once (the
    transfer has failed), not wait on the older transfer's record."""
    from fastkv.ops.core import CudaCaptureError

    fake, _pool, stream = fake_cuda
    older = [stream.record() for _ in range(3)]  # another transfer, still running
    handles = {e.handle for e in older}
    del older  # dropped while pending: back in the pool, their records still pending
    error = {
        "bad ids": ValueError("device_ids: 99 out of range"),
        "capturing stream": CudaCaptureError("cuda_stream: capturing"),
        "injected fault": RuntimeError("injected"),
    }[refusal]
    failures: list[int] = []

    def copy_layers(handle, events) -> None:
        raise error

    events = stream.launch_layers(
        3,
        lambda layer, h: pytest.fail("per-layer path used"),
        lambda e, layer: failures.append(layer),
        copy_layers,
    )
    assert {e.handle for e in events} == handles  # the pooled handles were reused
    queries = fake.queries
    assert all(e.query() and e.known_done for e in events)
    assert fake.queries == queries  # complete without asking the device
    assert all(e.synchronize(0.0) for e in events)
    assert failures == [0]


def test_a_failed_layer_keeps_the_events_the_core_recorded(fake_cuda) -> None:
    """A LayerCopyError comes after the core enqueued the layers before the failed
    one and recorded the rest behind them: those events are waited on, not latched."""
    from fastkv.ops.core import LayerCopyError

    fake, _pool, stream = fake_cuda

    def copy_layers(handle, events) -> None:
        for event in events:
            fake.event_record(3, event, handle)
        raise LayerCopyError("layer 1 failed", 1)

    events = stream.launch_layers(3, lambda layer, h: None, lambda e, layer: None, copy_layers)
    assert not any(e.query() for e in events)  # pending behind the enqueued layers
    fake.pending.clear()
    assert all(e.query() for e in events)


def test_a_cuda_load_ordered_after_other_copies_is_one_native_call(fake_cuda) -> None:
    """Issue 26, item 1: per-layer waits go into the one native call, layer-major,
    as a LayerWaits; nothing is waited for from Python. A completed event and an
    event a copy repeats for its next layers (an eviction launched whole) are
    skipped: the stream already waits for it through the earlier layer."""
    fake, _pool, stream = fake_cuda
    per_layer = [stream.record() for _ in range(3)]  # an eviction ordered per layer
    whole = [stream.record()] * 3  # an eviction launched whole: one end event
    finished = [stream.record() for _ in range(3)]
    fake.pending.discard(finished[1].handle)
    finished[1].query()  # latched complete
    calls = []

    def copy_layers(handle, events, waits=None) -> None:
        calls.append((handle, list(events), waits))

    events = stream.launch_layers(
        3,
        lambda layer, h: pytest.fail("per-layer path used"),
        lambda e, layer: pytest.fail(f"failed: {e}"),
        copy_layers,
        [per_layer, whole, finished],
    )
    assert len(calls) == 1 and fake.waits == []
    handle, handles, waits = calls[0]
    assert (handle, handles) == (77, [e.handle for e in events])
    assert waits.per_layer == 3
    p, w, f = per_layer, whole[0], finished
    assert list(waits.handles) == [
        p[0].handle, w.handle, f[0].handle,
        p[1].handle, None, None,
        p[2].handle, None, f[2].handle,
    ]  # fmt: skip


def test_a_cuda_load_with_nothing_left_to_wait_for_passes_no_waits(fake_cuda) -> None:
    fake, _pool, stream = fake_cuda
    done = [stream.record() for _ in range(2)]
    fake.pending.clear()
    for e in done:
        e.query()
    calls = []
    stream.launch_layers(
        2, lambda layer, h: None, lambda e, layer: None, lambda *a: calls.append(a), [done]
    )
    assert len(calls) == 1 and len(calls[0]) == 2  # (stream, events): no waits


def test_a_cuda_stream_refuses_to_wait_on_a_pending_host_event(fake_cuda) -> None:
    _fake, pool, stream = fake_cuda
    free = pool.num_free
    with pytest.raises(TypeError, match="only wait on CUDA events"):
        stream.launch_layers(
            2,
            lambda layer, h: None,
            lambda e, layer: None,
            lambda *a: None,
            [[HostEvent()] * 2],
        )
    assert pool.num_free == free  # refused before any event was taken
