"""The results channel against other tenants (issue 15 item 4), with real other
users (`setpriv --reuid=65534`) and a real other container (a process in its own
mount namespace that shares the network namespace):

- stalled: another uid flooding every address it can name costs the engine nothing;
- squatted: another uid taking the names first neither blocks the scheduler (when it
  squats what earlier versions used) nor receives results (when it squats the
  directory: both ends refuse it, saying why);
- forged: no message without the deployment secret is accepted, from another
  container or from root beside the engine, and what is logged about them is bounded;
- crashed: nothing a peer sends makes `poll()` raise.

The channel's directory is set through $FASTKV_RUNTIME_DIR under the system's temp
directory (sticky, world-writable: where other users can reach if the channel lets
them), never through a private pytest directory that would keep them out instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest

from fastkv.channel import ResultsReceiver, ResultsSender
from fastkv.metadata import TransferResult

pytestmark = pytest.mark.skipif(
    os.getuid() != 0, reason="acting as another user or namespace needs root"
)

WAIT_S = 10.0
NOBODY = 65534
OLD_ADDRESS_PREFIX = b"\0fastkv-results-"  # the abstract names of earlier versions

# Runs as the attacker; stdlib only. argv: mode, directory, channel name, seconds.
ATTACKER = r"""
import json, os, socket, sys, time
mode, directory, name, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
path = os.path.join(directory, name + ".sock")
abstract = b"\0fastkv-results-" + name.encode()
forged = json.dumps({"v": 1, "rank": 0, "results": [[7, True, ""]]}).encode()
counts = {"abstract": 0, "path_dgram": 0, "path_connect": 0, "path_sent": 0, "received": 0}
errors = set()
if mode == "squat_abstract":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(abstract)
    s.settimeout(0.05)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.recv(1 << 16)
            counts["received"] += 1
        except socket.timeout:
            pass
elif mode == "squat_dir":
    os.mkdir(directory, 0o777)
    os.chmod(directory, 0o777)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    os.chmod(path, 0o777)
    s.listen(16)
    s.settimeout(0.05)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            c, _ = s.accept()
            c.settimeout(0.05)
            counts["received"] += len(c.recv(1 << 16))
        except (socket.timeout, OSError):
            pass
elif mode == "squat_symlink":
    target = directory + ".mine"
    os.mkdir(target, 0o700)
    os.symlink(target, directory)
    print("ready", flush=True)
else:  # flood / forge: every address it can name, as fast as it can
    print("ready", flush=True)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end and (mode == "flood" or n < 20):
        n += 1
        for kind, family, address in (
            ("abstract", socket.SOCK_DGRAM, abstract),
            ("path_dgram", socket.SOCK_DGRAM, path),
            ("path_connect", socket.SOCK_SEQPACKET, path),
        ):
            s = socket.socket(socket.AF_UNIX, family | socket.SOCK_NONBLOCK)
            try:
                if family == socket.SOCK_DGRAM:
                    s.sendto(b"[" * 50000 if n % 2 else forged, address)
                else:
                    s.connect(address)
                    counts["path_connect"] += 1
                    s.send(b"FKR2" + os.urandom(64))
                    kind = "path_sent"
                counts[kind] += 1
            except OSError as e:
                errors.add(f"{kind}: {e.__class__.__name__}")
            finally:
                s.close()
counts["errors"] = sorted(errors)
print(json.dumps(counts), flush=True)
"""


def _nobody_python() -> str:
    """An interpreter user 65534 can run (this venv's may live under /root)."""
    for exe in (sys.executable, "/usr/bin/python3", shutil.which("python3") or ""):
        if (
            exe
            and subprocess.run(
                [*_as_nobody(), exe, "-c", "pass"], capture_output=True, timeout=30
            ).returncode
            == 0
        ):
            return exe
    raise AssertionError("no Python interpreter that uid 65534 can run")


def _as_nobody() -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


class Attacker:
    """The attacker's process; `ready()` once it has set up, `report()` its counts."""

    def __init__(self, prefix: list[str], mode: str, directory: str, name: str, seconds: float):
        self.proc = subprocess.Popen(
            [*prefix, "-c", ATTACKER, mode, directory, name, str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", (line, self.proc.stderr.read() if self.proc.stderr else "")

    def report(self) -> dict:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.wait(timeout=60)
        out, err = self.proc.stdout.read(), self.proc.stderr.read()  # after readline()
        assert self.proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A fresh sticky world-writable directory, as /tmp is, that the test owns."""
    base = os.path.join(tempfile.gettempdir(), f"fkv-attack-{uuid.uuid4().hex[:12]}")
    os.mkdir(base)
    os.chmod(base, 0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def rundir(shared_tmp: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The channel's directory, given to both ends through the environment."""
    path = os.path.join(shared_tmp, "fastkv-run")
    monkeypatch.setenv("FASTKV_RUNTIME_DIR", path)
    return path


def poll_until(receiver: ResultsReceiver, count: int, sender: ResultsSender | None = None):
    out: list[TransferResult] = []
    deadline = time.monotonic() + WAIT_S
    while len(out) < count and time.monotonic() < deadline:
        out += receiver.poll()
        if sender is not None:
            sender.flush()
        time.sleep(0.002)
    return out


def test_a_flood_from_another_user_reaches_nothing_and_results_keep_flowing(
    channel: str, rundir: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    receiver = ResultsReceiver(channel, tp_size=1)
    sender = ResultsSender(channel, 0)
    flood = Attacker([*_as_nobody(), _nobody_python()], "flood", rundir, channel, 2.0)
    try:
        flood.ready()
        got: list[TransferResult] = []
        for t in range(100):  # while the flood runs
            sender.send([TransferResult(t, True)])
            got += receiver.poll()
            time.sleep(0.005)
        got += poll_until(receiver, 100 - len(got), sender)
        counts = flood.report()
        assert [r.transfer_id for r in got] == list(range(100))
        # Nothing the flooder sent cost the engine a read, a parse or a log line.
        assert counts["abstract"] == counts["path_dgram"] == counts["path_connect"] == 0, counts
        assert "path_connect: PermissionError" in counts["errors"], counts
        stats = receiver.stats()
        assert (stats.rejected_datagrams, stats.rejected_connections) == (0, 0)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        sender.close()
        receiver.close()


def test_another_user_squatting_the_old_abstract_name_blocks_nothing_and_gets_nothing(
    channel: str, rundir: str
) -> None:
    squatter = Attacker(
        [*_as_nobody(), _nobody_python()], "squat_abstract", rundir, channel, 1.5
    )
    squatter.ready()
    receiver = ResultsReceiver(channel, tp_size=1)  # starts although the name is taken
    sender = ResultsSender(channel, 0)
    try:
        sender.send([TransferResult(1, False, "request r-42 failed")])
        assert poll_until(receiver, 1, sender) == [
            TransferResult(1, False, "rank 0: request r-42 failed")
        ]
        assert squatter.report()["received"] == 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("mode", ["squat_dir", "squat_symlink"])
def test_a_directory_another_user_made_first_is_refused_by_both_ends(
    channel: str, rundir: str, mode: str
) -> None:
    squatter = Attacker([*_as_nobody(), _nobody_python()], mode, rundir, channel, 1.5)
    squatter.ready()
    why = "owned by uid 65534" if mode == "squat_dir" else "symbolic link"
    with pytest.raises(PermissionError, match=why):
        ResultsReceiver(channel, tp_size=1)
    with pytest.raises(PermissionError, match=why):
        ResultsSender(channel, 0)  # a worker never hands its results to the squatter
    assert squatter.report()["received"] == 0


def test_a_directory_others_can_write_is_refused(channel: str, rundir: str) -> None:
    os.mkdir(rundir)
    os.chmod(rundir, 0o777)  # this user's, but open to everyone
    with pytest.raises(PermissionError, match="mode 0o777 lets others in"):
        ResultsReceiver(channel, tp_size=1)
    with pytest.raises(PermissionError, match="mode 0o777"):
        ResultsSender(channel, 0)


def test_root_in_another_container_sharing_the_network_cannot_forge_results(
    channel: str, rundir: str, shared_tmp: str
) -> None:
    receiver = ResultsReceiver(channel, tp_size=1)
    # Another container: its own mount namespace (its own view of shared_tmp), the
    # same network namespace (the abstract names), root.
    hide = f'mount -t tmpfs tmpfs "{shared_tmp}" && exec "$0" "$@"'
    forger = Attacker(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--fork",
            "sh",
            "-c",
            hide,
            sys.executable,
        ],
        "forge",
        rundir,
        channel,
        5.0,
    )
    try:
        forger.ready()
        counts = forger.report()
        assert counts["path_connect"] == 0 and counts["path_dgram"] == 0, counts
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert receiver.poll() == []
            time.sleep(0.01)
        assert receiver.stats().datagrams == 0
    finally:
        receiver.close()


def test_root_beside_the_engine_without_the_secret_cannot_forge_results(
    channel: str, rundir: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    receiver = ResultsReceiver(channel, tp_size=1)
    forger = Attacker([sys.executable], "forge", rundir, channel, 5.0)  # root: reaches the path
    try:
        forger.ready()
        counts = forger.report()
        assert counts["path_sent"] == 20, counts  # root got in, 20 connections
        got: list[TransferResult] = []
        deadline = time.monotonic() + WAIT_S
        while receiver.stats().rejected_datagrams < 20 and time.monotonic() < deadline:
            got += receiver.poll()
            time.sleep(0.002)
        assert got == [] and receiver.stats().results == 0
        assert receiver.stats().rejected_datagrams == 20
        lines = [r for r in caplog.records if r.name.startswith("fastkv.channel")]
        assert 1 <= len(lines) <= 6  # rate-limited: 5, then a suppressed count later
    finally:
        receiver.close()


def test_nothing_a_peer_sends_makes_poll_raise(channel: str, rundir: str) -> None:
    from fastkv.channel.frames import connection_key, seal
    from fastkv.channel.private_dir import load_secret, open_private_dir, read_epoch

    receiver = ResultsReceiver(channel, tp_size=1)
    try:
        deep = b"[" * 50000
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:  # what used to crash it (now nothing listens there)
            raw.sendto(deep, OLD_ADDRESS_PREFIX + channel.encode())
        except ConnectionRefusedError:
            pass
        finally:
            raw.close()
        assert receiver.poll() == []
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.connect(receiver.path)  # and unauthenticated on the socket itself
        raw.send(deep)
        raw.close()
        assert receiver.poll() == []
        dir_fd = open_private_dir(rundir)
        try:
            secret, epoch = load_secret(dir_fd, channel), read_epoch(dir_fd, channel)
        finally:
            os.close(dir_fd)
        assert epoch is not None
        rng = __import__("random").Random(15)
        payloads = [deep, b"", b"\x02" + b"\xff" * 6, os.urandom(1 << 15)]
        payloads += [
            bytes(rng.randrange(256) for _ in range(rng.randrange(64))) for _ in range(50)
        ]
        for payload in payloads:  # authentic (the secret's holder) but malformed
            nonce = os.urandom(16)
            key = connection_key(secret, epoch, nonce)
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            peer.connect(os.path.join(rundir, f"{channel}.sock"))
            peer.send(seal(key, nonce, 0, payload))
            peer.close()
            assert receiver.poll() == []
        assert receiver.stats().rejected_datagrams == len(payloads) + 1
        assert stat.S_ISSOCK(os.lstat(receiver.path).st_mode)  # still serving
        sender = ResultsSender(channel, 0)
        sender.send([TransferResult(3, True)])
        assert poll_until(receiver, 1, sender) == [TransferResult(3, True)]
        sender.close()
    finally:
        receiver.close()


def test_another_users_link_or_directory_above_the_channel_is_refused(
    channel: str, shared_tmp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25 item 10: a link or directory of another user anywhere above the
    channel's directory is refused by both ends; root's links stay usable."""
    theirs = os.path.join(shared_tmp, "theirs")
    aimed_at = os.path.join(shared_tmp, "aimed-at")  # root's, where the link points
    os.mkdir(aimed_at, 0o755)
    nobody = [*_as_nobody()]
    assert subprocess.run([*nobody, "mkdir", "-m", "755", theirs]).returncode == 0
    link = os.path.join(theirs, "link")
    assert subprocess.run([*nobody, "ln", "-s", aimed_at, link]).returncode == 0
    monkeypatch.setenv("FASTKV_RUNTIME_DIR", os.path.join(link, "run"))
    with pytest.raises(PermissionError, match=f"{theirs} on its path is owned by uid 65534"):
        ResultsReceiver(channel, tp_size=1)
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        ResultsSender(channel, 0)
    assert os.listdir(aimed_at) == []  # nothing adopted or written there
    roots = os.path.join(shared_tmp, "roots-link")
    os.symlink(aimed_at, roots)
    monkeypatch.setenv("FASTKV_RUNTIME_DIR", os.path.join(roots, "run"))
    receiver = ResultsReceiver(channel, tp_size=1)
    sender = ResultsSender(channel, 0)
    try:
        sender.send([TransferResult(1, True)])
        assert poll_until(receiver, 1, sender) == [TransferResult(1, True)]
    finally:
        sender.close()
        receiver.close()
