"""The engine demo: one workload served twice, with fastkv and with every prompt
recomputed, then compared request by request.

    python tools/demo.py [--tp N] [--metrics-port PORT] [--json] [--plot PATH] [...]

Prints the verdict (identical outputs, KV checksums, ranks in agreement) and a
table of what the cache did; exits 1 on any mismatch. With --metrics-port the
scheduler serves the fastkv run's metrics at http://127.0.0.1:PORT/metrics (0
picks a free port; the address goes to stderr and into the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from examples.engine.config import MODEL_ID, EngineConfig
from examples.engine.scheduler import EngineScheduler, RunResult
from examples.engine.workload import (
    ConversationSpec,
    MultiTurnChat,
    TraceWorkload,
    Workload,
    trace_sessions,
)
from tools.progress import Progress
from tools.trace_replay import TraceRequest, load_trace

LOGITS_RTOL = 1e-5


@dataclasses.dataclass(slots=True)
class Comparison:
    requests: int
    compared: int
    identical_tokens: int
    bitwise_logits: int
    max_logits_rel_diff: float
    problems: list[str]

    @property
    def identical_outputs(self) -> bool:
        return (
            not self.problems
            and self.compared > 0
            and self.identical_tokens == self.compared
            and self.max_logits_rel_diff <= LOGITS_RTOL
        )


def compare(cached: RunResult, baseline: RunResult) -> Comparison:
    """Generated tokens must be equal and last-step logits finite and equal within
    LOGITS_RTOL; both runs must reject the same requests, and some must run."""
    problems = [
        f"missing output: {rid}" for rid in sorted(set(baseline.outputs) ^ set(cached.outputs))
    ]
    if set(cached.rejected) != set(baseline.rejected):
        problems.append("the two runs rejected different requests")
    same_tokens = bitwise = compared = 0
    worst = 0.0
    for rid, tokens in baseline.outputs.items():
        if rid not in cached.outputs or rid in baseline.rejected or rid in cached.rejected:
            continue
        compared += 1
        same_tokens += cached.outputs[rid] == tokens
        a = np.frombuffer(cached.last_logits[rid], dtype=np.float32)
        b = np.frombuffer(baseline.last_logits[rid], dtype=np.float32)
        bitwise += a.tobytes() == b.tobytes()
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            worst = float("inf")
            continue
        scale = float(np.abs(b).max()) or 1.0
        worst = max(worst, float(np.abs(a - b).max()) / scale)
    if not compared:
        problems.append("no request ran in both runs")
    return Comparison(len(baseline.outputs), compared, same_tokens, bitwise, worst, problems)


def make_workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        trace, _ = select_trace(args)
        return TraceWorkload(
            trace, tokens_per_block=args.tokens_per_block, new_tokens=args.new_tokens
        )
    spec = ConversationSpec(
        conversations=args.conversations, turns=args.turns, new_tokens=args.new_tokens
    )
    return MultiTurnChat(spec)


def blocks_needed(tokens: int, new_tokens: int, block_size: int) -> int:
    """KV blocks a request holds at its end: its prompt and every token it generates."""
    return -(-(tokens + new_tokens) // block_size)


def select_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The trace requests the demo serves and a line saying which: the first
    `--trace-requests`, or with `--trace-sessions N` the requests of the first N
    multi-turn sessions whose every request fits the device pool (the sessions
    passed over are counted in the line)."""
    trace = load_trace(args.trace)
    if not args.trace_sessions:
        return trace[: args.trace_requests], f"trace: its first {args.trace_requests} requests"
    cfg: EngineConfig = args.config
    sizer = TraceWorkload([], tokens_per_block=args.tokens_per_block)
    chosen, passed = trace_sessions(
        trace,
        args.trace_sessions,
        fits=lambda r: (
            blocks_needed(len(sizer.tokens(r)), args.new_tokens, cfg.block_size)
            <= cfg.num_device_blocks
        ),
    )
    return chosen, (
        f"trace: its first {args.trace_sessions} multi-turn sessions, {len(chosen)} requests"
        f" ({passed} sessions passed over: a request larger than the device pool)"
    )


def oversized(workload: Workload, config: EngineConfig) -> list[tuple[str, int, int]]:
    """(request id, prompt tokens, blocks needed) of every request of a trace workload
    larger than the device pool: the engine would refuse each (a chat workload's
    prompts depend on the answers; its refusals fail the verdict instead)."""
    if not isinstance(workload, TraceWorkload):
        return []
    out = []
    for p in workload.prompts():
        need = blocks_needed(len(p.tokens), p.max_new_tokens, config.block_size)
        if need > config.num_device_blocks:
            out.append((p.request_id, len(p.tokens), need))
    return out


def refuse_oversized(args: argparse.Namespace) -> bool:
    """With --trace, print to stderr, naming each, the requests larger than the
    device pool; True if there are any."""
    if not args.trace:
        return False
    cfg: EngineConfig = args.config
    workload = make_workload(args)
    big = oversized(workload, cfg)
    if not big:
        return False
    print(
        f"--trace: {len(big)} of {workload.total_requests} requests are larger than the "
        f"device pool ({cfg.num_device_blocks} blocks of {cfg.block_size} tokens, "
        "--device-blocks); the engine cannot serve them:",
        file=sys.stderr,
    )
    for rid, tokens, need in big[:10]:
        print(
            f"  request {rid}: {tokens:,} prompt tokens + {args.new_tokens} new need "
            f"{need} blocks, the pool holds {cfg.num_device_blocks}",
            file=sys.stderr,
        )
    if len(big) > 10:
        print(f"  ... and {len(big) - 10} more", file=sys.stderr)
    print(
        f"serve them with --device-blocks {max(n for _, _, n in big)}, or take fewer "
        "(--trace-requests) or whole sessions that fit (--trace-sessions N)",
        file=sys.stderr,
    )
    return True


def run(
    config: EngineConfig, args: argparse.Namespace, label: str, metrics: Any = None
) -> RunResult:
    workload = make_workload(args)
    bar = Progress(workload.total_requests, label, enabled=not args.no_progress, check_every=1)
    scheduler = EngineScheduler(
        config, on_step=lambda done, total: bar.update(done - bar.done), metrics=metrics
    )
    result = scheduler.run(workload)
    bar.close()
    return result


def summary(cached: RunResult, baseline: RunResult, cmp: Comparison) -> dict[str, object]:
    stats = cached.cache
    worker = cached.worker
    assert worker is not None and stats is not None
    return {
        "identical_outputs": cmp.identical_outputs,
        "checksums_ok": not cached.checksum_mismatches,
        "ranks_agree": not cached.rank_mismatches and not baseline.rank_mismatches,
        "tp_size": cached.config.tp_size,
        "fail_rate": cached.config.fail_rate,
        "fail_rank": cached.config.fail_rank,
        "prefill_tokens_saved_frac": cached.saved_frac,
        "seconds_with_cache": cached.seconds,
        "seconds_without_cache": baseline.seconds,
        "speedup": baseline.seconds / cached.seconds if cached.seconds else 0.0,
        "requests": cmp.requests,
        "compared_requests": cmp.compared,
        "rejected_requests": len(cached.rejected),
        "identical_token_requests": cmp.identical_tokens,
        "bitwise_logits_requests": cmp.bitwise_logits,
        "max_logits_rel_diff": cmp.max_logits_rel_diff,
        "device": cached.device,
        "steps": cached.steps,
        "prompt_tokens": cached.prompt_tokens,
        "device_hit_tokens": cached.device_hit_tokens,
        "host_hit_tokens": cached.host_hit_tokens,
        "storage_hit_tokens": cached.storage_hit_tokens,
        "storage_writes": stats.storage.writes if stats.storage is not None else 0,  # type: ignore[attr-defined]
        "prefill_tokens_computed": cached.computed_prompt_tokens,
        "prefill_tokens_computed_without_cache": baseline.computed_prompt_tokens,
        "recomputed_tokens": cached.recomputed_tokens,
        "rollbacks": cached.rollbacks,
        "device_to_host_blocks": worker.device_to_host_blocks,
        "host_to_device_blocks": worker.host_to_device_blocks,
        "device_to_host_bytes": worker.device_to_host_bytes,
        "host_to_device_bytes": worker.host_to_device_bytes,
        "failed_transfers": worker.failed_transfers,
        "device_evictions": stats.device_evictions,  # type: ignore[attr-defined]
        "host_evictions": stats.host_evictions,  # type: ignore[attr-defined]
        "backups": stats.backups,  # type: ignore[attr-defined]
        "checksums_verified": worker.checksums_verified,
        "checksum_mismatches": len(cached.checksum_mismatches),
        "write_policy": cached.config.write_policy,
        "kv_dtype": cached.config.kv_dtype,
        # The fastkv run's final stats, as the metrics export them.
        "cache_stats": dataclasses.asdict(stats),  # type: ignore[call-overload]
        "rank_stats": [dataclasses.asdict(w) for w in cached.workers],
    }


def table(s: dict[str, object], cached: RunResult) -> str:
    def mib(n: object) -> str:
        return f"{int(n) / 2**20:.1f} MiB"  # type: ignore[call-overload]

    cfg = cached.config
    m = cfg.model
    rows = [
        *([("workload", str(s["workload"]))] if s.get("workload") else []),
        (
            "device",
            f"{s['device']}  (model: {m.num_layers} layers, hidden {m.hidden}, "
            f"{m.num_kv_heads} KV heads x {m.head_dim}; KV {cfg.kv_dtype}, "
            f"{cfg.block_size}-token blocks, {cfg.num_device_blocks} device / "
            f"{cfg.num_host_blocks} host, {cfg.write_policy})",
        ),
        (
            "tensor parallel",
            f"{cfg.tp_size} rank{'s' if cfg.tp_size > 1 else ''}, "
            f"{m.num_kv_heads // cfg.tp_size} KV head"
            f"{'s' if m.num_kv_heads // cfg.tp_size > 1 else ''} each"
            + (", attention outputs all-gathered per layer" if cfg.tp_size > 1 else ""),
        ),
        (
            "requests",
            f"{s['requests']}  in {s['steps']} steps"
            + (
                f", {s['rejected_requests']} REFUSED (larger than the device pool)"
                if s["rejected_requests"]
                else ""
            ),
        ),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        ("  served from device hits", f"{s['device_hit_tokens']:,}"),
        ("  served from host hits", f"{s['host_hit_tokens']:,}"),
        *(
            [
                (
                    "  served from storage hits",
                    f"{s['storage_hit_tokens']:,}  ({s['storage_writes']:,} blocks "
                    "written to disk)",
                )
            ]
            if cached.config.has_storage
            else []
        ),
        (
            "prefill tokens computed",
            f"{s['prefill_tokens_computed']:,}  "
            f"(without cache {s['prefill_tokens_computed_without_cache']:,})",
        ),
        ("prefill tokens saved", f"{s['prefill_tokens_saved_frac']:.1%}"),
        (
            "recomputed after failures",
            f"{s['recomputed_tokens']:,} tokens, {s['failed_transfers']} failed transfers"
            + (
                " (per rank: "
                + ", ".join(str(w["failed_transfers"]) for w in s["rank_stats"])  # type: ignore[attr-defined]
                + f"; {s['cache_stats']['failed_transfers']} after combining)"  # type: ignore[index]
                if cfg.tp_size > 1
                else ""
            ),
        ),
        (
            "blocks device->host",
            f"{s['device_to_host_blocks']:,}  ({mib(s['device_to_host_bytes'])}"
            f", {s['backups']:,} backups, {s['device_evictions']:,} device evictions)",
        ),
        (
            "blocks host->device",
            f"{s['host_to_device_blocks']:,}  ({mib(s['host_to_device_bytes'])})",
        ),
        ("wall time with cache", f"{s['seconds_with_cache']:.2f} s"),
        (
            "wall time without cache",
            f"{s['seconds_without_cache']:.2f} s  ({s['speedup']:.2f}x with the cache)",
        ),
        (
            "outputs",
            f"{s['identical_token_requests']}/{s['requests']} identical token "
            f"sequences; last logits bitwise equal for {s['bitwise_logits_requests']}, max "
            f"relative difference {s['max_logits_rel_diff']:.2e}",
        ),
        (
            "KV checksums",
            f"{s['checksums_verified']:,} cached blocks read, each layer checked just "
            f"before use: {s['checksum_mismatches']} mismatches",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plot(cached: RunResult, baseline: RunResult, path: Path) -> bool:
    """Hit tokens per tier over the run, next to the tokens computed. False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [h.step for h in cached.history]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.stackplot(
        steps,
        [h.device_hit_tokens for h in cached.history],
        [h.host_hit_tokens for h in cached.history],
        labels=["device hits", "host hits"],
        colors=["#4c72b0", "#dd8452"],
        alpha=0.85,
    )
    ax.plot(
        steps,
        [h.computed_prompt_tokens for h in cached.history],
        color="#2a2a2a",
        label="prompt tokens computed (fastkv)",
    )
    ax.plot(
        [h.step for h in baseline.history],
        [h.computed_prompt_tokens for h in baseline.history],
        color="#c44e52",
        linestyle="--",
        label="prompt tokens computed (no cache)",
    )
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens (cumulative)")
    ax.set_title("fastkv engine demo: prompt tokens served from each cache tier")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--trace", help="Mooncake-format trace instead of the multi-turn chat")
    p.add_argument("--trace-requests", type=int, default=120, help="first N trace requests")
    p.add_argument(
        "--trace-sessions",
        type=int,
        default=0,
        metavar="N",
        help="with --trace: instead of its first requests, the requests of its first N\n"
        "multi-turn sessions whose every request fits the device pool (each later\n"
        "turn continues an earlier one: real reuse)",
    )
    p.add_argument(
        "--tokens-per-block",
        type=int,
        default=32,
        help="tokens synthesized per trace hash id (the trace's blocks are 512)",
    )
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=12, help="tokens generated per request")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--device-blocks", type=int, default=d.num_device_blocks)
    p.add_argument("--host-blocks", type=int, default=d.num_host_blocks)
    p.add_argument(
        "--write-policy",
        default=d.write_policy,
        choices=["write_back", "write_through", "write_through_selective"],
    )
    p.add_argument("--kv-dtype", default=d.kv_dtype, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=d.device, help="auto, cpu or gpu:N")
    p.add_argument("--max-running", type=int, default=d.max_running)
    p.add_argument(
        "--tp",
        type=int,
        default=d.tp_size,
        help="tensor-parallel ranks: worker processes, each with 1/N of the KV heads",
    )
    p.add_argument(
        "--fail-rate",
        type=float,
        default=0.0,
        help="inject copy failures with this probability per copy call",
    )
    p.add_argument(
        "--fail-rank",
        type=int,
        default=None,
        help="inject the failures on this rank only (default: every rank)",
    )
    p.add_argument(
        "--storage-dir",
        default=None,
        help="a local-disk storage tier behind host memory in this directory (one "
        "subdirectory per rank); try a small --host-blocks to see blocks come back "
        "from disk",
    )
    p.add_argument("--storage-blocks", type=int, default=d.storage_blocks)
    p.add_argument(
        "--storage-write-policy",
        default=d.storage_write_policy,
        choices=["write_through", "on_host_eviction", "after_hits", "none"],
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the fastkv run's Prometheus metrics at 127.0.0.1:PORT/metrics "
        "(0: a free port)",
    )
    p.add_argument(
        "--metrics-linger",
        type=float,
        default=0.0,
        help="keep serving /metrics this many seconds after the run (to scrape the "
        "final values)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=d.model.num_layers,
        help="the demo model's layers (default %(default)s)",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: every request prefilled on a P instance "
        "decodes on a D instance, KV over Mooncake TE on TCP loopback (re-run inside "
        "`unshare --net` where it can)",
    )
    p.add_argument("--p-tp", type=int, default=1, help="--pd: P's tensor-parallel ranks")
    p.add_argument("--d-tp", type=int, default=1, help="--pd: D's tensor-parallel ranks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default="out/engine_demo.png", help="PNG path ('' for none)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.metrics_linger < 0:
        p.error(f"--metrics-linger: must be >= 0 seconds, got {args.metrics_linger}")
    if args.layers < 1:
        p.error(f"--layers: must be >= 1, got {args.layers}")
    if args.trace_sessions < 0 or (args.trace_sessions and not args.trace):
        p.error(f"--trace-sessions: {args.trace_sessions}: must be >= 1, and needs --trace")
    if args.pd and not (args.d_tp % args.p_tp == 0 and 2 % args.d_tp == 0):
        p.error(
            f"--p-tp {args.p_tp} --d-tp {args.d_tp}: D's ranks must be a multiple of P's, "
            "each dividing the model's 2 KV heads (1-1, 1-2, 2-2)"
        )
    try:
        args.config = EngineConfig(
            block_size=args.block_size,
            num_device_blocks=args.device_blocks,
            num_host_blocks=args.host_blocks,
            write_policy=args.write_policy,
            kv_dtype=args.kv_dtype,
            device=args.device,
            max_running=args.max_running,
            fail_rate=args.fail_rate,
            fail_rank=args.fail_rank,
            tp_size=args.tp,
            storage_dir=args.storage_dir,
            storage_blocks=args.storage_blocks,
            storage_write_policy=args.storage_write_policy,
            model=dataclasses.replace(d.model, num_layers=args.layers),
        )
    except ValueError as e:
        flags = {"tp_size": "--tp", "fail_rank": "--fail-rank", "fail_rate": "--fail-rate"}
        field_name, _, reason = str(e).partition(": ")
        p.error(f"{flags.get(field_name, field_name)}: {reason}")
    return args


def passed(s: dict[str, Any]) -> bool:
    """The verdict: identical outputs, clean checksums, ranks in agreement, and no
    request refused (one larger than the device pool is an error, not a pass)."""
    return bool(
        s["identical_outputs"]
        and s["checksums_ok"]
        and s["ranks_agree"]
        and not s["rejected_requests"]
    )


def report(
    s: dict[str, Any], cached: RunResult, baseline: RunResult, cmp: Comparison, ok: bool
) -> None:
    """The human-readable ending: the table, what went wrong (if anything), the verdict."""
    print(table(s, cached))
    if s.get("plot"):
        print(f"{'plot':<25}  {s['plot']}")
    if "metrics_url" in s:
        print(f"{'metrics':<25}  {s['metrics_url']}")
    for problem in cached.checksum_mismatches[:10]:
        print(f"  checksum: {problem}")
    for problem in (cached.rank_mismatches + baseline.rank_mismatches)[:10]:
        print(f"  ranks: {problem}")
    for problem in cmp.problems[:10]:
        print(f"  {problem}")
    for rid, reason in list(cached.rejected.items())[:10]:
        print(f"  refused {rid}: {reason}")
    print(
        f"\nverdict: {'PASS' if ok else 'FAIL'} - "
        + (
            "outputs identical to full recomputation"
            if ok
            else "requests refused (larger than the device pool)"
            if cached.rejected
            else "outputs differ"
        ),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if refuse_oversized(args):
        return 2
    if args.pd:
        from examples.engine.pd_demo import main_pd

        return main_pd(args, argv, compare, run)
    config: EngineConfig = args.config
    metrics = server = None
    url = ""
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from fastkv.metrics import CacheMetrics, serve_metrics

        registry = CollectorRegistry()
        metrics = CacheMetrics(registry, model=MODEL_ID)
        try:
            server = serve_metrics(args.metrics_port, registry)
        except (ValueError, OSError) as e:
            print(f"--metrics-port: cannot serve on {args.metrics_port}: {e}", file=sys.stderr)
            return 2
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        print(f"metrics: {url}", file=sys.stderr, flush=True)
    try:
        cached = run(config, args, "with fastkv   ", metrics)
        baseline = run(
            dataclasses.replace(config, enable_cache=False, fail_rate=0.0),
            args,
            "recompute all ",
        )
        cmp = compare(cached, baseline)
        s = summary(cached, baseline, cmp)
        s["workload"] = select_trace(args)[1] if args.trace else ""
        if server is not None:
            s["metrics_url"] = url
        if args.plot:
            s["plot"] = args.plot if plot(cached, baseline, Path(args.plot)) else None
        ok = passed(s)
        if args.json:
            print(json.dumps(s), flush=True)
        else:
            report(s, cached, baseline, cmp, ok)
        if server is not None and args.metrics_linger:
            print(
                f"serving {url} for {args.metrics_linger:g} s more", file=sys.stderr, flush=True
            )
            time.sleep(args.metrics_linger)
        return 0 if ok else 1
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    sys.exit(main())
