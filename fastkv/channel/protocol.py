"""What a results message carries, and how: the payload format and its limits.

A payload is one rank's batch of results in a fixed binary layout (no nesting, no
recursion): a head (version, rank, count) and at most RESULTS_PER_DATAGRAM rows.

- Every row carries its result's cache epoch (4 bytes, `fastkv.metadata.Epoch`).
- A TransferResult row: its id, success, error (cut to MAX_ERROR_CHARS characters)
  and the positions of a storage transfer's failed blocks (at most
  MAX_FAILED_BLOCKS; more go as "every block failed").
- A storage LookupResult row: the lookup id and the leading blocks a rank's storage
  holds (at most MAX_LOOKUP_HITS).
- A PD RankReport row (`fastkv.pd.messages`): the transfer id, ok and fenced (one
  flags byte) and the reason
  (cut to MAX_ERROR_CHARS characters). It names no rank: the receiver gives it the
  rank of the payload's head, which the connection is bound to, so a rank cannot
  report for another. Reports are not combined over ranks here: the PD scheduler
  half counts them per rank.

`decode` checks every length against its bound before it reads it, so its work is
bounded by the payload's size (at most MAX_PAYLOAD_BYTES). A payload of no rows
(`hello`) opens a connection. The receiver answers with acknowledgements
(`encode_ack`): the stream index below which every result of the worker's stream
has been applied. Payloads travel sealed (`fastkv.channel.frames`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from fastkv.config import check_int
from fastkv.metadata import MAX_EPOCH, LookupResult, TransferResult
from fastkv.pd.messages import RankReport

Result = TransferResult | LookupResult | RankReport

WIRE_VERSION = 5
RESULTS_PER_DATAGRAM = 32
MAX_ERROR_CHARS = 300
MAX_ERROR_BYTES = 4 * MAX_ERROR_CHARS  # UTF-8
MAX_FAILED_BLOCKS = 64  # per storage result; more are sent as "every block failed"
MAX_LOOKUP_HITS = (1 << 32) - 1
_PAYLOAD_HEAD = struct.Struct("!BIH")  # version, rank, count
_KIND_TRANSFER = 0
_KIND_LOOKUP = 1
_KIND_REPORT = 2
_ROW = struct.Struct("!BqIBHH")  # kind, id, epoch, success, error bytes, failed positions
_FAILED = struct.Struct("!I")  # one failed block position
_LOOKUP_ROW = struct.Struct("!BqII")  # kind, lookup_id, epoch, num_hits
_REPORT_ROW = struct.Struct("!BqIBH")  # kind, transfer_id, epoch, flags, reason bytes
_REPORT_OK, _REPORT_FENCED = 1, 2  # a report row's flags
_ACK = struct.Struct("!Q")  # the stream index every result below was applied
MAX_PAYLOAD_BYTES = _PAYLOAD_HEAD.size + RESULTS_PER_DATAGRAM * (
    _ROW.size + MAX_ERROR_BYTES + MAX_FAILED_BLOCKS * _FAILED.size
)


def encode(rank: int, results: Iterable[Result]) -> list[bytes]:
    """The payloads carrying one rank's results, RESULTS_PER_DATAGRAM per payload.

    A TransferResult row carries its id, success, error (cut to MAX_ERROR_CHARS
    characters) and the positions of its failed blocks (storage transfers); one
    naming more than MAX_FAILED_BLOCKS failed positions goes as "every block
    failed" (no positions, success False): the scheduler then drops the whole
    transfer, never keeps a bad block. A LookupResult row carries the lookup id and
    the leading blocks found (at most MAX_LOOKUP_HITS). A RankReport row carries
    its transfer id, ok and reason (cut to MAX_ERROR_CHARS characters); its rank
    must be `rank` (a rank reports only for itself).

    Raises:
        ValueError: an id, position or hit count outside what the format holds, or
            a RankReport of another rank.
        TypeError: an entry is not a TransferResult, LookupResult or RankReport.
    """
    rows = list(results)
    for i, r in enumerate(rows):
        _check_row(rank, i, r)
    out = []
    for i in range(0, len(rows), RESULTS_PER_DATAGRAM):
        chunk = rows[i : i + RESULTS_PER_DATAGRAM]
        parts = [_PAYLOAD_HEAD.pack(WIRE_VERSION, rank, len(chunk))]
        for r in chunk:
            parts += _row(r)
        out.append(b"".join(parts))
    return out


def _check_row(rank: int, i: int, r: Result) -> None:
    """Row `i` of rank `rank`'s payload fits the format (else ValueError/TypeError)."""
    if isinstance(r, (LookupResult, TransferResult, RankReport)):
        check_int(f"results[{i}].epoch", r.epoch, 0, MAX_EPOCH)
    if isinstance(r, RankReport):
        check_int(f"results[{i}].transfer_id", r.transfer_id, 0, (1 << 63) - 1)
        check_int(f"results[{i}].rank", r.rank, rank, rank)
    elif isinstance(r, LookupResult):
        check_int(f"results[{i}].lookup_id", r.lookup_id, 0, (1 << 63) - 1)
        check_int(f"results[{i}].num_hits", r.num_hits, 0, MAX_LOOKUP_HITS)
    elif isinstance(r, TransferResult):
        check_int(f"results[{i}].transfer_id", r.transfer_id, 0, (1 << 63) - 1)
        for j, pos in enumerate(r.failed_blocks):
            check_int(f"results[{i}].failed_blocks[{j}]", pos, 0, (1 << 32) - 1)
    else:
        raise TypeError(
            f"results[{i}]: expected TransferResult, LookupResult or RankReport, got {r!r:.80}"
        )


def _row(r: Result) -> list[bytes]:
    """The bytes of one checked row."""
    if isinstance(r, LookupResult):
        return [_LOOKUP_ROW.pack(_KIND_LOOKUP, r.lookup_id, r.epoch, r.num_hits)]
    if isinstance(r, RankReport):
        reason = r.reason[:MAX_ERROR_CHARS].encode("utf-8", "replace")
        flags = _REPORT_OK * bool(r.ok) | _REPORT_FENCED * bool(r.fenced)
        row = (_KIND_REPORT, r.transfer_id, r.epoch, flags, len(reason))
        return [_REPORT_ROW.pack(*row), reason]
    error = r.error[:MAX_ERROR_CHARS].encode("utf-8", "replace")
    failed = tuple(r.failed_blocks)
    if len(failed) > MAX_FAILED_BLOCKS:
        failed = ()  # with success False: every block failed
    success = r.success and not r.failed_blocks
    head = (_KIND_TRANSFER, r.transfer_id, r.epoch, int(success))
    tail = [_FAILED.pack(p) for p in failed]
    return [_ROW.pack(*head, len(error), len(failed)), error, *tail]


def hello(rank: int) -> bytes:
    """The payload of no rows a worker opens a connection with (the receiver answers
    with an acknowledgement, which proves it holds the secret)."""
    return _PAYLOAD_HEAD.pack(WIRE_VERSION, rank, 0)


def encode_ack(applied: int) -> bytes:
    """An acknowledgement: every result of the connection's stream below index
    `applied` has been applied (or dropped as a resend)."""
    return _ACK.pack(applied)


def decode_ack(data: bytes) -> int:
    """The index an acknowledgement carries.

    Raises:
        ValueError: not an acknowledgement.
    """
    if len(data) != _ACK.size:
        raise ValueError(f"acknowledgement: {len(data)} bytes, expected {_ACK.size}")
    return int(_ACK.unpack(data)[0])


def decode(data: bytes) -> tuple[int, list[Result]]:
    """One payload back into (rank, results). Work is bounded by the payload's size
    (at most RESULTS_PER_DATAGRAM rows, flat layout, every length checked against
    its bound before it is read).

    Raises:
        ValueError: not a payload of this format (the message says what is wrong).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"datagram: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    rank, count = _read_head(data)
    offset = _PAYLOAD_HEAD.size
    results: list[Result] = []
    result: Result
    for i in range(count):
        if offset + 1 > len(data):
            raise ValueError(f"datagram: results[{i}] cut short")
        kind = data[offset]
        if kind == _KIND_TRANSFER:
            result, offset = _read_transfer(data, offset, i)
        elif kind == _KIND_LOOKUP:
            result, offset = _read_lookup(data, offset, i)
        elif kind == _KIND_REPORT:
            result, offset = _read_report(data, offset, i, rank)
        else:
            raise ValueError(f"datagram: results[{i}] kind {kind}, expected 0, 1 or 2")
        results.append(result)
    if offset != len(data):
        raise ValueError(f"datagram: {len(data) - offset} bytes after the last result")
    return rank, results


def _read_head(data: bytes) -> tuple[int, int]:
    """(rank, count) of a payload, its size, version and count checked."""
    if not _PAYLOAD_HEAD.size <= len(data) <= MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"datagram: {len(data)} bytes, must be in "
            f"[{_PAYLOAD_HEAD.size}, {MAX_PAYLOAD_BYTES}]"
        )
    version, rank, count = _PAYLOAD_HEAD.unpack_from(data)
    if version != WIRE_VERSION:
        raise ValueError(f"datagram: version {version}, this end speaks {WIRE_VERSION}")
    if count > RESULTS_PER_DATAGRAM:
        raise ValueError(f"datagram: {count} results, at most {RESULTS_PER_DATAGRAM}")
    return rank, count


def _read_lookup(data: bytes, offset: int, i: int) -> tuple[LookupResult, int]:
    """Row `i`, a LookupResult, at `offset`; and the offset after it."""
    if offset + _LOOKUP_ROW.size > len(data):
        raise ValueError(f"datagram: results[{i}] cut short")
    _, lookup_id, epoch, hits = _LOOKUP_ROW.unpack_from(data, offset)
    if lookup_id < 0:
        raise ValueError(f"datagram: results[{i}] lookup id {lookup_id} < 0")
    return LookupResult(lookup_id, hits, 1, epoch), offset + _LOOKUP_ROW.size


def _read_report(data: bytes, offset: int, i: int, rank: int) -> tuple[RankReport, int]:
    """Row `i`, a RankReport of `rank` (the payload's), at `offset`; and the offset
    after it."""
    if offset + _REPORT_ROW.size > len(data):
        raise ValueError(f"datagram: results[{i}] cut short")
    _, transfer_id, epoch, flags, length = _REPORT_ROW.unpack_from(data, offset)
    offset += _REPORT_ROW.size
    if flags > _REPORT_OK | _REPORT_FENCED or transfer_id < 0 or length > MAX_ERROR_BYTES:
        raise ValueError(f"datagram: results[{i}] is not (id >= 0, flags, short reason)")
    if offset + length > len(data):
        raise ValueError(f"datagram: results[{i}] reason cut short")
    try:
        reason = data[offset : offset + length].decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"datagram: results[{i}] reason is not UTF-8") from None
    ok, fenced = bool(flags & _REPORT_OK), bool(flags & _REPORT_FENCED)
    return RankReport(transfer_id, epoch, rank, ok, reason, fenced), offset + length


def _read_transfer(data: bytes, offset: int, i: int) -> tuple[TransferResult, int]:
    """Row `i`, a TransferResult, at `offset`; and the offset after it."""
    if offset + _ROW.size > len(data):
        raise ValueError(f"datagram: results[{i}] cut short")
    _, transfer_id, epoch, success, length, num_failed = _ROW.unpack_from(data, offset)
    offset += _ROW.size
    if success > 1 or transfer_id < 0 or length > MAX_ERROR_BYTES:
        raise ValueError(f"datagram: results[{i}] is not (id >= 0, bool, short error)")
    if num_failed > MAX_FAILED_BLOCKS or (success and num_failed):
        raise ValueError(
            f"datagram: results[{i}] names {num_failed} failed blocks "
            f"(at most {MAX_FAILED_BLOCKS}, none on a success)"
        )
    end = offset + length + num_failed * _FAILED.size
    if end > len(data):
        raise ValueError(f"datagram: results[{i}] error or failed blocks cut short")
    try:
        error = data[offset : offset + length].decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"datagram: results[{i}] error is not UTF-8") from None
    offset += length
    failed = tuple(
        _FAILED.unpack_from(data, offset + k * _FAILED.size)[0] for k in range(num_failed)
    )
    return TransferResult(transfer_id, bool(success), error, failed, 1, epoch), end


__all__ = [
    "MAX_ERROR_BYTES",
    "MAX_ERROR_CHARS",
    "MAX_FAILED_BLOCKS",
    "MAX_LOOKUP_HITS",
    "MAX_PAYLOAD_BYTES",
    "RESULTS_PER_DATAGRAM",
    "WIRE_VERSION",
    "Result",
    "decode",
    "decode_ack",
    "encode",
    "encode_ack",
    "hello",
]
