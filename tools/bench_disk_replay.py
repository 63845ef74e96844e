#!/usr/bin/env python3
"""The trace replay with its storage tier on the local disk, against the same replay
with the storage tier in memory, in one run (issue 27, item 3).

    python tools/bench_disk_replay.py [TRACE] [--requests N] [--reps N] [--dir DIR]
        [--device-blocks N] [--host-blocks N] [--storage-blocks N] [--json]

TRACE defaults to the shared conversation trace. Each repetition replays the trace
twice, in memory and through `LocalDiskBackend` in a fresh directory (which goes
first alternates), and records the replay's wall time and the process's CPU time
(user + system, every thread). Both replays must reach the same hits block for block
and every block read back from disk must be the one stored; otherwise the bench
fails. The median ratio disk / memory is the figure (the target is <= 3).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastkv import CacheConfig, StorageConfig
from tools.trace_replay import (
    TRACE_BLOCK_SIZE,
    DiskStorage,
    MemoryStorage,
    ReplayResult,
    load_trace,
    replay,
)

DEFAULT_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where the disk tier lives")
    p.add_argument("--device-blocks", type=int, default=10_000)
    p.add_argument("--host-blocks", type=int, default=10_000)
    p.add_argument("--storage-blocks", type=int, default=200_000)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def timed(run: callable) -> tuple[ReplayResult, float]:  # type: ignore[valid-type]
    """The replay's result and the process CPU seconds it took."""
    gc.collect()
    cpu = time.process_time()
    result = run()
    return result, time.process_time() - cpu


def one_rep(
    trace: list, config: CacheConfig, args: argparse.Namespace, disk_first: bool
) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-disk-replay-", dir=args.dir))
    out: dict = {}
    try:
        order = ["disk", "memory"] if disk_first else ["memory", "disk"]
        for tier in order:
            if tier == "memory":
                mem = MemoryStorage(args.storage_blocks)
                out["memory"] = timed(lambda m=mem: replay(trace, config, storage=m))
                continue
            disk = DiskStorage(work / "store", args.storage_blocks, args.host_blocks)
            try:
                out["disk"] = timed(lambda d=disk: replay(trace, config, storage=d))
                out["verified"], out["mismatched"] = disk.verified, disk.mismatched
                out["direct_io"] = disk.backend.direct_io
            finally:
                disk.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (mem, mem_cpu), (dsk, dsk_cpu) = out["memory"], out["disk"]
    if dsk.stats.storage != mem.stats.storage or dsk.hit_rate != mem.hit_rate:
        raise RuntimeError(f"hits differ: disk {dsk.stats.storage}, memory {mem.stats.storage}")
    if out["mismatched"] or out["verified"] < dsk.stats.storage_hit_blocks:
        raise RuntimeError(f"disk reads not verified: {out['verified']}, {out['mismatched']}")
    return {
        "memory_s": mem.seconds,
        "disk_s": dsk.seconds,
        "memory_cpu_s": mem_cpu,
        "disk_cpu_s": dsk_cpu,
        "hit_rate": dsk.hit_rate,
        "storage_hit_blocks": dsk.stats.storage_hit_blocks,
        "storage_writes": dsk.storage_writes,
        "verified_reads": out["verified"],
        "direct_io": out["direct_io"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace)
    if args.requests:
        trace = trace[: args.requests]
    gc.freeze()
    config = CacheConfig(
        block_size=TRACE_BLOCK_SIZE,
        num_device_blocks=args.device_blocks,
        num_host_blocks=args.host_blocks,
        storage=StorageConfig(),
    )
    reps = [one_rep(trace, config, args, disk_first=bool(r % 2)) for r in range(args.reps)]
    med = {k: statistics.median(r[k] for r in reps) for k in reps[0] if k.endswith("_s")}
    summary = {
        "requests": len(trace),
        "blocks": sum(len(r.hash_ids) for r in trace),
        "reps": reps,
        "median": med,
        "wall_ratio": statistics.median(r["disk_s"] / r["memory_s"] for r in reps),
        "cpu_ratio": statistics.median(r["disk_cpu_s"] / r["memory_cpu_s"] for r in reps),
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"{len(trace):,} requests, {summary['blocks']:,} blocks; storage tier "
        f"{args.storage_blocks:,} blocks behind device {args.device_blocks:,} + host "
        f"{args.host_blocks:,}; direct_io {reps[0]['direct_io']}"
    )
    print(
        f"{'rep':>3} {'memory s':>9} {'disk s':>8} {'ratio':>6} {'mem cpu s':>10}"
        f" {'disk cpu s':>11} {'ratio':>6} {'hit rate':>9} {'verified':>9}"
    )
    for i, r in enumerate(reps):
        print(
            f"{i:>3} {r['memory_s']:>9.2f} {r['disk_s']:>8.2f}"
            f" {r['disk_s'] / r['memory_s']:>6.2f}"
            f" {r['memory_cpu_s']:>10.2f} {r['disk_cpu_s']:>11.2f}"
            f" {r['disk_cpu_s'] / r['memory_cpu_s']:>6.2f} {r['hit_rate']:>9.4f}"
            f" {r['verified_reads']:>9,}"
        )
    print(
        f"median disk / memory: wall {summary['wall_ratio']:.2f}x, "
        f"CPU {summary['cpu_ratio']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
