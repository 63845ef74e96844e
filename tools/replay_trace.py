#!/usr/bin/env python3
"""Replay a Mooncake-format trace through the real CacheManager and print hit rates.

    python tools/replay_trace.py TRACE [--device-blocks N [N ...]] [--host-blocks N]
                                       [--write-policy P] [--json]

Each hash id is one cacheable block (512 tokens); requests run one at a time in
timestamp order and a simulated worker completes every transfer at once. Several
--device-blocks values replay once per size and print one row each. TRACE may be
`synthetic` for a built-in multi-turn workload.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `tools` and `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastkv import CacheConfig, WritePolicy
from tools.progress import Progress
from tools.trace_replay import (
    TRACE_BLOCK_SIZE,
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
        ("device evictions", f"{s.device_evictions:,}"),
        ("host evictions", f"{s.host_evictions:,}"),
        ("device->host blocks", f"{s.device_to_host_blocks:,}  ({s.backups:,} backups)"),
        ("host->device blocks", f"{s.host_to_device_blocks:,}"),
        ("time", f"{result.seconds:.2f} s  ({result.us_per_block:.3f} us/block)"),
    ]


def sweep_table(results: list[tuple[CacheConfig, ReplayResult]]) -> str:
    lines = [
        f"{'device blocks':>13} {'host blocks':>11} {'hit rate':>9} {'device':>7} {'host':>7}"
        f" {'us/block':>9}"
    ]
    for config, r in results:
        lines.append(
            f"{config.num_device_blocks:>13,} {config.num_host_blocks:>11,} {r.hit_rate:>9.4f}"
            f" {r.device_hit_rate:>7.4f} {r.host_hit_rate:>7.4f} {r.us_per_block:>9.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        configs = [
            CacheConfig(
                block_size=TRACE_BLOCK_SIZE,
                num_device_blocks=n,
                num_host_blocks=args.host_blocks,
                write_policy=args.write_policy,
                selective_threshold=args.selective_threshold,
            )
            for n in args.device_blocks
        ]
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
    for config in configs:
        label = f"replay {config.num_device_blocks:,} blocks"
        bar = Progress(len(trace), label, enabled=not args.no_progress)
        result = replay(
            trace, config, on_request=(lambda _, b=bar: b.update()) if bar.enabled else None
        )
        bar.close()
        results.append((config, result))
    if args.json:
        objects = [r.as_dict() | {"device_blocks": c.num_device_blocks} for c, r in results]
        print(json.dumps(objects[0] if len(objects) == 1 else {"runs": objects}))
    elif len(results) == 1:
        print(format_table(summary_rows(results[0][1], results[0][0])))
    else:
        print(sweep_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
