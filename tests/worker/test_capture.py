"""G1 on the CPU: what the worker does when the engine's compute stream captures a
CUDA graph, with a compute stream that says it is capturing (the CUDA side is in
test_gpu_ordering.py, run on a GPU machine)."""

from __future__ import annotations

import pytest

from fastkv.ops.core import CudaCaptureError
from fastkv.worker.streams import HostEvent, InlineStream
from fastkv.worker.transfer_manager import LayerDoneCounter

LAYERS = 2


class CapturingCompute(InlineStream):
    """A device-side compute stream in the middle of a graph capture: counts the
    capture queries and the waits asked of it."""

    on_device = True

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0
        self.waits: list[object] = []

    def capturing(self) -> bool:
        self.queries += 1
        return True

    def wait_event(self, event) -> None:
        self.waits.append(event)


def _counter(compute: CapturingCompute, loaded: bool) -> LayerDoneCounter:
    events = [HostEvent(done=loaded) for _ in range(LAYERS)]
    return LayerDoneCounter(9, events, None, compute, [], LAYERS)


def test_a_layer_still_loading_refuses_a_wait_inside_a_capture() -> None:
    compute = CapturingCompute()
    counter = _counter(compute, loaded=False)
    with pytest.raises(CudaCaptureError, match="layer 1 is still loading"):
        counter.wait_for_layer(1)
    with pytest.raises(CudaCaptureError):
        counter.stream_wait_for_layer(0)
    assert compute.waits == []  # nothing was captured into the engine's graph


def test_a_loaded_layer_needs_nothing_inside_a_capture() -> None:
    compute = CapturingCompute()
    counter = _counter(compute, loaded=True)
    for layer in range(LAYERS):
        counter.wait_for_layer(layer)
    assert compute.waits == [] and compute.queries == 0  # not even a status query


def test_a_step_without_a_swap_in_waits_for_nothing_inside_a_capture() -> None:
    compute = CapturingCompute()
    counter = LayerDoneCounter(-1, (), None, compute, [], LAYERS)
    counter.wait_for_layer(0)
    assert compute.waits == [] and compute.queries == 0


def test_a_write_guard_still_pending_refuses_the_wait_too() -> None:
    compute = CapturingCompute()
    guard = [HostEvent() for _ in range(LAYERS)]
    counter = LayerDoneCounter(-1, (), None, compute, [guard], LAYERS)
    with pytest.raises(CudaCaptureError):
        counter.wait_for_layer(0)
    for e in guard:
        e.set()
    counter.wait_for_layer(1)
    assert compute.waits == []
