#!/usr/bin/env python3
"""Noise-free replay cost: instructions (callgrind) of fastkv against the leaf-first floor.

    python tools/callgrind_replay.py [--trace FILE] [--requests 4000] [--capacity 10000]
    python tools/callgrind_replay.py --full-hits [--requests 1000]

Each side runs under `valgrind --tool=callgrind` twice: once replaying the first
`--requests` requests and once replaying none, in the same process layout (imports,
trace loading). The difference is the replay's own instruction count, so start-up
cost cancels out. Prints both counts and their ratio (the issue 16 target is <= 2x).

--full-hits counts full hits instead: `--requests` requests of 128 distinct 32-byte
keys fill a cache that holds them all, each is served again once to warm up, then
once more, every block a hit: only that last pass is counted (callgrind collects
inside one `functools.reduce` call that runs it). It used to be the whole run less
a fill-only run, and that difference swung by 2x from run to run: whatever two
processes did apart from the hits (start-up, the fill, teardown at exit) landed in
it. Beside
fastkv: the leaf-first floor, and the lookup floor (the floor's dict probed once per
block: a full hit at the cost of a dictionary lookup).

Counts are free of timing noise but not identical run to run: nodes in sets hash by
address, and the address layout differs per process, which moves either count by
up to about 2%. To compare two versions, run both side by side, several times.

Needs valgrind on PATH (`apt-get install valgrind`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.trace_replay import TRACE_BLOCK_SIZE, load_trace, replay

IMPLS = ("fastkv", "floor", "lookup_floor")
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/conversation_trace.jsonl"


def _run_one(impl: str, trace_path: str, requests: int, capacity: int) -> None:
    """The measured body (run under callgrind): replay `requests` requests."""
    import gc

    from fastkv import CacheConfig
    from tools.bench_scheduler import leaf_first_floor

    trace = load_trace(trace_path)[:requests]
    gc.freeze()
    if not trace:  # the baseline run: imports and trace loading only
        return
    if impl == "fastkv":
        replay(trace, CacheConfig(block_size=TRACE_BLOCK_SIZE, num_device_blocks=capacity))
    else:
        leaf_first_floor(trace, capacity)


def _run_hits(impl: str, requests: int, hits: bool) -> None:
    """The measured body of --full-hits: fill with `requests` requests, serve each
    again once to warm up (the interpreter's specialisation, first-use caches), then
    serve each again inside `functools.reduce`, the one call callgrind counts
    (`--toggle-collect`)."""
    import functools
    import gc

    from tools.bench_scheduler import (
        SCALE_REQUEST_BLOCKS,
        _FastkvCache,
        _FloorCache,
        _LookupFloor,
        _scale_keys,
    )

    per = SCALE_REQUEST_BLOCKS
    keys = [_scale_keys(r, per) for r in range(requests)]
    cache = _FastkvCache(requests * per) if impl == "fastkv" else _FloorCache(requests * per)
    for ids in keys:
        cache.serve(ids)
    if impl == "lookup_floor":
        cache = _LookupFloor(cache.parent_of)  # type: ignore[union-attr]
    serve = cache.serve

    def hit(total: int, ids: list[bytes]) -> int:
        return total + serve(ids)

    if hits:
        for ids in keys:  # the warm-up
            serve(ids)
    gc.collect()
    gc.freeze()
    if hits and functools.reduce(hit, keys, 0) != per * requests:
        raise AssertionError(f"{impl}: not a full hit")


def _instructions(impl: str, trace: str, requests: int, capacity: int, mode: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            *(["--toggle-collect=functools_reduce"] if mode == "hits" else []),
            sys.executable,
            __file__,
            "--_child",
            impl,
            "--trace",
            trace,
            "--requests",
            str(requests),
            "--capacity",
            str(capacity),
            "--_mode",
            mode,
        ]
        # A fixed hash seed: string hashing (dict probes) must not vary between runs.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{impl}: callgrind failed:\n{proc.stderr[-2000:]}")
        match = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{impl}: no summary line in {out}")
        return int(match.group(1))


def _full_hits(trace: str, requests: int, as_json: bool) -> int:
    if shutil.which("valgrind") is None:
        print("valgrind not found (apt-get install valgrind)", file=sys.stderr)
        return 2
    counts = {}
    for impl in IMPLS:  # only the measured pass is counted (see _run_hits)
        counts[impl] = _instructions(impl, trace, requests, 0, "hits")
    blocks = requests * 128
    result = {
        "requests": requests,
        "blocks": blocks,
        **{f"{impl}_instructions_per_block": counts[impl] / blocks for impl in IMPLS},
        "vs_floor": counts["fastkv"] / counts["floor"],
        "vs_lookup_floor": counts["fastkv"] / counts["lookup_floor"],
    }
    if as_json:
        print(json.dumps(result))
    else:
        print(
            f"full hits, {requests:,} requests of 128 blocks, instructions per block: fastkv "
            f"{result['fastkv_instructions_per_block']:.0f}, floor "
            f"{result['floor_instructions_per_block']:.0f} ({result['vs_floor']:.3f}x), "
            f"lookup floor {result['lookup_floor_instructions_per_block']:.0f} "
            f"({result['vs_lookup_floor']:.3f}x)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--capacity", type=int, default=10_000)
    p.add_argument("--json", action="store_true")
    p.add_argument("--full-hits", action="store_true", help="count full hits (see above)")
    p.add_argument("--_child", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--_mode", default="replay", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        if args._mode == "replay":
            _run_one(args._child, args.trace, args.requests, args.capacity)
        else:
            _run_hits(args._child, args.requests, args._mode == "hits")
        return 0
    if args.full_hits:
        return _full_hits(args.trace, args.requests, args.json)
    if shutil.which("valgrind") is None:
        print("valgrind not found (apt-get install valgrind)", file=sys.stderr)
        return 2
    counts = {}
    for impl in ("fastkv", "floor"):
        full = _instructions(impl, args.trace, args.requests, args.capacity, "replay")
        empty = _instructions(impl, args.trace, 0, args.capacity, "replay")
        counts[impl] = full - empty
    result = {
        "requests": args.requests,
        "capacity": args.capacity,
        "fastkv_instructions": counts["fastkv"],
        "floor_instructions": counts["floor"],
        "ratio": counts["fastkv"] / counts["floor"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.requests:,} requests, {args.capacity:,} device blocks: fastkv "
            f"{counts['fastkv']:,} instructions, floor {counts['floor']:,}: "
            f"{result['ratio']:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
