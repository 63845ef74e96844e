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
