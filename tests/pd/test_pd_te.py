"""Prefill/decode end to end over a real Mooncake Transfer Engine on TCP loopback: a
P instance and a D instance as two OS processes (tests/pd/pd_te_cases.py), each
scenario in its own private network namespace. Nothing here is skipped: without
Mooncake or `unshare` these tests fail, as test_mooncake_te.py's do."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns_case import run_in_netns

HERE = Path(__file__).resolve().parent


def run_case(case: str, tp: str, tmp_path: Path) -> dict:
    return run_in_netns(HERE / "pd_te_cases.py", [case, str(tmp_path), tp], tmp_path)


def assert_d_clean(d: dict) -> None:
    assert d["invariants"] == "ok"
    assert d["receiving"] == 0 and d["active"] == []
    assert d["expected"] == [0] * len(d["expected"])  # every receiver forgot its transfers


@pytest.mark.parametrize("tp", ["1-1", "1-2", "2-2"])
def test_two_instances_over_te_commit_what_p_computed(tp: str, tmp_path: Path) -> None:
    out = run_case("happy", tp, tmp_path)
    r0, r1 = out["answers"]
    assert r0["num_prefix_blocks"] == 2 and len(r0["block_ids"]) == 4  # D's own prefix
    assert r1["num_prefix_blocks"] == 0 and len(r1["block_ids"]) == 5
    # per layer: layer 0 was on D before P computed layer 1
    assert out["layer0_landed_before_layer1"] and not out["layer1_landed_early"]
    assert out["p_errors"] == []
    assert out["p_digests"] == out["model"]  # P computed the non-PD run's KV
    for rid, o in out["d"]["outcomes"].items():
        assert o["success"], o
        assert o["digest"] == out["model"][rid], f"{rid}: D's KV differs from P's"
    assert out["d"]["counters"]["committed"] == 2
    assert out["d"]["rehits"] == {"r0": 5, "r1": 4}  # the next request hits every full block
    assert_d_clean(out["d"])
    p = out["p"]
    assert p["invariants"] == "ok" and p["active"] == [] and not any(p["num_sends"])
    assert p["counters"]["settled"] == 2 and p["counters"]["send_failed"] == 0
    # only the tails moved: 9 blocks x 3 layers x K,V x 4 tokens x 4 heads x 8 x fp16
    assert sum(p["bytes_sent"]) == 9 * 3 * 2 * 4 * 4 * 8 * 2


def test_p_killed_at_layer_1_ends_in_recompute_after_the_fence(tmp_path: Path) -> None:
    out = run_case("kill_p", "2-2", tmp_path)
    assert out["layer0_landed"]  # P died mid-prefill, with bytes on D
    d, timeout_s, grace_s = out["d"], out["timeout_s"], out["grace_s"]
    for rid, o in d["outcomes"].items():
        assert not o["success"] and "deadline" in o["reason"]
        assert timeout_s <= o["after_s"] < timeout_s + grace_s
        assert o["fenced_at_outcome"] == 11  # both tails still fenced, none freed
        assert o["digest"] == out["model"][rid]  # recomputed on D: the same KV
    assert d["released_after_s"] >= timeout_s + grace_s  # freed only after the grace
    assert d["counters"]["failed"] == 2 and d["counters"]["released_blocks"] == 11
    assert d["rehits"] == {"r0": 5, "r1": 4}
    assert_d_clean(d)


def test_d_killed_mid_batch_p_settles_and_unpins(tmp_path: Path) -> None:
    out = run_case("kill_d", "1-2", tmp_path)
    assert out["layer0_landed"] and out["p_errors"] == []
    p = out["p"]
    assert p["counters"]["settled"] == 2 and p["counters"]["send_failed"] == 2
    assert p["invariants"] == "ok" and p["active"] == [] and p["num_sends"] == [0]
    assert out["settled_s"] < 10.0  # well inside P's own send deadline
