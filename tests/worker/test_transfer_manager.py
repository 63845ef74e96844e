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
    tm.submit_to_host(1, [0], [0], lambda s: None)  # finishes at once
    tm.submit_to_host(2, [1], [1], lambda s: gate.wait(5))
    with pytest.raises(TransferTimeoutError, match="transfer 2"):
        tm.wait_all(timeout=0.1)
    gate.set()
    results = tm.wait_all(timeout=5)
    assert sorted(r.transfer_id for r in results) == [1, 2]


def test_is_layer_done_includes_the_write_guards(tm: TransferManager) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [4], [0], lambda s: gate.wait(5))
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
    done = tm.submit_to_host(3, [1, 2], [8, 9], lambda stream: gate.wait(5))
    assert not done.query()  # submit returned while the copy is held back
    assert tm.poll() == []
    gate.set()
    assert done.synchronize(5)
    assert [(r.transfer_id, r.success) for r in tm.poll()] == [(3, True)]


def test_a_load_into_a_block_still_being_evicted_waits_for_the_eviction(
    tm: TransferManager,
) -> None:
    gate = threading.Event()
    order: list[str] = []
    tm.submit_to_host(1, [4], [0], lambda s: (gate.wait(5), order.append("evict")))
    counter = tm.submit_to_device(2, [1], [4], lambda layer, s: order.append(f"load{layer}"))
    assert not counter.is_layer_done(0)
    assert tm.ordering_waits == 1
    gate.set()
    counter.wait_all(timeout=5)
    assert order == ["evict", "load0", "load1", "load2", "load3"]


def test_a_copy_into_a_host_block_still_being_read_waits(tm: TransferManager) -> None:
    gates = Gates(LAYERS)
    order: list[str] = []
    tm.submit_to_device(
        1, [3], [0], lambda layer, s: (gates.copy_layer(layer, s), order.append("load"))
    )
    done = tm.submit_to_host(2, [9], [3], lambda s: order.append("evict"))
    assert not done.synchronize(0.05)
    gates.open()
    assert done.synchronize(5)
    assert order == ["load"] * LAYERS + ["evict"]


def test_unrelated_copies_do_not_wait_for_each_other(tm: TransferManager) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [4], [0], lambda s: gate.wait(5))
    counter = tm.submit_to_device(2, [1], [5], lambda layer, s: None)
    counter.wait_all(timeout=5)  # completes while the eviction is held back
    assert tm.ordering_waits == 0
    gate.set()


def test_model_writes_wait_for_evictions_still_reading_their_blocks(
    tm: TransferManager,
) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [4], [0], lambda s: gate.wait(5))
    guarded = tm.guard_writes([4, 7])
    free = tm.guard_writes([7])
    free.wait_for_layer(0, timeout=1)  # block 7 is not being read
    with pytest.raises(TransferTimeoutError):
        guarded.wait_for_layer(0, timeout=0.05)
    gate.set()
    guarded.wait_for_layer(LAYERS - 1, timeout=5)


def test_finished_copies_stop_ordering_later_ones(tm: TransferManager) -> None:
    tm.submit_to_host(1, [4], [0], lambda s: None)
    tm.wait_all(timeout=5)
    counter = tm.submit_to_device(2, [1], [4], lambda layer, s: None)
    counter.wait_all(timeout=5)
    assert tm.ordering_waits == 0
    assert len(tm.device_hazards) == 1  # only the load still tracked until retired
    tm.wait_all(timeout=5)
    assert len(tm.device_hazards) == 0 and len(tm.host_hazards) == 0


def test_a_transfer_id_in_flight_cannot_be_reused(tm: TransferManager) -> None:
    gate = threading.Event()
    tm.submit_to_host(1, [0], [0], lambda s: gate.wait(5))
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
