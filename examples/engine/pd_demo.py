"""`tools/demo.py --pd`: the workload served with prefill/decode disaggregation (P
prefills, D decodes, KV over Mooncake TE on TCP loopback; examples/engine/pd.py) and
again by the plain engine recomputing every prompt, then compared request by request.

The Transfer Engine listens on every interface whatever host it is given: the demo
re-runs itself inside a private network namespace (`unshare --net`) where it can,
and otherwise says that it runs on the machine's loopback with TE listening on all
interfaces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from examples.engine.config import EngineConfig
from examples.engine.pd import PDEngine
from examples.engine.scheduler import RunResult

NETNS_ENV = "FASTKV_DEMO_NETNS"
PD_MIN_BLOCKS = 1024  # every request of a wave holds its blocks on D at once


def _reexec_in_netns(argv: list[str] | None) -> int | None:
    """Run the demo again inside `unshare --net`; None when that is not possible."""
    if os.environ.get(NETNS_ENV):
        return None
    try:
        probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if probe.returncode != 0:
        return None
    demo = Path(__file__).resolve().parents[2] / "tools" / "demo.py"
    args = sys.argv[1:] if argv is None else argv
    cmd = ["unshare", "--net", "--fork", sys.executable, str(demo), *args]
    return subprocess.run(cmd, env={**os.environ, NETNS_ENV: "1"}).returncode


def main_pd(
    args: argparse.Namespace,
    argv: list[str] | None,
    compare: Callable[[RunResult, RunResult], Any],
    run: Callable[..., RunResult],
) -> int:
    code = _reexec_in_netns(argv)
    if code is not None:
        return code
    if os.environ.get(NETNS_ENV):
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        where = "TCP loopback in a private network namespace"
    else:
        where = "TCP loopback (no private namespace: TE listens on every interface)"
        print(f"note: {where}", file=sys.stderr)
    config: EngineConfig = args.config
    config = dataclasses.replace(
        config, num_device_blocks=max(config.num_device_blocks, PD_MIN_BLOCKS)
    )
    engine = PDEngine(config, args.p_tp, args.d_tp, fail_rate=args.fail_rate)
    from examples.engine.demo import make_workload

    pd = engine.run(make_workload(args))
    baseline = run(
        dataclasses.replace(config, enable_cache=False, fail_rate=0.0, tp_size=1),
        args,
        "recompute all ",
    )
    cmp = compare(pd, baseline)
    st = engine.stats
    ttft = sorted(st.ttft_s) or [0.0]
    s = {
        "mode": "pd",
        "transport": where,
        "p_tp": args.p_tp,
        "d_tp": args.d_tp,
        "layers": config.model.num_layers,
        "fail_rate": args.fail_rate,
        "identical_outputs": cmp.identical_outputs,
        "ranks_agree": not pd.rank_mismatches,
        "requests": cmp.requests,
        "identical_token_requests": cmp.identical_tokens,
        "bitwise_logits_requests": cmp.bitwise_logits,
        "max_logits_rel_diff": cmp.max_logits_rel_diff,
        "prompt_tokens": pd.prompt_tokens,
        "p_prefill_tokens_computed": pd.computed_prompt_tokens,
        "p_prefix_hit_tokens": st.p_prefix_hit_tokens,
        "d_prefix_hit_tokens": st.d_prefix_hit_tokens,
        "transfers": st.transfers,
        "received_on_d": st.received,
        "recomputed_on_d": st.recomputed,
        "recomputed_tokens_on_d": pd.recomputed_tokens,
        "aborted_on_p": st.aborted_on_p,
        "blocks_sent": st.blocks_sent,
        "bytes_sent": st.bytes_sent,
        "overlap_frac": st.overlap_frac,
        "d_ttft_mean_s": statistics.fmean(ttft),
        "d_ttft_p50_s": ttft[len(ttft) // 2],
        "d_ttft_max_s": ttft[-1],
        "seconds_pd": pd.seconds,
        "seconds_baseline": baseline.seconds,
        "problems": cmp.problems + pd.rank_mismatches,
    }
    ok = bool(
        s["identical_outputs"]
        and s["ranks_agree"]
        and st.received + st.recomputed == cmp.requests
    )
    if args.json:
        print(json.dumps(s), flush=True)
    else:
        print(table(s, config))
        for problem in s["problems"][:10]:  # type: ignore[index]
            print(f"  {problem}")
        print(
            f"\nverdict: {'PASS' if ok else 'FAIL'} - "
            + (
                "every request decoded on D, outputs identical to full recomputation"
                if ok
                else "outputs differ"
            ),
            flush=True,
        )
    return 0 if ok else 1


def table(s: dict[str, Any], config: EngineConfig) -> str:
    m = config.model
    rows = [
        (
            "P -> D",
            f"TP {s['p_tp']} -> {s['d_tp']}, Mooncake TE over {s['transport']}",
        ),
        (
            "model",
            f"{m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim}, KV "
            f"{config.kv_dtype}, {config.block_size}-token blocks, "
            f"{config.num_device_blocks} device blocks per instance",
        ),
        ("requests", f"{s['requests']}"),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        (
            "  prefilled on P",
            f"{s['p_prefill_tokens_computed']:,}  ({s['p_prefix_hit_tokens']:,} P prefix hits)",
        ),
        ("  D prefix hits", f"{s['d_prefix_hit_tokens']:,}  (not sent: D had them)"),
        (
            "transfers",
            f"{s['transfers']}: {s['received_on_d']} committed on D, "
            f"{s['recomputed_on_d']} recomputed on D ({s['recomputed_tokens_on_d']:,} "
            f"tokens; failed P sends: {s['aborted_on_p']})",
        ),
        (
            "sent P -> D",
            f"{s['blocks_sent']:,} blocks, {s['bytes_sent'] / 2**20:.1f} MiB",
        ),
        (
            "overlap with P's prefill",
            f"{s['overlap_frac']:.1%} of the transfer time (first layer handed over to "
            "last write settled)",
        ),
        (
            "D time to first token",
            f"mean {s['d_ttft_mean_s'] * 1e3:.1f} ms, p50 {s['d_ttft_p50_s'] * 1e3:.1f} ms, "
            f"max {s['d_ttft_max_s'] * 1e3:.1f} ms (offer -> KV ready on D)",
        ),
        (
            "wall time",
            f"{s['seconds_pd']:.2f} s with PD, {s['seconds_baseline']:.2f} s "
            "recomputing every prompt on one instance",
        ),
        (
            "outputs",
            f"{s['identical_token_requests']}/{s['requests']} identical token sequences; "
            f"last logits bitwise equal for {s['bitwise_logits_requests']}, max relative "
            f"difference {s['max_logits_rel_diff']:.2e}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
