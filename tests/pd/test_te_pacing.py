"""The peer thread of `MooncakeTransport` waits on the engine without spinning a
core for the whole transfer (`PeerBatches`'s paced waiting), and never waits past a
batch's end for long. The engine here is simulated: each batch's bytes go at a
fixed rate, first in first out or shared between the batches in flight, and its
status call spins until the batch ended, as Mooncake's does, counting the time
spent spinning."""

from __future__ import annotations

import threading
import time

import pytest

from fastkv.pd.te_batches import WAKE_EARLY, MooncakeWriteHandle, PeerBatches, WriteJob
from fastkv.pd.transport import WriteState

RATE = 400e6  # bytes per second, unless a test changes `SimEngine.rate`
PIECE = 1 << 20


class SimEngine:
    """Batches of (bytes) served at `rate`: `fifo` one after another, else all in
    flight at once sharing the rate equally (each ends when its share is done)."""

    def __init__(self, fifo: bool) -> None:
        self.fifo = fifo
        self.rate = RATE
        self.lock = threading.Lock()
        self.batches: dict[int, float] = {}  # batch id -> end time (fifo)
        self.left: dict[int, float] = {}  # batch id -> bytes left (shared)
        self.ends: dict[int, float] = {}
        self.last = time.monotonic()
        self.free_at = 0.0
        self.next_id = 1
        self.spun = 0.0  # seconds spent spinning in get_batch_transfer_status
        self.late: list[float] = []  # seconds from a batch's end to its status return

    def _advance(self, now: float) -> None:
        while self.left and now > self.last:
            share = self.rate / len(self.left) * (now - self.last)
            first = min(self.left.values())
            if first > share:
                for b in self.left:
                    self.left[b] -= share
                self.last = now
                return
            self.last += first * len(self.left) / self.rate
            for b in list(self.left):
                self.left[b] -= first
                if self.left[b] <= 1e-6:
                    del self.left[b]
                    self.ends[b] = self.last
        self.last = max(self.last, now)

    def batch_transfer_async_write(self, peer, srcs, dsts, lengths) -> int:
        with self.lock:
            now = time.monotonic()
            b, self.next_id = self.next_id, self.next_id + 1
            if self.fifo:
                self.free_at = max(now, self.free_at) + sum(lengths) / self.rate
                self.ends[b] = self.free_at
            else:
                self._advance(now)
                self.left[b] = float(sum(lengths))
            return b

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        t0 = time.monotonic()
        while True:
            with self.lock:
                now = time.monotonic()
                if not self.fifo:
                    self._advance(now)
                end = self.ends.get(ids[0])
                if end is not None and end <= now:
                    self.spun += now - t0
                    self.late.append(max(0.0, t0 - end))
                    return 0


def layer_writes(peer: PeerBatches, n: int) -> float:
    """`n` rounds of 4 writes of 16 pieces (64 MiB) in flight, each round waited
    on; returns the seconds they took."""
    t0 = time.monotonic()
    for _ in range(n):
        handles = [write(peer, 16) for _ in range(4)]
        assert [h.wait(10) for h in handles] == [WriteState.DONE] * 4
    return time.monotonic() - t0


def write(peer: PeerBatches, n_pieces: int) -> MooncakeWriteHandle:
    handle = MooncakeWriteHandle(time.monotonic() + 30, threading.Lock())
    peer.start(WriteJob(handle, [0] * n_pieces, [0] * n_pieces, [PIECE] * n_pieces), False)
    return handle


@pytest.mark.parametrize("fifo", [True, False], ids=["fifo", "shared"])
def test_the_peer_thread_sleeps_through_most_of_a_transfer_and_wakes_before_its_end(
    fifo: bool,
) -> None:
    engine = SimEngine(fifo)
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        # warm-up: the first write spins throughout (no rate yet) and sets the rate
        assert write(peer, 8).wait(10) is WriteState.DONE
        engine.spun, engine.late = 0.0, []
        took = layer_writes(peer, 6)
    finally:
        peer.close()
    ideal = 6 * 64 * PIECE / RATE
    if fifo:
        # Spinning throughout would spin about `took`; paced, about WAKE_EARLY of
        # each batch. (Batches that share the engine end later than a FIFO
        # estimate says, so there the thread wakes early and spins longer: never
        # slower, only less saving. Mooncake's TCP lanes take slices in order.)
        assert engine.spun < 0.4 * took, (engine.spun, took)
    # Nothing waited on much past its end: the writes take about the ideal time.
    assert took < 1.25 * ideal + 0.05, (took, ideal)
    assert len(engine.late) == 24


def test_a_closed_peer_wakes_its_sleeping_thread_at_once() -> None:
    engine = SimEngine(True)
    peer = PeerBatches(engine, "h:1", cap=64)
    assert write(peer, 8).wait(10) is WriteState.DONE  # the rate is known now
    handle = write(peer, 64 * 4)  # about 0.7 s: the thread sleeps on its first chunk
    time.sleep(0.05)
    t0 = time.monotonic()
    peer.close()
    # two chunks of 32 pieces (about 0.17 s) are inside the engine: the write
    # stays PENDING until the thread, woken at once, has waited them out
    assert handle.state() is WriteState.PENDING
    assert peer.join(0.5), "the peer thread still slept after close"
    assert time.monotonic() - t0 < 0.5
    assert handle.state() is WriteState.FAILED
    assert 0 < WAKE_EARLY < 1


def test_a_link_that_got_faster_costs_a_few_late_wakes_not_a_slow_drift() -> None:
    """A peer's rate measured on a slow link, then the link runs 4x faster: the
    thread wakes late a few times, then on time again, instead of creeping
    toward the new rate over many batches."""
    engine = SimEngine(True)
    peer = PeerBatches(engine, "h:1", cap=64)
    try:
        engine.rate = RATE / 4
        for _ in range(2):
            assert write(peer, 8).wait(10) is WriteState.DONE
        engine.rate, engine.late = RATE, []
        took = layer_writes(peer, 8)
    finally:
        peer.close()
    ideal = 8 * 64 * PIECE / RATE
    late = [t for t in engine.late if t > 0.01]  # a batch takes 42 ms
    assert len(late) <= 5, late
    assert took < 1.4 * ideal + 0.05, (took, ideal)


class LatencyEngine(SimEngine):
    """FIFO at `rate` plus a fixed cost per batch, and `first_extra` more on the
    peer's first batch (a connection set up)."""

    def __init__(self, latency: float, first_extra: float = 0.0) -> None:
        super().__init__(True)
        self.latency, self.first_extra = latency, first_extra

    def batch_transfer_async_write(self, peer, srcs, dsts, lengths) -> int:
        with self.lock:
            now = time.monotonic()
            b, self.next_id = self.next_id, self.next_id + 1
            cost = self.latency + (self.first_extra if b == 1 else 0.0)
            self.free_at = max(now, self.free_at) + cost + sum(lengths) / self.rate
            self.ends[b] = self.free_at
            return b


def sized_write(
    peer: PeerBatches, n: int, piece: int, deadline_s: float
) -> MooncakeWriteHandle:
    handle = MooncakeWriteHandle(time.monotonic() + deadline_s, threading.Lock())
    peer.start(WriteJob(handle, [0] * n, [0] * n, [piece] * n), False)
    return handle


@pytest.mark.parametrize(
    ("latency", "first_extra", "warm", "big", "cap"),
    [
        (0.0, 0.05, [(1, 16 << 10)], [(64, PIECE), (1, PIECE)], 64),  # slow first batch
        (0.001, 0.0, [(1, 16 << 10)] * 10, [(64, 256 << 10)] * 8, 64),  # small then large
        (0.001, 0.0, [(1, 16 << 10)] * 10, [(64, 256 << 10)] * 32, 1024),  # all in flight
    ],
    ids=["slow-first-batch", "small-then-large", "all-in-flight"],
)
def test_small_or_slow_batches_before_large_ones_never_make_the_thread_sleep_long(
    latency: float, first_extra: float, warm: list, big: list, cap: int
) -> None:
    """A rate measured on small batches (their fixed cost makes them look slow)
    or on a slow first one must not put the thread to sleep past a large batch's
    end: the writes take about the engine's time, and none fails its deadline."""
    engine = LatencyEngine(latency, first_extra)
    peer = PeerBatches(engine, "h:1", cap=cap)
    try:
        for n, piece in warm:
            assert sized_write(peer, n, piece, 30).wait(30) is WriteState.DONE
        t0 = time.monotonic()
        handles = [sized_write(peer, n, piece, 2.0 + 0.1 * len(big)) for n, piece in big]
        states = [h.wait(30) for h in handles]
        took = time.monotonic() - t0
    finally:
        peer.close()
    assert states == [WriteState.DONE] * len(big)
    ideal = sum(latency + n * piece / engine.rate for n, piece in big)
    assert took < 1.3 * ideal + 0.05, (took, ideal)
