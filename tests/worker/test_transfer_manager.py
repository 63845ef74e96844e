"""Layer-wise loads, fire-and-forget evictions and block-level ordering, with fake
copies that the tests hold back or fail at will (no Paddle needed)."""

from __future__ import annotations

import threading

import pytest

from fastkv.worker.streams import HostStream, InlineStream
from fastkv.worker.transfer_manager import (
    TransferFailedError,
    TransferManager,
    TransferTimeoutError,
)

LAYERS = 4


@pytest.fixture
def tm():
    manager = TransferManager(HostStream("h2d"), HostStream("d2h"), InlineStream(), LAYERS)
    yield manager
    manager.input_stream.close()
    manager.output_stream.close()


class Gates:
    """One gate per layer; a copy of layer L runs once gate L opens."""

    def __init__(self, n: int) -> None:
        self.gates = [threading.Event() for _ in range(n)]
        self.ran: list[int] = []

    def copy_layer(self, layer: int, stream: int) -> None:
        assert self.gates[layer].wait(5), "test gate never opened"
        self.ran.append(layer)

    def open(self, *layers: int) -> None:
        for layer in layers or range(len(self.gates)):
            self.gates[layer].set()


def test_each_layer_completes_on_its_own(tm: TransferManager) -> None:
    gates = Gates(LAYERS)
    counter = tm.submit_to_device(1, [0, 1], [5, 6], gates.copy_layer)
    assert counter.has_swap_in and not counter.is_layer_done(0)
    gates.open(0, 1)
    counter.wait_for_layer(1, timeout=5)
    assert counter.is_layer_done(0) and counter.is_layer_done(1)
    assert not counter.is_layer_done(2)
    gates.open()
    counter.wait_all(timeout=5)
    assert gates.ran == [0, 1, 2, 3]
    results = tm.wait_all(timeout=5)
    assert [(r.transfer_id, r.success) for r in results] == [(1, True)]


def test_waits_are_bounded(tm: TransferManager) -> None:
    gates = Gates(LAYERS)
    counter = tm.submit_to_device(1, [0], [0], gates.copy_layer)
    with pytest.raises(TransferTimeoutError, match="layer 0"):
        counter.wait_for_layer(0, timeout=0.05)
    with pytest.raises(TransferTimeoutError):
        tm.wait_all(timeout=0.05)
    assert tm.poll() == []  # still in flight, not reported
    gates.open()
    assert [r.success for r in tm.wait_all(timeout=5)] == [True]


def test_a_wait_all_that_times_out_loses_no_result(tm: TransferManager) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [0], [0], lambda layer, s: None)  # finishes at once
    tm.submit_to_host(2, [1], [1], lambda layer, s: gate.wait(5))
    with pytest.raises(TransferTimeoutError, match="transfer 2"):
        tm.wait_all(timeout=0.1)
    gate.set()
    results = tm.wait_all(timeout=5)
    assert sorted(r.transfer_id for r in results) == [1, 2]


def test_is_layer_done_includes_the_write_guards(tm: TransferManager) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [4], [0], lambda layer, s: gate.wait(5))
    guarded = tm.guard_writes([4])
    assert not guarded.is_layer_done(0)
    gate.set()
    guarded.wait_for_layer(0, timeout=5)
    assert guarded.is_layer_done(0)


def test_a_failed_layer_fails_the_transfer_and_skips_the_rest(tm: TransferManager) -> None:
    gates = Gates(LAYERS)

    def copy_layer(layer: int, stream: int) -> None:
        if layer == 2:
            raise RuntimeError("DMA error")
        gates.copy_layer(layer, stream)

    counter = tm.submit_to_device(7, [0], [0], copy_layer)
    gates.open(0, 1)
    counter.wait_for_layer(1, timeout=5)  # intact: loaded before the failed layer
    with pytest.raises(TransferFailedError, match="DMA error") as info:
        counter.wait_for_layer(2, timeout=5)
    assert info.value.transfer_id == 7
    with pytest.raises(TransferFailedError):
        counter.wait_all(timeout=5)
    assert counter.failed
    gates.open()
    (result,) = tm.wait_all(timeout=5)
    assert (result.transfer_id, result.success) == (7, False)
    assert "DMA error" in result.error
    assert gates.ran == [0, 1]  # layer 3 never copied


def test_eviction_is_fire_and_forget(tm: TransferManager) -> None:
    gate = threading.Event()
    done = tm.submit_to_host(3, [1, 2], [8, 9], lambda layer, stream: gate.wait(5))
    assert not done.query()  # submit returned while the copy is held back
    assert tm.poll() == []
    gate.set()
    assert done.synchronize(5)
    assert [(r.transfer_id, r.success) for r in tm.poll()] == [(3, True)]


def test_a_load_into_a_block_still_being_evicted_waits_for_the_eviction(
    tm: TransferManager,
) -> None:
    evict_gates = Gates(LAYERS)
    order: list[str] = []

    def evict(layer: int, s: int) -> None:
        evict_gates.copy_layer(layer, s)
        order.append(f"evict{layer}")

    tm.submit_to_host(1, [4], [0], evict)
    counter = tm.submit_to_device(2, [1], [4], lambda layer, s: order.append(f"load{layer}"))
    assert not counter.is_layer_done(0)
    assert tm.ordering_waits == 1
    evict_gates.open()
    counter.wait_all(timeout=5)
    for layer in range(LAYERS):
        assert order.index(f"evict{layer}") < order.index(f"load{layer}")


def test_the_load_waits_per_layer_not_for_the_whole_eviction(tm: TransferManager) -> None:
    """P1: layer 0 of a load into a block this step's eviction still reads starts
    once the eviction's layer 0 is copied; the eviction's later layers do not hold
    it up."""
    evict_gates = Gates(LAYERS)
    tm.submit_to_host(1, [4, 5], [0, 1], evict_gates.copy_layer)
    counter = tm.submit_to_device(2, [7], [4], lambda layer, s: None)
    evict_gates.open(0)
    counter.wait_for_layer(0, timeout=5)  # the eviction's layers 1-3 are still held
    assert not counter.is_layer_done(1)
    evict_gates.open(1)
    counter.wait_for_layer(1, timeout=5)
    assert not counter.is_layer_done(2)
    evict_gates.open()
    counter.wait_all(timeout=5)
    assert [r.success for r in tm.wait_all(timeout=5)] == [True, True]


def test_a_copy_into_a_host_block_still_being_read_waits(tm: TransferManager) -> None:
    gates = Gates(LAYERS)
    order: list[str] = []
    tm.submit_to_device(
        1,
        [3],
        [0],
        lambda layer, s: (gates.copy_layer(layer, s), order.append(f"load{layer}")),
    )
    done = tm.submit_to_host(2, [9], [3], lambda layer, s: order.append(f"evict{layer}"))
    assert not done.synchronize(0.05)
    gates.open()
    assert done.synchronize(5)
    for layer in range(LAYERS):
        assert order.index(f"load{layer}") < order.index(f"evict{layer}")


def test_unrelated_copies_do_not_wait_for_each_other(tm: TransferManager) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [4], [0], lambda layer, s: gate.wait(5))
    counter = tm.submit_to_device(2, [1], [5], lambda layer, s: None)
    counter.wait_all(timeout=5)  # completes while the eviction is held back
    assert tm.ordering_waits == 0
    gate.set()


def test_model_writes_wait_for_evictions_still_reading_their_blocks(
    tm: TransferManager,
) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [4], [0], lambda layer, s: gate.wait(5))
    guarded = tm.guard_writes([4, 7])
    free = tm.guard_writes([7])
    free.wait_for_layer(0, timeout=1)  # block 7 is not being read
    with pytest.raises(TransferTimeoutError):
        guarded.wait_for_layer(0, timeout=0.05)
    gate.set()
    guarded.wait_for_layer(LAYERS - 1, timeout=5)


def test_finished_copies_stop_ordering_later_ones(tm: TransferManager) -> None:
    tm.submit_to_host(1, [4], [0], lambda layer, s: None)
    tm.wait_all(timeout=5)
    counter = tm.submit_to_device(2, [1], [4], lambda layer, s: None)
    counter.wait_all(timeout=5)
    assert tm.ordering_waits == 0
    assert len(tm.device_hazards) == 1  # only the load still tracked until retired
    tm.wait_all(timeout=5)
    assert len(tm.device_hazards) == 0 and len(tm.host_hazards) == 0


def test_a_transfer_id_in_flight_cannot_be_reused(tm: TransferManager) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [0], [0], lambda layer, s: gate.wait(5))
    with pytest.raises(ValueError, match="transfer_id: 1"):
        tm.submit_to_device(1, [1], [1], lambda layer, s: None)
    gate.set()
    tm.wait_all(timeout=5)


def test_layer_index_is_checked(tm: TransferManager) -> None:
    counter = tm.guard_writes(())
    with pytest.raises(IndexError):
        counter.wait_for_layer(LAYERS)
    with pytest.raises(IndexError):
        counter.is_layer_done(-1)


class RecordingCompute(InlineStream):
    """A compute stream that counts its records and the waits asked of it."""

    def __init__(self, on_device: bool = False) -> None:
        super().__init__()
        self.on_device = on_device
        self.records = 0
        self.waits: list[object] = []

    def record(self):
        self.records += 1
        return super().record()

    def wait_event(self, event) -> None:
        self.waits.append(event)
        if not self.on_device:
            super().wait_event(event)


def test_each_submission_orders_after_its_own_steps_compute_stream(tm: TransferManager) -> None:
    """The engine hands its compute stream per step; copies wait for that stream's
    work, not for the stream the manager was built with."""
    step_a, step_b = RecordingCompute(), RecordingCompute()
    default = tm.compute
    tm.submit_to_host(1, [0], [0], lambda layer, s: None, compute=step_a)
    counter = tm.submit_to_device(2, [1], [1], lambda layer, s: None, (), compute=step_b)
    guard = tm.guard_writes([3], compute=step_a)
    assert (step_a.records, step_b.records) == (1, 1)
    counter.stream_wait_for_layer(0)
    assert len(step_b.waits) == 1 and not step_a.waits
    guard.stream_wait_for_layer(0)
    assert tm.compute is default
    tm.wait_all(timeout=5)


class BrokenEvent:
    """An event whose checks raise, as a CUDA event does after a sticky fault."""

    def query(self) -> bool:
        raise RuntimeError("fkv_cuda_event_query: cudaErrorIllegalAddress")

    def synchronize(self, timeout: float) -> bool:
        return self.query()


class BreakingStream(HostStream):
    """A stand-in whose next recorded event is broken."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.break_next = False
        self._records = 0

    def record(self):
        """Breaks the completion event (the last layer's) of the next transfer."""
        event = super().record()
        if self.break_next:
            self._records += 1
            if self._records == LAYERS:
                self.break_next, self._records = False, 0
                event.synchronize(5)
                return BrokenEvent()
        return event


def test_a_sticky_cuda_error_fails_its_transfer_and_loses_no_other_result() -> None:
    out = BreakingStream("d2h")
    tm = TransferManager(HostStream("h2d"), out, InlineStream(), LAYERS)
    try:
        tm.submit_to_host(1, [0], [0], lambda layer, s: None)
        out.break_next = True
        tm.submit_to_host(2, [1], [1], lambda layer, s: None)
        tm.submit_to_host(3, [2], [2], lambda layer, s: None)
        out.record().synchronize(5)
        results = {r.transfer_id: r for r in tm.poll()}  # must not raise
        assert sorted(results) == [1, 2, 3]
        assert results[1].success and results[3].success
        assert not results[2].success and "cudaErrorIllegalAddress" in results[2].error
        assert tm.num_inflight == 0 and len(tm.device_hazards) == 0
        out.break_next = True
        tm.submit_to_host(4, [3], [3], lambda layer, s: None)
        (result,) = tm.wait_all(timeout=5)  # the waiting path reports it too
        assert (result.transfer_id, result.success) == (4, False)
    finally:
        tm.input_stream.close()
        out.close()


def test_a_layer_wait_that_hits_a_cuda_error_raises_transfer_failed(
    tm: TransferManager,
) -> None:
    counter = tm.submit_to_device(5, [0], [0], lambda layer, s: None)
    counter.wait_all(timeout=5)
    counter._events[1] = BrokenEvent()  # the event a fault broke
    with pytest.raises(TransferFailedError, match="cudaErrorIllegalAddress"):
        counter.wait_for_layer(1, timeout=5)
    assert counter.failed
    assert counter.is_layer_done(1)  # settled (failed), not pending forever


def test_on_a_device_stream_the_layer_wait_is_device_side_by_default(
    tm: TransferManager,
) -> None:
    """On a GPU, wait_for_layer makes the compute stream wait and returns at once
    (no host polling); on_device=False is the bounded host wait."""
    gates = Gates(LAYERS)
    compute = RecordingCompute(on_device=True)
    counter = tm.submit_to_device(6, [0], [0], gates.copy_layer, (), compute=compute)
    counter.wait_for_layer(2, timeout=0.01)  # the copy is held back: a host wait would time out
    assert len(compute.waits) == 1
    with pytest.raises(TransferTimeoutError):
        counter.wait_for_layer(2, timeout=0.05, on_device=False)
    gates.open()
    counter.wait_for_layer(3, timeout=5, on_device=False)
    counter.wait_all(timeout=5)
    tm.wait_all(timeout=5)


def test_a_device_side_wait_still_raises_a_known_failure(tm: TransferManager) -> None:
    compute = RecordingCompute(on_device=True)

    def copy_layer(layer: int, stream: int) -> None:
        raise RuntimeError("launch failed")

    counter = tm.submit_to_device(7, [0], [0], copy_layer, (), compute=compute)
    tm.wait_all(timeout=5)
    with pytest.raises(TransferFailedError, match="launch failed"):
        counter.wait_for_layer(0)


def test_a_native_launch_of_every_layer_reports_its_failed_layer(tm: TransferManager) -> None:
    """copy_layers is used by streams that launch natively; a HostStream keeps the
    per-layer path, and either way the failure lands on the right layer."""
    from fastkv.ops.core import LayerCopyError

    class NativeStream(HostStream):
        def launch_layers(self, num_layers, copy_layer, on_error, copy_layers=None, after=()):
            events = [self.record() for _ in range(num_layers)]
            try:
                copy_layers(self.handle, events)
            except BaseException as e:
                on_error(e, getattr(e, "failed_layer", 0))
            return events

    def copy_layers(handle, events) -> None:
        raise LayerCopyError("fkv_layout_swap: cudaErrorLaunchFailure", 2)

    native = TransferManager(HostStream("h2d"), HostStream("d2h"), InlineStream(), LAYERS)
    native.input_stream = NativeStream("native")
    try:
        counter = native.submit_to_device(
            8, [0], [0], lambda layer, s: None, (), None, copy_layers
        )
        counter.wait_for_layer(1, timeout=5)  # layers before the failed one are intact
        with pytest.raises(TransferFailedError, match="cudaErrorLaunchFailure"):
            counter.wait_for_layer(2, timeout=5)
        (result,) = native.wait_all(timeout=5)
        assert not result.success
    finally:
        for s in (native.input_stream, native.output_stream):
            s.close()


def test_an_eviction_nothing_writes_meanwhile_is_one_launch(tm: TransferManager) -> None:
    """P2: without handed-over blocks, every layer goes in one call (one kernel on a
    GPU); each layer's event is the copy's end."""
    calls: list[str] = []
    done = tm.submit_to_host(
        1,
        [4, 5],
        [0, 1],
        lambda layer, s: calls.append(f"layer{layer}"),
        copy_all=lambda s: calls.append("all"),
    )
    assert done.synchronize(5)
    assert calls == ["all"]
    counter = tm.submit_to_device(2, [7], [4], lambda layer, s: None)  # after it: fine
    counter.wait_all(timeout=5)
    assert [r.success for r in tm.wait_all(timeout=5)] == [True, True]


def test_a_handed_over_eviction_runs_layer_by_layer(tm: TransferManager) -> None:
    calls: list[str] = []
    tm.submit_to_host(
        1,
        [4, 5],
        [0, 1],
        lambda layer, s: calls.append(f"layer{layer}"),
        reused_block_ids=[5],
        copy_all=lambda s: calls.append("all"),
    )
    tm.wait_all(timeout=5)
    assert calls == [f"layer{layer}" for layer in range(LAYERS)]


def test_a_failed_one_launch_eviction_is_reported_failed(tm: TransferManager) -> None:
    def broken(s: int) -> None:
        raise RuntimeError("DMA error")

    tm.submit_to_host(1, [4], [0], lambda layer, s: None, copy_all=broken)
    (result,) = tm.wait_all(timeout=5)
    assert not result.success and "DMA error" in result.error


class _NoWalk(dict):
    """A block's readers that refuse to be walked: any walk fails the test."""

    def _walked(self, *args, **kwargs):
        raise AssertionError("the readers of a block were walked")

    __iter__ = values = items = keys = _walked  # type: ignore[assignment]


def test_block_hazards_add_and_remove_never_walk_a_blocks_other_readers() -> None:
    """P5: with 10,000 in-flight copies reading one block, adding and removing one
    reader touches only that reader's entry (it used to scan a list of readers)."""
    from fastkv.worker.transfer_manager import BlockHazards, _InFlight

    class Pending(_InFlight):
        __slots__ = ()

        def finished(self, timeout: float | None = None) -> bool:
            return False

    hazards = BlockHazards()
    copies = [Pending(tid, True, [7], [tid]) for tid in range(10_000)]
    for c in copies:
        hazards.add([7], [], c)
    hazards._readers[7] = _NoWalk(hazards._readers[7])
    extra = Pending(10_000, True, [7], [1])
    hazards.add([7], [], extra)
    hazards.remove([7], [], copies[1234])
    hazards.remove([7], [], extra)
    hazards.remove([7], [], copies[1234])  # twice: a no-op, not an error
    assert len(hazards._readers[7]) == 9_999 and 1234 not in hazards._readers[7]
    # A write still finds every remaining reader (that walk is the query's job).
    hazards._readers[7] = dict(dict.items(hazards._readers[7]))
    assert len(hazards.conflicts([], [7])) == 9_999
    for c in copies:
        hazards.remove([7], [], c)
    assert len(hazards) == 0 and hazards.conflicts([], [7]) == []
