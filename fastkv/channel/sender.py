"""A worker rank's end of the channel: sends its results to the receiver of this
user only, and keeps what cannot go yet.

- **Who.** At connect the sender checks the receiver's uid from the kernel
  (SO_PEERCRED), so results never go to a squatter; it reads the receiver's epoch
  and the secret again at every connect (a restarted receiver has new ones) and
  seals every message under a fresh connection key (`fastkv.channel.frames`).
- **Delivery.** Each rank sends `(rank, [TransferResult | LookupResult, ...])`
  (`ResultsSender.send`); what it cannot deliver yet (scheduler not bound, queue
  full, connection lost) stays queued up to a bound and goes with the next send or
  `flush`. Nothing blocks. A process forked from a worker starts afresh: it never
  speaks on its parent's connection.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fastkv.channel.ends import OPEN_ENDS, LogLimiter, peer_uid
from fastkv.channel.frames import NONCE_BYTES, connection_key, seal
from fastkv.channel.private_dir import (
    check_name,
    env_secret,
    load_secret,
    open_private_dir,
    read_epoch,
    runtime_dir,
    socket_address,
)
from fastkv.channel.protocol import RESULTS_PER_DATAGRAM, Result, encode
from fastkv.config import check_int
from fastkv.metadata import TransferResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SenderStats:
    sent: int
    """Results delivered to the receiver's socket."""
    pending: int
    """Results waiting for the receiver (not bound yet, or its queue was full)."""
    dropped: int
    """Results dropped because more than `max_pending` were waiting."""


class ResultsSender:
    """A worker rank's end: sends its results, keeping what cannot go yet.

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
        self._pending: deque[TransferResult] = deque()
        self._sent = self._dropped = 0
        self._log = LogLimiter(log)
        self._conn: socket.socket | None = None
        self._key = self._nonce = b""
        self._seq = 0
        self._warned_unreachable = False
        self._closed = False
        env_secret()  # a bad variable fails here, not at every send
        self._secret = b""  # read at every connect (the receiver makes it)
        self._dir_fd = open_private_dir(self.directory)
        OPEN_ENDS.add(self)

    def send(self, results: Iterable[Result]) -> int:
        """Queue `results` and send everything queued that the receiver takes now.

        Returns:
            How many results are still waiting.

        Raises:
            TypeError: an entry is neither a TransferResult nor a LookupResult.
            ValueError: an id, failed position or hit count the wire format cannot
                hold. Nothing is queued when it raises.
        """
        results = list(results)
        encode(self.rank, results)  # checks every entry before anything is queued
        self._pending.extend(results)
        overflow = len(self._pending) - self.max_pending
        if overflow > 0:
            for _ in range(overflow):
                self._pending.popleft()
            self._dropped += overflow
            log.error(
                "results channel %r, rank %d: dropped the %d oldest undelivered results "
                "(the scheduler has not read them; their blocks stay reserved)",
                self.name,
                self.rank,
                overflow,
            )
        return self.flush()

    def _connect(self) -> bool:
        """Connect and check the receiver is this uid; False: not reachable yet."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            sock.connect(socket_address(self._dir_fd, f"{self.name}.sock"))
            uid = peer_uid(sock)
        except (BlockingIOError, InterruptedError):  # its backlog is full
            sock.close()
            return False
        except (ConnectionRefusedError, FileNotFoundError):  # not bound (any more)
            sock.close()
            if not self._warned_unreachable:
                log.warning(
                    "results channel %r: no scheduler bound yet; rank %d keeps its "
                    "results and retries",
                    self.name,
                    self.rank,
                )
                self._warned_unreachable = True
            return False
        except OSError as e:
            sock.close()
            self._log(
                "connect",
                "results channel %r, rank %d: connect failed: %s",
                self.name,
                self.rank,
                e,
            )
            return False
        if uid != os.getuid():  # only root could have bound it; never hand it results
            sock.close()
            self._log(
                "uid",
                "results channel %r, rank %d: receiver runs as uid %d, not "
                "this uid; results kept",
                self.name,
                self.rank,
                uid,
            )
            return False
        # Read after connecting: the receiver wrote its epoch before it bound, and a
        # newer one can only exist once this connection's receiver closed (then the
        # send fails and the results stay queued).
        try:
            epoch = read_epoch(self._dir_fd, self.name)
        except OSError as e:
            sock.close()
            self._log("epoch", "results channel %r, rank %d: %s", self.name, self.rank, e)
            return False
        if epoch is None:
            sock.close()
            return False
        try:  # read again: the receiver makes a new key when it restarts
            self._secret = load_secret(self._dir_fd, self.name)
        except FileNotFoundError:  # its receiver closed meanwhile
            sock.close()
            return False
        except (OSError, ValueError) as e:
            sock.close()
            self._log("secret", "results channel %r, rank %d: %s", self.name, self.rank, e)
            return False
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._key = connection_key(self._secret, epoch, self._nonce)
        self._conn, self._seq = sock, 0
        return True

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._key, self._nonce = None, b"", b""

    def flush(self) -> int:
        """Send what is queued, oldest first, until the receiver stops taking.
        Never blocks.

        Returns:
            How many results are still waiting.
        """
        pending = self._pending
        while pending and not self._closed:
            if self._conn is None and not self._connect():
                break
            assert self._conn is not None
            batch = [pending[i] for i in range(min(RESULTS_PER_DATAGRAM, len(pending)))]
            (payload,) = encode(self.rank, batch)
            try:
                self._conn.send(seal(self._key, self._nonce, self._seq, payload))
            except (BlockingIOError, InterruptedError):  # the receiver's queue is full
                break
            except OSError as e:  # the receiver closed: reconnect at the next flush
                self._log(
                    "send",
                    "results channel %r, rank %d: connection lost (%s); results kept",
                    self.name,
                    self.rank,
                    e,
                )
                self._disconnect()
                break
            self._seq += 1
            for _ in batch:
                pending.popleft()
            self._sent += len(batch)
            self._warned_unreachable = False
        return len(pending)

    def stats(self) -> SenderStats:
        return SenderStats(self._sent, len(self._pending), self._dropped)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Try once more to send what is queued, then close (idempotent; what is left
        is lost, and logged)."""
        if self._closed:
            return
        left = self.flush()
        if left:
            log.error(
                "results channel %r, rank %d: closed with %d undelivered results",
                self.name,
                self.rank,
                left,
            )
        self._disconnect()
        self._closed = True
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        OPEN_ENDS.discard(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: leave the parent's connection (and its sequence
        numbers) alone; this copy connects afresh when it sends."""
        self._conn, self._key, self._nonce = None, b"", b""


__all__ = ["ResultsSender", "SenderStats"]
