"""The hook on a GPU: a layer's writes wait for the fence (a CUDA event on the
engine's stream) recorded when the engine launched the layer. A fake fence source
drives it deterministically on the CPU: nothing reaches the transport while a
layer's fence is open, layers start in hook order, and a fence that never
completes, a failing one, or `close` all end in a settled, failed send that
started no write."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from fastkv.pd.inproc import InProcFabric
from fastkv.pd.layout import KVLayout
from fastkv.pd.messages import Acceptance
from fastkv.pd.receiver import PDReceiver
from fastkv.pd.sender import PDSender

from .rig import TIMEOUT, Rig

TOKENS = list(range(5, 5 + 11))


class FakeFence:
    def __init__(self, stream: int | None) -> None:
        self.stream = stream
        self._done = threading.Event()
        self.error: str = ""

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return self._done.is_set()

    def synchronize(self, timeout: float) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return self._done.wait(timeout)


class FakeFences:
    def __init__(self) -> None:
        self.recorded: list[FakeFence] = []

    def record(self, stream: int | None) -> FakeFence:
        fence = FakeFence(stream)
        self.recorded.append(fence)
        return fence


def _spy_writes(rig: Rig) -> list[int]:
    """The layer of every write P's rank 0 starts, in order."""
    sender = rig.senders[0]
    regions = [
        (layer, t.ptr, t.ptr + t.nbytes)
        for layer in range(rig.layers)
        for t in sender.layout.layer(layer)
    ]
    seen: list[int] = []
    real = sender.transport.write

    def write(peer, pieces):
        src = pieces[0].src
        (layer,) = [lay for lay, lo, hi in regions if lo <= src < hi]
        seen.append(layer)
        return real(peer, pieces)

    sender.transport.write = write  # type: ignore[method-assign]
    return seen


def _until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.001)


def _rig() -> tuple[Rig, FakeFences, list[int]]:
    fences = FakeFences()
    rig = Rig(fences=fences)
    rig.senders[0]._fence_slice_s = 0.01  # the waiter rechecks often
    return rig, fences, _spy_writes(rig)


def _landed(rig: Rig, acc: Acceptance, layer: int) -> bool:
    """Has any byte of P's layer reached D's receiving blocks?"""
    t = rig.d.ctrls[0].caches[layer * 2].numpy()
    return any(t[b].any() for b in acc.block_ids)


def test_a_layers_write_starts_only_once_its_fence_completed() -> None:
    rig, fences, writes = _rig()
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    table = list(rig.p.mgr.block_table("r").block_ids)
    rig.p.write_layer(table, TOKENS, 0, 0)
    rig.senders[0].after_layer(0, stream=0xBEEF)
    (f0,) = fences.recorded
    assert f0.stream == 0xBEEF  # recorded on the stream the engine passed
    time.sleep(0.1)  # ten of the waiter's slices
    assert writes == [] and rig.senders[0].layers_sent == 0 and not _landed(rig, acc, 0)
    rig.step()  # poll: nothing settles, nothing checksummed, no progress notice
    assert rig.senders[0].num_sends == 1 and rig.senders[0].progress_sent == 0
    assert rig.receivers[0].counters.progress == 0
    f0.complete()
    _until(lambda: _landed(rig, acc, 0), "layer 0's write")
    assert writes == [0] and not _landed(rig, acc, 1)
    for layer in (1, 2):
        rig.p.write_layer(table, TOKENS, layer, 0)
        rig.senders[0].after_layer(layer)  # the engine's current stream
        fences.recorded[layer].complete()
    assert [f.stream for f in fences.recorded] == [0xBEEF, None, None]
    _until(lambda: writes == [0, 1, 2], "layers 1 and 2")
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_layers_start_in_hook_order_when_a_later_fence_completes_first() -> None:
    rig, fences, writes = _rig()
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    f0, f1, f2 = fences.recorded
    f2.complete()
    f1.complete()
    time.sleep(0.1)
    assert writes == [], "a layer started before an earlier layer's fence completed"
    f0.complete()
    _until(lambda: writes == [0, 1, 2], "every layer, in order")
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_a_fence_that_never_completes_fails_the_send_at_its_deadline() -> None:
    rig, fences, writes = _rig()
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.step()
    assert rig.senders[0].num_sends == 1 and rig.outcomes == []
    rig.step(TIMEOUT + 0.1)  # P's send deadline (and D's) passed
    _until(lambda: rig.senders[0].num_sends == 0, "the send to settle")
    for fence in fences.recorded:  # too late: the send was stopped
        fence.complete()
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success
    assert writes == [] and rig.senders[0].layers_sent == 0
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_close_with_a_pending_fence_starts_no_write() -> None:
    rig, fences, writes = _rig()
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS)
    fences.recorded[0].complete()
    _until(lambda: rig.senders[0].layers_sent == 1, "layer 0's write")
    rig.senders[0].close()
    for fence in fences.recorded[1:]:
        fence.complete()
    time.sleep(0.05)
    assert writes == [0], "a write started after close"
    assert not rig.senders[0]._waiter.is_alive()  # type: ignore[union-attr]
    rig.p_side.release("r")
    rig.run_until_quiet()  # the send settles failed: D is told at once
    (out,) = rig.outcomes
    assert not out.success and "P reported a failure" in out.reason
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()
    rig.senders[0].close()  # idempotent
    with pytest.raises(ValueError, match="the sender was closed"):
        rig.offer("r2", TOKENS)


def test_a_failing_fence_fails_the_send_and_starts_no_write() -> None:
    rig, fences, writes = _rig()
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    fences.recorded[1].error = "cudaErrorIllegalAddress"
    fences.recorded[0].complete()
    _until(lambda: rig.senders[0].num_sends == 1 and writes == [0], "layer 0")
    rig.p_side.release("r")
    _until(lambda: bool(rig.step() or rig.outcomes), "D's outcome", timeout=10.0)
    fences.recorded[2].complete()
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success
    assert writes == [0]
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_abort_with_pending_fences_starts_none_of_their_layers() -> None:
    rig, fences, writes = _rig()
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS)  # every layer handed over, none started
    rig.senders[0].abort(acc.epoch, acc.transfer_id)
    for fence in fences.recorded:
        fence.complete()
    time.sleep(0.05)
    assert writes == []
    rig.p_side.release("r")
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_a_recording_that_fails_fails_the_send() -> None:
    class Broken:
        def record(self, stream: int | None) -> FakeFence:
            raise RuntimeError("cudaEventRecord: cudaErrorLaunchFailure")

    rig = Rig(fences=Broken())
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success
    assert rig.senders[0].layers_sent == 0
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def _arrays() -> list[np.ndarray]:
    return [np.zeros((4, 2, 16), np.float16) for _ in range(2)]


def test_host_memory_takes_no_fence_and_a_gpu_layout_needs_a_device_transport() -> None:
    fabric = InProcFabric()
    lay = KVLayout.of_arrays(_arrays(), tensors_per_layer=2, block_size=4)
    assert lay.device is None
    assert PDSender(fabric.endpoint("p"), lay)._fences is None
    gpu = KVLayout(lay.tensors, 2, 4, lay.num_blocks, device=0)
    assert gpu.digest() == lay.digest()  # a GPU P pairs with a host D
    with pytest.raises(
        ValueError, match=r"layout\.device: 0: InProcTransport moves host memory"
    ):
        PDSender(fabric.endpoint("p2"), gpu)
    with pytest.raises(ValueError, match=r"layout\.device: 0: InProcTransport"):
        PDReceiver(fabric.endpoint("d2"), gpu)
    for bad in (-1, True, "0"):
        with pytest.raises(ValueError, match=r"device: .* must be None"):
            KVLayout(lay.tensors, 2, 4, lay.num_blocks, device=bad)  # type: ignore[arg-type]


class _Place:
    def __init__(self, gpu: int | None) -> None:
        self.gpu = gpu

    def is_gpu_place(self) -> bool:
        return self.gpu is not None

    def gpu_device_id(self) -> int:
        assert self.gpu is not None
        return self.gpu


class _Tensor:
    """What of_controller reads of a Paddle tensor."""

    def __init__(self, gpu: int | None, ptr: int) -> None:
        self.place = _Place(gpu)
        self.shape = (4, 2, 16)
        self.dtype = "paddle.float16"
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


class _Controller:
    def __init__(self, places: list[int | None]) -> None:
        from types import SimpleNamespace

        self.caches = [_Tensor(g, 1 << 20 + i * 4096) for i, g in enumerate(places)]
        self.block_bytes = [64] * len(places)
        self.shape = SimpleNamespace(tensors_per_layer=2, block_size=4, num_device_blocks=4)


def test_of_controller_reads_the_tensors_place() -> None:
    assert KVLayout.of_controller(_Controller([1, 1])).device == 1
    assert KVLayout.of_controller(_Controller([None, None])).device is None
    with pytest.raises(ValueError, match="on one GPU or all on the host"):
        KVLayout.of_controller(_Controller([0, None]))


def test_the_workers_hook_passes_the_stream_and_close_starts_no_queued_write() -> None:
    from fastkv.integrations.fd_pd_worker import PDWorker

    rig = Rig()
    fences = FakeFences()
    reports: list = []
    worker = PDWorker(
        rig.p.layouts[0],
        rig.fabric.endpoint("p-worker"),
        role="prefill",
        report_to=reports.extend,
        fences=fences,
    )
    sender = worker.sender
    assert sender is not None
    sender._fence_slice_s = 0.01
    sender.connect(*rig.receivers[0].handshake())
    rig.senders[0] = sender  # P's rank 0 is the worker's sender now
    writes = _spy_writes(rig)
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    table = list(rig.p.mgr.block_table("r").block_ids)
    rig.p.write_layer(table, TOKENS, 0, 0)
    worker.after_layer(0, stream=7)
    (fence,) = fences.recorded
    assert fence.stream == 7
    worker.close(timeout_s=5.0)  # the send settles (D told), then the transport closes
    fence.complete()
    time.sleep(0.05)
    assert writes == [] and sender.num_sends == 0
    assert not sender._waiter.is_alive()  # type: ignore[union-attr]
    assert [r.ok for r in reports] == [False]
    rig.p_side.on_reports(reports)
    rig.p_side.release("r")
    rig.run_until_quiet()
    (out,) = rig.outcomes  # P's failure notice went out before the transport closed
    assert not out.success and "P reported a failure" in out.reason
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_a_fence_past_one_sends_deadline_does_not_stop_a_later_send_behind_it() -> None:
    """Two sends handed over behind the same fences; the first one's deadline
    passes with the fences pending, the second one's does not. Only the first is
    stopped: the second's layers start once the fences complete and it succeeds."""
    rig, fences, writes = _rig()
    tokens2 = list(range(40, 40 + 11))
    acc1 = rig.offer("r1", TOKENS)
    rig.now += TIMEOUT * 0.6
    acc2 = rig.offer("r2", tokens2)
    assert isinstance(acc1, Acceptance) and isinstance(acc2, Acceptance)
    t1 = list(rig.p.mgr.block_table("r1").block_ids)
    t2 = list(rig.p.mgr.block_table("r2").block_ids)
    for layer in range(rig.layers):  # one hook call per layer hands over both
        rig.p.write_layer(t1, TOKENS, layer, 0)
        rig.p.write_layer(t2, tokens2, layer, 0)
        rig.senders[0].after_layer(layer)
    assert len(fences.recorded) == rig.layers
    rig.now += TIMEOUT * 0.5  # r1's deadline passed, r2's not
    send1 = rig.senders[0]._sends[(acc1.epoch, acc1.transfer_id)]
    send2 = rig.senders[0]._sends[(acc2.epoch, acc2.transfer_id)]
    _until(lambda: bool(send1.failed), "the waiter to stop r1")
    time.sleep(0.05)  # a few more of the waiter's slices
    assert not send2.failed, f"r2 was stopped by r1's deadline: {send2.failed}"
    for fence in fences.recorded:
        fence.complete()
    _until(lambda: len(writes) == rig.layers, "r2's layers")
    rig.p_side.release("r1")
    rig.p_side.release("r2")
    rig.run_until_quiet()
    assert rig.finish_on_d("r1", TOKENS) == "recomputed"
    assert rig.finish_on_d("r2", tokens2) == "received"
    rig.check_clean()


def test_an_empty_last_chunk_takes_no_checksum_of_layers_still_behind_their_fences() -> None:
    """A chunked send whose blocks all went in a chunk not marked last, then an
    empty last chunk: the earlier chunk's layers are still behind their fences
    (on a GPU: launched, not yet written). `poll` must not checksum them nor tell
    D they are done before their fences completed and their writes started."""
    rig, fences, writes = _rig()
    tokens = list(range(5, 5 + 12))  # three full blocks
    acc = rig.offer("r", tokens, chunked=True)
    assert isinstance(acc, Acceptance)
    sender = rig.senders[0]
    table = list(rig.p.mgr.block_table("r").block_ids)
    n = len(acc.block_ids)
    sender.chunk(acc.epoch, acc.transfer_id, n, last=False)
    for layer in range(rig.layers):
        sender.after_layer(layer)  # launched; the kernel writes later
    sender.chunk(acc.epoch, acc.transfer_id, n, last=True)  # nothing left to send
    rig.step()
    send = sender._sends[(acc.epoch, acc.transfer_id)]
    assert send.sums == [] and sender.progress_sent == 0, "checksummed unwritten KV"
    for layer in range(rig.layers):  # the kernels ran
        rig.p.write_layer(table, tokens, layer, 0)
    for fence in fences.recorded:
        fence.complete()
    _until(lambda: len(writes) == rig.layers, "every layer's write")
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", tokens) == "received"
    rig.check_clean()


def test_a_write_that_raises_an_unexpected_error_fails_its_send_and_the_waiter_goes_on() -> (
    None
):
    """The transport's write raising something else than TransportError on the
    waiter thread: that send fails; the thread lives on and the next send's
    layers still start (else every later send would wait for its deadline)."""
    rig, fences, writes = _rig()
    sender = rig.senders[0]
    spy = sender.transport.write

    def broken(peer, pieces):
        raise RuntimeError("engine: std::bad_alloc")

    sender.transport.write = broken  # type: ignore[method-assign]
    assert isinstance(rig.offer("r1", TOKENS), Acceptance)
    rig.prefill("r1", TOKENS)
    fences.recorded[0].complete()
    _until(lambda: len(sender._fenced) < rig.layers, "layer 0's fence handled")
    sender.transport.write = spy  # type: ignore[method-assign]
    for fence in fences.recorded:
        fence.complete()
    rig.p_side.release("r1")
    rig.run_until_quiet()
    assert rig.finish_on_d("r1", TOKENS) == "recomputed"
    tokens2 = list(range(40, 40 + 11))
    assert isinstance(rig.offer("r2", tokens2), Acceptance)
    rig.prefill("r2", tokens2)
    for fence in fences.recorded:
        fence.complete()
    _until(lambda: len(writes) == rig.layers, "r2's layers")
    rig.p_side.release("r2")
    rig.run_until_quiet()
    assert rig.finish_on_d("r2", tokens2) == "received"
    rig.check_clean()


def test_a_start_racing_close_is_refused_and_starts_no_write() -> None:
    """`close` running on another thread while `start` checks its plan (here: in
    the middle of the checks): the start is refused, so no hook after close starts
    a write for it (host memory: the hook would write at once)."""
    rig = Rig()
    sender = rig.senders[0]
    writes = _spy_writes(rig)
    check = sender._check_ids

    def check_then_close(*args):  # type: ignore[no-untyped-def]
        check(*args)
        sender.close()

    sender._check_ids = check_then_close  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="the sender was closed"):
        rig.offer("r", TOKENS)
    assert sender.num_sends == 0
    rig.prefill("r", TOKENS)
    assert writes == [], "a write started after close"
