"""The collective the engine's tensor-parallel worker ranks share: an all-gather over
a full mesh of socket pairs (a real engine would use NCCL; the demo needs only two
small exchanges per layer and has no GPU to run NCCL on).

Every operation is bounded. A send or receive that does not finish within `timeout`
seconds raises TimeoutError; a peer whose process exited closes its end of the
socket, so waiting on it raises PeerLostError at once; and every exchange carries
a sequence number and a kind, so ranks that fell out of step (one skipped an
exchange the others ran) raise RankDivergedError instead of mixing data of
different layers or hanging.

Pairs are served in the same global order on every rank (by the lower rank of the
pair, then the higher; the lower one sends first), so an exchange completes even
when a payload is larger than the socket buffers.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Mapping

_HEADER = struct.Struct("<QBQ")  # sequence number, kind, payload bytes
_AGREE, _GATHER = 1, 2
_KINDS = {_AGREE: "agree", _GATHER: "all_gather"}


class PeerLostError(RuntimeError):
    """A peer rank closed its end of the connection (its process exited or failed)."""


class RankDivergedError(RuntimeError):
    """A peer ran a different exchange than this rank: the ranks took different paths."""


class RankGroup:
    """This rank's end of the group.

    Args:
        rank: this rank, in [0, size).
        size: number of ranks, >= 1.
        peers: one connected socket per other rank (see `mesh`); owned by the group
            from now on (closed by `close`).
        timeout: bound on every exchange, in seconds (> 0).

    Raises:
        ValueError: an argument out of range, or `peers` not exactly the other ranks.
    """

    def __init__(
        self, rank: int, size: int, peers: Mapping[int, socket.socket], timeout: float
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: must be an int >= 1, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank: must be an int in [0, {size}), got {rank!r}")
        if set(peers) != set(range(size)) - {rank}:
            raise ValueError(
                f"peers: must hold one socket for each other rank "
                f"{sorted(set(range(size)) - {rank})}, got ranks {sorted(peers)}"
            )
        if not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout!r}")
        self.rank = rank
        self.size = size
        self.timeout = float(timeout)
        self._peers = dict(sorted(peers.items()))
        self._seq = 0

    @staticmethod
    def mesh(size: int) -> list[dict[int, socket.socket]]:
        """Connected socket pairs between every two of `size` ranks: entry r holds
        rank r's sockets, keyed by peer. Hand entry r to rank r's process and close
        the launcher's copies once the processes are started (otherwise a dead
        peer's socket stays open and its exit goes unnoticed until the timeout)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: must be an int >= 1, got {size!r}")
        ends: list[dict[int, socket.socket]] = [{} for _ in range(size)]
        for low in range(size):
            for high in range(low + 1, size):
                ends[low][high], ends[high][low] = socket.socketpair()
        return ends

    def all_gather(self, payload: bytes | bytearray | memoryview) -> list[bytes | bytearray]:
        """Every rank's payload, in rank order (this rank's own one included).

        Raises:
            TimeoutError, PeerLostError, RankDivergedError: see the module docstring.
        """
        return self._exchange(_GATHER, payload)

    def agree(self, ok: bool) -> bool:
        """True when every rank passed True: one collective decision, so every rank
        takes the same path afterwards.

        Raises:
            TimeoutError, PeerLostError, RankDivergedError: see the module docstring.
        """
        return all(
            flag == b"\x01" for flag in self._exchange(_AGREE, b"\x01" if ok else b"\x00")
        )

    def close(self) -> None:
        """Close every peer socket (the peers' next wait on this rank raises)."""
        for sock in self._peers.values():
            sock.close()

    def _exchange(
        self, kind: int, payload: bytes | bytearray | memoryview
    ) -> list[bytes | bytearray]:
        seq = self._seq
        self._seq += 1
        out: list[bytes | bytearray] = [b""] * self.size
        out[self.rank] = payload if isinstance(payload, (bytes, bytearray)) else bytes(payload)
        if self.size == 1:
            return out
        deadline = time.monotonic() + self.timeout
        for peer, sock in self._peers.items():
            if self.rank < peer:  # the lower rank of a pair sends first
                self._send(peer, sock, seq, kind, payload, deadline)
                out[peer] = self._recv(peer, sock, seq, kind, deadline)
            else:
                out[peer] = self._recv(peer, sock, seq, kind, deadline)
                self._send(peer, sock, seq, kind, payload, deadline)
        return out

    def _send(
        self,
        peer: int,
        sock: socket.socket,
        seq: int,
        kind: int,
        payload: bytes | bytearray | memoryview,
        deadline: float,
    ) -> None:
        try:
            sock.settimeout(self._left(peer, deadline))
            sock.sendall(_HEADER.pack(seq, kind, len(payload)))
            sock.sendall(payload)
        except TimeoutError as e:
            raise TimeoutError(
                f"rank {self.rank}: rank {peer} took no data for {self.timeout:.0f} s "
                f"({_KINDS[kind]} #{seq})"
            ) from e
        except OSError as e:  # broken pipe, reset: the peer is gone
            raise PeerLostError(
                f"rank {self.rank}: rank {peer} is gone ({_KINDS[kind]} #{seq}: {e})"
            ) from e

    def _recv(
        self, peer: int, sock: socket.socket, seq: int, kind: int, deadline: float
    ) -> bytearray:
        header = self._read(peer, sock, _HEADER.size, seq, kind, deadline)
        their_seq, their_kind, nbytes = _HEADER.unpack(header)
        if (their_seq, their_kind) != (seq, kind):
            raise RankDivergedError(
                f"rank {self.rank} runs {_KINDS[kind]} #{seq} but rank {peer} sent "
                f"{_KINDS.get(their_kind, their_kind)} #{their_seq}: the ranks took "
                "different paths"
            )
        return self._read(peer, sock, nbytes, seq, kind, deadline)

    def _read(
        self, peer: int, sock: socket.socket, nbytes: int, seq: int, kind: int, deadline: float
    ) -> bytearray:
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            try:
                sock.settimeout(self._left(peer, deadline))
                n = sock.recv_into(view[got:])
            except TimeoutError as e:
                raise TimeoutError(
                    f"rank {self.rank}: no data from rank {peer} in {self.timeout:.0f} s "
                    f"({_KINDS[kind]} #{seq})"
                ) from e
            except OSError as e:
                raise PeerLostError(
                    f"rank {self.rank}: rank {peer} is gone ({_KINDS[kind]} #{seq}: {e})"
                ) from e
            if n == 0:
                raise PeerLostError(
                    f"rank {self.rank}: rank {peer} closed its connection "
                    f"({_KINDS[kind]} #{seq}); its process exited or failed"
                )
            got += n
        return buf

    def _left(self, peer: int, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"rank {self.rank}: exchange with rank {peer} not done in {self.timeout:.0f} s"
            )
        return left
