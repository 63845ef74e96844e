"""Sealed frames: how a payload travels on one connection so that only holders of
the deployment's secret can speak, and nothing recorded can be replayed.

A frame is magic, the connection's random nonce, a sequence number, the payload
(`fastkv.channel.protocol`) and an HMAC-SHA256 over all of it, under a key derived
from the deployment secret, the receiver's epoch (random per receiver, published
in its lock file) and that nonce (`connection_key`). A frame that fails the check
closes its connection. A recorded frame cannot be replayed to another receiver
(another epoch), on another connection (the receiver accepts a nonce once) or
again on its own (sequence numbers). A frame is at most MAX_FRAME_BYTES, checked
before anything else is read.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from fastkv.channel.protocol import MAX_PAYLOAD_BYTES

NONCE_BYTES = 16
_FRAME_HEAD = struct.Struct(f"!4s{NONCE_BYTES}sQ")  # magic, connection nonce, sequence
_FRAME_MAGIC = b"FKR2"
_MAC_BYTES = 32
MAX_FRAME_BYTES = 1 << 16
assert _FRAME_HEAD.size + MAX_PAYLOAD_BYTES + _MAC_BYTES <= MAX_FRAME_BYTES
_KEY_LABEL = b"fastkv-results-v2\0"


def connection_key(secret: bytes, epoch: bytes, nonce: bytes) -> bytes:
    """The MAC key of one connection: the secret bound to the receiver's epoch and the
    connection's nonce."""
    return hmac.new(secret, _KEY_LABEL + epoch + nonce, hashlib.sha256).digest()


def seal(key: bytes, nonce: bytes, seq: int, payload: bytes) -> bytes:
    """One message on a connection: magic, nonce, sequence number, payload, HMAC
    (`key` = connection_key(secret, epoch, nonce))."""
    head = _FRAME_HEAD.pack(_FRAME_MAGIC, nonce, seq)
    return head + payload + hmac.new(key, head + payload, hashlib.sha256).digest()


def frame_nonce(frame: bytes) -> bytes:
    """The connection nonce a message claims (not yet verified).

    Raises:
        ValueError: too short or too long to be a message.
    """
    low, high = _FRAME_HEAD.size + _MAC_BYTES, MAX_FRAME_BYTES
    if not low <= len(frame) <= high:
        raise ValueError(f"message: {len(frame)} bytes, must be in [{low}, {high}]")
    magic, nonce, _ = _FRAME_HEAD.unpack_from(frame)
    if magic != _FRAME_MAGIC:
        raise ValueError(f"message: magic {magic!r}, expected {_FRAME_MAGIC!r}")
    return nonce


def unseal(key: bytes, frame: bytes) -> tuple[int, bytes]:
    """(sequence number, payload) of a message sealed with `key`.

    Raises:
        ValueError: not a message, or the MAC does not verify.
    """
    frame_nonce(frame)
    body, mac = frame[:-_MAC_BYTES], frame[-_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise ValueError("message: MAC does not verify (wrong secret, forged or altered)")
    _, _, seq = _FRAME_HEAD.unpack_from(body)
    return seq, body[_FRAME_HEAD.size :]


__all__ = [
    "MAX_FRAME_BYTES",
    "NONCE_BYTES",
    "connection_key",
    "frame_nonce",
    "seal",
    "unseal",
]
