#!/usr/bin/env python3
"""Replay a Mooncake-format trace through the real CacheManager and print hit rates.

    python tools/replay_trace.py TRACE [--device-blocks N [N ...]] [--host-blocks N]
                                       [--write-policy P] [--json]
                                       [--storage-blocks N [N ...]] [--storage-dir DIR]
                                       [--storage-write-policy P [P ...]]
                                       [--prefetch-policy P]

Each hash id is one cacheable block (512 tokens); requests run one at a time in
timestamp order and a simulated worker completes every transfer at once. Several
values of --device-blocks, --storage-blocks and --storage-write-policy replay once
per combination and print one row each. TRACE may be `synthetic` for a built-in
multi-turn workload.

With --storage-blocks N (> 0) a storage tier of N blocks sits behind the host tier
(which it needs: --host-blocks); it is held in memory, or, with --storage-dir, in
the real local-disk backend in DIR (a small stand-in payload per block). A second
replay on the same directory starts warm: it finds what the first one stored.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `tools` and `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastkv import CacheConfig, PrefetchPolicy, StorageConfig, StorageWritePolicy, WritePolicy
from tools.progress import Progress
from tools.trace_replay import (
    TRACE_BLOCK_SIZE,
    DiskStorage,
    MemoryStorage,
    ReplayResult,
    load_trace,
    replay,
    synthetic_trace,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("trace", help="Mooncake JSONL trace, or 'synthetic' for a built-in workload")
    p.add_argument("--device-blocks", type=int, nargs="+", default=[10_000])
    p.add_argument("--host-blocks", type=int, default=0)
    p.add_argument(
        "--write-policy", default="write_back", choices=[w.value for w in WritePolicy]
    )
    p.add_argument("--selective-threshold", type=int, default=2)
    p.add_argument(
        "--storage-blocks", type=int, nargs="+", default=[0], help="0: no storage tier"
    )
    p.add_argument("--storage-dir", help="the local-disk backend's directory (else memory)")
    p.add_argument(
        "--storage-write-policy",
        nargs="+",
        default=["write_through"],
        choices=[w.value for w in StorageWritePolicy],
    )
    p.add_argument(
        "--prefetch-policy", default="wait", choices=[w.value for w in PrefetchPolicy]
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, no table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def summary_rows(result: ReplayResult, config: CacheConfig) -> list[tuple[str, str]]:
    s = result.stats
    return [
        ("requests", f"{result.requests:,}"),
        ("blocks", f"{result.blocks:,}"),
        ("device blocks", f"{config.num_device_blocks:,}"),
        ("host blocks", f"{config.num_host_blocks:,}"),
        ("write policy", config.write_policy.value),
        ("hit rate", f"{result.hit_rate:.4f}"),
        ("  device hits", f"{result.device_hit_rate:.4f}  ({s.device_hit_blocks:,} blocks)"),
        ("  host hits", f"{result.host_hit_rate:.4f}  ({s.host_hit_blocks:,} blocks)"),
        (
            "  storage hits",
            f"{result.storage_hit_rate:.4f}  ({s.storage_hit_blocks:,} blocks)",
        ),
        ("storage writes", f"{result.storage_writes:,} blocks"),
        ("device evictions", f"{s.device_evictions:,}"),
        ("host evictions", f"{s.host_evictions:,}"),
        ("device->host blocks", f"{s.device_to_host_blocks:,}  ({s.backups:,} backups)"),
        ("host->device blocks", f"{s.host_to_device_blocks:,}"),
        ("time", f"{result.seconds:.2f} s  ({result.us_per_block:.3f} us/block)"),
    ]


def sweep_table(results: list[tuple[CacheConfig, ReplayResult]]) -> str:
    lines = [
        f"{'device':>8} {'host':>7} {'storage':>8} {'write policy':>17} {'hit rate':>9}"
        f" {'device':>7} {'host':>7} {'storage':>8} {'writes':>9} {'us/block':>9}"
    ]
    for config, r in results:
        st = config.storage
        lines.append(
            f"{config.num_device_blocks:>8,} {config.num_host_blocks:>7,}"
            f" {r.storage_blocks:>8,}"
            f" {st.write_policy.value if st else '-':>17} {r.hit_rate:>9.4f}"
            f" {r.device_hit_rate:>7.4f} {r.host_hit_rate:>7.4f} {r.storage_hit_rate:>8.4f}"
            f" {r.storage_writes:>9,} {r.us_per_block:>9.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = []
        for storage_blocks in args.storage_blocks:
            if storage_blocks < 0:
                raise ValueError(f"--storage-blocks: {storage_blocks} is negative")
            policies = args.storage_write_policy if storage_blocks else [None]
            for policy in policies:
                storage = None
                if storage_blocks:
                    storage = StorageConfig(
                        write_policy=policy, prefetch_policy=args.prefetch_policy
                    )
                for n in args.device_blocks:
                    config = CacheConfig(
                        block_size=TRACE_BLOCK_SIZE,
                        num_device_blocks=n,
                        num_host_blocks=args.host_blocks,
                        write_policy=args.write_policy,
                        selective_threshold=args.selective_threshold,
                        storage=storage,
                    )
                    runs.append((config, storage_blocks))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.trace == "synthetic":
        trace = synthetic_trace()
    elif not Path(args.trace).is_file():
        print(f"error: trace file {args.trace} not found", file=sys.stderr)
        return 2
    else:
        trace = load_trace(args.trace)
    gc.freeze()  # the trace is static: keep the collector from rescanning it

    results = []
    for config, storage_blocks in runs:
        label = f"replay {config.num_device_blocks:,} blocks"
        tier = None
        if storage_blocks:
            label += f", storage {storage_blocks:,} ({config.storage.write_policy.value})"  # type: ignore[union-attr]
            if args.storage_dir:
                tier = DiskStorage(args.storage_dir, storage_blocks, config.num_host_blocks)
            else:
                tier = MemoryStorage(storage_blocks)
        bar = Progress(len(trace), label, enabled=not args.no_progress)
        try:
            result = replay(
                trace,
                config,
                on_request=(lambda _, b=bar: b.update()) if bar.enabled else None,
                storage=tier,
            )
        finally:
            if isinstance(tier, DiskStorage):
                tier.close()
        bar.close()
        result.storage_blocks = storage_blocks
        results.append((config, result))
    if args.json:
        objects = [
            r.as_dict()
            | {
                "device_blocks": c.num_device_blocks,
                "host_blocks": c.num_host_blocks,
                "storage_blocks": r.storage_blocks,
                "storage_write_policy": c.storage.write_policy.value if c.storage else None,
            }
            for c, r in results
        ]
        print(json.dumps(objects[0] if len(objects) == 1 else {"runs": objects}))
    elif len(results) == 1:
        print(format_table(summary_rows(results[0][1], results[0][0])))
    else:
        print(sweep_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
