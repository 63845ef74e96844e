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
  chunks as earlier batches settle (`te_batches.PeerBatches`).
- The engine's wait spins: a peer's thread that called it at submission would
  burn a core for the whole transfer, the core a TCP transfer and the checksums
  need on a small host, and the engine loop's core on a large one. So the thread
  first sleeps until shortly before the batch's estimated end, estimated from the
  rate this peer's batches have measured, and spins only for the rest
  (`te_batches.PeerBatches`).
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
from collections.abc import Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from operator import add, le
from typing import Any

from fastkv.pd.te_batches import MooncakeWriteHandle, PeerBatches, WriteJob
from fastkv.pd.transport import MAX_TIMEOUT_S, Piece, TransportError, WriteState
from fastkv.pd.transport import check_timeout as _check_timeout

MAX_NOTICE_BYTES = 64 << 10
NOTIFY_THREADS = 2
QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
TCP_PROTO_ENV = "MC_TCP_PROTO"
DEFAULT_QUEUE = 1024  # the engine's default for QUEUE_ENV
NOTICE_MARK = "P"  # first character of every notice this transport sends


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
        self._peers: dict[str, PeerBatches] = {}
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
                state = self._peers[peer] = PeerBatches(self._engine, peer, self._max_in_flight)
        state.start(WriteJob(handle, srcs, dsts, lengths), inline)
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
