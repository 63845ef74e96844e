"""The results channel carries storage results: per-block failures of a storage
transfer and lookup answers, in the same bounded, authenticated format (wire
version 3), over real sockets; every length is checked before it is read."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

import fastkv.channel as rc
from fastkv.channel import ResultsReceiver, ResultsSender, frames, protocol
from fastkv.channel.protocol import MAX_FAILED_BLOCKS, decode, encode
from fastkv.metadata import LookupResult, TransferResult

WAIT_S = 10.0


def test_storage_results_round_trip() -> None:
    results = [
        TransferResult(4, False, "disk", (0, 3, 2**32 - 1)),
        LookupResult(9, 17),
        TransferResult(5, True),
        LookupResult(2**62, 0),
    ]
    (payload,) = encode(1, results)
    assert decode(payload) == (1, results)


def test_too_many_failed_blocks_go_as_every_block_failed() -> None:
    many = TransferResult(3, False, "", tuple(range(MAX_FAILED_BLOCKS + 1)))
    (payload,) = encode(0, [many])
    assert decode(payload) == (0, [TransferResult(3, False, "", ())])
    # A "success" naming failed blocks never comes out as a success.
    (payload,) = encode(0, [TransferResult(3, True, "", (1,))])
    assert decode(payload)[1][0].success is False


def test_encode_refuses_what_the_format_cannot_hold() -> None:
    for bad, field in (
        (LookupResult(-1, 0), "lookup_id"),
        (LookupResult(1, 2**32), "num_hits"),
        (TransferResult(1, False, "", (-1,)), "failed_blocks"),
    ):
        with pytest.raises(ValueError, match=field):
            encode(0, [bad])
    with pytest.raises(TypeError, match="LookupResult"):
        encode(0, ["x"])  # type: ignore[list-item]


def _row(kind: int, tid: int, success: int, nerr: int, nfailed: int) -> bytes:
    return struct.pack("!BqBHH", kind, tid, success, nerr, nfailed)


@pytest.mark.parametrize(
    "body",
    [
        _row(0, 1, 0, 0, MAX_FAILED_BLOCKS + 1) + b"\0" * 4 * (MAX_FAILED_BLOCKS + 1),
        _row(0, 1, 1, 0, 1) + b"\0\0\0\1",  # a success naming a failed block
        _row(0, 1, 0, 0, 2) + b"\0\0\0\1",  # failed positions cut short
        bytes([7]) + b"\0" * 13,  # unknown kind
        struct.pack("!BqI", 1, 5, 1)[:-1],  # lookup row cut short
        struct.pack("!BqI", 1, -5, 1),  # negative lookup id
    ],
)
def test_decode_rejects_hostile_rows(body: bytes) -> None:
    payload = struct.pack("!BIH", protocol.WIRE_VERSION, 0, 1) + body
    with pytest.raises(ValueError, match="datagram"):
        decode(payload)


def test_the_largest_payload_fits_one_frame() -> None:
    worst = [
        TransferResult(i, False, "é" * 1000, tuple(range(MAX_FAILED_BLOCKS)))
        for i in range(rc.RESULTS_PER_DATAGRAM)
    ]
    (payload,) = encode(0, worst)
    assert len(frames.seal(b"k" * 32, b"n" * 16, 0, payload)) <= frames.MAX_FRAME_BYTES
    assert decode(payload)[1] == [
        TransferResult(r.transfer_id, False, "é" * rc.MAX_ERROR_CHARS, r.failed_blocks)
        for r in worst
    ]


def test_lookups_and_block_failures_combine_over_ranks(tmp_path: Path) -> None:
    directory = str(tmp_path / "run")
    receiver = ResultsReceiver("fkv-storage-test", tp_size=2, directory=directory)
    senders = [ResultsSender("fkv-storage-test", r, directory=directory) for r in (0, 1)]
    try:
        senders[0].send([LookupResult(1, 5), TransferResult(2, False, "a", (3,))])
        senders[1].send([LookupResult(1, 2), TransferResult(2, False, "b", (1,))])
        out: list[object] = []
        deadline = time.monotonic() + WAIT_S
        while len(out) < 2 and time.monotonic() < deadline:
            out += receiver.poll()
            for sender in senders:  # as a worker's next report would
                sender.flush()
            time.sleep(0.002)
        lookups = [r for r in out if isinstance(r, LookupResult)]
        transfers = [r for r in out if isinstance(r, TransferResult)]
        assert lookups == [LookupResult(1, 2, num_ranks=2)]  # the prefix every rank holds
        assert len(transfers) == 1 and not transfers[0].success
        assert set(transfers[0].failed_blocks) == {1, 3}
        with pytest.raises(ValueError, match="num_hits"):
            senders[0].send([LookupResult(3, -1)])
        while senders[0].flush() and time.monotonic() < deadline:  # its acknowledgement
            receiver.poll()
        assert senders[0].stats().pending == 0
    finally:
        for s in senders:
            s.close()
        receiver.close()
