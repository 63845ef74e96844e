"""Progress notices: P tells each D rank which layers' writes all settled done, with
their checksums, while later layers still land; D verifies those layers then and
checks only the others after the final notice. A progress notice is a hint: lost,
late, repeated, forged or unknown ones are dropped and counted and only change how
much the final check costs; a layer whose early check failed is checked again."""

from __future__ import annotations

import ctypes

import pytest
from prometheus_client import CollectorRegistry

from fastkv.pd import receiver as receiver_mod
from fastkv.pd.messages import Acceptance, Notice, encode_notice
from fastkv.pd.metrics import watch_pd
from fastkv.pd.transport import Piece, WriteState

from .rig import BS, Rig

TOKENS = list(range(11, 11 + 3 * BS))


def _hand_over(rig: Rig, rid: str, layers: list[int]) -> None:
    """P computes `layers` of the prompt and calls every rank's hook after each."""
    table = list(rig.p.mgr.block_table(rid).block_ids)
    for layer in layers:
        rig.p.write_layer(table, TOKENS, layer, 0)
        for s in rig.senders:
            s.after_layer(layer)


def _start(rig: Rig) -> Acceptance:
    """Layer 0 handed over and landed, layers 1.. not computed; writes held."""
    rig.fabric.hold_writes = True
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    _hand_over(rig, "r", [0])
    rig.fabric.pump()
    return acc


def _finish(rig: Rig) -> None:
    _hand_over(rig, "r", list(range(1, rig.layers)))
    rig.p_side.release("r")
    rig.run_until_quiet()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 2)])
def test_d_verifies_a_layer_on_its_progress_notice_and_not_again(
    p_tp: int, d_tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = Rig(p_tp=p_tp, d_tp=d_tp)
    reg = CollectorRegistry()
    watch_pd(reg, role="decode", scheduler=rig.d_side, workers=lambda: rig.receivers)
    _start(rig)
    rig.step(pump=False)  # P: layer 0 settled -> progress; D verifies layer 0
    assert not rig.outcomes
    assert all(r.counters.progress == 1 for r in rig.receivers)
    assert all(r.counters.layers_early == 1 for r in rig.receivers)
    assert sum(s.progress_sent for s in rig.senders) == d_tp
    early = reg.get_sample_value(
        "fastkv:pd_layers_verified_early_total", {"model": "default", "role": "decode"}
    )
    assert early == d_tp
    checked: list[int] = []
    real = receiver_mod.layer_checksum

    def spy(tensors, block_ids, **kwargs):
        checked.append(tensors[0].ptr)
        return real(tensors, block_ids, **kwargs)

    monkeypatch.setattr(receiver_mod, "layer_checksum", spy)
    _finish(rig)
    # after the final notice each D rank checks layers 1.. only
    want = sorted(
        r.layout.layer(la)[0].ptr for r in rig.receivers for la in range(1, rig.layers)
    )
    assert sorted(checked) == want
    (out,) = rig.outcomes
    assert out.success
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_late_duplicate_forged_and_unknown_progress_notices_are_dropped_and_counted() -> None:
    rig = Rig()
    acc = _start(rig)
    rec = rig.receivers[0]
    d0 = rec.transport
    for s in rig.senders:
        rig.p_side.on_reports(s.poll())
    ((_, progress),) = list(d0.inbox)
    d0.inbox.append(("replay", progress))
    forged = Notice(acc.epoch, acc.transfer_id, 0, 1, 0, 1, False, rig.layers, (1,), 1, True)
    d0.inbox.append(("evil", encode_notice(forged, b"x" * 32)))
    other = Notice(acc.epoch, acc.transfer_id + 9, 0, 1, 0, 1, False, rig.layers, (1,), 0, True)
    d0.inbox.append(("evil", encode_notice(other, b"y" * 32)))
    assert rec.poll() == []  # progress reports nothing
    c = rec.counters
    assert (c.progress, c.layers_early, c.duplicate, c.forged, c.unknown) == (1, 1, 1, 1, 1)
    assert rec._waiting == {}  # an unknown progress notice is not kept waiting
    _hand_over(rig, "r", [1, 2])
    rig.fabric.pump()
    for s in rig.senders:
        rig.p_side.on_reports(s.poll())
    (final,) = rec.poll()
    assert final.ok
    d0.inbox.append(("replay", progress))  # after the final notice, before forget
    assert rec.poll() == []
    assert c.late == 1
    rig.outcomes += rig.d_side.on_reports([final])
    rig.p_side.release("r")
    rig.run_until_quiet()
    d0.inbox.append(("replay", progress))  # after forget
    rig.step()
    assert c.late == 2 and c.received == 1
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_a_lost_progress_notice_costs_only_the_final_check() -> None:
    rig = Rig()
    _start(rig)
    rig.fabric.drop_next_notices(1)
    rig.step(pump=False)
    assert rig.receivers[0].counters.progress == 0
    _finish(rig)
    assert rig.receivers[0].counters.layers_early == 0
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_a_layer_that_fails_its_early_check_is_checked_again_and_recomputes() -> None:
    """A partial write of layer 0 reported done: its progress notice's check fails,
    so the final check takes layer 0 again and the request recomputes."""
    rig = Rig()
    rig.fabric.hold_writes = True
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.fabric.partial_next_write(0.5, WriteState.DONE)  # a transport that lies
    _hand_over(rig, "r", [0])
    rig.fabric.pump()
    rig.step(pump=False)
    c = rig.receivers[0].counters
    assert c.progress == 1 and c.layers_early == 0
    _finish(rig)
    (out,) = rig.outcomes
    assert not out.success and "layer 0" in out.reason
    assert c.bad_checksum == 1
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_foreign_bytes_in_a_layer_not_yet_verified_are_caught_by_the_final_check() -> None:
    rig = Rig()
    acc = _start(rig)
    rig.step(pump=False)  # layer 0 verified early
    evil = rig.fabric.endpoint("evil")
    junk = bytearray(b"\x5a" * 64)
    buf = (ctypes.c_char * 64).from_buffer(junk)
    evil.register(ctypes.addressof(buf), 64)
    region = rig.d.layouts[0].layer(1)[0]  # layer 1's K, first received block
    dst = region.ptr + acc.block_ids[0] * region.block_bytes
    _hand_over(rig, "r", [1, 2])
    rig.fabric.pump()
    evil.write("d0", [Piece(ctypes.addressof(buf), dst, 64)])
    rig.fabric.pump()
    rig.p_side.release("r")
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success and "layer 1" in out.reason
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_chunked_send_sends_no_progress_before_the_last_chunk() -> None:
    """A chunk before the last leaves its blocks' later positions unwritten: P
    checksums and announces only layers of the last chunk."""
    rig = Rig()
    rig.fabric.hold_writes = True
    acc = rig.offer("r", TOKENS, chunked=True)
    assert isinstance(acc, Acceptance)
    rig.prefill_chunk("r", TOKENS, acc, 2 * BS)
    rig.fabric.pump()
    rig.step(pump=False)
    assert rig.senders[0].progress_sent == 0
    rig.prefill_chunk("r", TOKENS, acc, len(TOKENS))
    rig.fabric.pump()
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_a_checksum_that_raises_fails_its_send_and_not_the_others_settling_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P's checksum of one send raising (on a GPU: a CUDA error or the kernel's
    wait running out) while another send settles in the same `poll`: `poll` does
    not raise, the one send settles failed (D recomputes), the other is received
    (neither report nor notice lost)."""
    from fastkv.pd import sender as sender_mod

    rig = Rig()
    tokens2 = list(range(40, 40 + 3 * BS))
    assert isinstance(rig.offer("r1", TOKENS), Acceptance)
    assert isinstance(rig.offer("r2", tokens2), Acceptance)
    bad = tuple(rig.p.mgr.block_table("r1").block_ids)
    real = sender_mod.layer_checksum

    def checksum(tensors, block_ids, **kw):  # type: ignore[no-untyped-def]
        if tuple(block_ids) == bad:
            raise RuntimeError("fkv_cuda_crc3way: crc3way: not complete after 30.000 s")
        return real(tensors, block_ids, **kw)

    monkeypatch.setattr(sender_mod, "layer_checksum", checksum)
    t1 = list(rig.p.mgr.block_table("r1").block_ids)
    t2 = list(rig.p.mgr.block_table("r2").block_ids)
    for layer in range(rig.layers):
        rig.p.write_layer(t1, TOKENS, layer, 0)
        rig.p.write_layer(t2, tokens2, layer, 0)
        rig.senders[0].after_layer(layer)
    rig.p_side.release("r1")
    rig.p_side.release("r2")
    rig.run_until_quiet()
    assert rig.finish_on_d("r1", TOKENS) == "recomputed"
    assert rig.finish_on_d("r2", tokens2) == "received"
    rig.check_clean()


def test_a_landed_checksum_that_raises_on_d_fails_that_transfer_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D's checksum of one transfer's landed bytes raising (on a GPU: a CUDA
    error, or the kernel's wait running out) while another transfer's notice is in
    the same `poll`: `poll` does not raise (the notices it drained would be lost),
    that transfer fails and recomputes, the other is received."""
    rig = Rig()
    tokens2 = list(range(40, 40 + 3 * BS))
    acc1 = rig.offer("r1", TOKENS)
    acc2 = rig.offer("r2", tokens2)
    assert isinstance(acc1, Acceptance) and isinstance(acc2, Acceptance)
    real = receiver_mod.layer_checksum

    def checksum(tensors, block_ids, **kw):  # type: ignore[no-untyped-def]
        if tuple(block_ids) == tuple(acc1.block_ids):
            raise RuntimeError("fkv_cuda_crc3way: crc3way: not complete after 30.000 s")
        return real(tensors, block_ids, **kw)

    monkeypatch.setattr(receiver_mod, "layer_checksum", checksum)
    t1 = list(rig.p.mgr.block_table("r1").block_ids)
    t2 = list(rig.p.mgr.block_table("r2").block_ids)
    for layer in range(rig.layers):
        rig.p.write_layer(t1, TOKENS, layer, 0)
        rig.p.write_layer(t2, tokens2, layer, 0)
        rig.senders[0].after_layer(layer)
    rig.p_side.release("r1")
    rig.p_side.release("r2")
    rig.run_until_quiet()
    assert rig.finish_on_d("r1", TOKENS) == "recomputed"
    assert rig.finish_on_d("r2", tokens2) == "received"
    rig.check_clean()
