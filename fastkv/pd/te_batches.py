"""What `MooncakeTransport` keeps per peer: the write handles, and the batches
to one peer submitted in chunks within the engine's per-peer queue and waited on
in submission order by one thread that sleeps through most of each batch (see
`PeerBatches`). `fastkv.pd.mooncake_te` builds the transport on these."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from fastkv.pd.transport import TransportError, WriteState
from fastkv.pd.transport import check_timeout as _check_timeout

WAKE_EARLY = 0.15  # a peer's thread wakes this share of a batch's estimate early
RATE_DECAY = 0.9  # a peer's rate falls at most this much per batch timed
RATE_STEP = 1.5  # a peer's rate grows by this when a batch ended before the wake
SPUN = 100e-6  # an engine wait shorter than this found its batch already over


class MooncakeWriteHandle:
    """One write in flight. Settles once: DONE when the engine reported every byte
    written, FAILED when the engine failed a batch of it, the transport closed, or
    its deadline passed; never changes after that.

    Past the deadline, once a batch of it failed, or once the transport closed,
    nothing more of it goes to the engine, and it fails only once no batch of it
    is inside the engine any more (the engine's own timeout, `MC_TRANSFER_TIMEOUT`,
    ends that wait): a settled handle is one whose bytes this end no longer moves,
    which is what a notice sent after it tells D."""

    __slots__ = ("_deadline", "_failing", "_in_engine", "_latch", "_lock", "_state")

    def __init__(self, deadline: float, lock: threading.Lock) -> None:
        self._deadline = deadline
        self._lock = lock
        self._state = WriteState.PENDING
        self._in_engine = 0  # batches submitted whose engine wait has not returned
        self._failing = False  # a batch failed: FAILED once none is left inside
        self._latch = threading.Lock()  # held while PENDING: a cheap one-shot event
        self._latch.acquire()

    def _settle(self, state: WriteState) -> None:
        with self._lock:
            self._settle_locked(state)

    def _settle_locked(self, state: WriteState) -> None:
        if self._state is WriteState.PENDING:
            self._state = state
            self._latch.release()

    def _enter(self) -> bool:
        """Count a batch about to go to the engine; False (nothing counted) once
        the handle settled, a batch of it failed, or its deadline passed."""
        with self._lock:
            if (
                self._state is not WriteState.PENDING
                or self._failing
                or time.monotonic() >= self._deadline
            ):
                return False
            self._in_engine += 1
            return True

    def _leave(self, state: WriteState | None) -> None:
        """A batch came back from the engine (or was never started) as `state`
        (None: done, more of the write to come). DONE (the last batch) settles
        at once unless an earlier batch failed; a failure settles FAILED only once
        no other batch of the write is inside the engine, since those may still
        land; so does a deadline."""
        with self._lock:
            self._in_engine -= 1
            if state is WriteState.FAILED:
                self._failing = True
            elif state is not None and not self._failing:  # DONE: its last batch
                self._settle_locked(state)
            if not self._in_engine and (self._failing or time.monotonic() >= self._deadline):
                self._settle_locked(WriteState.FAILED)

    def _stop(self) -> None:
        """The transport closed: nothing more of the write goes to the engine; it
        is FAILED now if no batch of it is inside the engine, else when the last
        one comes back (its bytes may land until then)."""
        with self._lock:
            self._failing = True
            if not self._in_engine:
                self._settle_locked(WriteState.FAILED)

    def state(self) -> WriteState:
        """The write's state now; never blocks (a PENDING handle past its deadline
        with no batch inside the engine becomes FAILED here)."""
        if self._state is WriteState.PENDING and time.monotonic() >= self._deadline:
            with self._lock:
                if not self._in_engine:
                    self._settle_locked(WriteState.FAILED)
        return self._state

    def wait(self, timeout_s: float) -> WriteState:
        """Block at most `timeout_s`: until the write settles, or its deadline when
        no batch of it is inside the engine then."""
        timeout_s = _check_timeout("timeout_s", timeout_s)
        end = time.monotonic() + timeout_s
        for until in (min(end, self._deadline), end):
            if self.state() is not WriteState.PENDING:
                break
            left = until - time.monotonic()
            if left > 0 and self._latch.acquire(timeout=left):
                self._latch.release()  # let other waiters through
        return self.state()


class WriteJob:
    """One `write`: its lists, how far they were submitted, what is outstanding."""

    __slots__ = ("dsts", "handle", "lengths", "next", "outstanding", "srcs")

    def __init__(self, handle: MooncakeWriteHandle, srcs: list, dsts: list, lengths: list):
        self.handle = handle
        self.srcs, self.dsts, self.lengths = srcs, dsts, lengths
        self.next = 0  # first piece not yet submitted
        self.outstanding = 0  # batches submitted and not yet settled


class PeerBatches:
    """The batches to one peer, with at most `cap` pieces queued in the engine.

    Mooncake's TCP transport queues a bounded number of pieces per peer
    (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`, 1024 by default, plus as many
    awaiting admission); past that it rejects pieces, and in 0.3.13 every later
    batch to that peer fails too. So a write is submitted in chunks that keep the
    pieces in flight within `cap`, by this peer's thread as earlier batches settle
    (with `inline`, what fits at once by the caller's thread). The same thread
    waits for every batch (the engine's wait blocks and spins a core) in
    submission order.

    Paced waiting: the engine takes one peer's pieces in order, so a batch
    starts about when the one before it was seen to end (or when submitted, if
    later) and takes about `bytes / rate`, `rate` being this peer's measured
    rate. The thread sleeps through `1 - WAKE_EARLY` of that estimate (never
    past the write's deadline), then spins in the engine's wait for the rest.
    Every rule leans to waking early, since waking early costs a longer spin
    and waking late delays the write and every one behind it:
    - the rate is optimistic: a timed batch (one the wait spun on) raises it to
      its own rate, and lowers it by at most `RATE_DECAY` (a batch's fixed
      costs make small batches look slow);
    - no sleep without a rate, nor for a batch over twice the largest one
      timed: that batch spins and is timed;
    - a batch already over at the wake ran faster than estimated by an unknown
      amount: the rate grows by `RATE_STEP` at once, and the batches submitted
      before that wake (most likely over too) are not slept on.
    The handle's own deadline does not depend on any of this
    (`MooncakeWriteHandle.state`), and `close` wakes a sleeper."""

    def __init__(self, engine: Any, peer: str, cap: int) -> None:
        self._engine = engine
        self._peer = peer
        self._cap = cap
        self._in_flight = 0  # pieces submitted whose batch is not yet waited on
        self._backlog: deque[WriteJob] = deque()  # jobs with pieces not yet submitted
        # (batch, pieces, job, bytes, submitted at)
        self._waiting: deque[tuple[int, int, WriteJob, int, float]] = deque()
        self._rate = 0.0  # measured bytes per second; 0 until a batch was timed
        self._timed_bytes = 0  # the largest batch timed
        self._last_end = 0.0  # when the previous batch was seen to settle
        self.largest_batch = 0  # bytes: the engine's timeout grows 1 ns per byte
        self._late_at = 0.0  # the last wake that found its batch already over
        self._cond = threading.Condition()
        self._current: WriteJob | None = None  # the job whose batch the thread waits on
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"te-peer-{peer}", daemon=True)
        self._thread.start()

    def start(self, job: WriteJob, inline: bool) -> None:
        """Queue `job`; with `inline`, submit what fits now on the caller's thread
        and raise `TransportError` when the engine refuses the job's first chunk
        (then nothing of it was started). Else this peer's thread submits it."""
        with self._cond:
            if self._closed:
                raise TransportError("transport is closed")
            self._backlog.append(job)
            if inline:
                self._fill(first=job)
            self._cond.notify()

    def close(self) -> None:
        """Stop submitting: a job with no batch inside the engine is FAILED now;
        one with a batch inside stays PENDING until the thread has waited on (and
        so freed) its last batch, since its bytes may land until then."""
        with self._cond:
            self._closed = True
            jobs = [*self._backlog, *(job for _, _, job, *_ in self._waiting)]
            if self._current is not None:
                jobs.append(self._current)
            for job in jobs:
                job.handle._stop()
            self._backlog.clear()
            self._cond.notify()

    def stop_submitting(self) -> None:
        """Submit nothing more of any write: one with pieces not yet submitted
        fails (now, or once its batches inside the engine came back); a write
        wholly submitted settles as the engine says."""
        with self._cond:
            for job in self._backlog:
                job.handle._stop()
            self._backlog.clear()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _fill(self, first: WriteJob | None = None) -> None:
        """Submit chunks from the backlog while there is room (lock held). Raises
        `TransportError` if `first`'s first chunk is refused (nothing started)."""
        while self._backlog and self._in_flight < self._cap:
            job = self._backlog[0]
            if not job.handle._enter():  # failed, or past its deadline: no more of it
                self._backlog.popleft()
                job.handle.state()  # fails it now if no batch of it is in the engine
                continue
            left, room = len(job.srcs) - job.next, self._cap - self._in_flight
            # whole if it fits; else chunks of half the queue, so that one chunk
            # streams while the thread waits on the one before
            end = job.next + (left if left <= room else min(room, max(1, self._cap // 2)))
            batch, why = self._submit(job, end)
            if not batch:
                job.handle._leave(WriteState.FAILED)
            else:
                nbytes = sum(job.lengths[job.next : end])
                self.largest_batch = max(self.largest_batch, nbytes)
                self._waiting.append((batch, end - job.next, job, nbytes, time.monotonic()))
                self._in_flight += end - job.next
                job.outstanding += 1
                job.next = end
            if not batch or end == len(job.srcs):
                self._backlog.popleft()
            if not batch and job is first and job.next == 0:
                raise TransportError(f"peer={self._peer!r}: {why}; nothing was started")

    def _pace(self, nbytes: int, start: float, submitted: float, deadline: float) -> bool:
        """Sleep until `WAKE_EARLY` of the batch's estimated time before its
        estimated end (never past its deadline), submitting queued chunks as they
        fit (lock held). Returns whether it slept: not without a rate, not for a
        batch over twice the largest one timed (a rate says nothing about a much
        larger batch, whose fixed costs weigh less), and not for one submitted
        before a wake that came late (it is most likely over)."""
        if not self._rate or nbytes > 2 * self._timed_bytes or submitted < self._late_at:
            return False
        wake = min(start + (1 - WAKE_EARLY) * nbytes / self._rate, deadline - 1e-3)
        while not self._closed and (left := wake - time.monotonic()) > 0:
            self._cond.wait(left)
            self._fill()
        return True

    def _measured(self, nbytes: int, start: float, woke: float, paced: bool) -> None:
        """Fold a batch that settled now into the rate (lock held). A batch the
        engine's wait had to spin on was timed: the rate is the larger of its
        rate and the old one decayed by `RATE_DECAY` (optimistic: too high a
        rate costs spinning, too low a late wake). A paced batch already over at
        the wake ran faster than estimated by an unknown amount: the rate grows
        by `RATE_STEP`. An unpaced one already over tells nothing."""
        now = self._last_end = time.monotonic()
        if now - woke < SPUN:
            if paced:
                self._late_at = woke
                self._rate *= RATE_STEP
            return
        if (took := now - start) <= 0:
            return
        sample = nbytes / took
        self._timed_bytes = max(self._timed_bytes, nbytes)
        self._rate = max(sample, self._rate * RATE_DECAY)

    def _submit(self, job: WriteJob, end: int) -> tuple[int, str]:
        """Pieces [job.next, end) to the engine: (batch id, "") or (0, why not)."""
        whole = job.next == 0 and end == len(job.srcs)
        sl = slice(job.next, end)
        try:
            batch = self._engine.batch_transfer_async_write(
                self._peer,
                job.srcs if whole else job.srcs[sl],
                job.dsts if whole else job.dsts[sl],
                job.lengths if whole else job.lengths[sl],
            )
        except TypeError:
            return 0, "pieces: addresses and lengths must be unsigned integers"
        except Exception as exc:  # any engine error: the batch did not start
            # Raising here would leave the batch counted inside the engine (the
            # write PENDING for ever) and, on this peer's thread, end the thread.
            return 0, f"the engine raised {type(exc).__name__}: {exc}"
        return batch, "" if batch else "the engine could not start the batch"

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not (self._backlog and not self._closed):
                    if self._closed:
                        return
                    self._cond.wait()
                if not self._closed:
                    self._fill()
                if not self._waiting:
                    continue
                batch, count, job, nbytes, submitted = self._waiting.popleft()
                self._current = job
                start = max(submitted, self._last_end)  # FIFO: after the one before
                paced = self._pace(nbytes, start, submitted, job.handle._deadline)
                woke = time.monotonic()
            # blocks (GIL released) until the batch completed, failed or hit the
            # engine's timeout; the engine frees the batch on every outcome
            rc = self._engine.get_batch_transfer_status([batch])
            with self._cond:
                self._current = None
                if rc == 0:
                    self._measured(nbytes, start, woke, paced)
                self._in_flight -= count
                job.outstanding -= 1
                if rc != 0:
                    job.handle._leave(WriteState.FAILED)
                elif job.outstanding == 0 and job.next == len(job.srcs):
                    job.handle._leave(WriteState.DONE)
                else:  # more to come, or past its deadline with nothing left inside
                    job.handle._leave(None)


__all__ = ["MooncakeWriteHandle", "PeerBatches", "WriteJob"]
