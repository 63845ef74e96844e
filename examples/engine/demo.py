"""The engine demo: one workload served twice, with fastkv and with every prompt
recomputed, then compared request by request.

    python tools/demo.py [--trace FILE] [--json] [--plot PATH] [...]

Prints the verdict (identical outputs, KV checksums) and a table of what the
cache did; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from examples.engine.config import EngineConfig
from examples.engine.scheduler import EngineScheduler, RunResult
from examples.engine.workload import ConversationSpec, MultiTurnChat, TraceWorkload, Workload
from tools.progress import Progress
from tools.trace_replay import load_trace

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
        trace = load_trace(args.trace)[: args.trace_requests]
        return TraceWorkload(
            trace, tokens_per_block=args.tokens_per_block, new_tokens=args.new_tokens
        )
    spec = ConversationSpec(
        conversations=args.conversations, turns=args.turns, new_tokens=args.new_tokens
    )
    return MultiTurnChat(spec)


def run(config: EngineConfig, args: argparse.Namespace, label: str) -> RunResult:
    workload = make_workload(args)
    bar = Progress(workload.total_requests, label, enabled=not args.no_progress, check_every=1)
    scheduler = EngineScheduler(config, on_step=lambda done, total: bar.update(done - bar.done))
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
    }


def table(s: dict[str, object], cached: RunResult) -> str:
    def mib(n: object) -> str:
        return f"{int(n) / 2**20:.1f} MiB"  # type: ignore[call-overload]

    cfg = cached.config
    m = cfg.model
    rows = [
        (
            "device",
            f"{s['device']}  (model: {m.num_layers} layers, hidden {m.hidden}, "
            f"{m.num_kv_heads} KV heads x {m.head_dim}; KV {cfg.kv_dtype}, "
            f"{cfg.block_size}-token blocks, {cfg.num_device_blocks} device / "
            f"{cfg.num_host_blocks} host, {cfg.write_policy})",
        ),
        (
            "requests",
            f"{s['requests']}  in {s['steps']} steps"
            + (
                f", {s['rejected_requests']} rejected (larger than the device pool)"
                if s["rejected_requests"]
                else ""
            ),
        ),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        ("  served from device hits", f"{s['device_hit_tokens']:,}"),
        ("  served from host hits", f"{s['host_hit_tokens']:,}"),
        (
            "prefill tokens computed",
            f"{s['prefill_tokens_computed']:,}  "
            f"(without cache {s['prefill_tokens_computed_without_cache']:,})",
        ),
        ("prefill tokens saved", f"{s['prefill_tokens_saved_frac']:.1%}"),
        (
            "recomputed after failures",
            f"{s['recomputed_tokens']:,} tokens, {s['failed_transfers']} failed transfers",
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
        "--fail-rate",
        type=float,
        default=0.0,
        help="inject copy failures with this probability per copy call",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default="out/engine_demo.png", help="PNG path ('' for none)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = EngineConfig(
        block_size=args.block_size,
        num_device_blocks=args.device_blocks,
        num_host_blocks=args.host_blocks,
        write_policy=args.write_policy,
        kv_dtype=args.kv_dtype,
        device=args.device,
        max_running=args.max_running,
        fail_rate=args.fail_rate,
    )
    cached = run(config, args, "with fastkv   ")
    baseline = run(
        dataclasses.replace(config, enable_cache=False, fail_rate=0.0), args, "recompute all "
    )
    cmp = compare(cached, baseline)
    s = summary(cached, baseline, cmp)
    if args.plot:
        s["plot"] = args.plot if plot(cached, baseline, Path(args.plot)) else None
    ok = bool(s["identical_outputs"] and s["checksums_ok"])
    if args.json:
        print(json.dumps(s))
    else:
        print(table(s, cached))
        if s.get("plot"):
            print(f"{'plot':<25}  {s['plot']}")
        for problem in cached.checksum_mismatches[:10]:
            print(f"  checksum: {problem}")
        for problem in cmp.problems[:10]:
            print(f"  {problem}")
        print(
            f"\nverdict: {'PASS' if ok else 'FAIL'} - "
            + ("outputs identical to full recomputation" if ok else "outputs differ")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
