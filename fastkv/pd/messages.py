"""What the two instances of a prefill/decode transfer tell each other.

    P scheduler ──Offer──────────► D scheduler      (engine's control channel)
    P scheduler ◄─Acceptance/Rejection── D scheduler
    P rank ──writes──► D rank's registered memory  (PDTransport)
    P rank ──Notice (bytes, HMAC)──► D rank         (PDTransport.notify)
    D rank ──RankReport──► D scheduler;  P rank ──RankReport──► P scheduler

Offers and answers travel over the engines' own channel (whatever carries requests
from P to D); only notices cross the transport, so only notices are encoded and
authenticated here. A final notice (done, stopped or failed) is sent by a P rank
after every write it started for that D rank has settled. Done and stopped (a
failure, yet every write started settled done) tell D that no write of that rank for
that transfer can land any more (D's early fence). Failed (a write of it failed,
or the transport's done means only "sent": `done_means_applied`) does not: a
transport that gave a write up may still have its bytes on the wire
(Mooncake's TCP transport times a batch out while bytes sit in a stalled receiver's
socket), so D fences those blocks by its grace. A progress notice says only that the
writes of layers [first_layer, first_layer + len(checksums)) settled done, with
those layers' checksums, so D can verify them while later layers still land; it
fences nothing and reports nothing (`fastkv.pd.receiver`).

Notice wire format (little-endian):

    offset  field
         0  magic        8 bytes b"FKVPDN\\0\\2"
         8  epoch        u64
        16  transfer_id  u64
        24  p_rank, num_p_ranks, d_rank, num_d_ranks   u16 each
        32  status       u32    0 done, 1 failed, 2 progress, 3 stopped
        36  num_layers   u32    the layout's layers
        40  first_layer  u32    the first layer the checksums cover (0 unless progress)
        44  num_sums     u32
        48  checksums    u32 per layer from first_layer: crc32c-3way of that layer's
                                bytes of every block, as D's rank receives them
                                (`fastkv.pd.layout.layer_checksum`); a done notice
                                carries every layer's or, checksums off, none
         …  mac          32 bytes HMAC-SHA256(key, every byte before it)

The key is the transfer's secret: random per transfer from D's acceptance, or, where
a deployment secret is set, derived from it, the epoch and the transfer id
(`transfer_secret`), so that it never travels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import struct
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from fastkv.metadata import Epoch

MAGIC = b"FKVPDN\0\2"
_HEAD = struct.Struct("<8sQQHHHHIIII")
MAC_BYTES = 32
SECRET_BYTES = 32
MAX_SUMS = 1 << 16  # one per layer
STATUS_DONE = 0
STATUS_FAILED = 1
STATUS_PROGRESS = 2
STATUS_STOPPED = 3  # failed, but every write started settled done: nothing more lands


@dataclass(frozen=True, slots=True)
class Offer:
    """P asks D to take a request's KV: `num_tokens` prompt tokens in `num_p_ranks`
    shards laid out as `layout_digest` says (`fastkv.pd.layout.KVLayout.digest`)."""

    request_id: Hashable
    num_tokens: int
    layout_digest: bytes
    num_p_ranks: int


@dataclass(frozen=True, slots=True)
class Acceptance:
    """D's answer: P skips the first `num_prefix_blocks` blocks (D holds them) and
    writes the rest into `block_ids`, then each P rank notifies every D rank it
    wrote to, with `secret` as the notice key, within `timeout_s`."""

    request_id: Hashable
    transfer_id: int
    epoch: Epoch
    num_tokens: int
    num_prefix_blocks: int
    block_ids: tuple[int, ...]
    secret: bytes
    timeout_s: float
    num_d_ranks: int

    def public(self) -> Acceptance:
        """This acceptance without its key, for P where a deployment secret is set
        (P derives the key itself with `transfer_secret`, so it never travels)."""
        return dataclasses.replace(self, secret=b"")


@dataclass(frozen=True, slots=True)
class Rejection:
    """D cannot take the request (no room, mismatched layout, ...); P recomputes
    nothing and unpins at once."""

    request_id: Hashable
    reason: str


@dataclass(frozen=True, slots=True)
class SendPlan:
    """What every P rank's worker needs to send one request (`fastkv.pd.sender`),
    made by P's scheduler half (`PrefillTransfers.plan`)."""

    transfer_id: int
    epoch: Epoch
    secret: bytes
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    num_d_ranks: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's word on one transfer, to its own scheduler half.

    On D: the rank's verified notice arrived (`ok`: done and every landed block's
    checksum matched; not ok: P reported a failure, or the bytes did not verify).
    On P: the rank's writes settled and its notice went out (`ok`) or not.

    `fenced`: no write of that rank for the transfer can land any more. On P
    whether its writes settled (false when one was still pending at the send's
    deadline: no notice went out); always for an ok report; on D false when P's
    notice says a write failed (its bytes may still be on the wire) or the landed
    bytes did not verify: D then holds the blocks until its deadline plus grace."""

    transfer_id: int
    epoch: Epoch
    rank: int
    ok: bool
    reason: str = ""
    fenced: bool = True


@dataclass(frozen=True, slots=True)
class Notice:
    """A decoded, authenticated notice (see the module docstring): final (done, or
    `failed`: `stopped` when every write started still settled done), or
    `progress` (layers from `first_layer` settled done, one checksum each)."""

    epoch: Epoch
    transfer_id: int
    p_rank: int
    num_p_ranks: int
    d_rank: int
    num_d_ranks: int
    failed: bool
    num_layers: int
    checksums: tuple[int, ...]
    first_layer: int = 0
    progress: bool = False
    stopped: bool = False


class NoticeError(ValueError):
    """A payload that is not a notice this key authenticates."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def transfer_secret(deployment_secret: bytes, epoch: Epoch, transfer_id: int) -> bytes:
    """The notice key of one transfer under a deployment-wide secret."""
    label = b"fastkv-pd-notice" + struct.pack("<QQ", epoch, transfer_id)
    return hmac.new(deployment_secret, label, hashlib.sha256).digest()


def encode_notice(notice: Notice, key: bytes) -> bytes:
    """The notice's bytes, authenticated with `key`.

    Raises:
        ValueError: a notice both failed and progress, a progress notice
            without checksums, or a stopped one not failed."""
    if notice.progress and (notice.failed or not notice.checksums):
        raise ValueError("notice: a progress notice is not failed and carries checksums")
    if notice.stopped and not notice.failed:
        raise ValueError("notice: a stopped notice is a failed one")
    if notice.failed:
        status = STATUS_STOPPED if notice.stopped else STATUS_FAILED
    else:
        status = STATUS_PROGRESS if notice.progress else STATUS_DONE
    head = _HEAD.pack(
        MAGIC,
        notice.epoch,
        notice.transfer_id,
        notice.p_rank,
        notice.num_p_ranks,
        notice.d_rank,
        notice.num_d_ranks,
        status,
        notice.num_layers,
        notice.first_layer,
        len(notice.checksums),
    )
    body = head + struct.pack(f"<{len(notice.checksums)}I", *notice.checksums)
    return body + hmac.new(key, body, hashlib.sha256).digest()


def peek_notice(payload: bytes) -> tuple[Epoch, int]:
    """(epoch, transfer_id) a payload claims, unauthenticated: to find its key.

    Raises:
        NoticeError: not shaped as a notice."""
    if len(payload) < _HEAD.size + MAC_BYTES or payload[:8] != MAGIC:
        raise NoticeError("not a fastkv PD notice")
    _, epoch, transfer_id = struct.unpack_from("<8sQQ", payload)
    return Epoch(epoch), transfer_id


def peek_progress(payload: bytes) -> bool:
    """Whether a payload shaped as a notice (`peek_notice`) claims to be a progress
    notice, unauthenticated: D keeps only final notices for a transfer it does not
    expect yet."""
    return struct.unpack_from("<I", payload, 32)[0] == STATUS_PROGRESS


def decode_notice(payload: bytes, key: bytes) -> Notice:
    """Verify `payload` under `key` and decode it.

    Raises:
        NoticeError: wrong shape, length, status or authenticator."""
    peek_notice(payload)
    (_, epoch, tid, p_rank, num_p, d_rank, num_d, status, layers, first, nsums) = (
        _HEAD.unpack_from(payload)
    )
    if nsums > MAX_SUMS or len(payload) != _HEAD.size + 4 * nsums + MAC_BYTES:
        raise NoticeError(f"notice length {len(payload)} does not fit {nsums} checksums")
    body = payload[:-MAC_BYTES]
    want = hmac.new(key, body, hashlib.sha256).digest()
    if not hmac.compare_digest(want, payload[-MAC_BYTES:]):
        raise NoticeError("notice authenticator does not verify")
    if status not in (STATUS_DONE, STATUS_FAILED, STATUS_PROGRESS, STATUS_STOPPED):
        raise NoticeError(f"notice status {status} unknown")
    if status == STATUS_PROGRESS and not nsums:
        raise NoticeError("progress notice without checksums")
    sums = struct.unpack_from(f"<{nsums}I", payload, _HEAD.size)
    return Notice(
        Epoch(epoch),
        tid,
        p_rank,
        num_p,
        d_rank,
        num_d,
        status in (STATUS_FAILED, STATUS_STOPPED),
        layers,
        sums,
        first,
        status == STATUS_PROGRESS,
        status == STATUS_STOPPED,
    )


def check_positive(name: str, value: object) -> float:
    """`value` as a float if it is a finite number > 0, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e12:
        raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")
    return float(value)


def check_rank_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 0xFFFF:
        raise ValueError(f"{name}: must be an int in [1, 65535], got {value!r}")
    return value


def check_digest(name: str, value: object) -> bytes:
    """A layout digest (`KVLayout.digest()`: 32 bytes), else ValueError naming it."""
    if not isinstance(value, bytes) or len(value) != 32:
        raise ValueError(f"{name}: must be 32 bytes (KVLayout.digest()), got {value!r:.80}")
    return value


def check_secret(name: str, value: bytes | None) -> bytes | None:
    """A deployment secret (None, or bytes of at least 16), else ValueError naming it."""
    if value is not None and (not isinstance(value, bytes) or len(value) < 16):
        raise ValueError(f"{name}: must be at least 16 bytes")
    return value


def checked_reports(reports: Iterable[RankReport]) -> list[RankReport]:
    """`reports` as a list, every entry a RankReport (else TypeError, before any is
    applied)."""
    out = list(reports)
    for i, r in enumerate(out):
        if not isinstance(r, RankReport):
            raise TypeError(f"reports[{i}]: expected RankReport, got {r!r:.80}")
    return out


__all__ = [
    "Acceptance",
    "Notice",
    "NoticeError",
    "Offer",
    "RankReport",
    "Rejection",
    "SendPlan",
    "decode_notice",
    "encode_notice",
    "new_secret",
    "peek_notice",
    "peek_progress",
    "transfer_secret",
]
