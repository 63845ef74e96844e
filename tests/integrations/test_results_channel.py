"""The results channel over real abstract-namespace datagram sockets: two worker
processes report per-rank results, the scheduler end combines them (a transfer
comes out once every rank reported, failed if any rank failed); a sender keeps
what it cannot deliver and delivers it once the scheduler binds; bad, duplicate
and foreign datagrams are dropped and counted, never raised."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest

from fastkv.integrations.results_channel import (
    MAX_ERROR_CHARS,
    ResultsReceiver,
    ResultsSender,
    channel_address,
    decode,
    encode,
)
from fastkv.metadata import TransferResult

WAIT_S = 10.0


def collect(
    receiver: ResultsReceiver, count: int, sender: ResultsSender | None = None
) -> list[TransferResult]:
    """Poll (bounded) until `count` combined results came out, flushing `sender`
    as a worker's next report would."""
    out: list[TransferResult] = []
    deadline = time.monotonic() + WAIT_S
    while len(out) < count and time.monotonic() < deadline:
        out += receiver.poll()
        if sender is not None:
            sender.flush()
        time.sleep(0.002)
    return out


def _send_as_rank(name: str, rank: int, failing: int, ready, go) -> None:
    sender = ResultsSender(name, rank)
    ready.set()
    go.wait(WAIT_S)
    results = [
        TransferResult(
            t, not (rank == 1 and t == failing), "copy failed" if t == failing else ""
        )
        for t in range(rank, 40)  # rank 1 reports 1..39; rank 0 reports 0..39
    ]
    for i in range(0, len(results), 7):
        sender.send(results[i : i + 7])
    deadline = time.monotonic() + WAIT_S
    while sender.flush() and time.monotonic() < deadline:  # the receiver's queue was full
        time.sleep(0.002)
    assert sender.stats().pending == 0
    sender.close()


def test_two_worker_processes_combine_into_one_result_per_transfer(channel: str) -> None:
    ctx = mp.get_context("spawn")
    receiver = ResultsReceiver(channel, tp_size=2)
    try:
        go = ctx.Event()
        readies = [ctx.Event(), ctx.Event()]
        procs = [
            ctx.Process(target=_send_as_rank, args=(channel, rank, 13, readies[rank], go))
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        for ready in readies:
            assert ready.wait(60)
        go.set()
        combined = collect(receiver, 39)
        for p in procs:
            p.join(WAIT_S)
            assert p.exitcode == 0
        assert sorted(r.transfer_id for r in combined) == list(range(1, 40))
        failed = [r for r in combined if not r.success]
        assert failed == [TransferResult(13, False, "rank 1: copy failed")]
        assert receiver.missing() == {("transfer", 0): [1]}  # rank 1 never reported transfer 0
        stats = receiver.stats()
        assert (stats.results, stats.combined, stats.rejected_datagrams) == (79, 39, 0)
    finally:
        receiver.close()


def test_a_sender_keeps_results_until_the_scheduler_binds(channel: str) -> None:
    sender = ResultsSender(channel, 0)
    assert sender.send([TransferResult(1, True), TransferResult(2, False, "x")]) == 2
    assert sender.stats().pending == 2 and sender.stats().sent == 0
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        assert receiver.poll() == []
        assert sender.flush() == 0
        got = collect(receiver, 2)
        assert got == [TransferResult(1, True), TransferResult(2, False, "rank 0: x")]
    finally:
        sender.close()
        receiver.close()


def test_undeliverable_results_are_bounded_and_the_oldest_dropped(channel: str) -> None:
    sender = ResultsSender(channel, 0, max_pending=5)
    sender.send(TransferResult(t, True) for t in range(8))
    assert sender.stats().pending == 5 and sender.stats().dropped == 3
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        sender.flush()
        assert [r.transfer_id for r in collect(receiver, 5)] == [3, 4, 5, 6, 7]
    finally:
        sender.close()
        receiver.close()


def test_a_full_receiver_queue_holds_results_back_until_it_drains(channel: str) -> None:
    receiver = ResultsReceiver(channel, tp_size=1)
    sender = ResultsSender(channel, 0)
    try:
        error = 'é\n"' * 500  # escaped by JSON, cut to MAX_ERROR_CHARS
        left = sender.send(TransferResult(t, False, error) for t in range(5000))
        assert left > 0, "the receiver's queue was meant to fill up"
        got = collect(receiver, 5000, sender)
        assert [r.transfer_id for r in got] == list(range(5000))  # in order, none lost
        assert all(r.error == "rank 0: " + error[:MAX_ERROR_CHARS] for r in got)
        assert receiver.stats().datagrams > 1
    finally:
        sender.close()
        receiver.close()


def test_bad_duplicate_and_out_of_range_reports_are_dropped_and_counted(channel: str) -> None:
    receiver = ResultsReceiver(channel, tp_size=2)
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        address = channel_address(channel)
        for junk in (
            b"\x80not json",
            b"[1, 2]",
            b'{"v": 1, "rank": 0, "results": [[1, "yes", ""]]}',
        ):
            raw.sendto(junk, address)
        (good,) = encode(0, [TransferResult(5, True)])
        raw.sendto(good, address)
        raw.sendto(good, address)  # rank 0 reports transfer 5 twice
        (bad_rank,) = encode(7, [TransferResult(5, True)])
        raw.sendto(bad_rank, address)
        (other,) = encode(1, [TransferResult(5, True)])
        raw.sendto(other, address)
        assert collect(receiver, 1) == [TransferResult(5, True)]
        stats = receiver.stats()
        assert (stats.rejected_datagrams, stats.rejected_results) == (3, 2)
    finally:
        raw.close()
        receiver.close()


@pytest.mark.skipif(os.getuid() != 0, reason="sending as another user needs root")
def test_datagrams_from_another_user_are_dropped(channel: str) -> None:
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.setuid(65534)  # nobody
                sender = ResultsSender(channel, 0)
                sender.send([TransferResult(1, True)])
                code = 0 if sender.stats().sent == 1 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # it was delivered to the socket
        deadline = time.monotonic() + WAIT_S
        while not receiver.stats().datagrams and time.monotonic() < deadline:
            assert receiver.poll() == []
            time.sleep(0.002)
        assert receiver.stats().rejected_datagrams == 1
    finally:
        receiver.close()


def test_names_and_second_binds_are_refused_clearly(channel: str) -> None:
    for bad in ("", "x" * 200, "a\0b", "tab\there"):
        with pytest.raises(ValueError, match="name"):
            channel_address(bad)
    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        with pytest.raises(OSError, match=channel):
            ResultsReceiver(channel, tp_size=1)
    finally:
        receiver.close()
    with pytest.raises(ValueError, match="tp_size"):
        ResultsReceiver(channel, tp_size=0)
    with pytest.raises(ValueError, match="rank"):
        ResultsSender(channel, -1)
    with pytest.raises(TypeError, match="TransferResult"):
        ResultsSender(channel, 0).send(["done"])


def test_wire_format_round_trips_and_rejects_what_it_is_not() -> None:
    results = [TransferResult(1, True), TransferResult(2**40, False, "boom")]
    (datagram,) = encode(3, results)
    assert decode(datagram) == (3, results)
    for bad in (
        b"{}",
        b'{"v": 2, "rank": 0, "results": []}',
        b'{"v": 1, "rank": "0", "results": []}',
    ):
        with pytest.raises(ValueError, match="datagram"):
            decode(bad)
