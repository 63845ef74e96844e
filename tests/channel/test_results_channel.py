"""The results channel over real sockets in a real private directory: worker
processes report per-rank results, the scheduler end combines them (a transfer comes
out once every rank reported, failed if any rank failed); a sender keeps what it
cannot deliver and delivers it once the scheduler binds (again); bad, duplicate and
replayed messages are dropped and counted, never raised; a closed receiver frees its
name at once. Attacks from other users and namespaces: test_results_channel_attacks.py.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import resource
import signal
import socket
import time
from pathlib import Path

import pytest

import fastkv.channel as rc
from fastkv.channel import MAX_ERROR_CHARS, ResultsReceiver, ResultsSender, frames, private_dir
from fastkv.channel.protocol import decode, decode_ack, encode
from fastkv.channel.receiver import ACCEPTS_PER_POLL, MESSAGES_PER_POLL
from fastkv.metadata import LookupResult, TransferResult

WAIT_S = 10.0


@pytest.fixture
def rundir(tmp_path: Path) -> str:
    """A private directory the channel makes itself (its parent is pytest's)."""
    return str(tmp_path / "run")


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


def settle(receiver: ResultsReceiver, sender: ResultsSender) -> list[TransferResult]:
    """Poll and flush (bounded) until the receiver acknowledged all `sender` sent."""
    out: list[TransferResult] = []
    deadline = time.monotonic() + WAIT_S
    while sender.flush() and time.monotonic() < deadline:
        out += receiver.poll()
        time.sleep(0.002)
    return out


def drain(receiver: ResultsReceiver, datagrams: int) -> list[TransferResult]:
    """Poll (bounded) until the receiver has read `datagrams` messages."""
    out: list[TransferResult] = []
    deadline = time.monotonic() + WAIT_S
    while receiver.stats().datagrams < datagrams and time.monotonic() < deadline:
        out += receiver.poll()
        time.sleep(0.002)
    return out + receiver.poll()


class RawPeer:
    """A hand-driven connection that knows the secret (what a worker would send)."""

    def __init__(self, directory: str, name: str, nonce: bytes | None = None) -> None:
        dir_fd = private_dir.open_private_dir(directory)
        try:
            secret = private_dir.load_secret(dir_fd, name)
            epoch = private_dir.read_epoch(dir_fd, name)
        finally:
            os.close(dir_fd)
        assert epoch is not None
        self.nonce = nonce if nonce is not None else os.urandom(16)
        self.key = frames.connection_key(secret, epoch, self.nonce)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(os.path.join(directory, f"{name}.sock"))
        self.seq = 0
        self.stream = os.urandom(frames.STREAM_BYTES)

    def frame(self, payload: bytes, seq: int | None = None) -> bytes:
        seq = self.seq if seq is None else seq  # results numbered by message here
        return frames.seal(self.key, self.nonce, seq, payload, stream=self.stream, first=seq)

    def send(self, payload: bytes) -> bytes:
        frame = self.frame(payload)
        self.sock.send(frame)
        self.seq += 1
        return frame

    def closed_by_peer(self) -> bool:
        """Whether the receiver closed the connection (its acknowledgements read
        past)."""
        self.sock.settimeout(WAIT_S)
        try:
            while self.sock.recv(1 << 16):
                pass
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def _send_as_rank(directory: str, name: str, rank: int, failing: int, ready, go) -> None:
    sender = ResultsSender(name, rank, directory=directory)
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


def test_two_worker_processes_combine_into_one_result_per_transfer(
    channel: str, rundir: str
) -> None:
    ctx = mp.get_context("spawn")
    receiver = ResultsReceiver(channel, tp_size=2, directory=rundir)
    try:
        go = ctx.Event()
        readies = [ctx.Event(), ctx.Event()]
        procs = [
            ctx.Process(
                target=_send_as_rank, args=(rundir, channel, rank, 13, readies[rank], go)
            )
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
        assert failed == [TransferResult(13, False, "rank 1: copy failed", num_ranks=2)]
        assert receiver.missing() == {("transfer", 0): [1]}  # rank 1 never reported transfer 0
        stats = receiver.stats()
        assert (stats.results, stats.combined, stats.rejected_datagrams) == (79, 39, 0)
    finally:
        receiver.close()


def test_the_private_directory_and_its_files_are_the_users_alone(
    channel: str, rundir: str
) -> None:
    old = os.umask(0)  # the modes must not depend on the umask
    try:
        receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    finally:
        os.umask(old)
    try:
        st = os.lstat(rundir)
        assert (st.st_uid, st.st_mode & 0o7777) == (os.getuid(), 0o700)
        for suffix in ("key", "lock"):
            st = os.lstat(os.path.join(rundir, f"{channel}.{suffix}"))
            assert (st.st_uid, st.st_mode & 0o077) == (os.getuid(), 0)
        assert len(Path(rundir, f"{channel}.key").read_bytes()) == private_dir.KEY_FILE_BYTES
        assert receiver.path == os.path.join(rundir, f"{channel}.sock")
    finally:
        receiver.close()


def test_a_sender_keeps_results_until_the_scheduler_binds(channel: str, rundir: str) -> None:
    sender = ResultsSender(channel, 0, directory=rundir)
    assert sender.send([TransferResult(1, True), TransferResult(2, False, "x")]) == 2
    assert sender.stats().pending == 2 and sender.stats().sent == 0
    assert os.listdir(rundir) == []  # only a receiver makes files
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    try:
        assert receiver.poll() == []
        assert sender.flush() == 2  # a hello first: results go once it is answered
        got = collect(receiver, 2, sender)
        assert got == [TransferResult(1, True), TransferResult(2, False, "rank 0: x")]
        assert settle(receiver, sender) == [] and sender.stats().sent == 2
    finally:
        sender.close()
        receiver.close()


def test_a_sender_reconnects_to_a_restarted_scheduler_and_keeps_what_failed(
    channel: str, rundir: str
) -> None:
    sender = ResultsSender(channel, 0, directory=rundir)
    first = ResultsReceiver(channel, tp_size=1, directory=rundir)
    try:
        sender.send([TransferResult(1, True)])
        assert collect(first, 1, sender) == [TransferResult(1, True)]
    finally:
        first.close()
    second = ResultsReceiver(channel, tp_size=1, directory=rundir)
    try:
        # The old connection is dead: the result stays queued, and the next flushes
        # connect to the new receiver (its new epoch, a new nonce) and deliver it.
        assert sender.send([TransferResult(2, False, "boom")]) == 1
        assert collect(second, 1, sender) == [TransferResult(2, False, "rank 0: boom")]
        assert settle(second, sender) == [] and sender.stats().sent == 2
        assert second.stats().rejected_datagrams == 0
        second.close()
        assert sender.send([TransferResult(3, True)]) == 1  # kept; nothing made
        assert os.listdir(rundir) == []
    finally:
        sender.close()
        second.close()


def test_undeliverable_results_are_bounded_and_the_oldest_dropped(
    channel: str, rundir: str
) -> None:
    sender = ResultsSender(channel, 0, max_pending=5, directory=rundir)
    sender.send(TransferResult(t, True) for t in range(8))
    assert sender.stats().pending == 5 and sender.stats().dropped == 3
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    try:
        assert [r.transfer_id for r in collect(receiver, 5, sender)] == [3, 4, 5, 6, 7]
    finally:
        sender.close()
        receiver.close()


def test_a_full_receiver_queue_holds_results_back_until_it_drains(
    channel: str, rundir: str
) -> None:
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    sender = ResultsSender(channel, 0, directory=rundir)
    try:
        error = 'é\n"' * 500  # cut to MAX_ERROR_CHARS
        left = sender.send(TransferResult(t, False, error) for t in range(5000))
        assert left > 0, "the receiver's queue was meant to fill up"
        got = collect(receiver, 5000, sender)
        assert [r.transfer_id for r in got] == list(range(5000))  # in order, none lost
        assert all(r.error == "rank 0: " + error[:MAX_ERROR_CHARS] for r in got)
        assert receiver.stats().datagrams > 1
    finally:
        sender.close()
        receiver.close()


def test_bad_duplicate_and_out_of_range_reports_are_dropped_and_counted(
    channel: str, rundir: str
) -> None:
    receiver = ResultsReceiver(channel, tp_size=2, directory=rundir)
    peers: list[RawPeer] = []
    try:
        for junk in (b"\x80not a payload", encode(0, [TransferResult(1, True)])[0][:-1]):
            peer = RawPeer(rundir, channel)
            peers.append(peer)
            peer.send(junk)  # authentic but malformed: dropped, connection closed
            drain(receiver, receiver.stats().datagrams + 1)
            assert peer.closed_by_peer()
        peer = RawPeer(rundir, channel)
        peers.append(peer)
        (good,) = encode(0, [TransferResult(5, True)])
        peer.send(good)
        peer.send(good)  # rank 0 reports transfer 5 twice
        (other,) = encode(1, [TransferResult(5, True)])
        peer_1 = RawPeer(rundir, channel)
        peers.append(peer_1)
        peer_1.send(encode(7, [TransferResult(5, True)])[0])  # no rank 7
        peer_1 = RawPeer(rundir, channel)
        peers.append(peer_1)
        peer_1.send(other)
        got = drain(receiver, 2 + 2 + 1 + 1)
        assert got == [TransferResult(5, True, num_ranks=2)]
        stats = receiver.stats()
        assert (stats.rejected_datagrams, stats.rejected_results) == (2, 2)
    finally:
        for peer in peers:
            peer.close()
        receiver.close()


def test_one_poll_reads_a_bounded_number_of_messages_per_connection(
    channel: str, rundir: str
) -> None:
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    peer = RawPeer(rundir, channel)
    try:
        if os.getuid() == 0:  # room for every message before the receiver reads
            peer.sock.setsockopt(socket.SOL_SOCKET, 32, 8 << 20)  # SO_SNDBUFFORCE
        count = MESSAGES_PER_POLL + 44
        peer.sock.settimeout(WAIT_S)
        for t in range(count):
            peer.send(encode(0, [TransferResult(t, True)])[0])
        first = receiver.poll()
        assert len(first) == MESSAGES_PER_POLL  # the rest waits in the kernel
        rest = drain(receiver, count)
        assert [r.transfer_id for r in first + rest] == list(range(count))
    finally:
        peer.close()
        receiver.close()


def test_replayed_messages_are_refused(channel: str, rundir: str) -> None:
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    a = RawPeer(rundir, channel)
    b = RawPeer(rundir, channel, nonce=a.nonce)  # same nonce, another connection
    try:
        recorded = a.send(encode(0, [TransferResult(1, True)])[0])
        assert drain(receiver, 1) == [TransferResult(1, True)]
        b.sock.send(recorded)  # the recorded message on another connection
        a.sock.send(recorded)  # and again on its own (same sequence number)
        assert drain(receiver, 3) == []
        assert receiver.stats().rejected_datagrams == 2
        assert a.closed_by_peer() and b.closed_by_peer()
    finally:
        a.close()
        b.close()
        receiver.close()
    second = ResultsReceiver(channel, tp_size=1, directory=rundir)
    c = RawPeer(rundir, channel)
    try:
        c.sock.send(recorded)  # to the next receiver on the name: its epoch differs
        assert drain(second, 1) == []
        assert second.stats().rejected_datagrams == 1
    finally:
        c.close()
        second.close()


def test_close_frees_the_name_at_once_without_the_garbage_collector(
    channel: str, rundir: str
) -> None:
    gc.disable()  # nothing may depend on a finalizer
    try:
        receivers = []
        for _ in range(3):
            receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
            receivers.append(receiver)  # kept referenced: only close() can free it
            with pytest.raises(OSError, match=rf"{channel}.*pid {os.getpid()}"):
                ResultsReceiver(channel, tp_size=1, directory=rundir)
            receiver.close()
            receiver.close()  # idempotent
            assert receiver.closed and receiver.poll() == []
            assert os.listdir(rundir) == []  # socket, key and lock file gone
    finally:
        gc.enable()


def _bind_and_close_repeatedly(directory: str, name: str, marker: str, rounds: int) -> None:
    held = violations = 0
    deadline = time.monotonic() + WAIT_S
    while held < rounds and time.monotonic() < deadline:
        try:
            receiver = ResultsReceiver(name, tp_size=1, directory=directory)
        except OSError:
            continue
        held += 1
        try:  # nobody else may hold the name now
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            violations += 1
        else:
            time.sleep(0.0005)
            os.unlink(marker)
        receiver.close()
    os._exit(2 if violations else 0 if held == rounds else 3)


def test_receivers_racing_for_one_name_never_hold_it_together(
    channel: str, rundir: str, tmp_path: Path
) -> None:
    marker = str(tmp_path / "held")
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_bind_and_close_repeatedly, args=(rundir, channel, marker, 50))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]  # each held it 50 times, alone


def test_a_killed_scheduler_leaves_nothing_that_blocks_the_next(
    channel: str, rundir: str
) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child binds and waits to be killed
        try:
            ResultsReceiver(channel, tp_size=1, directory=rundir)
            os.write(1, b"")
            time.sleep(60)
        finally:
            os._exit(1)
    deadline = time.monotonic() + WAIT_S
    sock_path = os.path.join(rundir, f"{channel}.sock")
    while not os.path.exists(sock_path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(sock_path)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert os.path.exists(sock_path)  # stale: the lock died with the process
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    sender = ResultsSender(channel, 0, directory=rundir)
    try:
        assert sender.send([TransferResult(9, True)]) == 1  # until acknowledged
        assert collect(receiver, 1, sender) == [TransferResult(9, True)]
    finally:
        sender.close()
        receiver.close()


def test_a_forked_child_does_not_keep_the_name(channel: str, rundir: str) -> None:
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child outlives the parent's receiver
        os.close(write_end)
        os.write(ready_write, b"r")  # its fork handlers ran before this line
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"r"
        os.close(ready_read)
        receiver.close()
        again = ResultsReceiver(channel, tp_size=1, directory=rundir)  # child still alive
        again.close()
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)


def test_the_environment_secret_must_match_on_both_ends(
    channel: str, rundir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(rc.SECRET_ENV, "engine-secret-0123456789")
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    try:
        assert not os.path.exists(os.path.join(rundir, f"{channel}.key"))
        good = ResultsSender(channel, 0, directory=rundir)
        good.send([TransferResult(1, True)])
        assert collect(receiver, 1, good) == [TransferResult(1, True)]
        good.close()
        monkeypatch.setenv(rc.SECRET_ENV, "another-secret-0123456789")
        wrong = ResultsSender(channel, 0, directory=rundir)
        wrong.send([TransferResult(2, True)])
        assert drain(receiver, 2) == []
        assert receiver.stats().rejected_datagrams == 1
        wrong.close()
        monkeypatch.setenv(rc.SECRET_ENV, "short")
        with pytest.raises(ValueError, match=rf"{rc.SECRET_ENV}: 5 bytes, at least 16"):
            ResultsSender(channel, 0, directory=rundir)
    finally:
        receiver.close()


def test_the_directory_comes_from_the_environment_or_a_place_others_cannot_squat(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(rc.RUNTIME_DIR_ENV, "/somewhere/fastkv")
    assert rc.runtime_dir() == "/somewhere/fastkv"
    monkeypatch.delenv(rc.RUNTIME_DIR_ENV)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert rc.runtime_dir() == str(xdg / "fastkv")
    xdg.chmod(0o755)  # not private: not used
    expected = "/run/fastkv" if os.getuid() == 0 else f"fastkv-{os.getuid()}"
    assert rc.runtime_dir().endswith(expected)


def test_names_and_bad_arguments_are_refused_clearly(channel: str, rundir: str) -> None:
    for bad in ("", "x" * 65, "a\0b", "tab\there", "../up", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="name"):
            ResultsReceiver(bad, tp_size=1, directory=rundir)
        with pytest.raises(ValueError, match="name"):
            ResultsSender(bad, 0, directory=rundir)
    assert not os.path.exists(rundir)  # refused before anything was made
    with pytest.raises(ValueError, match="tp_size"):
        ResultsReceiver(channel, tp_size=0, directory=rundir)
    with pytest.raises(ValueError, match="rank"):
        ResultsSender(channel, -1, directory=rundir)
    with pytest.raises(ValueError, match="runtime_dir"):
        ResultsSender(channel, 0, directory="relative/dir")
    sender = ResultsSender(channel, 0, directory=rundir)
    with pytest.raises(TypeError, match="TransferResult"):
        sender.send(["done"])
    assert sender.stats().pending == 0
    sender.close()


def test_wire_format_round_trips_and_rejects_what_it_is_not() -> None:
    results = [
        TransferResult(1, True),
        TransferResult(2**40, False, "boom é", epoch=7),
        LookupResult(4, 2, epoch=2**32 - 1),
    ]
    (payload,) = encode(3, results)
    assert decode(payload) == (3, results)  # each row keeps its cache epoch
    with pytest.raises(ValueError, match="epoch"):
        encode(3, [TransferResult(1, True, epoch=2**32)])
    bad_version = bytes([9]) + payload[1:]
    too_many = payload[:5] + (33).to_bytes(2, "big") + payload[7:]
    for bad in (b"", payload[:-1], payload + b"x", bad_version, too_many, b"[" * 50000):
        with pytest.raises(ValueError, match="datagram"):
            decode(bad)
    key = os.urandom(32)
    frame = frames.seal(key, b"n" * 16, 4, payload, stream=b"s" * 8, first=7)
    assert frames.unseal(key, frame) == (4, payload, b"s" * 8, 7)
    for bad in (frame[:-1] + bytes([frame[-1] ^ 1]), frame[:10], b"x" * (1 << 17)):
        with pytest.raises(ValueError, match="message"):
            frames.unseal(key, bad)


# -- issue 25 items 6-9: acknowledged delivery, bounded accepts, no exception, ---
# -- and a receiver that proves the secret ----------------------------------------


def test_results_sent_to_a_receiver_at_its_connection_cap_stay_until_acknowledged(
    channel: str, rundir: str
) -> None:
    """Item 6: the kernel takes a connection and its messages before the receiver
    accepts it; a receiver at its cap then closes it unread. The sender keeps every
    result until the receiver acknowledged it, and delivers it once there is room."""
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir, max_connections=1)
    holder = RawPeer(rundir, channel)  # takes the one place
    sender = ResultsSender(channel, 0, directory=rundir)
    try:
        assert receiver.poll() == []
        for t in range(10):
            sender.send([TransferResult(t, True)])
        for _ in range(20):
            assert receiver.poll() == []
            sender.flush()
        stats = sender.stats()
        assert (stats.sent, stats.pending) == (0, 10)
        assert receiver.stats().rejected_connections >= 1
        holder.close()  # room again
        got = collect(receiver, 10, sender)
        assert [r.transfer_id for r in got] == list(range(10))
        assert settle(receiver, sender) == []
        assert (sender.stats().sent, sender.stats().pending) == (10, 0)
    finally:
        holder.close()
        sender.close()
        receiver.close()


def test_dead_connections_are_reaped_before_new_ones_are_accepted(
    channel: str, rundir: str
) -> None:
    """Item 6: the first poll after idle connections died frees their places before
    it accepts, so a live worker is never refused for a dead one."""
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir, max_connections=2)
    idle = [RawPeer(rundir, channel) for _ in range(2)]
    sender = ResultsSender(channel, 0, directory=rundir)
    try:
        assert receiver.poll() == [] and receiver.stats().accepted_connections == 2
        for peer in idle:
            peer.close()  # they die while idle
        assert sender.send([TransferResult(1, True)]) == 1  # connects: a hello waits
        assert receiver.poll() == []  # the first poll after they died
        assert receiver.stats().rejected_connections == 0
        assert collect(receiver, 1, sender) == [TransferResult(1, True)]
    finally:
        sender.close()
        receiver.close()


def test_a_result_sent_again_is_applied_once(channel: str, rundir: str) -> None:
    """Item 6: results are numbered in their sender's stream; a message sent again on
    a new connection (the old one died before its acknowledgement was read) is
    recognised and only what is new in it is applied; the acknowledgement says how
    far the stream is applied."""
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    a = RawPeer(rundir, channel)
    b = RawPeer(rundir, channel)
    b.stream = a.stream  # the same worker, reconnected
    try:
        (two,) = encode(0, [TransferResult(1, True), TransferResult(2, True)])
        a.sock.send(frames.seal(a.key, a.nonce, 0, two, stream=a.stream, first=0))
        assert drain(receiver, 1) == [TransferResult(1, True), TransferResult(2, True)]
        (three,) = encode(0, [TransferResult(t, True) for t in (1, 2, 3)])
        b.sock.send(frames.seal(b.key, b.nonce, 0, three, stream=b.stream, first=0))
        assert drain(receiver, 2) == [TransferResult(3, True)]
        assert receiver.stats().duplicates == 2
        assert receiver.stats().rejected_results == 0
        for peer, applied in ((a, 2), (b, 3)):  # each acknowledged, sealed for it
            peer.sock.settimeout(WAIT_S)
            ack = frames.unseal(
                frames.ack_key(*_secret_and_epoch(rundir, channel), peer.nonce),
                peer.sock.recv(1 << 16),
            )
            assert (ack.seq, decode_ack(ack.payload)) == (0, applied)
    finally:
        a.close()
        b.close()
        receiver.close()


def _secret_and_epoch(directory: str, name: str) -> tuple[bytes, bytes]:
    dir_fd = private_dir.open_private_dir(directory)
    try:
        secret = private_dir.load_secret(dir_fd, name)
        epoch = private_dir.read_epoch(dir_fd, name)
    finally:
        os.close(dir_fd)
    assert epoch is not None
    return secret, epoch


def test_a_sender_whose_connection_died_unacknowledged_delivers_each_result_once(
    channel: str, rundir: str
) -> None:
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    sender = ResultsSender(channel, 0, directory=rundir)
    try:
        sender.send([TransferResult(1, True), TransferResult(2, True)])
        got = collect(receiver, 2)
        while len(got) < 2 and sender.stats().pending:
            sender.flush()
            got += collect(receiver, 2 - len(got))
        assert [r.transfer_id for r in got] == [1, 2]
        sender._disconnect()  # lost before it read the acknowledgement
        assert sender.stats().resent == 2
        assert settle(receiver, sender) == []  # none applied twice
        assert (sender.stats().sent, sender.stats().pending) == (2, 0)
    finally:
        sender.close()
        receiver.close()


def test_one_poll_accepts_a_bounded_number_of_connections(channel: str, rundir: str) -> None:
    """Item 7: a flood of connections costs each poll at most ACCEPTS_PER_POLL
    accepts; the rest wait in the backlog for the next polls."""
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir, max_connections=100)
    peers = [RawPeer(rundir, channel) for _ in range(3 * ACCEPTS_PER_POLL)]
    try:
        for polls in range(1, 4):
            assert receiver.poll() == []
            assert receiver.stats().accepted_connections == polls * ACCEPTS_PER_POLL
        assert receiver.poll() == [] and receiver.stats().accepted_connections == len(peers)
    finally:
        for peer in peers:
            peer.close()
        receiver.close()


def test_no_free_file_descriptor_never_raises_from_send_or_flush(
    channel: str, rundir: str
) -> None:
    """Item 8: a reconnect that finds no free fd keeps the result queued, counts the
    failure and says why in stats(); the engine's step sees no exception."""
    receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)
    sender = ResultsSender(channel, 0, directory=rundir)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 16, hard))
        with pytest.raises(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        assert sender.send([TransferResult(1, True)]) == 1
        assert sender.flush() == 1
        stats = sender.stats()
        assert stats.errors >= 2 and "Too many open files" in stats.last_error
        for fd in held:
            os.close(fd)
        held.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert collect(receiver, 1, sender) == [TransferResult(1, True)]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sender.close()
        receiver.close()


def _killed_receiver(directory: str, name: str) -> None:
    """Bind `name` in a child and kill it: a stale socket, lock and key stay."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child binds and waits to be killed
        try:
            ResultsReceiver(name, tp_size=1, directory=directory)
            os.write(ready_write, b"r")
            time.sleep(60)
        finally:
            os._exit(1)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"r"
    os.close(ready_read)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_a_process_binding_a_dead_schedulers_socket_gets_no_result(
    channel: str, rundir: str
) -> None:
    """Item 9: a same-uid process that binds the socket of a scheduler that died gets
    the worker's hello and nothing else (it cannot acknowledge it without the
    secret; a reflected hello does not verify as an acknowledgement); once the real
    scheduler binds again, the worker moves to it at its next flush."""
    _killed_receiver(rundir, channel)
    path = os.path.join(rundir, f"{channel}.sock")
    os.unlink(path)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    squatter.bind(path)
    squatter.listen(8)
    squatter.setblocking(False)
    sender = ResultsSender(channel, 0, directory=rundir)
    heard: list[bytes] = []
    conns: list[socket.socket] = []
    try:
        assert sender.send([TransferResult(t, True) for t in range(3)]) == 3
        for _ in range(50):
            sender.flush()
            with contextlib.suppress(BlockingIOError):
                conns.append(squatter.accept()[0])
            for conn in conns:
                with contextlib.suppress(OSError):
                    frame = conn.recv(1 << 16, socket.MSG_DONTWAIT)
                    if frame:  # b"": the sender gave this connection up
                        heard.append(frame)
                        conn.send(frame)  # reflected as if it were an acknowledgement
            time.sleep(0.002)
        payloads = [f[frames.HEAD_BYTES : -frames.MAC_BYTES] for f in heard]
        assert payloads and all(decode(p)[1] == [] for p in payloads)  # hellos only
        stats = sender.stats()
        assert (stats.sent, stats.pending) == (0, 3)
        assert "acknowledgement refused" in stats.last_error
        receiver = ResultsReceiver(channel, tp_size=1, directory=rundir)  # back
        try:
            got = collect(receiver, 3, sender)
            assert [r.transfer_id for r in got] == [0, 1, 2]
            assert settle(receiver, sender) == [] and sender.stats().sent == 3
        finally:
            receiver.close()
    finally:
        for conn in conns:
            conn.close()
        squatter.close()
        sender.close()


def test_pd_rank_reports_pass_per_rank_and_name_only_the_sending_rank(rundir: str) -> None:
    from fastkv.pd.messages import RankReport

    name = f"pd-{os.getpid()}"
    receiver = ResultsReceiver(name, 2, directory=rundir)
    s1 = ResultsSender(name, 1, directory=rundir)
    try:
        # Not combined over ranks: rank 1's report alone comes out, as rank 1's.
        s1.send([RankReport(7, 3, 1, False, "x" * (MAX_ERROR_CHARS + 5))])
        out = collect(receiver, 1, s1)
        assert out == [RankReport(7, 3, 1, False, "x" * MAX_ERROR_CHARS)]
        # A rank cannot report for another: refused before anything is queued.
        with pytest.raises(ValueError, match=r"results\[0\]\.rank"):
            s1.send([RankReport(8, 3, 0, True)])
        assert s1.pending == 0
    finally:
        s1.close()
        receiver.close()
    # The row names no rank: decode gives it the payload's (the connection's).
    (payload,) = encode(1, [RankReport(9, 2, 1, True, "")])
    assert decode(payload) == (1, [RankReport(9, 2, 1, True, "")])
    with pytest.raises(ValueError, match="results\\[0\\] is not"):
        decode(payload[:-2] + b"\x07" + payload[-1:])  # flags 7: not ok/fenced bits
    # A D rank's failure that does not fence (a failed write: its bytes may still
    # land) keeps saying so across the channel: D then holds the blocks to its grace.
    for ok, fenced in ((False, False), (False, True), (True, True)):
        report = RankReport(9, 2, 1, ok, "why", fenced)
        assert decode(encode(1, [report])[0]) == (1, [report])
