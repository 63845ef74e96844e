"""What the channel's two ends (`receiver.py`, `sender.py`) share: the peer's uid
as the kernel reports it, logging about peers that a peer cannot flood, and the
register of open ends a forked child drops.

Nothing relies on finalizers: a process forked from the scheduler (or a worker)
drops its inherited copies of every open end at once, so it never keeps the
channel's name nor speaks on its parent's connection.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
import weakref
from typing import Protocol

_CREDS = struct.Struct("iII")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of the connected AF_UNIX `sock`
    (SO_PEERCRED: from the kernel, not from anything the peer says)."""
    _, uid, _ = _CREDS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    )
    return uid


class LogLimiter:
    """At most `burst` lines per `interval_s` per kind on `logger`, at ERROR; the next
    line allowed says how many were suppressed."""

    def __init__(
        self, logger: logging.Logger, burst: int = 5, interval_s: float = 10.0
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self._window: dict[str, tuple[float, int, int]] = {}  # start, logged, suppressed

    def __call__(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        start, logged, suppressed = self._window.get(kind, (now, 0, 0))
        if now - start >= self.interval_s:
            start, logged = now, 0
        if logged >= self.burst:
            self._window[kind] = (start, logged, suppressed + 1)
            return
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self.logger.error(msg, *args)
        self._window[kind] = (start, logged + 1, 0)


class _End(Protocol):
    def _forget_after_fork(self) -> None: ...


OPEN_ENDS: weakref.WeakSet[_End] = weakref.WeakSet()
"""Every receiver and sender not yet closed (each adds itself when it opens and
discards itself when it closes)."""


def _after_fork_in_child() -> None:
    for end in list(OPEN_ENDS):
        end._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["OPEN_ENDS", "LogLimiter", "peer_uid"]
