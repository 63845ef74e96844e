"""An in-process `PDTransport` with fault injection, for deterministic tests.

Endpoints of one `InProcFabric` write into each other's registered memory with
`memmove` and pass notices through in-memory inboxes. By default every write lands
at once and every notice is delivered at once; the fabric's knobs change that:

    hold_writes / hold_notices   queue them until `pump()` (delay)
    reorder                      `pump()` and `poll_notices` deliver in shuffled order
    drop_next_notices(n)         the next n notices vanish (a lost message)
    partial_next_write(f, st)    the next write lands only the first fraction f of
                                 each piece, its handle settles to `st`
    kill(name, land_fraction)    the endpoint dies: its queued writes land that
                                 fraction of their bytes and fail, queued writes
                                 to it fail, its queued notices vanish, later
                                 writes and notices to it fail

A held write past `write_timeout_s` (fabric clock) fails and is discarded: it never
lands afterwards, the guarantee a receiver's fence grace relies on.
"""

from __future__ import annotations

import bisect
import ctypes
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastkv.pd.transport import Piece, TransportError, WriteState, check_timeout


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Handle:
    def __init__(self, fabric: InProcFabric, deadline: float) -> None:
        self._fabric = fabric
        self._state = WriteState.PENDING
        self.deadline = deadline

    def state(self) -> WriteState:
        with self._fabric._cond:
            self._fabric._expire()
            return self._state

    def wait(self, timeout_s: float) -> WriteState:
        end = time.monotonic() + check_timeout("timeout_s", timeout_s)
        with self._fabric._cond:
            while True:
                self._fabric._expire()
                left = end - time.monotonic()
                if self._state is not WriteState.PENDING or left <= 0:
                    return self._state
                self._fabric._cond.wait(min(left, 0.01))


@dataclass(slots=True)
class _Write:
    handle: _Handle
    src: str
    dst: str
    pieces: tuple[Piece, ...]


@dataclass(slots=True)
class _Notice:
    src: str
    dst: str
    payload: bytes


class InProcTransport:
    """One endpoint (see `InProcFabric.endpoint`)."""

    def __init__(self, fabric: InProcFabric, name: str) -> None:
        self._fabric = fabric
        self._name = name
        self.regions: list[tuple[int, int]] = []  # sorted by start
        self._starts: list[int] = []
        self.inbox: list[tuple[str, bytes]] = []
        self.dead = False
        self.done_means_applied = True  # a DONE write ran memmove to its end

    @property
    def address(self) -> str:
        return self._name

    def register(self, addr: int, length: int) -> None:
        """Register `[addr, addr+length)`; refuses overlap with a registered region."""
        for field, value in (("addr", addr), ("length", length)):
            if not _is_int(value) or value <= 0:
                raise TransportError(f"register: {field}={value!r}: must be a positive integer")
        with self._fabric._cond:
            self._check_live()
            i = bisect.bisect(self._starts, addr)
            if (i > 0 and self.regions[i - 1][1] > addr) or (
                i < len(self._starts) and self._starts[i] < addr + length
            ):
                raise TransportError(
                    f"region [{addr:#x}, {addr + length:#x}) overlaps a registered region"
                )
            self._starts.insert(i, addr)
            self.regions.insert(i, (addr, addr + length))

    def write(self, peer: str, pieces: Sequence[Piece]) -> _Handle:
        return self._fabric._write(self, peer, tuple(pieces))

    def notify(self, peer: str, payload: bytes, timeout_s: float) -> None:
        check_timeout("timeout_s", timeout_s)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TransportError(f"payload: {type(payload).__name__}, must be bytes")
        self._fabric._notify(self, peer, bytes(payload))

    def poll_notices(self) -> list[tuple[str, bytes]]:
        with self._fabric._cond:
            self._check_live()
            out, self.inbox = self.inbox, []
            if self._fabric.reorder:
                self._fabric._rng.shuffle(out)
            return out

    def close(self, timeout_s: float | None = None) -> bool:
        """Dead from now on; its writes already ran (or were dropped) in `write`."""
        with self._fabric._cond:
            self.dead = True
        return True

    def covers(self, addr: int, length: int) -> bool:
        """Whether one registered region holds `[addr, addr+length)`."""
        i = bisect.bisect(self._starts, addr) - 1
        return i >= 0 and addr + length <= self.regions[i][1]

    def _check_live(self) -> None:
        if self.dead:
            raise TransportError(f"{self._name}: transport closed or killed")


class InProcFabric:
    """The endpoints of one process and the faults between them.

    Args:
        write_timeout_s: a write still queued this long after it started fails
            and never lands.
        clock: monotonic seconds (the write timeout).
        seed: the shuffles of `reorder`.
    """

    def __init__(
        self,
        *,
        write_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        self.write_timeout_s = write_timeout_s
        self._clock = clock
        self._rng = random.Random(seed)
        self._cond = threading.Condition(threading.RLock())
        self._ends: dict[str, InProcTransport] = {}
        self._writes: list[_Write] = []
        self._notices: list[_Notice] = []
        self._partial: list[tuple[float, WriteState]] = []
        self._drop = 0
        self.hold_writes = False
        self.hold_notices = False
        self.reorder = False
        self.bytes_written = 0
        self.notices_dropped = 0

    def endpoint(self, name: str) -> InProcTransport:
        with self._cond:
            if name in self._ends:
                raise ValueError(f"name: endpoint {name!r} exists")
            end = self._ends[name] = InProcTransport(self, name)
            return end

    # -- faults ---------------------------------------------------------------

    def drop_next_notices(self, n: int) -> None:
        with self._cond:
            self._drop += n

    def partial_next_write(
        self, fraction: float, state: WriteState = WriteState.FAILED
    ) -> None:
        with self._cond:
            self._partial.append((fraction, state))

    def kill(self, name: str, *, land_fraction: float = 0.5) -> None:
        """`name` dies: its queued writes land `land_fraction` of each piece and
        fail; its queued notices vanish."""
        with self._cond:
            self._ends[name].dead = True
            for w in [w for w in self._writes if name in (w.src, w.dst)]:
                self._writes.remove(w)
                if w.src == name:  # a dying writer: some bytes got out
                    self._land(w, land_fraction)
                self._settle(w.handle, WriteState.FAILED)
            self._notices = [n for n in self._notices if n.src != name]

    def pump(self) -> int:
        """Run every queued write and deliver every queued notice (shuffled with
        `reorder`); returns how many."""
        with self._cond:
            self._expire()
            writes, self._writes = self._writes, []
            notices, self._notices = self._notices, []
            if self.reorder:
                self._rng.shuffle(writes)
                self._rng.shuffle(notices)
            for w in writes:
                self._run(w)
            for n in notices:
                self._deliver(n)
            return len(writes) + len(notices)

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._writes) + len(self._notices)

    # -- internals ------------------------------------------------------------

    def _write(self, end: InProcTransport, peer: str, pieces: tuple[Piece, ...]) -> _Handle:
        with self._cond:
            end._check_live()
            dst = self._ends.get(peer)
            if dst is None or dst.dead:
                raise TransportError(f"write: peer {peer!r} unknown or dead")
            for i, p in enumerate(pieces):
                if not (_is_int(p.src) and _is_int(p.dst) and _is_int(p.length)):
                    raise TransportError(
                        f"pieces[{i}]={p!r}: addresses and length must be integers"
                    )
                if p.length <= 0 or not end.covers(p.src, p.length):
                    raise TransportError(f"pieces[{i}]: source outside a registered region")
                if not dst.covers(p.dst, p.length):
                    raise TransportError(f"pieces[{i}]: destination outside {peer}'s regions")
            handle = _Handle(self, self._clock() + self.write_timeout_s)
            w = _Write(handle, end.address, peer, pieces)
            if self.hold_writes:
                self._writes.append(w)
            else:
                self._run(w)
            return w.handle

    def _run(self, w: _Write) -> None:
        if self._ends[w.src].dead or self._ends[w.dst].dead:
            self._settle(w.handle, WriteState.FAILED)
            return
        if self._partial:
            fraction, state = self._partial.pop(0)
            self._land(w, fraction)
            self._settle(w.handle, state)
            return
        self._land(w, 1.0)
        self._settle(w.handle, WriteState.DONE)

    def _land(self, w: _Write, fraction: float) -> None:
        for p in w.pieces:
            n = int(p.length * fraction)
            if n:
                ctypes.memmove(p.dst, p.src, n)
                self.bytes_written += n

    def _settle(self, handle: _Handle, state: WriteState) -> None:
        handle._state = state
        self._cond.notify_all()

    def _expire(self) -> None:
        if not self._writes:
            return
        now = self._clock()
        for w in [w for w in self._writes if now >= w.handle.deadline]:
            self._writes.remove(w)
            self._settle(w.handle, WriteState.FAILED)

    def _notify(self, end: InProcTransport, peer: str, payload: bytes) -> None:
        with self._cond:
            end._check_live()
            dst = self._ends.get(peer)
            if dst is None or dst.dead:
                raise TransportError(f"notify: peer {peer!r} unknown or dead")
            if self._drop:
                self._drop -= 1
                self.notices_dropped += 1
                return
            n = _Notice(end.address, peer, payload)
            if self.hold_notices:
                self._notices.append(n)
            else:
                self._deliver(n)

    def _deliver(self, n: _Notice) -> None:
        dst = self._ends[n.dst]
        if not dst.dead:
            dst.inbox.append((n.src, n.payload))


__all__ = ["InProcFabric", "InProcTransport"]
