"""`tools/demo.py --pd`, small: P prefills, D decodes over Mooncake TE (TCP loopback in
a private network namespace, the demo re-runs itself under `unshare --net`), outputs
bitwise equal to the plain engine recomputing every prompt. Not skipped: without
Mooncake or `unshare` these fail, as tests/pd/test_mooncake_te.py's do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--conversations", "3", "--turns", "2", "--new-tokens", "3", "--no-progress"]


def run_demo(*flags: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo.py"), "--pd", "--json", *SMALL, *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "fail_rate", "layers"),
    [("1", "1", "0", "3"), ("1", "2", "0.5", "5"), ("2", "2", "0", "3")],
)
def test_pd_demo_decodes_every_request_on_d_with_identical_outputs(
    p_tp: str, d_tp: str, fail_rate: str, layers: str
) -> None:
    s = run_demo("--p-tp", p_tp, "--d-tp", d_tp, "--fail-rate", fail_rate, "--layers", layers)
    assert "private network namespace" in s["transport"]
    assert s["identical_outputs"] and s["ranks_agree"], s["problems"]
    assert s["requests"] == s["bitwise_logits_requests"] == 6
    assert s["layers"] == int(layers)
    assert s["received_on_d"] + s["recomputed_on_d"] == s["transfers"] == 6
    assert s["recomputed_on_d"] == s["aborted_on_p"]  # every failed P send, and only those
    assert s["d_prefix_hit_tokens"] > 0  # the second turns hit D's own prefix
    assert s["blocks_sent"] > 0 and s["bytes_sent"] > 0
    assert 0.0 < s["overlap_frac"] <= 1.0
    if float(fail_rate):
        assert s["aborted_on_p"] > 0 and s["recomputed_tokens_on_d"] > 0


def test_a_failing_pd_worker_is_reported_with_its_error() -> None:
    """A rank that cannot start (float16 KV on the CPU) answers with its traceback;
    the engine raises it instead of a bare EOFError (no TE endpoint is made)."""
    from examples.engine.config import EngineConfig
    from examples.engine.pd import PDEngine
    from examples.engine.workload import ConversationSpec, MultiTurnChat

    engine = PDEngine(EngineConfig(device="cpu", kv_dtype="float16"), 1, 1, local_d=True)
    with pytest.raises(RuntimeError, match=r"d rank 0 failed:(.|\n)*float16 needs a GPU"):
        engine.run(MultiTurnChat(ConversationSpec(conversations=1, turns=1)))
