"""The byte mover under prefill/decode transfers: one interface over existing engines.

A transport moves bytes from memory registered on one side into memory registered
on the other, and carries small notices. It knows nothing of blocks, layers,
requests or trust: `fastkv.pd` builds those on top, and trusts nothing a transport
delivers (notices are authenticated, landed blocks are checksummed there).

Implementations: Mooncake Transfer Engine (TCP here, RDMA where the hardware has
it) and an in-process transport for deterministic fault tests.

Contract (every implementation):
- `register` a region once, before any write touches it; writes outside a region
  registered on both sides are refused (`TransportError`), never partly applied
  by the transport's own choice.
- `write` starts a batch of pieces and returns at once; the handle settles to
  DONE (every byte landed) or FAILED (some may have landed: the receiver must not
  trust any of them without a completion notice). A handle never stays PENDING
  past the transport's own timeout. Once DONE no byte of its batch lands any more;
  a FAILED one's bytes may still (a transport gives a batch up, not the bytes
  already on the wire). The receiver's fence: `fastkv.pd.decode` frees a block
  when the writer's notice says its handles all settled DONE (done, or stopped),
  else a grace longer than this timeout after its deadline.
- A transport whose DONE means only "sent", not "applied at the peer", says so
  with a false `done_means_applied` attribute (absent: true): a sender's stopped
  notice then goes as failed, so the receiver holds the blocks to its grace.
- `notify` delivers a payload to the peer's `poll_notices`, at most once, in any
  order relative to other notices, or raises `TransportError`; it may also be lost
  silently (a dead peer): senders and receivers keep their own deadlines.
- Nothing here blocks longer than its `timeout_s`.
- A transport that can read and write GPU memory (registered device pointers)
  says so with a true `device_memory` attribute; one without it is given host
  memory only (`check_transport_memory`: the senders and receivers refuse a GPU
  layout over it, since it would dereference device pointers on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

MAX_TIMEOUT_S = 3600.0


class TransportError(RuntimeError):
    """A transport refused or could not start an operation; the message says why."""


def check_timeout(field: str, value: float) -> float:
    """`value` as seconds in (0, MAX_TIMEOUT_S]; TransportError naming `field` else."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT_S
    ):
        raise TransportError(f"{field}={value!r}: must be a number in (0, {MAX_TIMEOUT_S}] s")
    return float(value)


def check_transport_memory(transport: object, device: int | None) -> None:
    """Refuse GPU memory (`device` a CUDA ordinal) over a transport that does not
    declare `device_memory`; host memory (None) goes over any.

    Raises:
        ValueError: naming the transport and the device."""
    if device is not None and not getattr(transport, "device_memory", False):
        raise ValueError(
            f"layout.device: {device}: {type(transport).__name__} moves host memory "
            "only (no device_memory); GPU caches need a transport that reads and "
            "writes GPU memory (Mooncake TE's CUDA wheel)"
        )


class WriteState(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Piece:
    """Copy `length` bytes from local address `src` to the peer's address `dst`."""

    src: int
    dst: int
    length: int


class WriteHandle(Protocol):
    def state(self) -> WriteState:
        """The batch's state now; never blocks."""
        ...

    def wait(self, timeout_s: float) -> WriteState:
        """Block at most `timeout_s` for the batch to settle; returns its state."""
        ...


class PDTransport(Protocol):
    @property
    def address(self) -> str:
        """Where peers reach this end ("host:port"), as given to `write`/`notify`."""
        ...

    def register(self, addr: int, length: int) -> None:
        """Make `[addr, addr+length)` readable by local writes and writable by peers."""
        ...

    def write(self, peer: str, pieces: Sequence[Piece]) -> WriteHandle:
        """Start writing `pieces` into `peer`'s registered memory; returns at once.

        Raises:
            TransportError: the peer is unknown or unreachable, or a piece lies
                outside a registered region; nothing was started.
        """
        ...

    def notify(self, peer: str, payload: bytes, timeout_s: float) -> None:
        """Deliver `payload` to `peer`'s `poll_notices` (raises TransportError)."""
        ...

    def poll_notices(self) -> list[tuple[str, bytes]]:
        """The notices received since the last call, as (sender address, payload);
        the sender address is what the transport says, not proof of anything."""
        ...

    def close(self, timeout_s: float | None = None) -> bool:
        """Release the transport; later calls raise TransportError. Returns True
        once no write of this end reads or writes registered memory any more (it
        may be freed), False if one still does at `timeout_s` (the transport's own
        bound when None): call again before freeing that memory."""
        ...
