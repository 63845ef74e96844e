"""Sealed frames: how a payload travels on one connection so that only holders of
the deployment's secret can speak, and nothing recorded can be replayed.

A frame is magic, the connection's random nonce, a sequence number, the sender's
stream id and the stream index of the frame's first result (`Frame`), the payload
(`fastkv.channel.protocol`) and an HMAC-SHA256 over all of it, under a key derived
from the deployment secret, the receiver's epoch (random per receiver, published
in its lock file) and that nonce. Each direction has its own key: workers seal
results with `connection_key`, the receiver seals its acknowledgements with
`ack_key` (so a frame of one direction never verifies in the other, and an
acknowledgement proves the receiver holds the secret and the epoch). A frame that
fails the check closes its connection. A recorded frame cannot be replayed to
another receiver (another epoch), on another connection (the receiver accepts a
nonce once) or again on its own (sequence numbers). A frame is at most
MAX_FRAME_BYTES, checked before anything else is read.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

from fastkv.channel.protocol import MAX_PAYLOAD_BYTES

NONCE_BYTES = 16
STREAM_BYTES = 8
NO_STREAM = bytes(STREAM_BYTES)
# magic, connection nonce, sequence, sender's stream, stream index of the first result
_FRAME_HEAD = struct.Struct(f"!4s{NONCE_BYTES}sQ{STREAM_BYTES}sQ")
_FRAME_MAGIC = b"FKR3"
_MAC_BYTES = 32
HEAD_BYTES = _FRAME_HEAD.size
MAC_BYTES = _MAC_BYTES
MAX_FRAME_BYTES = 1 << 16
assert _FRAME_HEAD.size + MAX_PAYLOAD_BYTES + _MAC_BYTES <= MAX_FRAME_BYTES
_KEY_LABEL = b"fastkv-results-v3\0"
_ACK_LABEL = b"fastkv-results-ack-v3\0"


class Frame(NamedTuple):
    """A verified frame's head fields and payload."""

    seq: int
    payload: bytes
    stream: bytes = NO_STREAM
    """The sending worker's stream id (random per sender; results are numbered in
    it across reconnections, so a resent result is recognised)."""
    first: int = 0
    """The stream index of the payload's first result (the next ones follow)."""


def connection_key(secret: bytes, epoch: bytes, nonce: bytes) -> bytes:
    """The MAC key of a connection's worker-to-receiver frames: the secret bound to
    the receiver's epoch and the connection's nonce."""
    return hmac.new(secret, _KEY_LABEL + epoch + nonce, hashlib.sha256).digest()


def ack_key(secret: bytes, epoch: bytes, nonce: bytes) -> bytes:
    """The MAC key of a connection's receiver-to-worker frames (acknowledgements):
    only a receiver holding the secret and the epoch can make it."""
    return hmac.new(secret, _ACK_LABEL + epoch + nonce, hashlib.sha256).digest()


def seal(
    key: bytes,
    nonce: bytes,
    seq: int,
    payload: bytes,
    *,
    stream: bytes = NO_STREAM,
    first: int = 0,
) -> bytes:
    """One message on a connection: the head (magic, nonce, sequence number, stream,
    first index), payload, HMAC (`key`: `connection_key` or `ack_key`)."""
    head = _FRAME_HEAD.pack(_FRAME_MAGIC, nonce, seq, stream, first)
    return head + payload + hmac.new(key, head + payload, hashlib.sha256).digest()


def frame_nonce(frame: bytes) -> bytes:
    """The connection nonce a message claims (not yet verified).

    Raises:
        ValueError: too short or too long to be a message.
    """
    low, high = _FRAME_HEAD.size + _MAC_BYTES, MAX_FRAME_BYTES
    if not low <= len(frame) <= high:
        raise ValueError(f"message: {len(frame)} bytes, must be in [{low}, {high}]")
    magic, nonce, *_ = _FRAME_HEAD.unpack_from(frame)
    if magic != _FRAME_MAGIC:
        raise ValueError(f"message: magic {magic!r}, expected {_FRAME_MAGIC!r}")
    return nonce


def unseal(key: bytes, frame: bytes) -> Frame:
    """The head fields and payload of a message sealed with `key`.

    Raises:
        ValueError: not a message, or the MAC does not verify.
    """
    frame_nonce(frame)
    body, mac = frame[:-_MAC_BYTES], frame[-_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise ValueError("message: MAC does not verify (wrong secret, forged or altered)")
    _, _, seq, stream, first = _FRAME_HEAD.unpack_from(body)
    return Frame(seq, body[_FRAME_HEAD.size :], stream, first)


__all__ = [
    "HEAD_BYTES",
    "MAC_BYTES",
    "MAX_FRAME_BYTES",
    "NONCE_BYTES",
    "NO_STREAM",
    "STREAM_BYTES",
    "Frame",
    "ack_key",
    "connection_key",
    "frame_nonce",
    "seal",
    "unseal",
]
