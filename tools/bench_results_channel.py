"""Result latency over the results channel, idle and under a flood from another
user (issue 15 item 4's target: flooded within 2x of idle) or from processes of the
engine's own uid (issue 25 item 7).

A worker process sends one result every --interval-ms; the scheduler's end polls
every --poll-ms, as a scheduler loop would. Latency is from just before `send` to the
`poll` that returns the result (CLOCK_MONOTONIC is one clock for all processes).
The flood phase runs, for the same time, a process as uid 65534 (`setpriv --reuid
65534 --regid 65534 --clear-groups`) that sends to every address it can name as fast
as it can: the channel's socket path (connect and datagram) and the abstract name
earlier versions listened on. The control phase runs the same process, with the
same calls, at addresses that do not exist: it takes the same CPU time from the
scheduler and the worker but never reaches the channel, so flooded/control is the
channel's own share of the slowdown (on a 2-core machine the flooder's CPU use
alone moves the tail). The same-uid phase runs three such processes as the
engine's own uid (they reach the socket, so every connection they make is accepted,
read and refused by the scheduler's `poll()`). Phases rotate (--phases, default
idle, control, flooded) for --rounds rounds and each phase's latencies are pooled.
Needs root (to switch users), like CI. To compare two versions of fastkv in one
run, alternate PYTHONPATH between their trees around this script.

    .venv/bin/python tools/bench_results_channel.py --seconds 10 [--rounds 3]
    .venv/bin/python tools/bench_results_channel.py --phases idle,same-uid
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

from fastkv.channel import ResultsReceiver, ResultsSender
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


SAME_UID_FLOODERS = 3


def start_flooders(phase: str, path: str, abstract: str, seconds: float) -> list:
    """The flooder processes of `phase`, started and ready."""
    if phase == "same-uid":
        prefix, count = [sys.executable], SAME_UID_FLOODERS
    else:
        prefix, count = [*_AS_NOBODY, _nobody_python()], 1
    flooders = []
    for _ in range(count):
        flooder = subprocess.Popen(
            [*prefix, "-c", FLOODER, path, abstract, str(seconds)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        flooders.append(flooder)
        assert flooder.stdout is not None
        if flooder.stdout.readline() != "ready\n":
            raise SystemExit("a flooder did not start")
    return flooders


def flood_report(flooders: list) -> dict | None:
    """The flooders' counts, summed."""
    if not flooders:
        return None
    total: dict = {"tries": 0, "delivered": {}, "errors": set()}
    for flooder in flooders:
        flooder.wait(timeout=60)
        one = json.loads(flooder.stdout.read().strip().splitlines()[-1])
        total["tries"] += one["tries"]
        for kind, n in one["delivered"].items():
            total["delivered"][kind] = total["delivered"].get(kind, 0) + n
        total["errors"] |= set(one["errors"])
    total["errors"] = sorted(total["errors"])
    return total


def run_phase(args: argparse.Namespace, directory: str, phase: str) -> dict:
    """One phase: "idle", "control" (the flooder at addresses that do not exist),
    "flooded" (the flooder, uid 65534, at the channel's addresses) or "same-uid"
    (three flooders of this uid at the channel's addresses)."""
    name = f"bench-{uuid.uuid4().hex[:10]}"
    receiver = ResultsReceiver(name, tp_size=1, directory=directory)
    counter = _Counter()
    logging.getLogger("fastkv.channel").addHandler(counter)
    flooders: list = []
    try:
        if phase != "idle":
            path, abstract = receiver.path, "fastkv-results-" + name
            if phase == "control":
                path = os.path.join(directory, "absent", "results.sock")
                abstract = f"fastkv-absent-{uuid.uuid4().hex}"
            flooders = start_flooders(phase, path, abstract, args.seconds + 1)
            time.sleep(0.2)  # let them reach full speed
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
        polls: list[float] = []
        first: list[float] = []  # the first result's latency (includes connecting)
        last_news = time.monotonic()
        while worker.is_alive() or len(latencies) < count.value:
            t0 = time.monotonic()
            got = receiver.poll()
            t1 = time.monotonic()
            polls.append(t1 - t0)
            latencies += [t1 - sent_at[r.transfer_id] for r in got]
            first = [t1 - sent_at[0] for r in got if r.transfer_id == 0] or first
            if got or worker.is_alive():
                last_news = t1
            elif t1 - last_news > 5:  # the rest was lost: results shows received < sent
                break
            time.sleep(args.poll_ms / 1000)
        worker.join()
        flood = flood_report(flooders)
        stats = receiver.stats()
    finally:
        logging.getLogger("fastkv.channel").removeHandler(counter)
        receiver.close()
        for flooder in flooders:
            if flooder.poll() is None:
                flooder.kill()
    return {
        "sent": count.value,
        "latencies": latencies,
        "first": first,
        "polls": polls,
        "log_lines": counter.lines,
        "rejected": stats.rejected_datagrams + stats.rejected_connections,
        "flooder": flood,
    }


def pooled(runs: list[dict]) -> dict:
    """One phase's rounds together."""
    latencies = sorted(x for r in runs for x in r["latencies"])
    delivered: dict[str, int] = {}
    for r in runs:
        for kind, n in ((r["flooder"] or {}).get("delivered") or {}).items():
            delivered[kind] = delivered.get(kind, 0) + n
    return {
        "sent": sum(r["sent"] for r in runs),
        "first_ms": max((x for r in runs for x in r["first"]), default=float("nan")) * 1e3,
        "received": len(latencies),
        "median_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
        "max_ms": latencies[-1] * 1e3,
        "poll_p99_ms": sorted(p for r in runs for p in r["polls"])[
            int(0.99 * (sum(len(r["polls"]) for r in runs) - 1))
        ]
        * 1e3,
        "longest_poll_ms": max(max(r["polls"]) for r in runs) * 1e3,
        "log_lines": sum(r["log_lines"] for r in runs),
        "rejected": sum(r["rejected"] for r in runs),
        "flooder_tries": sum((r["flooder"] or {}).get("tries", 0) for r in runs),
        "flooder_delivered": delivered,
        "flooder_errors": sorted(
            {e for r in runs for e in (r["flooder"] or {}).get("errors", [])}
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="between results")
    parser.add_argument("--poll-ms", type=float, default=1.0, help="scheduler loop period")
    parser.add_argument("--rounds", type=int, default=1, help="phase cycles")
    parser.add_argument(
        "--phases",
        default="idle,control,flooded",
        help="comma-separated, from idle, control, flooded, same-uid (idle first)",
    )
    args = parser.parse_args()
    phases = tuple(args.phases.split(","))
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds must be >= 1 and --seconds > 0")
    if phases[0] != "idle" or not set(phases) <= {"idle", "control", "flooded", "same-uid"}:
        parser.error(f"--phases: {args.phases!r}: idle first, then control, flooded, same-uid")
    if os.getuid() != 0:
        raise SystemExit("run as root: the flooder runs as uid 65534 through setpriv")
    base = tempfile.mkdtemp(prefix="fkv-bench-")
    os.chmod(base, 0o1777)  # as /tmp: the flooder may reach whatever the channel allows
    runs: dict[str, list[dict]] = {p: [] for p in phases}
    try:
        directory = os.path.join(base, "fastkv-run")
        for k in range(args.rounds):
            for phase in phases:
                print(f"round {k + 1}/{args.rounds}: {phase}", file=sys.stderr, flush=True)
                runs[phase].append(run_phase(args, directory, phase))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(tuple({p: pooled(runs[p]) for p in phases}.items()))


def report(result: tuple[tuple[str, dict], ...]) -> None:
    """Print each phase's figures and its ratios to idle (and to control)."""
    by_phase = dict(result)
    for label, r in result:
        print(
            f"{label:8s} results {r['received']}/{r['sent']}  first (worst) "
            f"{r['first_ms']:.1f} ms  latency median "
            f"{r['median_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  max {r['max_ms']:.3f} ms  "
            f"poll p99 {r['poll_p99_ms']:.3f} ms  longest {r['longest_poll_ms']:.3f} ms  "
            f"log lines {r['log_lines']}  "
            f"rejected {r['rejected']}"
        )
    for label, r in result:
        if label != "idle":
            print(
                f"{label} flooders: tries {r['flooder_tries']}  delivered "
                f"{json.dumps(r['flooder_delivered'])}  errors {r['flooder_errors']}"
            )
    for label, r in result:
        bases = ("idle",) if label in ("idle", "control") else ("idle", "control")
        for what in (b for b in bases if b in by_phase and label != "idle"):
            base_r = by_phase[what]
            print(
                f"ratio {label}/{what}: median {r['median_ms'] / base_r['median_ms']:.2f}x  "
                f"p99 {r['p99_ms'] / base_r['p99_ms']:.2f}x"
            )


if __name__ == "__main__":
    main()
