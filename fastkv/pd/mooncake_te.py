"""`PDTransport` over Mooncake Transfer Engine (`mooncake.engine.TransferEngine`).

The engine runs without a metadata server (`P2PHANDSHAKE`): peers address each
other as `host:rpc_port`, the engine's own handshake port (`address`). TCP here,
RDMA where the hardware and the wheel have it (`protocol`).

What it does on top of the engine:
- Local checks before anything starts: every piece's source lies inside a region
  this end registered, every length is positive, the peer is `host:port`. The
  engine itself sends whatever local memory it is pointed at; only the receiver
  checks its side, and refuses a write outside its registered memory by failing
  the batch (pieces before the refused one may have landed: FAILED means "trust
  nothing of it").
- A deadline on every write: once `write_timeout_s` passed without the engine
  reporting the write complete, nothing more of it is submitted, and its handle is
  FAILED as soon as no batch of it is inside the engine. The engine's own wait
  (`get_batch_transfer_status`) blocks, spins a core until the batch settles and
  frees the batch, so one thread per peer does that wait, in submission order; the
  engine's own timeout (`MC_TRANSFER_TIMEOUT`, 30 s by default, at least 5 s, plus
  a nanosecond per byte) ends it. A handle does not fail earlier than that because
  a settled handle lets P's notice go out, and the notice tells D that no byte of
  the write can land any more, so D may reuse the blocks at once.
- At most `max_pieces_in_flight` pieces queued in the engine per peer: its TCP
  transport rejects pieces past its per-peer queue and then fails every later
  batch to that peer (0.3.13). A larger write, or one behind others, goes in
  chunks as earlier batches settle (`_Peer`).
- The engine's wait spins: a peer's thread that called it at submission would
  burn a core for the whole transfer, the core a TCP transfer and the checksums
  need on a small host, and the engine loop's core on a large one. So the thread
  first sleeps until shortly before the batch's estimated end, estimated from the
  rate this peer's batches have measured, and spins only for the rest (`_Peer`).
- The engine's submit costs the submitting thread about 2 µs per piece here, so
  by default the peer's thread submits and `write` only checks and queues (about
  15-25 µs for 64 pieces); `submit_in_caller=True` submits on the calling thread.
- Notices ride the engine's notification (`transfer_sync` of zero bytes with a
  `TransferNotify`), sent from a small thread pool so `notify` returns by its
  `timeout_s` even when the peer hangs; a notice that timed out may still arrive
  later, at most once. Payload bytes travel as latin-1 text (every byte value
  maps to one character and back) after a one-character marker, so an empty
  payload is a notice too and the engine's other notifications are told apart.

Who can write into registered memory: any process that reaches the engine's
ports and names an address inside a registered region. Mooncake 0.3.13 listens
on every interface (its handshake and TCP data ports bind the wildcard address)
whatever host name it is given, and `MC_TCP_BIND_ADDRESS` only chooses the
address it advertises when a metadata server is used, not what it binds. So the
PD address confines nothing by itself: run the engine where only the peers can
reach it (a private network namespace, as the tests do, or a firewall that
admits only the PD peers). `listening()` reports what the engine bound, and
`require_private_listen=True` refuses to start when it bound a wildcard address.
`fastkv.pd` never trusts landed bytes without an authenticated notice and
per-block checksums.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from operator import add, le
from typing import Any

from fastkv.pd.transport import MAX_TIMEOUT_S, Piece, TransportError, WriteState
from fastkv.pd.transport import check_timeout as _check_timeout

MAX_NOTICE_BYTES = 64 << 10
NOTIFY_THREADS = 2
QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
TCP_PROTO_ENV = "MC_TCP_PROTO"
DEFAULT_QUEUE = 1024  # the engine's default for QUEUE_ENV
NOTICE_MARK = "P"  # first character of every notice this transport sends
WAKE_EARLY = 0.15  # a peer's thread wakes this share of a batch's estimate early
RATE_DECAY = 0.9  # a peer's rate falls at most this much per batch timed
RATE_STEP = 1.5  # a peer's rate grows by this when a batch ended before the wake
SPUN = 100e-6  # an engine wait shorter than this found its batch already over


def _check_unsigned(*lists: list) -> None:
    for name, values in zip(("src", "dst", "length"), lists, strict=True):
        for i, v in enumerate(values):
            if type(v) is not int or v < 0:
                raise TransportError(f"pieces[{i}].{name}={v!r}: must be an unsigned integer")
    raise TransportError("pieces: addresses and lengths must be unsigned integers")


def _check_peer(peer: Any) -> None:
    host, sep, port = peer.rpartition(":") if isinstance(peer, str) else ("", "", "")
    if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
        raise TransportError(f"peer={peer!r}: must be 'host:port' with port in [1, 65535]")


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


class _Job:
    """One `write`: its lists, how far they were submitted, what is outstanding."""

    __slots__ = ("dsts", "handle", "lengths", "next", "outstanding", "srcs")

    def __init__(self, handle: MooncakeWriteHandle, srcs: list, dsts: list, lengths: list):
        self.handle = handle
        self.srcs, self.dsts, self.lengths = srcs, dsts, lengths
        self.next = 0  # first piece not yet submitted
        self.outstanding = 0  # batches submitted and not yet settled


class _Peer:
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
        self._backlog: deque[_Job] = deque()  # jobs with pieces not yet submitted
        # (batch, pieces, job, bytes, submitted at)
        self._waiting: deque[tuple[int, int, _Job, int, float]] = deque()
        self._rate = 0.0  # measured bytes per second; 0 until a batch was timed
        self._timed_bytes = 0  # the largest batch timed
        self._last_end = 0.0  # when the previous batch was seen to settle
        self.largest_batch = 0  # bytes: the engine's timeout grows 1 ns per byte
        self._late_at = 0.0  # the last wake that found its batch already over
        self._cond = threading.Condition()
        self._current: _Job | None = None  # the job whose batch the thread waits on
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"te-peer-{peer}", daemon=True)
        self._thread.start()

    def start(self, job: _Job, inline: bool) -> None:
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

    def _fill(self, first: _Job | None = None) -> None:
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

    def _submit(self, job: _Job, end: int) -> tuple[int, str]:
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


def engine_timeout_s() -> float:
    """The engine's own bound on a batch, in seconds, read from the environment as
    the engine reads it when it is made: `MC_TRANSFER_TIMEOUT` through C's `atoi`
    (no leading digits: 0), at least 5; 30 when unset. A batch may take a
    nanosecond per byte longer."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return 30.0
    digits = re.match(r"\s*([+-]?\d+)", raw)
    return float(max(5, int(digits.group(1)) if digits else 0))


def legacy_tcp_proto() -> bool:
    """Does the engine use TCP's legacy framing, whose COMPLETED fires once the
    bytes are in the sender's socket (not applied at the peer)? `MC_TCP_PROTO`
    exactly "1", as the engine tests it at every transfer."""
    return os.environ.get(TCP_PROTO_ENV) == "1"


def _cuda_wheel() -> bool:
    """Is Mooncake's CUDA wheel the one installed (not `-non-cuda`)?"""
    from importlib import metadata

    try:
        metadata.distribution("mooncake-transfer-engine")
    except metadata.PackageNotFoundError:
        return False
    return True


class MooncakeTransport:
    """A `PDTransport` over one Mooncake `TransferEngine` (see the module docstring).

    Args:
        host: the address peers use to reach this end (the configured PD address;
            "127.0.0.1" in tests). The engine picks its handshake port itself.
        write_timeout_s: once this long passed without the engine reporting a
            write complete, no more of it is submitted, and its handle is FAILED
            when no batch of it is left inside the engine (at most the engine's
            own `MC_TRANSFER_TIMEOUT` later).
        protocol: the engine's transport ("tcp"; "rdma" where the hardware is).
        device: the engine's device filter ("" for none).
        require_private_listen: raise `TransportError` if the engine listens on a
            wildcard address (see `listening`).
        max_pieces_in_flight: pieces queued in the engine per peer at most (a
            larger write goes in chunks); default the engine's own queue,
            `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER` or 1024.
        submit_in_caller: submit each write to the engine on the calling thread
            (an unreachable peer then raises in `write`) instead of the peer's
            thread. The engine's submit costs the calling thread about 2 µs per
            piece here: off by default, so a per-layer send hook pays only the
            checks (`write` raises for an unreachable peer only on the first
            write to it, which always submits inline and handshakes).

    Raises:
        TransportError: an argument is out of range, Mooncake is missing, or the
            engine did not start.
    """

    def __init__(
        self,
        host: str,
        *,
        write_timeout_s: float = 30.0,
        protocol: str = "tcp",
        device: str = "",
        require_private_listen: bool = False,
        max_pieces_in_flight: int | None = None,
        submit_in_caller: bool = False,
    ) -> None:
        if not isinstance(host, str) or not 0 < len(host) <= 253 or ":" in host:
            raise TransportError(f"host={host!r}: must be a host name or IPv4 address")
        self._write_timeout_s = _check_timeout("write_timeout_s", write_timeout_s)
        if protocol not in ("tcp", "rdma"):
            raise TransportError(f"protocol={protocol!r}: must be 'tcp' or 'rdma'")
        if not isinstance(device, str):
            raise TransportError(f"device={device!r}: must be a string")
        if max_pieces_in_flight is None:
            queued = os.environ.get(QUEUE_ENV, "")
            max_pieces_in_flight = int(queued) if queued.isdigit() else DEFAULT_QUEUE
        if type(max_pieces_in_flight) is not int or not 0 < max_pieces_in_flight <= 1 << 16:
            raise TransportError(
                f"max_pieces_in_flight={max_pieces_in_flight!r}: must be in [1, 65536]"
            )
        self._max_in_flight = max_pieces_in_flight
        self._protocol = protocol
        self._submit_in_caller = bool(submit_in_caller)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransportError(f"mooncake.engine is not importable: {exc}") from exc
        before = _own_listening()
        engine = TransferEngine()
        if engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise TransportError(f"TransferEngine.initialize({host!r}, {protocol!r}) failed")
        self._listening = sorted(set(_own_listening()) - set(before))
        self._engine: Any = engine
        self._engine_timeout_s = engine_timeout_s()  # the engine read it just now
        self._address = f"{host}:{engine.get_rpc_port()}"
        self._lock = threading.Lock()  # regions, settlers, closed
        self._settle_lock = threading.Lock()  # handle states
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._ends_by_index = [0]  # bisect_right(starts, src) -> that region's end
        self._peers: dict[str, _Peer] = {}
        self._notifier = ThreadPoolExecutor(NOTIFY_THREADS, thread_name_prefix="te-notify")
        self._closed = False
        self.foreign_notices = 0
        if require_private_listen and self.listens_on_wildcard():
            self.close()
            raise TransportError(
                f"the engine listens on {self._listening}: a wildcard address, "
                "reachable from every interface (require_private_listen=True)"
            )

    # -- facts -----------------------------------------------------------

    @property
    def device_memory(self) -> bool:
        """Can this engine move GPU memory? Only Mooncake's CUDA wheel
        (`mooncake-transfer-engine`) can; the non-CUDA one copies every piece
        with the CPU, so a GPU layout over it is refused (`check_transport_memory`)."""
        return _cuda_wheel()

    @property
    def done_means_applied(self) -> bool:
        """Does DONE mean the bytes were applied at the peer? Over TCP only with the
        engine's acknowledged framing, which `MC_TCP_PROTO=1` turns off (the engine
        reads it at every transfer); then DONE means "in this end's socket", and
        bytes may still land after it. (A peer engine older than 0.3.12 turns it
        off too, which this end cannot see: see docs/pd.md.)"""
        return self._protocol != "tcp" or not legacy_tcp_proto()

    @property
    def address(self) -> str:
        """Where peers reach this end ("host:port")."""
        return self._address

    @property
    def write_timeout_s(self) -> float:
        return self._write_timeout_s

    def listening(self) -> list[str]:
        """The "ip:port" addresses the engine's listening sockets bound (read from
        /proc at start; empty where /proc has no network tables)."""
        return list(self._listening)

    def listens_on_wildcard(self) -> bool:
        return any(a.startswith(("0.0.0.0:", "[::]:")) for a in self._listening)

    def regions(self) -> list[tuple[int, int]]:
        """The registered regions as (address, length), by address."""
        return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=True)]

    # -- PDTransport -----------------------------------------------------

    def register(self, addr: int, length: int) -> None:
        """Register `[addr, addr+length)`; refuses overlap with a registered region."""
        for field, value in (("addr", addr), ("length", length)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TransportError(f"{field}={value!r}: must be a positive integer")
        if addr + length > 1 << 64:
            raise TransportError(f"addr+length={addr + length:#x}: past 2**64")
        with self._lock:
            self._check_open()
            i = bisect.bisect_right(self._starts, addr)
            if (i > 0 and self._ends[i - 1] > addr) or (
                i < len(self._starts) and self._starts[i] < addr + length
            ):
                raise TransportError(
                    f"region [{addr:#x}, {addr + length:#x}) overlaps a registered region"
                )
            rc = self._engine.register_memory(addr, length)
            if rc != 0:
                raise TransportError(f"register_memory({addr:#x}, {length}) returned {rc}")
            self._starts.insert(i, addr)
            self._ends.insert(i, addr + length)
            self._ends_by_index = [0, *self._ends]

    def write(self, peer: str, pieces: Sequence[Piece]) -> MooncakeWriteHandle:
        """Start writing `pieces` into `peer`'s registered memory; returns at once.

        Raises:
            TransportError: closed; `peer` malformed or unreachable; a piece's
                length is not positive or its source is outside every region
                registered here. Nothing was started.
        """
        return self.write_lists(
            peer,
            [p.src for p in pieces],
            [p.dst for p in pieces],
            [p.length for p in pieces],
        )

    def write_lists(
        self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]
    ) -> MooncakeWriteHandle:
        """`write` for callers that already hold the three address/length lists
        (equal lengths, same order): the lists go to the engine as they are, and
        must not change until the handle settled (a large write is sent in
        chunks)."""
        if not len(srcs) == len(dsts) == len(lengths):
            raise TransportError(
                f"len(srcs)={len(srcs)}, len(dsts)={len(dsts)}, len(lengths)={len(lengths)}: "
                "must be equal"
            )
        if peer not in self._peers:
            _check_peer(peer)
        handle = MooncakeWriteHandle(
            time.monotonic() + self._write_timeout_s, self._settle_lock
        )
        if not srcs:
            handle._settle(WriteState.DONE)
            return handle
        with self._lock:
            self._check_open()
            self._check_pieces(srcs, dsts, lengths)
            state = self._peers.get(peer)
            inline = self._submit_in_caller or state is None
            if state is None:  # the first write to a peer handshakes here
                state = self._peers[peer] = _Peer(self._engine, peer, self._max_in_flight)
        state.start(_Job(handle, srcs, dsts, lengths), inline)
        return handle

    def notify(self, peer: str, payload: bytes, timeout_s: float) -> None:
        """Deliver `payload` to `peer`'s `poll_notices`, or raise `TransportError`
        by `timeout_s` (a notice that timed out may still arrive, at most once)."""
        _check_peer(peer)
        timeout_s = _check_timeout("timeout_s", timeout_s)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TransportError(f"payload: {type(payload).__name__}, must be bytes")
        if len(payload) > MAX_NOTICE_BYTES:
            raise TransportError(f"len(payload)={len(payload)}: at most {MAX_NOTICE_BYTES}")
        text = NOTICE_MARK + bytes(payload).decode("latin-1")
        with self._lock:
            self._check_open()
            future = self._notifier.submit(self._send_notice, peer, text)
        try:
            rc = future.result(timeout_s)
        except FutureTimeout:
            raise TransportError(f"notify {peer}: no answer within {timeout_s} s") from None
        except CancelledError:  # still queued when close shut the pool down
            raise TransportError(f"notify {peer}: the transport closed") from None
        if rc != 0:
            raise TransportError(f"notify {peer}: the engine returned {rc}")

    def connect(self, peer: str, timeout_s: float) -> None:
        """Do the engine's handshake with `peer` now, within `timeout_s`, so the
        first `write` to it does not (a `write` to a peer not yet met handshakes
        inline, bounded only by the engine's connect timeout).

        Raises:
            TransportError: no answer within `timeout_s`, or the peer is unreachable
                or has no registered memory.
        """
        _check_peer(peer)
        timeout_s = _check_timeout("timeout_s", timeout_s)
        with self._lock:
            self._check_open()
            future = self._notifier.submit(self._engine.get_first_buffer_address, peer)
        try:
            first = future.result(timeout_s)
        except FutureTimeout:
            raise TransportError(f"connect {peer}: no answer within {timeout_s} s") from None
        except CancelledError:  # still queued when close shut the pool down
            raise TransportError(f"connect {peer}: the transport closed") from None
        if not first:
            raise TransportError(f"connect {peer}: unreachable or no memory registered there")

    def poll_notices(self) -> list[tuple[str, bytes]]:
        """Notices received since the last call, as (claimed sender, payload).
        A notification not sent by this transport (no marker) is dropped and
        counted in `foreign_notices`."""
        with self._lock:
            self._check_open()
            got = self._engine.get_notifies()
        out = []
        for n in got:
            msg = n.msg
            if msg[:1] != NOTICE_MARK:
                self.foreign_notices += 1
                continue
            try:
                out.append((n.name, msg[1:].encode("latin-1")))
            except UnicodeEncodeError:
                self.foreign_notices += 1
        return out

    @property
    def release_bound_s(self) -> float:
        """How long after `close` starts the engine holds a batch at most: its own
        timeout (`MC_TRANSFER_TIMEOUT` as read when it was made, at least 5 s)
        plus a nanosecond per byte of the largest batch submitted, plus 1 s for
        the peer threads to see it end."""
        largest = max((p.largest_batch for p in self._peers.values()), default=0)
        return self._engine_timeout_s + largest * 1e-9 + 1.0

    def stop_writes(self) -> None:
        """Submit no more of any write already started (a large write goes to the
        engine in chunks): those not wholly submitted fail once their batches
        inside the engine came back. New writes and notices still go. A closing
        sender calls it so that what is left inside the engine ends sooner."""
        with self._lock:
            peers = list(self._peers.values())
        for state in peers:
            state.stop_submitting()

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop: no write starts any more, and the regions are unregistered (a
        peer's later write is refused) once the engine let go of every batch.

        A write with no batch inside the engine is FAILED at once; one with a
        batch inside stays PENDING until the engine gives the batch back (it
        completes, fails or hits the engine's own timeout), since until then it
        still reads the memory it writes from. Waits at most `timeout_s` (default
        `release_bound_s`, capped at the longest timeout, an hour) for that.
        Callable again; each call waits again.

        Returns:
            True once the engine holds no batch (the registered memory may be
            freed); False if one is still inside at `timeout_s`: its memory must
            stay allocated, and the regions stay registered, until a later
            `close` returns True.
        """
        if timeout_s is None:  # a bound past an hour (MC_TRANSFER_TIMEOUT): False then
            with self._lock:
                timeout_s = min(self.release_bound_s, MAX_TIMEOUT_S)
        timeout_s = _check_timeout("timeout_s", timeout_s)
        with self._lock:
            first = not self._closed
            self._closed = True
            peers = list(self._peers.values())
        if first:
            for state in peers:
                state.close()
            self._notifier.shutdown(wait=False, cancel_futures=True)
        end = time.monotonic() + timeout_s
        released = all([state.join(max(0.0, end - time.monotonic())) for state in peers])
        if not released:
            return False
        with self._lock:  # no batch inside: the regions can go
            if self._engine is not None:
                for start in self._starts:
                    self._engine.unregister_memory(start)
            self._starts.clear()
            self._ends.clear()
            self._ends_by_index = [0]
            self._peers.clear()
            self._engine = None
        return True

    # -- internals -------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def _check_pieces(self, srcs: list[int], dsts: list[int], lengths: list[int]) -> None:
        """Every address and length a Python int, every destination non-negative,
        every length positive (so the engine can convert every chunk, now or
        later), and every source inside one registered region: one comparison
        when the whole batch lies in one region, else one bisection per piece.
        (Destinations are the peer's to check.)"""
        try:
            ints = (
                type(sum(srcs)) is int and type(sum(dsts)) is int and type(sum(lengths)) is int
            )
            shortest, lowest_dst = min(lengths), min(dsts)
            lo = min(srcs)
            hi = max(srcs) + max(lengths)  # at or past every piece's end
        except TypeError:
            ints = False
        if not ints:
            _check_unsigned(srcs, dsts, lengths)  # names the first bad one
        if shortest <= 0:
            i = next(i for i, n in enumerate(lengths) if n <= 0)
            raise TransportError(f"pieces[{i}].length={lengths[i]!r}: must be positive")
        if lowest_dst < 0:
            _check_unsigned(srcs, dsts, lengths)
        r = bisect.bisect_right(self._starts, lo) - 1
        if r >= 0 and hi <= self._ends[r]:
            return
        # several regions (K and V tensors), or pieces of unequal lengths: each
        # piece's region by bisection, every loop in C (map), not in Python
        idx = list(map(partial(bisect.bisect_right, self._starts), srcs))
        ends = map(self._ends_by_index.__getitem__, idx)  # index 0: before all, end 0
        if not all(map(le, map(add, srcs, lengths), ends)):
            for i, (src, n, r) in enumerate(zip(srcs, lengths, idx, strict=True)):
                if src + n > self._ends_by_index[r]:
                    raise TransportError(
                        f"pieces[{i}]: source [{src:#x}, {src + n:#x}) is outside every "
                        f"region registered here ({len(self._starts)} regions)"
                    )

    def _send_notice(self, peer: str, text: str) -> int:
        from mooncake.engine import TransferNotify, TransferOpcode

        engine = self._engine
        if engine is None:
            return -1
        # zero bytes into the peer's first region: the engine sends the notice
        # once this (empty) transfer completed
        dst = engine.get_first_buffer_address(peer)
        src = self._starts[0] if self._starts else 0
        return engine.transfer_sync(
            peer, src, dst, 0, TransferOpcode.Write, notify=TransferNotify(self._address, text)
        )


def _own_listening() -> list[str]:
    """The "ip:port" of this process's listening TCP sockets, from /proc."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    out.append(_proc_address(cols[1], v6))
    return out


def _proc_address(field: str, v6: bool) -> str:
    ip_hex, port_hex = field.split(":")
    port = int(port_hex, 16)
    if not v6:
        ip = ".".join(str(b) for b in reversed(bytes.fromhex(ip_hex)))
        return f"{ip}:{port}"
    if int(ip_hex, 16) == 0:
        return f"[::]:{port}"
    words = [bytes.fromhex(ip_hex[i : i + 8])[::-1].hex() for i in range(0, 32, 8)]
    return f"[{''.join(words)}]:{port}"


__all__ = ["MAX_NOTICE_BYTES", "MooncakeTransport", "MooncakeWriteHandle"]
