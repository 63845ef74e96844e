"""PD end to end on the CPU worker path over the in-process transport: the happy
path at each TP pair, and the fault matrix. Each case ends with D holding KV
bitwise equal to what P computed (received, or recomputed on D), or with a clear
error; both halves' invariants hold and nothing is left held on either side."""

from __future__ import annotations

import numpy as np
import pytest

from fastkv.pd.messages import Acceptance, Notice, Offer, RankReport, Rejection, encode_notice
from fastkv.pd.sender import PDSender
from fastkv.pd.transport import Piece, WriteState

from .rig import GRACE, TIMEOUT, Rig, d_hashes, make_instance

TOKENS = list(range(100, 100 + 4 * 5 + 2))  # 6 blocks, the last partial


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 2), (2, 4)])
def test_bitwise_equal_at_each_tp_pair(p_tp: int, d_tp: int) -> None:
    rig = Rig(p_tp=p_tp, d_tp=d_tp)
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_refused_tp_pair_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="multiple of P's"):
        Rig(p_tp=2, d_tp=1)


def test_d_reuses_its_prefix_and_the_next_request_hits_the_received_blocks() -> None:
    rig = Rig()
    mgr = rig.d.mgr
    prefix = TOKENS[:8]
    mgr.add_request("local", prefix)
    assert mgr.allocate("local", num_tokens=8)
    table = list(mgr.block_table("local").block_ids)
    for layer in range(rig.layers):
        rig.d.write_layer(table, prefix, layer, 0)
    mgr.commit("local", num_computed_tokens=8)
    mgr.finish("local")
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance) and acc.num_prefix_blocks == 2
    assert len(acc.block_ids) == 4
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    hit = mgr.add_request("next", [*TOKENS, 7, 7, 7])
    assert hit.num_device_hits == 5  # every full block of the prompt
    mgr.finish("next")
    rig.check_clean()


@pytest.mark.parametrize(("k", "landed"), [(0, 0.0), (1, 0.5), (2, 1.0)])
def test_kill_p_at_layer_k_ends_in_recompute_after_the_fence(k: int, landed: float) -> None:
    rig = Rig()
    rig.fabric.hold_writes = True
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS, stop_at=k + 1)  # layers 0..k handed over, queued
    rig.fabric.kill("p0", land_fraction=landed)  # that share of each queued piece lands
    rig.p_dead = True
    rig.step(TIMEOUT)
    (out,) = rig.outcomes
    assert not out.success and "deadline" in out.reason
    assert rig.d.mgr.num_receiving_blocks == len(acc.block_ids)  # fenced, not free
    rig.step(GRACE)
    assert rig.d.mgr.num_receiving_blocks == 0
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_kill_d_mid_batch_p_settles_and_unpins() -> None:
    rig = Rig()
    rig.fabric.hold_writes = True
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS, stop_at=1)
    rig.fabric.kill("d0")
    rig.senders[0].after_layer(1)  # a write to a dead peer cannot start
    rig.p_side.release("r")
    for s in rig.senders:
        rig.p_side.on_reports(s.poll())
    assert rig.p_side.counters.send_failed == 1
    rig.p_side.check_invariants()
    assert rig.p.mgr.active_request_ids() == [] and rig.senders[0].num_sends == 0


def test_abort_while_receiving_goes_at_once_and_frees_when_fenced() -> None:
    rig = Rig()
    rig.fabric.hold_notices = True
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS, stop_at=1)
    rig.d_side.abort("r")
    assert not rig.d.mgr.is_active("r")
    assert rig.d.mgr.num_receiving_blocks == len(acc.block_ids)
    rig.prefill("r", TOKENS)  # P goes on: its writes may still land
    rig.p_side.release("r")
    for s in rig.senders:
        rig.p_side.on_reports(s.poll())
    assert rig.d.mgr.num_receiving_blocks == len(acc.block_ids)
    rig.step()  # the notice: P's writes settled -> fenced, released
    assert rig.d.mgr.num_receiving_blocks == 0 and rig.d_side.counters.late == 1
    rig.run_until_quiet()
    rig.check_clean()


def test_late_notice_after_the_deadline_is_dropped_and_counted() -> None:
    rig = Rig()
    rig.fabric.hold_notices = True
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.step(TIMEOUT, pump=False)  # D's deadline passes before the notice arrives
    (out,) = rig.outcomes
    assert not out.success
    assert rig.d.mgr.num_receiving_blocks == len(acc.block_ids)
    rig.step()  # the notice lands late: it fences the blocks and changes nothing else
    assert rig.d_side.counters.late == 1 and rig.d.mgr.num_receiving_blocks == 0
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_duplicate_notice_is_dropped_and_counted() -> None:
    rig = Rig()
    rig.fabric.hold_notices = True
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.step(pump=False)  # P settles and notifies; the notice is queued
    rig.fabric.pump()
    d0 = rig.receivers[0].transport
    d0.inbox.extend(list(d0.inbox))  # the same notice twice
    rig.step()
    assert rig.receivers[0].counters.duplicate == 1
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.run_until_quiet()
    rig.check_clean()


def test_forged_notice_and_foreign_bytes_end_in_recompute() -> None:
    """Another process reaches D's transport: its notice under a guessed key is
    refused; the bytes it writes into D's receiving blocks fail the checksum."""
    rig = Rig()
    evil = rig.fabric.endpoint("evil")
    junk = np.full(1 << 16, 0x5A, dtype=np.uint8)
    evil.register(junk.ctypes.data, junk.nbytes)
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    forged = Notice(acc.epoch, acc.transfer_id, 0, 1, 0, 1, False, rig.layers, (0,) * 4)
    evil.notify("d0", encode_notice(forged, b"guessed" * 4), 1.0)
    rig.step()
    assert rig.receivers[0].counters.forged == 1 and not rig.outcomes
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    region = rig.d.layouts[0].tensors[0]  # layer 0's K, first received block
    dst = region.ptr + acc.block_ids[0] * region.block_bytes
    evil.write("d0", [Piece(junk.ctypes.data, dst, 64)])
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success and "checksum" in out.reason
    assert rig.receivers[0].counters.bad_checksum == 1
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_partial_write_reported_done_is_caught_by_the_checksum() -> None:
    rig = Rig()
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.fabric.partial_next_write(0.5, WriteState.DONE)  # a transport that lies
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_partial_write_that_fails_sends_a_failure_notice() -> None:
    rig = Rig()
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.fabric.partial_next_write(0.3)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success and "P reported a failure" in out.reason
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


@pytest.mark.parametrize(
    ("state", "why"),
    [
        (WriteState.FAILED, "a write failed"),
        (WriteState.DONE, "landed bytes do not match"),
    ],
)
def test_a_failed_or_unverified_write_holds_ds_blocks_to_the_grace(
    state: WriteState, why: str
) -> None:
    """A write the transport failed may still have bytes on the wire (Mooncake's
    TCP transport gives a batch up while its bytes sit in a stalled receiver's
    socket), and bytes that do not verify may still be landing: the report that
    says so does not fence D's blocks; the deadline plus grace does. (P aborting
    with every write started settled done does: see the abort test below.)"""
    rig = Rig()
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance) and acc.block_ids
    rig.fabric.partial_next_write(0.3, state)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.step(0.5)
    (out,) = rig.outcomes
    assert not out.success and why in out.reason
    assert rig.p_side.check_invariants() is None and not rig.p.mgr.is_active("r")
    fence_at = TIMEOUT + GRACE  # accepted at 0
    rig.step(fence_at - 0.1 - rig.now)
    assert rig.d.mgr.num_receiving_blocks == len(acc.block_ids)  # every report in
    rig.step(0.2)
    assert rig.d.mgr.num_receiving_blocks == 0
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_delayed_and_reordered_writes_and_notices_still_arrive_whole() -> None:
    rig = Rig(p_tp=2, d_tp=4)
    rig.fabric.hold_writes = rig.fabric.hold_notices = rig.fabric.reorder = True
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    rig.check_clean()


def test_lost_notice_ends_in_recompute_and_p_unpins() -> None:
    rig = Rig()
    rig.fabric.drop_next_notices(1)
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success and "deadline" in out.reason
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_layout_mismatch_is_refused_at_the_handshake_and_the_offer() -> None:
    rig = Rig()
    other = make_instance(1, rig.layers, 8, head_dim=16)
    sender = PDSender(rig.fabric.endpoint("p-other"), other.layouts[0])
    with pytest.raises(ValueError, match="layouts differ"):
        sender.connect(*rig.receivers[0].handshake())
    offer = Offer("x", 9, other.layouts[0].digest(), 1)
    answer = rig.d_side.accept(offer, d_hashes(rig.d.mgr, list(range(9))))
    assert isinstance(answer, Rejection) and "layout" in answer.reason
    rig.check_clean()


def test_d_without_room_rejects_and_p_unpins() -> None:
    rig = Rig(d_blocks=4)
    answer = rig.offer("r", TOKENS)  # 6 blocks: more than D has
    assert isinstance(answer, Rejection)
    assert rig.p_side.counters.rejected == 1
    rig.p_side.release("r")
    rig.check_clean()


def test_d_never_answers_p_unpins_at_its_deadline() -> None:
    rig = Rig()
    mgr = rig.p.mgr
    mgr.add_request("r", TOKENS)
    assert mgr.allocate("r", num_tokens=len(TOKENS))
    rig.p_side.offer("r", len(TOKENS))  # the offer is lost on the way
    rig.p_side.release("r")
    rig.step(TIMEOUT - 0.1)
    assert mgr.is_active("r")
    rig.step(0.2)
    assert not mgr.is_active("r") and rig.p_side.counters.expired == 1
    rig.check_clean()


def test_p_rank_dies_scheduler_lives_unpins_at_the_deadline() -> None:
    """A P rank's transport dies mid-transfer while P's scheduler lives: the rank's
    send fails and settles (its failure notice cannot go out), P unpins; D fences
    by its deadline and grace and recomputes."""
    rig = Rig()
    rig.fabric.hold_writes = True
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS, stop_at=1)
    rig.fabric.kill("p0", land_fraction=0.25)
    rig.p_side.release("r")
    rig.step(TIMEOUT)
    assert not rig.p.mgr.is_active("r") and rig.senders[0].num_sends == 0
    assert rig.d.mgr.num_receiving_blocks == len(acc.block_ids)
    rig.step(GRACE)
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_sender_never_notifies_while_a_write_is_pending() -> None:
    """A write still pending at the send deadline: no notice (it would tell D that
    nothing can land any more); P reports the send failed, and not fenced."""
    rig = Rig()
    rig.fabric.hold_writes = True
    rig.fabric.write_timeout_s = 100.0  # a transport slower than the send deadline
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS, stop_at=2)  # the model stalls after layer 1
    rig.p_side.release("r")
    reports: list[RankReport] = []
    poll = rig.senders[0].poll
    rig.senders[0].poll = lambda: (reports.extend(got := poll()), got)[1]
    rig.step(TIMEOUT, pump=False)
    assert rig.senders[0].num_sends == 0 and rig.p_side.counters.send_failed == 1
    assert [(r.ok, r.fenced) for r in reports] == [(False, False)]  # bytes may land
    assert rig.receivers[0].counters.received == 0  # no notice went out
    assert rig.fabric.num_queued == 2


def test_metrics_of_both_roles() -> None:
    from prometheus_client import CollectorRegistry

    from fastkv.pd.metrics import watch_pd

    rig = Rig()
    reg_p, reg_d = CollectorRegistry(), CollectorRegistry()
    watch_pd(reg_p, role="prefill", scheduler=rig.p_side, workers=lambda: rig.senders)
    watch_pd(reg_d, role="decode", scheduler=rig.d_side, workers=lambda: rig.receivers)
    with pytest.raises(ValueError, match="role"):
        watch_pd(CollectorRegistry(), role="decode", scheduler=rig.p_side)
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    d = {"model": "default", "role": "decode"}
    p = {"model": "default", "role": "prefill"}
    assert reg_d.get_sample_value("fastkv:pd_transfers", {**d, "state": "receiving"}) == 1
    assert reg_p.get_sample_value("fastkv:pd_transfers", {**p, "state": "sending"}) == 1
    rig.now += 2.0
    assert reg_d.get_sample_value("fastkv:pd_oldest_transfer_age_seconds", d) == 2.0
    forged = Notice(acc.epoch, acc.transfer_id, 0, 1, 0, 1, False, rig.layers, ())
    rig.receivers[0].transport.inbox.append(("evil", encode_notice(forged, b"x" * 32)))
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    nbytes = len(acc.block_ids) * sum(t.block_bytes for t in rig.d.layouts[0].tensors)
    assert reg_p.get_sample_value("fastkv:pd_bytes_total", {**p, "direction": "sent"}) == nbytes
    assert reg_d.get_sample_value("fastkv:pd_bytes_total", {**d, "direction": "received"}) == (
        nbytes
    )
    assert (
        reg_d.get_sample_value("fastkv:pd_transfer_events_total", {**d, "event": "committed"})
        == 1
    )
    assert (
        reg_d.get_sample_value("fastkv:pd_notices_dropped_total", {**d, "reason": "unknown"})
        == 0
    )
    assert rig.receivers[0].counters.forged + rig.receivers[0].counters.unknown >= 0
    assert reg_d.get_sample_value("fastkv:pd_transfers", {**d, "state": "receiving"}) == 0
    rig.finish_on_d("r", TOKENS)
    rig.check_clean()


def test_abort_on_p_mid_prefill_sends_a_failure_notice_and_d_recomputes() -> None:
    rig = Rig(p_tp=2, d_tp=2)
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS, stop_at=1)
    for s in rig.senders:
        s.abort(acc.epoch, acc.transfer_id)
    rig.p_side.release("r")
    rig.step()
    (out,) = rig.outcomes
    assert not out.success and "P reported a failure" in out.reason
    assert rig.d.mgr.num_receiving_blocks == 0  # every rank's notice fenced it
    assert not rig.p.mgr.is_active("r")
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2)])
def test_checksums_off_on_both_sides_commits_bitwise_equal_kv(p_tp: int, d_tp: int) -> None:
    rig = Rig(p_tp=p_tp, d_tp=d_tp, p_checksums=False, d_checksums=False)
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    assert rig.finish_on_d("r", TOKENS) == "received"
    assert all(r.counters.checksum_mismatch == 0 for r in rig.receivers)
    rig.check_clean()


@pytest.mark.parametrize(("p_sums", "d_sums"), [(False, True), (True, False)])
def test_checksum_settings_that_differ_end_in_recompute(p_sums: bool, d_sums: bool) -> None:
    """A D verifying checksums refuses a notice without them (else a P built with
    them off would switch D's check off), and a D built with them off refuses
    a notice carrying them: the two sides must agree, the request recomputes."""
    from prometheus_client import CollectorRegistry

    from fastkv.pd.metrics import watch_pd

    rig = Rig(p_checksums=p_sums, d_checksums=d_sums)
    reg = CollectorRegistry()
    watch_pd(reg, role="decode", scheduler=rig.d_side, workers=lambda: rig.receivers)
    assert isinstance(rig.offer("r", TOKENS), Acceptance)
    rig.prefill("r", TOKENS)
    rig.p_side.release("r")
    rig.run_until_quiet()
    (out,) = rig.outcomes
    assert not out.success and "must agree" in out.reason
    assert rig.receivers[0].counters.checksum_mismatch == 1
    labels = {"model": "default", "role": "decode", "reason": "checksum_mismatch"}
    assert reg.get_sample_value("fastkv:pd_notices_dropped_total", labels) == 1
    for not_a_drop in ("received", "progress", "layers_early"):
        labels["reason"] = not_a_drop
        assert reg.get_sample_value("fastkv:pd_notices_dropped_total", labels) is None
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_checksums_option_must_be_a_bool() -> None:
    rig = Rig()
    with pytest.raises(ValueError, match="checksums"):
        PDSender(rig.fabric.endpoint("x"), rig.p.layouts[0], checksums=1)  # type: ignore[arg-type]


def test_abort_over_a_transport_whose_done_means_only_sent_holds_ds_blocks_to_the_grace() -> (
    None
):
    """Over a transport whose DONE means only "sent" (Mooncake TCP with
    `MC_TCP_PROTO=1`: COMPLETED once the bytes are in P's socket), a write that
    settled done may still land: P's abort goes as failed, not stopped, and D
    holds the blocks to its deadline plus grace."""
    rig = Rig(p_tp=2, d_tp=2)
    for s in rig.senders:
        s.transport.done_means_applied = False
    acc = rig.offer("r", TOKENS)
    assert isinstance(acc, Acceptance)
    rig.prefill("r", TOKENS, stop_at=1)  # layer 0's writes settled done
    for s in rig.senders:
        s.abort(acc.epoch, acc.transfer_id)
    rig.p_side.release("r")
    rig.step()
    (out,) = rig.outcomes
    assert not out.success and "a write failed" in out.reason
    assert rig.d.mgr.num_receiving_blocks == len(acc.block_ids)  # every report in
    rig.step(TIMEOUT + GRACE)
    assert rig.d.mgr.num_receiving_blocks == 0
    assert rig.finish_on_d("r", TOKENS) == "recomputed"
    rig.check_clean()


def test_pd_worker_close_bounds_the_notices_of_the_sends_it_settles() -> None:
    """PDWorker.close waits at most its timeout in all. The sends it aborts settle
    in its poll, each with a notice per D rank; to a D that does not answer each
    notice waits out the notify timeout, so their number must not stretch the
    wait: once the time is spent, no more notices go (D holds the blocks to its
    grace, as for any lost notice)."""
    import time

    from fastkv.integrations.fd_pd_worker import PDWorker
    from fastkv.pd.inproc import InProcFabric
    from fastkv.pd.transport import TransportError

    rig = Rig(d_blocks=32)
    for i in range(3):
        tokens = [t + 1000 * i for t in TOKENS]
        assert isinstance(rig.offer(f"r{i}", tokens), Acceptance)
        rig.prefill(f"r{i}", tokens, stop_at=1)  # layer 0 written, the rest not yet
    sender = rig.senders[0]
    pd = PDWorker(
        rig.p.layouts[0], InProcFabric().endpoint("spare"), role="prefill", report_to=list
    )
    assert pd.sender is not None
    pd.sender.close()
    pd.sender, pd.transport = sender, sender.transport  # the rig's rank 0
    waited: list[float] = []

    def unanswered(peer: str, payload: bytes, timeout_s: float) -> None:
        waited.append(timeout_s)
        time.sleep(timeout_s)
        raise TransportError(f"notify {peer}: no answer within {timeout_s} s")

    sender.transport.notify = unanswered  # type: ignore[method-assign]
    stopped: list[int] = []  # the sends still open when close stopped the writes
    sender.transport.stop_writes = lambda: stopped.append(sender.num_sends)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="notify_until"):
        sender.close(notify_until=float("nan"))
    assert sender.num_sends == 3  # refused before anything changed
    t0 = time.monotonic()
    assert pd.close(timeout_s=0.5) is True
    took = time.monotonic() - t0
    assert took < 0.8, (took, waited)
    assert sender.num_sends == 0  # every send settled and reported
    assert stopped == [3]  # no more chunks of their writes, before they settled
