"""Issue 13 item 4: the engine's writes into blocks handed over while an eviction
still reads them are ordered by fastkv, not by the caller.

The scheduler lists the evicted blocks it gave to a new owner
(`CacheSwapMetadata.reused_block_ids`); the controller orders the compute stream
after those reads at every submission while they run, and only after those:
write-through backups never hold the model up.
"""

from __future__ import annotations

import hashlib
import logging
import threading

import pytest

from fastkv import CacheConfig
from fastkv.metadata import CacheLevel, CacheSwapMetadata
from fastkv.scheduler import CacheManager
from fastkv.worker.streams import HostStream, InlineStream
from fastkv.worker.transfer_manager import TransferManager

LAYERS = 3
RUNS = 40


def _model():
    pytest.importorskip("paddle", reason="the CacheController needs paddle")
    import handover_model

    return handover_model


def test_a_model_writing_right_after_submit_reads_no_wrong_kv(capsys) -> None:
    handover_model = _model()
    logging.disable(logging.INFO)
    try:
        bad, wrong, reused = handover_model.rate(RUNS, hand_over=True)
    finally:
        logging.disable(logging.NOTSET)
    with capsys.disabled():
        print(
            f"\nhandover: {bad} of {RUNS} runs read wrong KV ({wrong} blocks, {reused} reused)"
        )
    assert reused > RUNS  # the runs did hand evicted blocks over
    assert (bad, wrong) == (0, 0)


def test_the_same_model_reads_wrong_kv_when_nothing_orders_its_writes() -> None:
    """The control: with the list stripped (nothing says which blocks were handed
    over) the model above reads wrong KV, so the harness can see the hazard."""
    handover_model = _model()
    logging.disable(logging.INFO)
    try:
        bad, wrong, _ = handover_model.rate(RUNS, hand_over=False)
    finally:
        logging.disable(logging.NOTSET)
    assert bad > 0 and wrong >= bad


# -- the metadata field ----------------------------------------------------------


def test_reused_block_ids_are_checked() -> None:
    d2h = (0, CacheLevel.DEVICE, CacheLevel.HOST, [4, 5], [0, 1])
    assert CacheSwapMetadata(*d2h, reused_block_ids=[5]).reused_block_ids == [5]
    with pytest.raises(ValueError, match=r"reused_block_ids\[0\]: 7 is not one of"):
        CacheSwapMetadata(*d2h, reused_block_ids=[7])
    with pytest.raises(ValueError, match=r"reused_block_ids\[1\]: 4 is listed twice"):
        CacheSwapMetadata(*d2h, reused_block_ids=[4, 4])
    with pytest.raises(ValueError, match="only a DEVICE->HOST copy"):
        CacheSwapMetadata(0, CacheLevel.HOST, CacheLevel.DEVICE, [0], [4], reused_block_ids=[4])


def _manager(policy: str, reuse: bool) -> CacheManager:
    return CacheManager(
        CacheConfig(
            block_size=2,
            num_device_blocks=4,
            num_host_blocks=8,
            write_policy=policy,
            reuse_evicted_blocks=reuse,
        )
    )


def _digests(names: list[str]) -> list[bytes]:
    return [hashlib.sha256(n.encode()).digest() for n in names]


def _fill(mgr: CacheManager, rid: str, keys: list[str]) -> None:
    mgr.match(rid, _digests(keys), 2 * len(keys))
    assert mgr.allocate(rid, num_tokens=2 * len(keys))
    mgr.commit(rid, num_computed_tokens=2 * len(keys))
    mgr.finish(rid)


@pytest.mark.parametrize("reuse", [True, False])
def test_the_cache_manager_lists_the_evicted_blocks_it_hands_over(reuse: bool) -> None:
    mgr = _manager("write_back", reuse)
    _fill(mgr, "a", ["a0", "a1", "a2", "a3"])
    mgr.match("b", _digests(["b0", "b1"]), 4)
    mgr.allocate("b", num_tokens=4)  # evicts two of a's blocks
    evict = mgr.take_swap_metadata().evict
    assert evict is not None and len(evict.src_block_ids) == 2
    if reuse:  # the blocks are b's already, while the copy still reads them
        assert sorted(evict.reused_block_ids) == sorted(evict.src_block_ids)
        assert sorted(mgr.block_table("b").block_ids) == sorted(evict.src_block_ids)
    else:  # the blocks stay reserved until the copy's result
        assert list(evict.reused_block_ids) == []


def test_write_through_backups_are_not_listed() -> None:
    mgr = _manager("write_through", True)
    _fill(mgr, "a", ["a0", "a1"])
    backup = mgr.take_swap_metadata().evict
    assert backup is not None and len(backup.src_block_ids) == 2
    assert list(backup.reused_block_ids) == []


# -- the worker's ordering -----------------------------------------------------------


class RecordingCompute(InlineStream):
    """A device-like compute stream: records the waits asked of it, blocks nobody."""

    on_device = True

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[object] = []

    def wait_event(self, event) -> None:
        self.waits.append(event)


@pytest.fixture
def tm():
    manager = TransferManager(HostStream("h2d"), HostStream("d2h"), InlineStream(), LAYERS)
    yield manager
    manager.input_stream.close()
    manager.output_stream.close()


def test_only_handed_over_blocks_order_the_compute_stream(tm: TransferManager) -> None:
    gate = threading.Event()
    compute = RecordingCompute()
    backup = tm.submit_to_host(1, [0, 1], [0, 1], lambda layer, s: gate.wait(5), compute)
    assert tm.order_compute(compute) == 0 and compute.waits == []  # backups overlap
    evict = tm.submit_to_host(
        2, [2, 3], [2, 3], lambda layer, s: gate.wait(5), compute, reused_block_ids=[3]
    )
    assert tm.handed_over_blocks() == {3}
    assert tm.order_compute(compute) == 1 and compute.waits == [evict]
    assert backup not in compute.waits
    gate.set()
    tm.wait_all(timeout=5)
    assert tm.handed_over_blocks() == frozenset()


def test_a_handed_over_block_of_an_earlier_step_orders_later_steps(tm: TransferManager) -> None:
    gate = threading.Event()
    step1, step2 = RecordingCompute(), RecordingCompute()
    evict = tm.submit_to_host(
        1, [4], [0], lambda layer, s: gate.wait(5), step1, reused_block_ids=[4]
    )
    tm.order_compute(step1)
    tm.guard_writes((), step2)  # the next step: no eviction of its own
    assert tm.order_compute(step2) == 1 and step2.waits == [evict]
    gate.set()
    assert evict.synchronize(5)
    assert tm.order_compute(step2) == 0  # done: nothing more to wait for


def test_on_the_cpu_stand_in_the_model_waits_for_the_handed_over_reads(
    tm: TransferManager,
) -> None:
    read: list[int] = []
    gate = threading.Event()

    def copy(layer: int, s: int) -> None:
        gate.wait(5)
        read.append(layer)

    tm.submit_to_host(1, [4], [0], copy, reused_block_ids=[4])
    threading.Timer(0.05, gate.set).start()
    assert tm.order_compute() == 1  # the inline compute stream: the caller blocks
    assert read == list(range(LAYERS))  # every layer was read before it returned
    tm.wait_all(timeout=5)


def test_the_controller_evicts_layer_by_layer_only_where_something_writes_meanwhile() -> None:
    paddle = pytest.importorskip("paddle", reason="the CacheController needs paddle")
    del paddle
    from fastkv.worker import CacheController, KVCacheSpec

    spec = KVCacheSpec(
        num_layers=3,
        num_kv_heads=1,
        head_dim=8,
        block_size=4,
        num_device_blocks=8,
        num_host_blocks=8,
        dtype="float32",
    )
    ctrl = CacheController(spec)
    seen: list[bool] = []
    submit = ctrl.transfers.submit_to_host

    def spy(*args, **kwargs):
        seen.append(args[7] is None)  # copy_all: None means layer by layer
        return submit(*args, **kwargs)

    ctrl.transfers.submit_to_host = spy
    d2h, h2d = CacheLevel.DEVICE, CacheLevel.HOST
    tensors = range(len(ctrl.caches))
    for t in tensors:
        for b in range(5):
            ctrl.device_blocks(t)[b] = 10 * t + b + 1
    try:
        ctrl.submit_swap_tasks(CacheSwapMetadata(1, d2h, h2d, [0, 1], [0, 1]), None)
        ctrl.submit_swap_tasks(
            CacheSwapMetadata(2, d2h, h2d, [2, 3], [2, 3], reused_block_ids=[3]), None
        )
        ctrl.submit_swap_tasks(  # this step's load writes block 4 while it is read
            CacheSwapMetadata(3, d2h, h2d, [4], [4]),
            CacheSwapMetadata(4, h2d, d2h, [0], [4]),
        )
        assert seen == [False, True, True]
        assert all(r.success for r in ctrl.wait_all(timeout=10))
        for t in tensors:  # both ways copied every layer's bytes
            for b in range(5):
                assert (ctrl.host_blocks(t)[b] == 10 * t + b + 1).all(), (t, b)
    finally:
        ctrl.free_cache()
