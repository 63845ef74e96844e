"""Transfer results from every worker rank back to the scheduler, over one local
datagram socket.

An engine whose scheduler and workers are separate processes on one host (FastDeploy)
has no return path for copy results: FastDeploy v1 drops them, so a failed load can
never be recomputed. This channel is that path:

- the scheduler binds an AF_UNIX SOCK_DGRAM socket in the abstract namespace,
  `"\\0fastkv-results-" + name` (no file to clean up, gone when the process exits),
  and polls it without blocking (`ResultsReceiver.poll`);
- each worker rank sends `(rank, [TransferResult, ...])` datagrams to it
  (`ResultsSender.send`); results it cannot deliver yet (the scheduler is not bound,
  or its queue is full) stay queued, up to a bound, and go with the next send or
  `flush`;
- the receiver combines the ranks' reports with `fastkv.tp.RankResults`: a transfer
  comes out once every rank has reported it, successful only if all succeeded.

Wire format: JSON `{"v": 1, "rank": r, "results": [[transfer_id, success, error],
...]}`, never pickle: an abstract socket has no file permissions, so any local
process can send to it, and unpickling would run the sender's code. The receiver
also takes the sender's credentials from the kernel (SCM_CREDENTIALS) and drops
datagrams from other users. Malformed or foreign datagrams are counted and dropped,
never raised into the scheduler loop.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fastkv.config import check_int
from fastkv.metadata import TransferResult
from fastkv.tp import RankResults

log = logging.getLogger(__name__)

ADDRESS_PREFIX = "fastkv-results-"
# sun_path holds 108 bytes; the abstract namespace spends one on the leading NUL.
MAX_NAME_BYTES = 107 - len(ADDRESS_PREFIX)
WIRE_VERSION = 1
# 32 results with errors of 300 characters fit 64 KiB even if every character is
# JSON-escaped to 6 bytes.
RESULTS_PER_DATAGRAM = 32
MAX_ERROR_CHARS = 300
MAX_DATAGRAM_BYTES = 1 << 16
_CREDS = struct.Struct("iII")  # struct ucred: pid, uid, gid


def channel_address(name: str) -> bytes:
    """The abstract socket address of channel `name`.

    Raises:
        ValueError: `name` is empty, too long, or holds a NUL or non-printable
            character.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
    raw = name.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"name: {len(raw)} bytes, at most {MAX_NAME_BYTES} fit an address")
    if not name.isprintable():
        raise ValueError(f"name: {name!r} holds a non-printable character")
    return b"\0" + ADDRESS_PREFIX.encode() + raw


def encode(rank: int, results: Iterable[TransferResult]) -> list[bytes]:
    """The datagrams carrying one rank's results (errors cut to MAX_ERROR_CHARS)."""
    rows = [[r.transfer_id, r.success, r.error[:MAX_ERROR_CHARS]] for r in results]
    return [
        json.dumps(
            {"v": WIRE_VERSION, "rank": rank, "results": rows[i : i + RESULTS_PER_DATAGRAM]},
            separators=(",", ":"),
        ).encode()
        for i in range(0, len(rows), RESULTS_PER_DATAGRAM)
    ]


def decode(data: bytes) -> tuple[int, list[TransferResult]]:
    """One datagram back into (rank, results).

    Raises:
        ValueError: not a datagram of this format (the message says what is wrong).
    """
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"datagram: not JSON ({e})") from None
    if not isinstance(message, dict) or message.get("v") != WIRE_VERSION:
        raise ValueError(f"datagram: not a version {WIRE_VERSION} results message")
    rank, rows = message.get("rank"), message.get("results")
    if type(rank) is not int or not isinstance(rows, list):
        raise ValueError("datagram: rank must be an int and results a list")
    results = []
    for i, row in enumerate(rows):
        if (
            not isinstance(row, list)
            or len(row) != 3
            or type(row[0]) is not int
            or type(row[1]) is not bool
            or not isinstance(row[2], str)
        ):
            raise ValueError(f"datagram: results[{i}] is not [int, bool, str]")
        results.append(TransferResult(row[0], row[1], row[2]))
    return rank, results


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    datagrams: int
    results: int
    """Per-rank results accepted."""
    combined: int
    """Transfers every rank has reported (what `poll` returned)."""
    rejected_datagrams: int
    """Malformed, oversized, or from another user."""
    rejected_results: int
    """A rank out of range, or a transfer a rank reported twice."""


class ResultsReceiver:
    """The scheduler's end: binds the channel and combines the ranks' results.

    Args:
        name: the channel name, shared with every worker (see `channel_address`).
        tp_size: how many ranks report each transfer.
        same_user_only: drop datagrams sent by another user id.

    Raises:
        ValueError: a bad name or tp_size.
        OSError: the address is taken (another scheduler with the same name runs);
            the message names the channel.
    """

    def __init__(self, name: str, tp_size: int, *, same_user_only: bool = True) -> None:
        address = channel_address(name)
        self.name = name
        self._ranks = RankResults(tp_size)
        self.tp_size = tp_size
        self._uid = os.getuid() if same_user_only else None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(address)
        except OSError as e:
            sock.close()
            raise OSError(
                e.errno,
                f"results channel {name!r}: cannot bind ({e.strerror}); is another "
                "scheduler using this name? Set FASTKV_RESULTS_CHANNEL to tell them apart",
            ) from None
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._datagrams = self._results = self._combined = 0
        self._bad_datagrams = self._bad_results = 0

    def poll(self) -> list[TransferResult]:
        """Read every datagram waiting (never blocks); return the transfers that
        every rank has now reported, combined."""
        sock = self._sock
        if sock is None:
            return []
        done: list[TransferResult] = []
        cmsg_space = socket.CMSG_SPACE(_CREDS.size)
        while True:
            try:
                data, ancillary, flags, _ = sock.recvmsg(MAX_DATAGRAM_BYTES, cmsg_space)
            except (BlockingIOError, InterruptedError):
                break
            self._datagrams += 1
            if flags & socket.MSG_TRUNC or not self._from_allowed_user(ancillary):
                self._bad_datagrams += 1
                log.error(
                    "results channel %r: dropped a truncated or foreign datagram", self.name
                )
                continue
            try:
                rank, results = decode(data)
            except ValueError as e:
                self._bad_datagrams += 1
                log.error("results channel %r: dropped a datagram: %s", self.name, e)
                continue
            for result in results:  # one at a time: a bad one spoils no other
                try:
                    combined = self._ranks.add(rank, [result])
                except ValueError as e:
                    self._bad_results += 1
                    log.error("results channel %r: dropped a result: %s", self.name, e)
                    continue
                self._results += 1
                done += combined
        self._combined += len(done)
        return done

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
        )

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _from_allowed_user(self, ancillary: list[tuple[int, int, bytes]]) -> bool:
        if self._uid is None:
            return True
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                _, uid, _ = _CREDS.unpack(data[: _CREDS.size])
                return uid == self._uid
        return False


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
        name: the channel name (see `channel_address`).
        rank: this worker's tensor-parallel rank.
        max_pending: results kept while the receiver is unreachable; past it the
            oldest are dropped (logged and counted): the scheduler then never
            frees those transfers' blocks, which loses capacity, never data.

    Raises:
        ValueError: a bad name, rank or max_pending.
    """

    def __init__(self, name: str, rank: int, *, max_pending: int = 1 << 16) -> None:
        self._address = channel_address(name)
        check_int("rank", rank, 0)
        check_int("max_pending", max_pending, 1)
        self.name = name
        self.rank = rank
        self.max_pending = max_pending
        self._pending: deque[TransferResult] = deque()
        self._sent = self._dropped = 0
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._warned_unreachable = False

    def send(self, results: Iterable[TransferResult]) -> int:
        """Queue `results` and send everything queued that the receiver takes now.

        Returns:
            How many results are still waiting.

        Raises:
            TypeError: an entry is not a TransferResult (nothing is queued).
        """
        results = list(results)
        for r in results:
            if not isinstance(r, TransferResult):
                raise TypeError(f"results: expected TransferResult, got {r!r:.80}")
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

    def flush(self) -> int:
        """Send what is queued, oldest first, until the receiver stops taking.

        Returns:
            How many results are still waiting.
        """
        sock = self._sock
        pending = self._pending
        while pending and sock is not None:
            batch = [pending[i] for i in range(min(RESULTS_PER_DATAGRAM, len(pending)))]
            (datagram,) = encode(self.rank, batch)
            try:
                sock.sendto(datagram, self._address)
            except (BlockingIOError, InterruptedError):  # the receiver's queue is full
                break
            except (ConnectionRefusedError, FileNotFoundError):  # not bound yet
                if not self._warned_unreachable:
                    log.warning(
                        "results channel %r: no scheduler bound yet; rank %d keeps its "
                        "results and retries",
                        self.name,
                        self.rank,
                    )
                    self._warned_unreachable = True
                break
            except OSError as e:  # e.g. no buffer space: keep them for the next flush
                log.error(
                    "results channel %r, rank %d: send failed: %s", self.name, self.rank, e
                )
                break
            for _ in batch:
                pending.popleft()
            self._sent += len(batch)
        return len(pending)

    def stats(self) -> SenderStats:
        return SenderStats(self._sent, len(self._pending), self._dropped)

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Try once more to send what is queued, then close (what is left is lost,
        and logged)."""
        if self._sock is None:
            return
        left = self.flush()
        if left:
            log.error(
                "results channel %r, rank %d: closed with %d undelivered results",
                self.name,
                self.rank,
                left,
            )
        self._sock.close()
        self._sock = None


__all__ = [
    "ADDRESS_PREFIX",
    "ReceiverStats",
    "ResultsReceiver",
    "ResultsSender",
    "SenderStats",
    "channel_address",
    "decode",
    "encode",
]
