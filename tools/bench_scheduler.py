#!/usr/bin/env python3
"""Scheduler cost next to plain-Python floors measured in the same run.

    python tools/bench_scheduler.py [--json] [--trace FILE] [--repeats N]

(a) Replay of the conversation trace through the real CacheManager (no host tier),
    in microseconds per block, at several device capacities, next to two floors that
    serve the same ids with the same policy and give the same hit rate:
      floor      dict + OrderedDict LRU, leaf-first: a parent-of dict and a
                 child-count dict, in-use blocks taken off the LRU while a request
                 holds them and appended back deepest-first, and every victim
                 checked to be a leaf;
      lru floor  one OrderedDict touched deepest-first, which keeps leaves at its
                 head without knowing which entries are leaves.
(b) Chained block hashing in ns per token at block sizes 16, 64 and 512, next to
    raw hashlib SHA-256 over the same bytes in one call.
(d) Storage lookups: the replay with 10,000 device and 10,000 host blocks and a
    storage tier that holds nothing (every request's remainder looked up, answered
    in a later step, nothing loaded), next to the same replay without a storage
    tier: the scheduler's cost of asking, per request and per block.
(e) Metrics: the replay at 10,000 device blocks with fastkv's Prometheus metrics
    registered (read at scrape time; a scrape every 500 requests), next to none.
(c) Commit cost per block at request depths 100, 1,000 and 8,000 under each write
    policy: one request commits its blocks one at a time, each commit followed by a
    step (take_swap_metadata, results applied), as decode does. Flat means the cost
    of a commit does not grow with the depth of the path above it; the ratio of the
    deepest to the shallowest depth is printed per policy.
(f) Scale (--scale-blocks, default 1M and 4M; 0 skips): requests of 128 distinct
    32-byte digests fill a cache of that many device blocks, then as many blocks
    again go through it (each evicting the oldest). Each side runs in a fresh
    process: bytes per cached block (RSS growth over the fill, the keys excluded),
    the longest single garbage collection (timed with gc.callbacks) and the longest
    single scheduler call (the floor: the longest single request), both in CPU
    time of the scheduler's thread. The floor is
    the leaf-first floor above, holding the same keys.

Every figure is the best of --repeats interleaved runs: the machines this runs on
are shared, and the minimum is the least disturbed run.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: make `tools` and `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastkv import CacheConfig, StorageConfig, WritePolicy
from fastkv.hashing import _chain_native, hash_blocks, namespace_root
from fastkv.scheduler import CacheManager
from tools.trace_replay import (
    TRACE_BLOCK_SIZE,
    MemoryStorage,
    TraceRequest,
    complete_transfers,
    load_trace,
    replay,
    synthetic_trace,
)

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/conversation_trace.jsonl"
CAPACITIES = (1_000, 10_000, 30_000, 100_000)
HEADLINE_CAPACITY = 10_000
DEPTHS = (100, 1_000, 8_000)
SCALE_BLOCKS = (1_000_000, 4_000_000)
SCALE_REQUEST_BLOCKS = 128


def leaf_first_floor(trace: Sequence[TraceRequest], capacity: int) -> tuple[float, float]:
    """Returns (hit rate, us per block)."""
    parent_of: dict[bytes, bytes | None] = {}
    num_children: dict[bytes, int] = {}
    lru: OrderedDict[bytes, None] = OrderedDict()
    blocks = hits = 0
    start = time.perf_counter()
    for request in trace:
        ids = request.block_hashes  # the 32-byte digests the manager takes too
        blocks += len(ids)
        n = 0
        for h in ids:
            if h not in parent_of:
                break
            n += 1
        hits += n
        for h in ids[:n]:  # held by the request: not evictable
            del lru[h]
        for _ in range(len(parent_of) + len(ids) - n - capacity):
            victim = lru.popitem(last=False)[0]
            if num_children.pop(victim):
                raise AssertionError("the floor evicted an inner block")
            parent = parent_of.pop(victim)
            if parent is not None:
                num_children[parent] -= 1
        parent = ids[n - 1] if n else None
        for h in ids[n:]:
            parent_of[h] = parent
            num_children[h] = 0
            if parent is not None:
                num_children[parent] += 1
            parent = h
        for h in reversed(ids):  # released: most recent, deepest first
            lru[h] = None
    return hits / blocks, (time.perf_counter() - start) * 1e6 / blocks


def lru_floor(trace: Sequence[TraceRequest], capacity: int) -> tuple[float, float]:
    """Returns (hit rate, us per block)."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    blocks = hits = 0
    start = time.perf_counter()
    for request in trace:
        ids = request.block_hashes
        blocks += len(ids)
        n = 0
        for h in ids:
            if h not in lru:
                break
            n += 1
        hits += n
        for h in reversed(ids):
            lru[h] = None
            lru.move_to_end(h)
        for _ in range(len(lru) - capacity):
            lru.popitem(last=False)
    return hits / blocks, (time.perf_counter() - start) * 1e6 / blocks


def fastkv_replay(trace: Sequence[TraceRequest], capacity: int) -> tuple[float, float]:
    result = replay(trace, CacheConfig(block_size=TRACE_BLOCK_SIZE, num_device_blocks=capacity))
    return result.hit_rate, result.us_per_block


def bench_replay(trace: Sequence[TraceRequest], repeats: int) -> dict[str, dict[str, float]]:
    runners: dict[str, Callable[[Sequence[TraceRequest], int], tuple[float, float]]] = {
        "fastkv": fastkv_replay,
        "floor": leaf_first_floor,
        "lru_floor": lru_floor,
    }
    out: dict[str, dict[str, float]] = {}
    for capacity in CAPACITIES:
        best = {name: float("inf") for name in runners}
        rates = {}
        for _ in range(repeats):
            for name, run in runners.items():
                rates[name], us = run(trace, capacity)
                best[name] = min(best[name], us)
        if len(set(round(r, 12) for r in rates.values())) != 1:
            raise AssertionError(f"hit rates differ at {capacity} blocks: {rates}")
        out[str(capacity)] = {
            "hit_rate": rates["fastkv"],
            "us_per_block": best["fastkv"],
            "floor_us_per_block": best["floor"],
            "lru_floor_us_per_block": best["lru_floor"],
            "vs_floor": best["fastkv"] / best["floor"],
            "vs_lru_floor": best["fastkv"] / best["lru_floor"],
        }
    return out


def bench_hashing(repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, size=1 << 18, dtype=np.uint32)
    as_list = tokens.tolist()
    raw = tokens.tobytes()
    root = namespace_root("bench")

    def per_token(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best * 1e9 / tokens.size

    out = {"hash_native": float(_chain_native is not None)}
    for block in (16, 64, 512):
        out[f"hash_ns_per_token_b{block}"] = per_token(
            lambda b=block: hash_blocks(root, tokens, b)
        )
        out[f"hash_list_ns_per_token_b{block}"] = per_token(
            lambda b=block: hash_blocks(root, as_list, b)
        )
        out[f"hash_floor_ns_per_token_b{block}"] = per_token(
            lambda: hashlib.sha256(raw).digest()
        )
        out[f"hash_vs_floor_b{block}"] = (
            out[f"hash_ns_per_token_b{block}"] / out[f"hash_floor_ns_per_token_b{block}"]
        )
    return out


def commit_step_us(policy: WritePolicy, depth: int, block_size: int = 16) -> float:
    """Microseconds per block for one request committing `depth` blocks one by one."""
    mgr = CacheManager(
        CacheConfig(
            block_size=block_size,
            num_device_blocks=depth,
            num_host_blocks=depth,
            write_policy=policy,
            selective_threshold=1,
        )
    )
    mgr.match("r", [i.to_bytes(32, "big") for i in range(depth)], depth * block_size + 1)
    assert mgr.allocate("r", num_tokens=depth * block_size)
    start = time.perf_counter()
    for k in range(1, depth + 1):
        mgr.commit("r", num_computed_tokens=k * block_size)
        complete_transfers(mgr)
    seconds = time.perf_counter() - start
    mgr.finish("r")
    return seconds * 1e6 / depth


def bench_commit_depth(repeats: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for policy in WritePolicy:
        best = {d: min(commit_step_us(policy, d) for _ in range(repeats)) for d in DEPTHS}
        row = {f"us_per_block_d{d}": us for d, us in best.items()}
        row["deepest_vs_shallowest"] = best[DEPTHS[-1]] / best[DEPTHS[0]]
        out[policy.value] = row
    return out


def bench_storage_lookups(trace: Sequence[TraceRequest], repeats: int) -> dict[str, float]:
    base = CacheConfig(
        block_size=TRACE_BLOCK_SIZE, num_device_blocks=10_000, num_host_blocks=10_000
    )
    looking = CacheConfig(
        block_size=TRACE_BLOCK_SIZE,
        num_device_blocks=10_000,
        num_host_blocks=10_000,
        storage=StorageConfig(write_policy="none"),
    )
    off = on = float("inf")
    for _ in range(repeats):
        off = min(off, replay(trace, base).seconds)
        on = min(on, replay(trace, looking, storage=MemoryStorage(0)).seconds)
    blocks = sum(len(r.hash_ids) for r in trace)
    return {
        "lookups_off_us_per_request": off * 1e6 / len(trace),
        "lookups_on_us_per_request": on * 1e6 / len(trace),
        "lookups_off_us_per_block": off * 1e6 / blocks,
        "lookups_on_us_per_block": on * 1e6 / blocks,
        "lookups_on_vs_off": on / off,
    }


def bench_metrics(trace: Sequence[TraceRequest], repeats: int) -> dict[str, float]:
    from prometheus_client import CollectorRegistry, generate_latest

    from fastkv.metrics import CacheMetrics

    config = CacheConfig(block_size=TRACE_BLOCK_SIZE, num_device_blocks=HEADLINE_CAPACITY)
    registry: list[CollectorRegistry] = []

    def attach(mgr: CacheManager) -> None:
        registry.append(CollectorRegistry())
        CacheMetrics(registry[-1], model="bench").watch_scheduler(mgr)

    def scrape(i: int) -> None:
        if i % 500 == 0:
            generate_latest(registry[-1])

    off = on = float("inf")
    for _ in range(repeats):
        off = min(off, replay(trace, config).us_per_block)
        on = min(on, replay(trace, config, on_request=scrape, on_manager=attach).us_per_block)
    return {
        "metrics_off_us_per_block": off,
        "metrics_on_us_per_block": on,
        "metrics_on_vs_off": on / off,
    }


class _FloorCache:
    """The leaf-first floor of `leaf_first_floor`, one request at a time."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.parent_of: dict[bytes, bytes | None] = {}
        self.num_children: dict[bytes, int] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()

    def serve(self, ids: Sequence[bytes]) -> int:
        parent_of, num_children, lru = self.parent_of, self.num_children, self.lru
        n = 0
        for h in ids:
            if h not in parent_of:
                break
            n += 1
        for h in ids[:n]:
            del lru[h]
        for _ in range(len(parent_of) + len(ids) - n - self.capacity):
            victim = lru.popitem(last=False)[0]
            if num_children.pop(victim):
                raise AssertionError("the floor evicted an inner block")
            parent = parent_of.pop(victim)
            if parent is not None:
                num_children[parent] -= 1
        parent = ids[n - 1] if n else None
        for h in ids[n:]:
            parent_of[h] = parent
            num_children[h] = 0
            if parent is not None:
                num_children[parent] += 1
            parent = h
        for h in reversed(ids):
            lru[h] = None
        return n


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scale_child(impl: str, num_blocks: int) -> dict[str, float]:
    """One side of the scale bench (run in a fresh process): fill `num_blocks`, then
    push as many blocks again through the full cache."""
    per = SCALE_REQUEST_BLOCKS
    num_requests = 2 * num_blocks // per
    keys = [
        [(r * per + j).to_bytes(32, "big") for j in range(per)] for r in range(num_requests)
    ]
    gc.collect()
    gc.freeze()  # the keys are the workload, not the scheduler's state
    pauses: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.thread_time())
        else:
            pauses.append(time.thread_time() - started.pop())

    # CPU time of this thread: the machines this runs on are shared, and a wall
    # clock would time other processes' turns as pauses.
    clock = time.thread_time
    longest_call = 0.0
    hits = 0
    rss0 = _rss_bytes()
    gc.callbacks.append(on_gc)
    start = clock()
    fill_seconds = bytes_per_block = 0.0
    if impl == "floor":
        floor = _FloorCache(num_blocks)
        for r, ids in enumerate(keys):
            t = clock()
            hits += floor.serve(ids)
            longest_call = max(longest_call, clock() - t)
            if r + 1 == num_requests // 2:
                fill_seconds = clock() - start
                bytes_per_block = (_rss_bytes() - rss0) / num_blocks
    else:
        mgr = CacheManager(
            CacheConfig(block_size=16, num_device_blocks=num_blocks), clock=lambda: 0.0
        )
        num_tokens = per * 16 + 1
        for r, ids in enumerate(keys):
            t = clock()
            hit = mgr.match(r, ids, num_tokens)
            longest_call = max(longest_call, clock() - t)
            t = clock()
            if not mgr.allocate(r, num_tokens=per * 16):
                raise AssertionError(f"request {r}: allocation refused")
            longest_call = max(longest_call, clock() - t)
            t = clock()
            mgr.commit(r, num_computed_tokens=per * 16)
            longest_call = max(longest_call, clock() - t)
            t = clock()
            mgr.finish(r)
            longest_call = max(longest_call, clock() - t)
            hits += hit.num_hits
            if r + 1 == num_requests // 2:
                fill_seconds = clock() - start
                bytes_per_block = (_rss_bytes() - rss0) / num_blocks
    seconds = clock() - start
    gc.callbacks.remove(on_gc)
    return {
        "bytes_per_block": bytes_per_block,
        "fill_seconds": fill_seconds,
        "seconds": seconds,
        "gc_collections": len(pauses),
        "gc_seconds": sum(pauses),
        "longest_gc_ms": max(pauses, default=0.0) * 1e3,
        "longest_call_ms": longest_call * 1e3,
        "hit_rate": hits / (num_requests * per),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def bench_scale(sizes: Sequence[int]) -> dict[str, dict[str, dict[str, float]]]:
    """Each size and side in its own process, so that neither inherits the other's
    heap."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for n in sizes:
        row = {}
        for impl in ("fastkv", "floor"):
            proc = subprocess.run(
                [sys.executable, __file__, "--_scale-child", impl, str(n)],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"scale bench ({impl}, {n} blocks) failed:\n{proc.stderr}")
            row[impl] = json.loads(proc.stdout)
        if row["fastkv"]["hit_rate"] != row["floor"]["hit_rate"]:
            raise AssertionError(f"hit rates differ at {n} blocks: {row}")
        out[str(n)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (JSONL)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--scale-blocks",
        type=int,
        nargs="*",
        default=list(SCALE_BLOCKS),
        help="cache sizes of the scale bench (f); none (or 0) skips it",
    )
    p.add_argument("--scale-only", action="store_true", help="run only the scale bench (f)")
    p.add_argument("--_scale-child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._scale_child:
        impl, n = args._scale_child
        print(json.dumps(scale_child(impl, int(n))))
        return 0
    scale_sizes = [n for n in args.scale_blocks if n > 0]
    if args.scale_only:
        scale_figures = bench_scale(scale_sizes)
        if args.json:
            print(json.dumps({"scale": scale_figures}))
        else:
            _print_scale(scale_figures)
        return 0

    if Path(args.trace).is_file():
        trace, source = load_trace(args.trace), args.trace
    else:
        trace, source = synthetic_trace(), "synthetic (trace file not found)"
    gc.freeze()  # the trace is static: keep the collector from rescanning it
    print(f"trace: {source}, {len(trace):,} requests", file=sys.stderr)

    replay_figures = bench_replay(trace, args.repeats)
    hash_figures = bench_hashing(args.repeats)
    depth_figures = bench_commit_depth(args.repeats)
    lookup_figures = bench_storage_lookups(trace, args.repeats)
    metrics_figures = bench_metrics(trace, args.repeats)
    scale_figures = bench_scale(scale_sizes)
    headline = replay_figures[str(HEADLINE_CAPACITY)]
    result = {
        "replay_us_per_block": headline["us_per_block"],
        "floor_us_per_block": headline["floor_us_per_block"],
        "lru_floor_us_per_block": headline["lru_floor_us_per_block"],
        "replay_vs_floor": headline["vs_floor"],
        "replay_vs_lru_floor": headline["vs_lru_floor"],
        "replay_by_capacity": replay_figures,
        "commit_by_depth": depth_figures,
        **lookup_figures,
        **metrics_figures,
        **hash_figures,
        "scale": scale_figures,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{'device blocks':>13} {'hit rate':>9} {'fastkv':>8} {'floor':>8} {'ratio':>6}"
        f" {'lru floor':>9} {'ratio':>6}   (us per block)"
    )
    for capacity, f in replay_figures.items():
        print(
            f"{int(capacity):>13,} {f['hit_rate']:>9.4f} {f['us_per_block']:>8.3f}"
            f" {f['floor_us_per_block']:>8.3f} {f['vs_floor']:>5.2f}x"
            f" {f['lru_floor_us_per_block']:>9.3f} {f['vs_lru_floor']:>5.2f}x"
        )
    print(
        f"\n{'block size':>10} {'numpy':>8} {'list':>8} {'raw sha256':>10} {'ratio':>6}"
        "   (ns per token)"
    )
    for block in (16, 64, 512):
        print(
            f"{block:>10} {hash_figures[f'hash_ns_per_token_b{block}']:>8.2f}"
            f" {hash_figures[f'hash_list_ns_per_token_b{block}']:>8.2f}"
            f" {hash_figures[f'hash_floor_ns_per_token_b{block}']:>10.2f}"
            f" {hash_figures[f'hash_vs_floor_b{block}']:>5.2f}x"
        )
    print(
        f"\n{'write policy':<24}"
        + "".join(f" {f'depth {d:,}':>12}" for d in DEPTHS)
        + f" {'deepest/shallowest':>19}   (commit + step, us per block)"
    )
    for policy, row in depth_figures.items():
        print(
            f"{policy:<24}"
            + "".join(f" {row[f'us_per_block_d{d}']:>12.2f}" for d in DEPTHS)
            + f" {row['deepest_vs_shallowest']:>18.2f}x"
        )
    lf, mf = lookup_figures, metrics_figures
    print(
        f"\nstorage lookups (10,000 device + 10,000 host blocks): off "
        f"{lf['lookups_off_us_per_request']:.2f} us/request, on "
        f"{lf['lookups_on_us_per_request']:.2f} us/request ({lf['lookups_on_vs_off']:.2f}x)"
    )
    print(
        f"metrics (10,000 device blocks): off {mf['metrics_off_us_per_block']:.3f} us/block,"
        f" on {mf['metrics_on_us_per_block']:.3f} us/block ({mf['metrics_on_vs_off']:.3f}x)"
    )
    _print_scale(scale_figures)
    if not hash_figures["hash_native"]:
        print("(hashing ran the pure-Python loop: fastkv._chain_hash is not built)")
    return 0


def _print_scale(figures: dict[str, dict[str, dict[str, float]]]) -> None:
    if not figures:
        return
    print(
        f"\n{'cached blocks':>13} {'side':>6} {'bytes/block':>11} {'fill s':>7}"
        f" {'GCs':>5} {'GC s':>6} {'longest GC ms':>13} {'longest call ms':>15}"
        f" {'peak RSS MiB':>12}   (CPU time)"
    )
    for n, row in figures.items():
        for impl, f in row.items():
            print(
                f"{int(n):>13,} {impl:>6} {f['bytes_per_block']:>11.1f}"
                f" {f['fill_seconds']:>7.2f} {f['gc_collections']:>5}"
                f" {f['gc_seconds']:>6.2f} {f['longest_gc_ms']:>13.2f}"
                f" {f['longest_call_ms']:>15.2f} {f['peak_rss_mib']:>12.0f}"
            )


if __name__ == "__main__":
    sys.exit(main())
