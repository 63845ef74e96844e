"""The scheduler's end of the channel: binds the name, accepts this user's workers,
checks every message and combines the ranks' reports.

- **Who.** At connect the receiver reads the peer's uid from the kernel
  (SO_PEERCRED) and drops other uids. Every message must unseal under the
  connection's key (`fastkv.channel.frames`), carry the next sequence number and
  the rank the connection spoke for before; a message that fails any check closes
  its connection.
- **Delivery.** `poll()` never blocks and never raises for anything a peer sends;
  it first serves the connections it holds (dropping dead ones), then accepts at
  most ACCEPTS_PER_POLL new ones and reads at most MESSAGES_PER_POLL messages per
  connection, so one call stays bounded however fast workers send or connect, and
  what it logs about peers is rate-limited. After reading a connection it
  acknowledges, sealed under the connection's acknowledgement key, the stream index
  below which that worker's results are applied: a worker lets a result go only
  then, and a result it sends again (its connection died before the
  acknowledgement came) is recognised by its index and dropped, so each result is
  applied once. The ranks' reports are combined with `fastkv.tp.RankResults`: a
  transfer comes out once every rank reported it, successful only if all succeeded.
- **Release.** `close()` (idempotent) closes every connection, unlinks the socket,
  key and lock file and releases the lock at once: the next receiver on the same
  name binds immediately. A process forked from the scheduler drops its inherited
  copies so it never keeps the name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import socket
from collections import OrderedDict
from dataclasses import dataclass

from fastkv.channel.ends import OPEN_ENDS, LogLimiter, peer_uid
from fastkv.channel.frames import (
    MAX_FRAME_BYTES,
    ack_key,
    connection_key,
    frame_nonce,
    seal,
    unseal,
)
from fastkv.channel.private_dir import (
    EPOCH_BYTES,
    check_name,
    load_secret,
    open_private_dir,
    open_private_file,
    runtime_dir,
    socket_address,
)
from fastkv.channel.protocol import Result, decode, encode_ack
from fastkv.config import check_int
from fastkv.pd.messages import RankReport
from fastkv.tp import RankResults

log = logging.getLogger(__name__)

MESSAGES_PER_POLL = 256
"""Messages `poll()` reads from one connection; the rest wait for the next poll."""
ACCEPTS_PER_POLL = 16
"""Connections `poll()` accepts (or refuses) at most; the rest wait in the backlog."""
MAX_STREAMS = 1024
"""Workers' streams whose applied index the receiver remembers (the oldest go)."""


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    datagrams: int
    """Messages read from connected workers (authenticated or not)."""
    results: int
    """Per-rank results accepted."""
    combined: int
    """Transfers every rank has reported (what `poll` returned)."""
    rejected_datagrams: int
    """Messages that failed the MAC, sequence, size or format check."""
    rejected_results: int
    """A rank out of range, or a transfer a rank reported twice."""
    rejected_connections: int = 0
    """Connections from another uid, or past `max_connections`."""
    accepted_connections: int = 0
    """Connections accepted and kept."""
    duplicates: int = 0
    """Results a worker sent again that were applied already (dropped)."""


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    nonce: bytes = b""
    key: bytes = b""
    ack_key: bytes = b""
    next_seq: int = 0
    rank: int | None = None
    stream: bytes | None = None
    ack_seq: int = 0
    ack_due: bool = False


class ResultsReceiver:
    """The scheduler's end: binds the channel and combines the ranks' results.

    Args:
        name: the channel name, shared with every worker (see `check_name`).
        tp_size: how many ranks report each transfer.
        same_user_only: refuse connections from another uid (kept on except in
            tests of the MAC itself).
        directory: the private directory; default `runtime_dir()`.
        max_connections: connections held at once (workers reconnect after a
            scheduler restart; past the bound new ones are closed).

    Raises:
        ValueError: a bad name, tp_size or max_connections.
        PermissionError: the directory or key file is not private to this user.
        OSError: another receiver holds the name (the message names the channel and
            its pid), or binding failed.
    """

    def __init__(
        self,
        name: str,
        tp_size: int,
        *,
        same_user_only: bool = True,
        directory: str | None = None,
        max_connections: int | None = None,
    ) -> None:
        check_name(name)
        self._ranks = RankResults(tp_size)
        self._tp_size = tp_size
        if max_connections is None:
            max_connections = 4 * tp_size + 16
        check_int("max_connections", max_connections, 1)
        self.name = name
        self.tp_size = tp_size
        self.max_connections = max_connections
        self.directory = directory if directory is not None else runtime_dir()
        self._uid = os.getuid() if same_user_only else None
        self._log = LogLimiter(log)
        self._conns: list[_Conn] = []
        self._epoch = secrets.token_bytes(EPOCH_BYTES)
        # One nonce per connection this receiver accepted (16 bytes each; only this
        # uid can connect, and workers reconnect only after errors).
        self._nonces_seen: set[bytes] = set()
        # (rank, stream) -> the index below which its results were applied
        self._applied: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self._accepted = self._duplicates = 0
        self._datagrams = self._results = self._combined = 0
        self._bad_datagrams = self._bad_results = self._bad_connections = 0
        self._sock: socket.socket | None = None
        self._lock_fd = -1
        self._sock_ino = -1
        self._dir_fd = open_private_dir(self.directory)
        try:
            self._lock_fd = self._take_lock()  # first: a closing one deletes its key
            self._secret = load_secret(self._dir_fd, name, create=True)
            self._sock = self._bind()
        except BaseException:
            self._release(unlink=False)
            raise
        OPEN_ENDS.add(self)

    @property
    def path(self) -> str:
        """The socket's file path."""
        return os.path.join(self.directory, f"{self.name}.sock")

    def _take_lock(self) -> int:
        """Lock `<name>.lock` (made if missing), retrying while a closing receiver
        unlinks the file we locked; write our pid and epoch into it."""
        for _ in range(100):
            fd = self._lock_once()
            if fd >= 0:
                return fd
        raise OSError(
            errno.EAGAIN, f"results channel {self.name!r}: the lock file keeps changing"
        )

    def _lock_once(self) -> int:
        filename = f"{self.name}.lock"
        fd = open_private_file(
            self._dir_fd, filename, os.O_RDWR | os.O_CREAT, f"lock file {filename}"
        )
        try:
            st = os.fstat(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fields = os.pread(fd, 128, 0).decode(errors="replace").split()
                holder = fields[0] if fields else "?"
                raise OSError(
                    errno.EADDRINUSE,
                    f"results channel {self.name!r}: bound by another receiver (pid "
                    f"{holder}; if it is this process, close() the previous one). Set "
                    "FASTKV_RESULTS_CHANNEL to tell schedulers apart",
                ) from None
            try:  # the receiver we waited for unlinked it while closing: lock anew
                now = os.stat(filename, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                return -1
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {self._epoch.hex()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _bind(self) -> socket.socket:
        filename = f"{self.name}.sock"
        # left by a receiver that died: the lock says no one else uses it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(filename, dir_fd=self._dir_fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            sock.bind(socket_address(self._dir_fd, filename))
            sock.listen(64)
            self._sock_ino = os.stat(
                filename, dir_fd=self._dir_fd, follow_symlinks=False
            ).st_ino
        except OSError as e:
            sock.close()
            raise OSError(
                e.errno, f"results channel {self.name!r}: cannot bind ({e.strerror})"
            ) from None
        return sock

    def poll(self) -> list[Result]:
        """Serve the connections held (reading every message waiting, dropping dead
        connections), then accept at most ACCEPTS_PER_POLL waiting workers and serve
        them too; never blocks. Return the transfers that every rank has now
        reported, combined. Never raises for anything a peer sent: bad input is
        counted, logged (rate-limited) and its connection closed."""
        if self._sock is None:
            return []
        done: list[Result] = []
        self._serve(list(self._conns), done)  # first: dead ones free their places
        try:
            fresh = self._accept()
        except Exception as e:  # nothing a peer does may escape
            self._log("internal", "results channel %r: accept failed: %r", self.name, e)
            fresh = []
        self._serve(fresh, done)
        self._combined += len(done)
        return done

    def _serve(self, conns: list[_Conn], done: list[Result]) -> None:
        """Read what `conns` sent and acknowledge it."""
        for conn in conns:
            try:
                self._drain(conn, done)
                if conn in self._conns:
                    self._acknowledge(conn)
            except Exception as e:  # nothing a peer sends may escape
                self._bad_datagrams += 1
                self._log(
                    "internal", "results channel %r: dropped a connection: %r", self.name, e
                )
                self._drop(conn)

    def _accept(self) -> list[_Conn]:
        """Accept (or refuse) at most ACCEPTS_PER_POLL waiting connections; the
        connections kept."""
        assert self._sock is not None
        fresh: list[_Conn] = []
        for _ in range(ACCEPTS_PER_POLL):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. out of fds: try again next poll
                self._log("accept", "results channel %r: accept failed: %s", self.name, e)
                break
            try:
                refused = self._refusal(sock)
            except OSError as e:
                refused = f"accept failed: {e}"
            if refused:
                self._bad_connections += 1
                self._log("refused", "results channel %r: %s", self.name, refused)
                sock.close()
                continue
            conn = _Conn(sock)
            self._conns.append(conn)
            fresh.append(conn)
            self._accepted += 1
        return fresh

    def _refusal(self, sock: socket.socket) -> str:
        """Why a connection just accepted is refused ("" when it is not)."""
        sock.setblocking(False)
        uid = peer_uid(sock)
        if self._uid is not None and uid != self._uid:
            return f"refused a connection from uid {uid}"
        if len(self._conns) >= self.max_connections:
            return f"{len(self._conns)} connections open, refused another"
        return ""

    def _drain(self, conn: _Conn, done: list[Result]) -> None:
        for _ in range(MESSAGES_PER_POLL):  # the rest waits for the next poll
            try:
                frame = conn.sock.recv(MAX_FRAME_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the worker went away
                self._drop(conn)
                return
            if not frame:  # the worker closed its end
                self._drop(conn)
                return
            self._datagrams += 1
            try:
                rank, first, results = self._open(conn, frame)
            except ValueError as e:
                self._bad_datagrams += 1
                self._log(
                    "message", "results channel %r: closed a connection: %s", self.name, e
                )
                self._drop(conn)
                return
            self._combine(rank, self._unapplied(conn, first, results), done)
            conn.ack_due = True

    def _unapplied(self, conn: _Conn, first: int, results: list[Result]) -> list[Result]:
        """The results of a message (its first at stream index `first`) not applied
        before; the stream's applied index moves past the message."""
        assert conn.rank is not None and conn.stream is not None
        key = (conn.rank, conn.stream)
        applied = self._applied.get(key, 0)
        seen = min(len(results), max(0, applied - first))
        self._duplicates += seen
        if results and first + len(results) > applied:
            self._applied[key] = first + len(results)
            self._applied.move_to_end(key)
            if len(self._applied) > MAX_STREAMS:
                self._applied.popitem(last=False)
        return results[seen:]

    def _acknowledge(self, conn: _Conn) -> None:
        """Tell the worker on `conn` up to where its stream is applied (when it sent
        something since the last acknowledgement; a full socket retries next poll)."""
        if not conn.ack_due or conn.rank is None or conn.stream is None:
            return
        applied = self._applied.get((conn.rank, conn.stream), 0)
        frame = seal(conn.ack_key, conn.nonce, conn.ack_seq, encode_ack(applied))
        try:
            conn.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the worker went away: it sends again on its next connection
            self._drop(conn)
            return
        conn.ack_seq += 1
        conn.ack_due = False

    def _open(self, conn: _Conn, frame: bytes) -> tuple[int, int, list[Result]]:
        """The (rank, first stream index, results) of the next message on `conn`: it
        must unseal under the connection's key, carry the next sequence number, and
        the rank and stream the connection spoke for before. `conn` moves on to the
        next message only when every check passed.

        Raises:
            ValueError: a check failed (the connection is to be closed).
        """
        if not conn.key:  # the connection's first message names its nonce
            nonce = frame_nonce(frame)
            if nonce in self._nonces_seen:
                raise ValueError("message: a connection nonce used before (replay)")
            conn.nonce, conn.key = nonce, connection_key(self._secret, self._epoch, nonce)
        opened = unseal(conn.key, frame)
        if opened.seq != conn.next_seq:
            raise ValueError(f"message: sequence {opened.seq}, expected {conn.next_seq}")
        rank, results = decode(opened.payload)
        if conn.rank is not None and rank != conn.rank:
            raise ValueError(f"message: rank {rank} on rank {conn.rank}'s connection")
        if conn.stream is not None and opened.stream != conn.stream:
            raise ValueError("message: another stream on this connection")
        if conn.next_seq == 0:
            self._nonces_seen.add(conn.nonce)
            conn.ack_key = ack_key(self._secret, self._epoch, conn.nonce)
        conn.next_seq += 1
        conn.rank, conn.stream = rank, opened.stream
        return rank, opened.first, results

    def _combine(self, rank: int, results: list[Result], done: list[Result]) -> None:
        """Add one rank's results; append to `done` those every rank has reported.
        A PD RankReport goes to `done` as it is (the PD half counts ranks itself),
        only from a rank in range."""
        for result in results:  # one at a time: a bad one spoils no other
            if isinstance(result, RankReport):
                if not 0 <= rank < self._tp_size:
                    self._bad_results += 1
                    self._log(
                        "result",
                        "results channel %r: dropped a report of rank %d",
                        self.name,
                        rank,
                    )
                    continue
                self._results += 1
                done.append(result)
                continue
            try:
                combined = self._ranks.add(rank, [result])
            except ValueError as e:
                self._bad_results += 1
                self._log("result", "results channel %r: dropped a result: %s", self.name, e)
                continue
            self._results += 1
            done += combined

    def _drop(self, conn: _Conn) -> None:
        conn.sock.close()
        if conn in self._conns:
            self._conns.remove(conn)

    def missing(self) -> dict[tuple[str, int], list[int]]:
        """Transfers and lookups some rank has reported and others not yet:
        (kind, id) -> missing ranks (see `RankResults.missing`)."""
        return self._ranks.missing()

    def stats(self) -> ReceiverStats:
        return ReceiverStats(
            self._datagrams,
            self._results,
            self._combined,
            self._bad_datagrams,
            self._bad_results,
            self._bad_connections,
            self._accepted,
            self._duplicates,
        )

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Release the name now (idempotent): unlink the socket, the key file and
        the lock file, close every connection, release the lock. A receiver made next
        on the same name binds at once (with a new key unless the secret comes from
        the environment; workers read it when they reconnect). Results this receiver
        did not acknowledge stay with their workers, which send them to the next
        receiver on the name (as they do with results queued while none is bound)."""
        if self._dir_fd < 0:
            return
        self._release(unlink=True)

    def _release(self, *, unlink: bool) -> None:
        for conn in self._conns:
            conn.sock.close()
        self._conns.clear()
        if self._sock is not None:
            if unlink:
                filename = f"{self.name}.sock"
                try:  # only our own socket: never one a later receiver bound
                    st = os.stat(filename, dir_fd=self._dir_fd, follow_symlinks=False)
                    if st.st_ino == self._sock_ino:
                        os.unlink(filename, dir_fd=self._dir_fd)
                except OSError:
                    pass
            self._sock.close()
            self._sock = None
        if self._lock_fd >= 0:
            if unlink:  # still holding the lock: no receiver can be using these
                for suffix in ("key", "lock"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{self.name}.{suffix}", dir_fd=self._dir_fd)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        OPEN_ENDS.discard(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited copies, touch nothing shared."""
        self._release(unlink=False)


__all__ = [
    "ACCEPTS_PER_POLL",
    "MAX_STREAMS",
    "MESSAGES_PER_POLL",
    "ReceiverStats",
    "ResultsReceiver",
]
