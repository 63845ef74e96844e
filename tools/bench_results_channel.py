"""Result latency over the results channel, idle and under a flood from another
user (issue 15 item 4's target: flooded within 2x of idle).

A worker process sends one result every --interval-ms; the scheduler's end polls
every --poll-ms, as a scheduler loop would. Latency is from just before `send` to the
`poll` that returns the result (CLOCK_MONOTONIC is one clock for all processes).
The flood phase runs, for the same time, a process as uid 65534 (`setpriv --reuid
65534 --regid 65534 --clear-groups`) that sends to every address it can name as fast
as it can: the channel's socket path (connect and datagram) and the abstract name
earlier versions listened on. Needs root (to switch users), like CI.

    .venv/bin/python tools/bench_results_channel.py --seconds 10
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from fastkv.integrations.results_channel import ResultsReceiver, ResultsSender
from fastkv.metadata import TransferResult

FLOODER = r"""
import json, os, socket, sys, time
path, abstract, seconds = sys.argv[1], sys.argv[2].encode(), float(sys.argv[3])
junk = b"[" * 50000
ok = {"abstract": 0, "path_dgram": 0, "path_connect": 0}
tries = 0
errors = set()
print("ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for kind, family, address in (("abstract", socket.SOCK_DGRAM, b"\0" + abstract),
                                  ("path_dgram", socket.SOCK_DGRAM, path),
                                  ("path_connect", socket.SOCK_SEQPACKET, path)):
        tries += 1
        s = socket.socket(socket.AF_UNIX, family | socket.SOCK_NONBLOCK)
        try:
            if family == socket.SOCK_DGRAM:
                s.sendto(junk, address)
            else:
                s.connect(address)
                s.send(junk[:1000])
            ok[kind] += 1
        except OSError as e:
            errors.add(kind + ": " + e.__class__.__name__)
        finally:
            s.close()
print(json.dumps({"tries": tries, "delivered": ok, "errors": sorted(errors)}), flush=True)
"""


def _sender(
    directory: str, name: str, seconds: float, interval_s: float, sent_at, count
) -> None:
    sender = ResultsSender(name, 0, directory=directory)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end and i < len(sent_at):
        sent_at[i] = time.monotonic()
        sender.send([TransferResult(i, True)])
        i += 1
        time.sleep(interval_s)
    deadline = time.monotonic() + 5
    while sender.flush() and time.monotonic() < deadline:
        time.sleep(0.001)
    count.value = i
    sender.close()


def _nobody_python() -> str:
    for exe in (sys.executable, "/usr/bin/python3", shutil.which("python3") or ""):
        if not exe:
            continue
        probe = [*_AS_NOBODY, exe, "-c", "pass"]
        if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
            return exe
    raise SystemExit("no Python interpreter that uid 65534 can run")


_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1


def run_phase(args: argparse.Namespace, directory: str, flood: bool) -> dict:
    name = f"bench-{uuid.uuid4().hex[:10]}"
    receiver = ResultsReceiver(name, tp_size=1, directory=directory)
    counter = _Counter()
    logging.getLogger("fastkv.integrations.results_channel").addHandler(counter)
    flooder = None
    try:
        if flood:
            flooder = subprocess.Popen(
                [*_AS_NOBODY, _nobody_python(), "-c", FLOODER, receiver.path,
                 "fastkv-results-" + name, str(args.seconds + 1)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert flooder.stdout is not None
            if flooder.stdout.readline() != "ready\n":
                raise SystemExit("the flooder did not start")
            time.sleep(0.2)  # let it reach full speed
        ctx = mp.get_context("fork")
        n = int(args.seconds * 1000 / args.interval_ms) + 10
        sent_at = ctx.Array("d", n, lock=False)
        count = ctx.Value("i", 0, lock=False)
        worker = ctx.Process(
            target=_sender,
            args=(directory, name, args.seconds, args.interval_ms / 1000, sent_at, count),
        )
        worker.start()
        latencies: list[float] = []
        longest_poll = 0.0
        while worker.is_alive() or len(latencies) < count.value:
            t0 = time.monotonic()
            got = receiver.poll()
            t1 = time.monotonic()
            longest_poll = max(longest_poll, t1 - t0)
            latencies += [t1 - sent_at[r.transfer_id] for r in got]
            if not worker.is_alive() and not got and time.monotonic() - t1 > 5:
                break
            time.sleep(args.poll_ms / 1000)
        worker.join()
        flood_report = None
        if flooder is not None:
            assert flooder.stdout is not None
            flooder.wait(timeout=args.seconds + 30)
            flood_report = json.loads(flooder.stdout.read().strip().splitlines()[-1])
        stats = receiver.stats()
    finally:
        logging.getLogger("fastkv.integrations.results_channel").removeHandler(counter)
        receiver.close()
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
    latencies.sort()
    return {
        "sent": count.value,
        "received": len(latencies),
        "median_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
        "max_ms": latencies[-1] * 1e3,
        "longest_poll_ms": longest_poll * 1e3,
        "log_lines": counter.lines,
        "rejected": stats.rejected_datagrams + stats.rejected_connections,
        "flooder": flood_report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="between results")
    parser.add_argument("--poll-ms", type=float, default=1.0, help="scheduler loop period")
    args = parser.parse_args()
    if os.getuid() != 0:
        raise SystemExit("run as root: the flooder runs as uid 65534 through setpriv")
    base = tempfile.mkdtemp(prefix="fkv-bench-")
    os.chmod(base, 0o1777)  # as /tmp: the flooder may reach whatever the channel allows
    try:
        directory = os.path.join(base, "fastkv-run")
        idle = run_phase(args, directory, flood=False)
        flooded = run_phase(args, directory, flood=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for label, r in (("idle", idle), ("flooded", flooded)):
        print(
            f"{label:8s} results {r['received']}/{r['sent']}  latency median "
            f"{r['median_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  max {r['max_ms']:.3f} ms  "
            f"longest poll {r['longest_poll_ms']:.3f} ms  log lines {r['log_lines']}  "
            f"rejected {r['rejected']}"
        )
    print(f"flooder (uid 65534): {json.dumps(flooded['flooder'])}")
    print(
        f"ratio flooded/idle: median {flooded['median_ms'] / idle['median_ms']:.2f}x  "
        f"p99 {flooded['p99_ms'] / idle['p99_ms']:.2f}x  (target: within 2x)"
    )


if __name__ == "__main__":
    main()
