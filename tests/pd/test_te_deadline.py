"""A `MooncakeTransport` write handle past its deadline settles only once no batch
of it is inside the engine: a settled handle lets P's notice go out, and the
notice tells D that no byte of the write can land any more (D then reuses the
blocks at once). Past the deadline nothing more of the write is submitted. The
engine here is a stand-in whose batches end when the test says so."""

from __future__ import annotations

import threading
import time

import pytest

from fastkv.pd.mooncake_te import engine_timeout_s, legacy_tcp_proto
from fastkv.pd.te_batches import MooncakeWriteHandle, PeerBatches, WriteJob
from fastkv.pd.transport import WriteState

PIECE = 1 << 20


class HeldEngine:
    """Every batch stays inside until `end(batch, rc)`; the status call blocks
    until then (as the engine's does, up to its own timeout)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.submitted: list[int] = []  # pieces per batch, in order
        self.rc: dict[int, int] = {}
        self.ended = threading.Condition(self.lock)

    def batch_transfer_async_write(self, peer, srcs, dsts, lengths) -> int:
        with self.lock:
            self.submitted.append(len(srcs))
            return len(self.submitted)

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        with self.ended:
            self.ended.wait_for(lambda: ids[0] in self.rc, timeout=10)
            return self.rc.get(ids[0], -1)

    def end(self, batch: int, rc: int) -> None:
        with self.ended:
            self.rc[batch] = rc
            self.ended.notify_all()


def start(
    peer: PeerBatches, pieces: int, deadline_s: float, *, inline: bool = False
) -> MooncakeWriteHandle:
    handle = MooncakeWriteHandle(time.monotonic() + deadline_s, threading.Lock())
    peer.start(WriteJob(handle, [0] * pieces, [0] * pieces, [PIECE] * pieces), inline)
    return handle


def until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_past_its_deadline_a_write_inside_the_engine_stays_pending_until_it_returns() -> None:
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        handle = start(peer, 8, 0.1)
        until(lambda: engine.submitted == [8])
        assert handle.wait(0.3) is WriteState.PENDING  # past the deadline, still inside
        assert handle.state() is WriteState.PENDING
        engine.end(1, -1)  # the engine's own timeout, or its failure
        assert handle.wait(2) is WriteState.FAILED
    finally:
        peer.close()


def test_a_write_the_engine_completes_after_the_deadline_is_done() -> None:
    """Every byte landed, as the engine says: DONE, however late."""
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        handle = start(peer, 8, 0.05)
        until(lambda: engine.submitted == [8])
        time.sleep(0.1)
        engine.end(1, 0)
        assert handle.wait(2) is WriteState.DONE
    finally:
        peer.close()


def test_past_its_deadline_no_more_of_a_write_goes_to_the_engine() -> None:
    """A write in two chunks (128 pieces over a 64-piece queue): the deadline
    passes with the first chunk inside; when it returns done, the second is never
    submitted and the write fails (not all of it landed)."""
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        handle = start(peer, 128, 0.1)
        until(lambda: len(engine.submitted) == 2)  # two chunks of 32 fill the queue
        time.sleep(0.15)  # past the deadline
        engine.end(1, 0)
        engine.end(2, 0)
        assert handle.wait(2) is WriteState.FAILED
        time.sleep(0.05)
        assert engine.submitted == [32, 32]
    finally:
        peer.close()


def test_a_write_with_nothing_inside_the_engine_fails_at_its_deadline() -> None:
    """Queued behind another write's full queue, nothing of it started: it fails at
    its deadline, not when the engine lets go of the other write."""
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        first = start(peer, 64, 30)
        until(lambda: engine.submitted == [64])
        second = start(peer, 8, 0.1)
        t0 = time.monotonic()
        assert second.wait(2) is WriteState.FAILED
        assert time.monotonic() - t0 < 0.5
        engine.end(1, 0)
        assert first.wait(2) is WriteState.DONE
        time.sleep(0.05)
        assert engine.submitted == [64]  # the failed write never went in
    finally:
        peer.close()


def test_a_failed_batch_settles_its_write_only_once_no_other_batch_of_it_is_inside() -> None:
    """A write in two chunks inside the engine: the first fails (the engine's
    timeout) while the second is still inside. The handle stays PENDING until the
    second returns (a FAILED handle lets P's failure notice go out, which tells D
    no byte can land any more), and no more of the write is submitted."""
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        handle = start(peer, 96, 30)
        until(lambda: len(engine.submitted) == 2)  # two chunks of 32 inside
        engine.end(1, -1)
        time.sleep(0.1)
        assert handle.state() is WriteState.PENDING  # chunk 2 may still land
        assert handle.wait(0.05) is WriteState.PENDING
        engine.end(2, 0)
        assert handle.wait(2) is WriteState.FAILED
        time.sleep(0.05)
        assert engine.submitted == [32, 32]  # the rest never went in
    finally:
        peer.close()


class RaisingEngine(HeldEngine):
    """Raises from the submit of the batches numbered in `raise_on` (1-based)."""

    def __init__(self, raise_on: set[int]) -> None:
        super().__init__()
        self.raise_on = raise_on
        self.calls = 0

    def batch_transfer_async_write(self, peer, srcs, dsts, lengths) -> int:
        self.calls += 1
        if self.calls in self.raise_on:
            raise RuntimeError("engine: std::bad_alloc")
        return super().batch_transfer_async_write(peer, srcs, dsts, lengths)


def test_an_engine_submit_that_raises_fails_the_write_and_the_peer_goes_on() -> None:
    """The engine's submit raising (not returning 0) for a write's second chunk:
    the write fails once its first chunk returns (not PENDING forever, counted
    inside the engine), and the peer's thread still serves the next write."""
    engine = RaisingEngine({2})
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        handle = start(peer, 96, 30)
        until(lambda: engine.calls >= 2)
        engine.end(1, 0)
        assert handle.wait(2) is WriteState.FAILED
        nxt = start(peer, 8, 30)
        until(lambda: len(engine.submitted) == 2)
        engine.end(2, 0)
        assert nxt.wait(2) is WriteState.DONE
    finally:
        peer.close()


def test_a_write_whose_first_batch_failed_is_failed_even_when_its_later_batches_succeed() -> (
    None
):
    """Every batch of a write submitted (three of them), the first fails and the
    others succeed: FAILED (not every byte landed), once the last returned."""
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        other = start(peer, 16, 30)
        until(lambda: engine.submitted == [16])
        handle = start(peer, 60, 30, inline=True)  # the thread waits on batch 1
        until(lambda: engine.submitted == [16, 32, 16])
        engine.end(1, 0)
        until(lambda: engine.submitted == [16, 32, 16, 12])  # the rest fits now
        assert other.wait(2) is WriteState.DONE
        engine.end(2, -1)
        engine.end(3, 0)
        time.sleep(0.05)
        assert handle.state() is WriteState.PENDING  # batch 4 still inside
        engine.end(4, 0)
        assert handle.wait(2) is WriteState.FAILED
    finally:
        peer.close()


def test_closing_fails_at_once_only_the_writes_with_nothing_inside_the_engine() -> None:
    """A closed transport submits nothing more, but a write whose batch is inside
    the engine may still move bytes: it stays PENDING until the batch comes back
    (then FAILED, even when the engine completed it), and the peer's thread ends
    only then, which is what `MooncakeTransport.close` waits for before the
    regions go."""
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    inside = start(peer, 64, 30)
    until(lambda: engine.submitted == [64])
    queued = start(peer, 8, 30)  # behind a full queue: nothing of it started
    peer.close()
    assert queued.state() is WriteState.FAILED
    assert inside.wait(0.2) is WriteState.PENDING
    assert not peer.join(0.1)  # still waiting on the engine
    engine.end(1, 0)
    assert inside.wait(2) is WriteState.FAILED
    assert peer.join(2)
    assert engine.submitted == [64]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 30.0), ("60", 60.0), ("2", 5.0), ("abc", 5.0), (" 12s", 12.0), ("-3", 5.0)],
)
def test_the_engines_timeout_is_read_as_the_engine_reads_it(
    monkeypatch: pytest.MonkeyPatch, value: str | None, seconds: float
) -> None:
    if value is None:
        monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("MC_TRANSFER_TIMEOUT", value)
    assert engine_timeout_s() == seconds


@pytest.mark.parametrize(
    ("value", "legacy"), [(None, False), ("1", True), ("2", False), ("1 ", False), ("", False)]
)
def test_the_legacy_tcp_framing_is_read_as_the_engine_reads_it(
    monkeypatch: pytest.MonkeyPatch, value: str | None, legacy: bool
) -> None:
    """`MC_TCP_PROTO` exactly "1": DONE means only "in P's socket" (docs/pd.md)."""
    if value is None:
        monkeypatch.delenv("MC_TCP_PROTO", raising=False)
    else:
        monkeypatch.setenv("MC_TCP_PROTO", value)
    assert legacy_tcp_proto() is legacy


def test_stopping_submission_fails_the_writes_not_wholly_submitted_and_no_other() -> None:
    """A closing sender stops the chunks of writes it handed over, so that what
    is inside the engine ends sooner: a write with pieces left is not submitted
    further and fails once its batches came back; a write wholly submitted
    settles as the engine says; the peer takes new writes afterwards."""
    engine = HeldEngine()
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        whole = start(peer, 16, 30)
        until(lambda: engine.submitted == [16])
        chunked = start(peer, 128, 30, inline=True)  # 48 of 128 pieces fit now
        assert engine.submitted == [16, 32, 16]
        queued = start(peer, 8, 30)  # behind it: nothing of it started
        peer.stop_submitting()
        assert queued.state() is WriteState.FAILED
        assert chunked.state() is WriteState.PENDING  # batches of it are inside
        engine.end(1, 0)
        assert whole.wait(2) is WriteState.DONE
        engine.end(2, 0)
        engine.end(3, 0)
        assert chunked.wait(2) is WriteState.FAILED
        time.sleep(0.05)
        assert engine.submitted == [16, 32, 16]  # nothing more of it went
        later = start(peer, 4, 30)
        until(lambda: len(engine.submitted) == 4)
        engine.end(4, 0)
        assert later.wait(2) is WriteState.DONE
    finally:
        peer.close()
