"""A worker rank's end of the channel: sends its results to the receiver of this
user only, and keeps each until the receiver acknowledged it.

- **Who.** At connect the sender checks the receiver's uid from the kernel
  (SO_PEERCRED), so results never go to another user's socket; it reads the
  receiver's epoch and the secret again at every connect (a restarted receiver has
  new ones) and seals every message under a fresh connection key
  (`fastkv.channel.frames`). It opens the connection with a message of no results
  and sends results only once the receiver answered with an acknowledgement sealed
  under the connection's acknowledgement key: a process that bound the socket
  without the secret (e.g. after the scheduler died) gets no result. While no
  acknowledgement came, the sender re-reads the epoch at every flush and moves to
  a new receiver as soon as its epoch appears.
- **Delivery.** Each rank sends `(rank, [TransferResult | LookupResult, ...])`
  (`ResultsSender.send`), each result numbered in the sender's stream. A result
  leaves the queue only when the receiver acknowledged its index (the kernel takes
  a message before the receiver accepts the connection, and a receiver at its
  connection cap closes it unread); when a connection is lost, what it did not
  acknowledge is sent again on the next one, and the receiver drops what it had
  applied. What cannot go yet stays queued up to a bound. Nothing blocks, and
  `send`/`flush` raise only for bad input: trouble (no scheduler bound, out of file
  descriptors, a connection lost) shows in the count returned and in `stats()`. A
  process forked from a worker starts afresh: it never speaks on its parent's
  connection.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fastkv.channel.ends import OPEN_ENDS, LogLimiter, peer_uid
from fastkv.channel.frames import (
    MAX_FRAME_BYTES,
    NONCE_BYTES,
    STREAM_BYTES,
    ack_key,
    connection_key,
    seal,
    unseal,
)
from fastkv.channel.private_dir import (
    check_name,
    env_secret,
    load_secret,
    open_private_dir,
    read_epoch,
    runtime_dir,
    socket_address,
)
from fastkv.channel.protocol import RESULTS_PER_DATAGRAM, Result, decode_ack, encode, hello
from fastkv.config import check_int

log = logging.getLogger(__name__)


_Queued = tuple[int, Result]  # (stream index, result)


@dataclass(frozen=True, slots=True)
class SenderStats:
    sent: int
    """Results the receiver acknowledged (applied)."""
    pending: int
    """Results not acknowledged yet: waiting for a receiver, or sent and waiting for
    its acknowledgement."""
    dropped: int
    """Results dropped because more than `max_pending` were waiting."""
    resent: int = 0
    """Results sent again on a new connection (the last one died before they were
    acknowledged)."""
    errors: int = 0
    """Connects and sends that failed for a reason other than "no receiver bound
    yet" (out of file descriptors, a connection lost, a receiver that could not
    prove the secret...); `last_error` says the latest."""
    last_error: str = ""


class ResultsSender:
    """A worker rank's end: sends its results, keeping each until acknowledged.

    Args:
        name: the channel name (see `check_name`).
        rank: this worker's tensor-parallel rank.
        max_pending: results kept while the receiver is unreachable; past it the
            oldest are dropped (logged and counted): the scheduler then never
            frees those transfers' blocks, which loses capacity, never data.
        directory: the private directory; default `runtime_dir()`.

    Raises:
        ValueError: a bad name, rank, max_pending or $FASTKV_RESULTS_SECRET.
        PermissionError: the directory is not private to this user (a squatter's
            directory is refused: results never go to another user).
    """

    def __init__(
        self,
        name: str,
        rank: int,
        *,
        max_pending: int = 1 << 16,
        directory: str | None = None,
    ) -> None:
        check_name(name)
        check_int("rank", rank, 0)
        check_int("max_pending", max_pending, 1)
        self.name = name
        self.rank = rank
        self.max_pending = max_pending
        self.directory = directory if directory is not None else runtime_dir()
        self._unsent: deque[_Queued] = deque()  # oldest first
        self._inflight: deque[_Queued] = deque()  # sent, not acknowledged; oldest first
        self._next_index = 0
        self._stream = secrets.token_bytes(STREAM_BYTES)
        self._sent = self._dropped = self._resent = self._errors = 0
        self._last_error = ""
        self._log = LogLimiter(log)
        self._conn: socket.socket | None = None
        self._key = self._ack_key = self._nonce = self._epoch = b""
        self._seq = self._ack_seq = 0
        self._proven = False
        self._warned_unreachable = False
        self._closed = False
        env_secret()  # a bad variable fails here, not at every send
        self._dir_fd = open_private_dir(self.directory)
        OPEN_ENDS.add(self)

    def send(self, results: Iterable[Result]) -> int:
        """Queue `results` and send everything queued that the receiver takes now.

        Returns:
            How many results are not acknowledged yet (trouble reaching the
            receiver shows here and in `stats()`, never as an exception).

        Raises:
            TypeError: an entry is neither a TransferResult nor a LookupResult.
            ValueError: an id, failed position or hit count the wire format cannot
                hold. Nothing is queued when it raises.
        """
        results = list(results)
        encode(self.rank, results)  # checks every entry before anything is queued
        for r in results:
            self._unsent.append((self._next_index, r))
            self._next_index += 1
        overflow = len(self._inflight) + len(self._unsent) - self.max_pending
        if overflow > 0:
            for _ in range(overflow):
                (self._inflight or self._unsent).popleft()
            self._dropped += overflow
            log.error(
                "results channel %r, rank %d: dropped the %d oldest undelivered results "
                "(the scheduler has not read them; their blocks stay reserved)",
                self.name,
                self.rank,
                overflow,
            )
        return self.flush()

    def flush(self) -> int:
        """Read the receiver's acknowledgements, then send what is queued, oldest
        first, until the receiver stops taking. Never blocks; never raises.

        Returns:
            How many results are not acknowledged yet.
        """
        if not self._closed:
            try:
                self._flush()
            except OSError as e:  # anything the calls above did not expect
                self._trouble("flush", e)
                self._disconnect()
        return self.pending

    @property
    def pending(self) -> int:
        """Results not acknowledged yet."""
        return len(self._inflight) + len(self._unsent)

    def _flush(self) -> None:
        if self._conn is not None:
            self._read_acks()
        if self._conn is not None and not self._proven and self._epoch_moved():
            self._disconnect()  # a new receiver bound the name: go to it
        if self._conn is None and not self._connect():  # even with nothing queued:
            return  # the connection is proven by the time results come
        if self._proven:
            self._send_unsent()

    def _read_acks(self) -> None:
        """Apply every acknowledgement waiting; a bad one drops the connection."""
        assert self._conn is not None
        while True:
            try:
                frame = self._conn.recv(MAX_FRAME_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._trouble("recv", e)
                self._disconnect()
                return
            if not frame:  # the receiver closed it
                if not self._proven:
                    self._trouble(
                        "hello",
                        OSError(
                            errno.ECONNRESET,
                            "the receiver closed the connection unacknowledged (at its "
                            "connection cap, or it holds another secret)",
                        ),
                    )
                self._disconnect()
                return
            try:
                opened = unseal(self._ack_key, frame)
                if opened.seq != self._ack_seq:
                    raise ValueError(f"sequence {opened.seq}, expected {self._ack_seq}")
                applied = decode_ack(opened.payload)
            except ValueError as e:  # not the receiver holding the secret
                self._trouble("ack", OSError(errno.EPROTO, f"acknowledgement refused: {e}"))
                self._disconnect()
                return
            self._ack_seq += 1
            self._proven = True
            self._warned_unreachable = False
            self._acknowledged(applied)

    def _acknowledged(self, applied: int) -> None:
        """Let go every queued result below stream index `applied`."""
        for queue in (self._inflight, self._unsent):
            while queue and queue[0][0] < applied:
                queue.popleft()
                self._sent += 1

    def _send_unsent(self) -> None:
        """Send what is not in flight yet, in messages of consecutive indices."""
        assert self._conn is not None
        unsent = self._unsent
        while unsent:
            batch = [unsent[0]]
            while len(batch) < min(RESULTS_PER_DATAGRAM, len(unsent)):
                if unsent[len(batch)][0] != batch[-1][0] + 1:
                    break
                batch.append(unsent[len(batch)])
            (payload,) = encode(self.rank, [r for _, r in batch])
            frame = seal(
                self._key, self._nonce, self._seq, payload, stream=self._stream,
                first=batch[0][0],
            )  # fmt: skip
            try:
                self._conn.send(frame)
            except (BlockingIOError, InterruptedError):  # the receiver's queue is full
                return
            except OSError as e:  # the receiver closed: reconnect at the next flush
                self._trouble("send", e)
                self._disconnect()
                return
            self._seq += 1
            for _ in batch:
                self._inflight.append(unsent.popleft())

    def _epoch_moved(self) -> bool:
        """Whether the lock file names another receiver than this connection's."""
        try:
            return read_epoch(self._dir_fd, self.name) not in (None, self._epoch)
        except OSError:
            return False

    def _connect(self) -> bool:
        """Connect, check the receiver is this uid and open the connection with a
        hello (results go once the receiver acknowledged it); False: not now."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        except OSError as e:  # e.g. out of file descriptors: the results stay queued
            self._trouble("connect", e)
            return False
        try:
            if not self._open(sock):
                sock.close()
                return False
            sock.send(seal(self._key, self._nonce, 0, hello(self.rank), stream=self._stream))
        except (BlockingIOError, InterruptedError):  # its backlog or queue is full
            sock.close()
            return False
        except OSError as e:
            self._trouble("connect", e)
            sock.close()
            return False
        self._conn, self._seq, self._ack_seq, self._proven = sock, 1, 0, False
        return True

    def _open(self, sock: socket.socket) -> bool:
        """Connect `sock` and derive the connection's keys; False: no receiver of
        this uid is bound (yet)."""
        try:
            sock.connect(socket_address(self._dir_fd, f"{self.name}.sock"))
        except (ConnectionRefusedError, FileNotFoundError):  # not bound (any more)
            self._unreachable()
            return False
        uid = peer_uid(sock)
        if uid != os.getuid():  # only root could have bound it; never hand it results
            self._trouble("uid", OSError(errno.EACCES, f"receiver runs as uid {uid}"))
            return False
        # Read after connecting: the receiver wrote its epoch before it bound, and a
        # newer one can only exist once this connection's receiver closed (then the
        # connection fails and the results stay queued).
        epoch = read_epoch(self._dir_fd, self.name)
        if epoch is None:
            return False
        try:  # read again: the receiver makes a new key when it restarts
            secret = load_secret(self._dir_fd, self.name)
        except FileNotFoundError:  # its receiver closed meanwhile
            return False
        except ValueError as e:
            raise OSError(errno.EINVAL, str(e)) from None
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._key = connection_key(secret, epoch, self._nonce)
        self._ack_key = ack_key(secret, epoch, self._nonce)
        self._epoch = epoch
        return True

    def _unreachable(self) -> None:
        if not self._warned_unreachable:
            log.warning(
                "results channel %r: no scheduler bound yet; rank %d keeps its "
                "results and retries",
                self.name,
                self.rank,
            )
            self._warned_unreachable = True

    def _trouble(self, what: str, e: OSError) -> None:
        """Count and log (rate-limited) a failure; the results stay queued."""
        self._errors += 1
        self._last_error = f"{what}: {e}"
        self._log(
            what,
            "results channel %r, rank %d: %s failed (%s); results kept",
            self.name,
            self.rank,
            what,
            e,
        )

    def _disconnect(self) -> None:
        """Drop the connection; what it did not acknowledge goes again on the next."""
        if self._conn is not None:
            self._conn.close()
        self._conn, self._key, self._ack_key, self._nonce = None, b"", b"", b""
        self._proven = False
        if self._inflight:
            self._resent += len(self._inflight)
            self._unsent.extendleft(reversed(self._inflight))
            self._inflight.clear()

    def stats(self) -> SenderStats:
        return SenderStats(
            self._sent,
            self.pending,
            self._dropped,
            self._resent,
            self._errors,
            self._last_error,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Try once more to send what is queued and read what was acknowledged, then
        close (idempotent). What is not acknowledged by then is logged: results
        already sent may still be applied, the rest is lost."""
        if self._closed:
            return
        left = self.flush()
        if left:
            log.error(
                "results channel %r, rank %d: closed with %d results not acknowledged "
                "(%d of them sent)",
                self.name,
                self.rank,
                left,
                len(self._inflight),
            )
        self._disconnect()
        self._closed = True
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        OPEN_ENDS.discard(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: leave the parent's connection (and its sequence
        numbers) and the parent's queued results alone (the parent delivers them);
        this copy connects afresh when it sends, under a stream of its own."""
        self._conn, self._key, self._ack_key, self._nonce = None, b"", b"", b""
        self._proven = False
        self._stream = secrets.token_bytes(STREAM_BYTES)
        self._inflight.clear()
        self._unsent.clear()


__all__ = ["ResultsSender", "SenderStats"]
