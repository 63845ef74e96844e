"""Sending overlaps the prefill: P is held after layer 0 until D has observed layer
0's bytes in its receiving blocks, while layer 1 there is still untouched."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fastkv.pd.messages import Acceptance

from .rig import BS, Rig, d_hashes, kv_values

TOKENS = list(range(7, 7 + 3 * BS))


def _layer_landed(rig: Rig, acc: Acceptance, layer: int) -> bool:
    t = rig.d.ctrls[0].caches[layer * 2].numpy()
    for i, block in enumerate(acc.block_ids):
        want = kv_values(TOKENS, layer, 0)[i * BS : (i + 1) * BS].transpose(1, 0, 2)
        if t[block].tobytes() != np.ascontiguousarray(want).tobytes():
            return False
    return True


def test_p_held_after_layer_0_until_d_observed_its_bytes() -> None:
    rig = Rig(layers=3)
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    seen = threading.Event()
    layer1_clean = []

    def observe() -> None:  # D's side, another thread: wait for layer 0's bytes
        for _ in range(2000):
            if _layer_landed(rig, acc, 0):
                t1 = rig.d.ctrls[0].caches[2].numpy()
                layer1_clean.append(all(not t1[b].any() for b in acc.block_ids))
                seen.set()
                return
            threading.Event().wait(0.001)

    sender = rig.senders[0]
    hook = sender.after_layer

    def held_hook(layer: int) -> None:
        hook(layer)
        if layer == 0:
            assert seen.wait(10.0), "D never observed layer 0's bytes"

    sender.after_layer = held_hook  # type: ignore[method-assign]
    d = threading.Thread(target=observe)
    d.start()
    rig.prefill("r", TOKENS)  # P: layer 0, hook (held), then layers 1 and 2
    d.join(10.0)
    assert layer1_clean == [True], "layer 1 arrived before P computed it"
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_hook_out_of_order_fails_the_send() -> None:
    rig = Rig()
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.senders[0].after_layer(1)  # a step already under way: waits for layer 0
    assert rig.senders[0].layers_sent == 0
    rig.senders[0].after_layer(0)
    rig.senders[0].after_layer(2)  # layer 1 skipped
    rig.p_side.release("r")
    rig.step()
    (out,) = rig.outcomes
    assert not out.success and "P reported a failure" in out.reason
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_sender_refuses_a_plan_for_unconnected_ranks() -> None:
    rig = Rig(p_tp=1, d_tp=2)
    from fastkv.pd.messages import SendPlan

    plan = SendPlan(1, rig.d_side.epoch, b"k" * 32, (0,), (0,), 4, 5.0)
    with pytest.raises(ValueError, match="connected"):
        rig.senders[0].start(plan)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2)])
def test_chunked_prefill_sends_each_block_with_the_chunk_that_completes_it(
    p_tp: int, d_tp: int
) -> None:
    tokens = list(range(50, 50 + 5 * BS + 3))  # 6 blocks, the last partial
    rig = Rig(p_tp=p_tp, d_tp=d_tp)
    acc = rig.offer("r", tokens, chunked=True)
    assert isinstance(acc, Acceptance)
    rig.prefill_chunk("r", tokens, acc, 6)  # block 0 full, block 1 half
    sent = rig.fabric.bytes_written
    per_block = sum(t.block_bytes for t in rig.p.layouts[0].tensors)
    assert sent == per_block * p_tp  # block 0 only, every layer, to every D rank
    rig.prefill_chunk("r", tokens, acc, 13)  # blocks 1 and 2 complete
    assert rig.fabric.bytes_written == 3 * per_block * p_tp
    rig.step()
    assert not rig.outcomes  # no notice before the last chunk
    rig.prefill_chunk("r", tokens, acc, len(tokens))  # the rest, partial block too
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", tokens) == "received"
    rig.check_clean()


def test_chunk_calls_are_checked() -> None:
    rig = Rig()
    acc = rig.offer("r", TOKENS, chunked=True)
    assert isinstance(acc, Acceptance)
    s = rig.senders[0]
    with pytest.raises(ValueError, match="with last"):
        s.chunk(acc.epoch, acc.transfer_id, 1, last=True)
    with pytest.raises(ValueError, match="must be in"):
        s.chunk(acc.epoch, acc.transfer_id, 99, last=False)
    s.chunk(acc.epoch, acc.transfer_id, 1, last=False)
    with pytest.raises(ValueError, match="no send waiting"):
        s.chunk(acc.epoch, acc.transfer_id, 2, last=False)  # the step has not run
    with pytest.raises(ValueError, match="no send waiting"):
        s.chunk(acc.epoch, 999, 2, last=False)


def test_hooks_on_the_engine_thread_while_sends_start_and_settle_on_another() -> None:
    """The engine's thread runs step after step of layer hooks while the scheduler's
    thread starts sends (some mid-step: they wait for the next step's layer 0),
    polls and delivers: every request arrives whole."""
    rig = Rig(layers=4, p_blocks=64, d_blocks=64)
    reqs = [(f"r{i}", list(range(i * 50, i * 50 + 9))) for i in range(10)]
    stop = threading.Event()
    hook_errors: list[BaseException] = []

    def engine() -> None:
        try:
            while not stop.is_set():
                for layer in range(rig.layers):
                    rig.senders[0].after_layer(layer)
        except BaseException as exc:  # pragma: no cover - reported below
            hook_errors.append(exc)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        for rid, toks in reqs:
            rig.p.mgr.add_request(rid, toks)
            assert rig.p.mgr.allocate(rid, num_tokens=len(toks))
            table = list(rig.p.mgr.block_table(rid).block_ids)
            for layer in range(rig.layers):  # computed before the send starts
                rig.p.write_layer(table, toks, layer, 0)
            offer = rig.p_side.offer(rid, len(toks))
            answer = rig.d_side.accept(offer, d_hashes(rig.d.mgr, toks))
            assert isinstance(answer, Acceptance)
            rig.receivers[0].expect(answer, 1)
            assert rig.p_side.on_answer(answer)
            rig.senders[0].start(rig.p_side.plan(rid))
            rig.p_side.release(rid)
            rig.step()
        for _ in range(2000):
            if len(rig.outcomes) == len(reqs):
                break
            rig.step()
            threading.Event().wait(0.001)
    finally:
        stop.set()
        thread.join(10.0)
    assert not hook_errors
    assert sorted(o.request_id for o in rig.outcomes if o.success) == sorted(r for r, _ in reqs)
    for rid, toks in reqs:
        assert rig.finish_on_d(rid, toks) == "received"
    rig.run_until_quiet()
    rig.check_clean()


def test_p_checksums_its_blocks_while_the_writes_are_in_flight(monkeypatch) -> None:
    """P's checksum overlaps the transfer: each layer's taken by the first poll
    after it was handed over, with every write still held, and not again when the
    writes settle; D verifies them and receives the request."""
    from fastkv.pd import sender as sender_mod

    calls: list[int] = []
    real = sender_mod.layer_checksum

    def spy(*args, **kwargs):
        calls.append(rig.fabric.num_queued)
        return real(*args, **kwargs)

    monkeypatch.setattr(sender_mod, "layer_checksum", spy)
    rig = Rig()
    rig.fabric.hold_writes = True
    tokens = list(range(100, 122))
    assert isinstance(rig.offer("r", tokens), Acceptance)
    rig.prefill("r", tokens)
    rig.p_side.release("r")
    rig.step(pump=False)
    assert len(calls) == rig.layers and min(calls) > 0  # writes still queued
    rig.fabric.hold_writes = False
    rig.run_until_quiet()
    assert len(calls) == rig.layers
    assert rig.finish_on_d("r", tokens) == "received"
    rig.check_clean()
