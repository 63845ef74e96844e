"""Mooncake Transfer Engine scenarios for `MooncakeTransport`, each run by
test_mooncake_te.py as its own process inside a private network namespace (the
engine listens on every interface):

    unshare --net --fork python tests/pd/te_cases.py CASE LOGDIR

A case that needs a second process starts this file again as a peer
(`--peer receiver|sender`), in the same namespace, and talks to it by JSON lines
on its stdin/stdout. A case prints one line `RESULT <json>` for the test to
assert on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
os.environ.setdefault("GLOG_minloglevel", "1")  # the engine logs every batch at INFO

import numpy as np  # noqa: E402
from transport_contract import CHECKS, pair_from  # noqa: E402

from fastkv.pd.mooncake_te import MooncakeTransport  # noqa: E402
from fastkv.pd.transport import Piece, TransportError  # noqa: E402

HOST = "127.0.0.1"
GUARD = 64 << 10


# -- the peer process ---------------------------------------------------------


def peer_receiver(size: int) -> None:
    """Registers `size` zero bytes (plus an unregistered guard) and answers commands."""
    t = MooncakeTransport(HOST)
    buf = np.zeros(size + GUARD, dtype=np.uint8)
    t.register(buf.ctypes.data, size)
    print(json.dumps({"address": t.address, "base": buf.ctypes.data}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "notices":
            got: list[list[str]] = []
            end = time.monotonic() + cmd["timeout_s"]
            while len(got) < cmd["count"] and time.monotonic() < end:
                got += [[name, payload.hex()] for name, payload in t.poll_notices()]
                time.sleep(0.002)
            print(json.dumps({"notices": got}), flush=True)
        elif cmd["cmd"] == "dump":
            buf.tofile(cmd["path"])
            print(json.dumps({"dumped": True}), flush=True)
        else:
            break
    t.close()


def peer_sender(peer: str, base: int, piece_bytes: int, pieces: int, rounds: int) -> None:
    """Writes the same batch `rounds` times, then one notice; reports each round."""
    t = MooncakeTransport(HOST)
    src = np.random.default_rng(7).integers(0, 256, piece_bytes * pieces, dtype=np.uint8)
    t.register(src.ctypes.data, src.nbytes)
    batch = [
        Piece(src.ctypes.data + i * piece_bytes, base + i * piece_bytes, piece_bytes)
        for i in range(pieces)
    ]
    print(json.dumps({"ready": t.address}), flush=True)
    for r in range(rounds):
        state = t.write(peer, batch).wait(30)
        print(json.dumps({"round": r, "state": state.name}), flush=True)
    t.notify(peer, b"all rounds written", 5.0)
    print(json.dumps({"notified": True}), flush=True)


class Peer:
    def __init__(self, logdir: Path, role: str, *args: Any) -> None:
        self.log = open(logdir / f"peer-{role}.log", "ab")  # noqa: SIM115 (closed in close)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--peer", role, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.hello = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait(10)}")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.read()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


# -- the cases ----------------------------------------------------------------


def contract(logdir: Path) -> dict:
    """Every check of transport_contract.py, both ends in this process."""
    out = {}
    for name, check in CHECKS.items():
        try:
            check(lambda: pair_from(MooncakeTransport(HOST), MooncakeTransport(HOST)))
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()[-3000:]
    return out


def bytes_two_process(logdir: Path) -> dict:
    """200 pieces of random sizes to shuffled places in another process, a notice,
    then a write past its region; the receiver's memory compared byte for byte."""
    size = 8 << 20
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    lengths = rng.integers(1, 32 << 10, 200)
    slots = rng.permutation(200) * (size // 200)
    offsets = np.cumsum(lengths) - lengths
    peer = Peer(logdir, "receiver", size)
    t = MooncakeTransport(HOST)
    try:
        t.register(src.ctypes.data, size)
        base, address = peer.hello["base"], peer.hello["address"]
        pieces = [
            Piece(src.ctypes.data + int(o), base + int(s), int(n))
            for o, s, n in zip(offsets, slots, lengths, strict=True)
        ]
        state = t.write(address, pieces).wait(30)
        t.notify(address, b"sent\x00" + bytes(range(256)), 5.0)
        notices = peer.ask(cmd="notices", count=1, timeout_s=5)["notices"]
        past = t.write(address, [Piece(src.ctypes.data, base + size - 10, 4096)]).wait(30)
        peer.ask(cmd="dump", path=str(logdir / "dst.bin"))
        got = np.fromfile(logdir / "dst.bin", dtype=np.uint8)
        want = np.zeros(size + GUARD, dtype=np.uint8)
        for o, s, n in zip(offsets, slots, lengths, strict=True):
            want[s : s + n] = src[o : o + n]
        # the refused piece: bytes inside the region may land, none past it
        inside = got[size - 10 : size]
        inside_ok = not inside.any() or np.array_equal(inside, src[:10])
        got[size - 10 : size] = want[size - 10 : size]
        return {
            "state": state.name,
            "exact": bool(np.array_equal(got, want)),
            "notices": notices,
            "sender": t.address,
            "past_state": past.name,
            "inside_ok": inside_ok,
        }
    finally:
        t.close()
        peer.close()


def receiver_killed(logdir: Path) -> dict:
    """The receiver stopped with 64 MiB in flight, then killed: the batch fails
    promptly, and so does a later write to the dead peer."""
    size = 64 << 20
    src = np.ones(size, dtype=np.uint8)
    peer = Peer(logdir, "receiver", size)
    t = MooncakeTransport(HOST, write_timeout_s=60)
    try:
        t.register(src.ctypes.data, size)
        base, address = peer.hello["base"], peer.hello["address"]
        t.connect(address, 5.0)
        peer.signal(signal.SIGSTOP)
        n = size // 16
        pieces = [Piece(src.ctypes.data + i * n, base + i * n, n) for i in range(16)]
        handle = t.write(address, pieces)
        time.sleep(0.3)
        stalled = handle.state().name
        peer.signal(signal.SIGKILL)
        peer.proc.wait(10)
        killed_at = time.monotonic()
        state = handle.wait(30)
        settle_s = time.monotonic() - killed_at
        t0 = time.monotonic()
        try:
            later = t.write(address, pieces[:1]).wait(30).name
        except TransportError as exc:
            later = f"TransportError: {exc}"
        return {
            "stalled": stalled,
            "state": state.name,
            "settle_after_kill_s": settle_s,
            "later": later,
            "later_s": time.monotonic() - t0,
        }
    finally:
        t.close()
        peer.close()


def receiver_frozen(logdir: Path) -> dict:
    """A receiver that stops answering: past the transport's deadline the write
    stays PENDING while its batch is inside the engine (its bytes sit in the
    frozen receiver's socket and would land once it runs again), and is FAILED
    once the engine's own timeout (5 s here) ends the batch; the notice raises by
    its timeout; neither changes afterwards."""
    os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # read when an engine is made
    size = 64 << 20
    src = np.ones(size, dtype=np.uint8)
    peer = Peer(logdir, "receiver", size)
    t = MooncakeTransport(HOST, write_timeout_s=1.0)
    try:
        t.register(src.ctypes.data, size)
        base, address = peer.hello["base"], peer.hello["address"]
        t.connect(address, 5.0)
        t2 = MooncakeTransport(HOST, write_timeout_s=60)
        t2.register(src.ctypes.data, size)
        t2.connect(address, 5.0)
        peer.signal(signal.SIGSTOP)
        n = size // 16
        pieces = [Piece(src.ctypes.data + i * n, base + i * n, n) for i in range(16)]
        t0 = time.monotonic()
        handle = t.write(address, pieces)
        at_deadline = handle.wait(1.5)  # past write_timeout_s, the batch still inside
        state = handle.wait(30)
        failed_after_s = time.monotonic() - t0
        t0 = time.monotonic()
        try:
            t.notify(address, b"x", 0.5)
            notify = "delivered"
        except TransportError as exc:
            notify = str(exc)
        notify_s = time.monotonic() - t0
        # closing with a write stuck in the engine: close returns by its timeout,
        # saying the engine still holds a batch; the write stays PENDING (its
        # bytes may still land) until the engine gives the batch back
        stuck = t2.write(address, pieces)
        time.sleep(0.2)
        stuck_before = stuck.state().name
        t0 = time.monotonic()
        released = t2.close(timeout_s=0.5)
        close_s = time.monotonic() - t0
        stuck_after = stuck.state().name
        peer.signal(signal.SIGCONT)
        released_later = t2.close(timeout_s=20)
        return {
            "at_deadline": at_deadline.name,
            "state": state.name,
            "failed_after_s": failed_after_s,
            "notify": notify,
            "notify_s": notify_s,
            "state_later": handle.state().name,
            "stuck_before_close": stuck_before,
            "stuck_after_close": stuck_after,
            "released": released,
            "close_s": close_s,
            "released_later": released_later,
            "stuck_later": stuck.state().name,
            "regions_later": t2.regions(),
        }
    finally:
        t.close()
        peer.close()


def sender_killed(logdir: Path) -> dict:
    """The sender killed while its batches stream in: the receiver gets no notice by
    its own deadline, and its transport still takes a new sender's batch."""
    piece_bytes, pieces = 1 << 20, 64
    size = piece_bytes * pieces
    t = MooncakeTransport(HOST)
    dst = np.zeros(size, dtype=np.uint8)
    t.register(dst.ctypes.data, size)
    peer = Peer(logdir, "sender", t.address, dst.ctypes.data, piece_bytes, pieces, 10_000)
    try:
        first = peer.read()  # one round landed in full: bytes are streaming
        time.sleep(0.05)
        peer.signal(signal.SIGKILL)
        peer.proc.wait(10)
        t0 = time.monotonic()
        notices = []
        while time.monotonic() - t0 < 1.0:  # the receiver's own deadline
            notices += t.poll_notices()
            time.sleep(0.01)
        other = MooncakeTransport(HOST)
        try:
            src = np.full(4096, 9, dtype=np.uint8)
            other.register(src.ctypes.data, 4096)
            again = other.write(t.address, [Piece(src.ctypes.data, dst.ctypes.data, 4096)])
            again_state = again.wait(30).name
            other.notify(t.address, b"fresh", 5.0)
            fresh = []
            t1 = time.monotonic()
            while not fresh and time.monotonic() - t1 < 5:
                fresh = t.poll_notices()
                time.sleep(0.002)
        finally:
            other.close()
        return {
            "first": first,
            "landed": bool(dst[-piece_bytes:].any()),
            "notices": [[n, p.hex()] for n, p in notices],
            "again": again_state,
            "again_exact": bool((dst[:4096] == 9).all()),
            "fresh": [[n, p.hex()] for n, p in fresh],
            "other": other.address,
        }
    finally:
        t.close()
        peer.close()


def listen(logdir: Path) -> dict:
    """What the engine bound, and the strict mode's answer to it."""
    t = MooncakeTransport(HOST)
    try:
        out: dict[str, Any] = {
            "address": t.address,
            "listening": t.listening(),
            "wildcard": t.listens_on_wildcard(),
        }
    finally:
        t.close()
    try:
        MooncakeTransport(HOST, require_private_listen=True).close()
        out["strict"] = "started"
    except TransportError as exc:
        out["strict"] = str(exc)
    return out


def long_engine_timeout(logdir: Path) -> dict:
    """An engine made with `MC_TRANSFER_TIMEOUT` of two hours: its release bound is
    past an hour, the longest a timeout may be; close with no timeout, and the
    strict mode's refusal (which closes), still work."""
    os.environ["MC_TRANSFER_TIMEOUT"] = "7200"
    out: dict[str, Any] = {}
    t = MooncakeTransport(HOST)
    out["bound"] = t.release_bound_s
    try:
        out["closed"] = t.close()
    except TransportError as exc:
        out["closed"] = str(exc)
    try:
        MooncakeTransport(HOST, require_private_listen=True).close()
        out["strict"] = "started"
    except TransportError as exc:
        out["strict"] = str(exc)
    return out


def notify_racing_close(logdir: Path) -> dict:
    """A notice queued behind busy notifier threads when close runs: `notify`
    raises TransportError (its contract), whatever the pool does with it."""
    import threading

    t = MooncakeTransport(HOST)
    busy, release = threading.Semaphore(0), threading.Event()

    def stuck(peer: str, text: str) -> int:  # a peer that does not answer
        busy.release()
        release.wait(10)
        return 0

    t._send_notice = stuck
    errors: list[str] = []

    def send(timeout_s: float) -> None:
        try:
            t.notify("127.0.0.1:1", b"x", timeout_s)
            errors.append("sent")
        except Exception as exc:
            errors.append(type(exc).__name__)

    stalled = [threading.Thread(target=send, args=(0.2,)) for _ in range(2)]
    for th in stalled:
        th.start()
    busy.acquire(timeout=5)
    busy.acquire(timeout=5)  # both notifier threads are inside the peer's call
    queued = threading.Thread(target=send, args=(5.0,))
    queued.start()

    def connect() -> None:
        try:
            t.connect("127.0.0.1:1", 5.0)
            errors.append("connected")
        except Exception as exc:
            errors.append("connect " + type(exc).__name__)

    connecting = threading.Thread(target=connect)
    connecting.start()
    time.sleep(0.2)
    for th in stalled:
        th.join(5)
    closed = t.close(timeout_s=1.0)
    queued.join(5)
    connecting.join(5)
    release.set()
    return {"errors": sorted(errors), "closed": closed}


CASES = {
    "notify_racing_close": notify_racing_close,
    "long_engine_timeout": long_engine_timeout,
    "contract": contract,
    "bytes_two_process": bytes_two_process,
    "receiver_killed": receiver_killed,
    "receiver_frozen": receiver_frozen,
    "sender_killed": sender_killed,
    "listen": listen,
}


def main() -> None:
    if sys.argv[1] == "--peer":
        role, args = sys.argv[2], json.loads(sys.argv[3])
        {"receiver": peer_receiver, "sender": peer_sender}[role](*args)
        sys.stdout.flush()
        os._exit(0)
    case, logdir = sys.argv[1], Path(sys.argv[2])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    code = 0
    try:
        print("RESULT " + json.dumps(CASES[case](logdir)), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        code = 1
    sys.stderr.flush()
    # the engine's threads may still wait on a dead peer: skip their teardown
    os._exit(code)


if __name__ == "__main__":
    main()
