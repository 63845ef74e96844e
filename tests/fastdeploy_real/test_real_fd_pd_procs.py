"""FastDeploy's P and D engines (real ResourceManagerV1s, fastkv installed) in one
process, each instance's ranks in a process of their own, as in a deployment: the
scheduler's PD tasks reach the ranks only on the engine's own payloads (the step's
batch, the drained tasks), the ranks' RankReports come back over the results
channel, KV moves over Mooncake TE on loopback (pd_procs_case.py, in a private
network namespace). Not skipped: without Mooncake or `unshare` it fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from netns_case import run_in_netns  # noqa: E402


@pytest.mark.parametrize("tp", [1, 2])
def test_pd_tasks_reach_ranks_in_other_processes_only_with_the_engines_payloads(
    tp: int, tmp_path: Path
) -> None:
    out = run_in_netns(
        HERE / "pd_procs_case.py", [str(tmp_path), str(tp)], tmp_path, timeout_s=300
    )
    assert len(out["pids"]) == 3  # the engines', P's ranks', D's ranks'
    assert out["errors"] == [None, None]
    first, second = out["dest"]
    assert len(first) == 4 and -1 not in first
    assert second[:2] == [-1, -1] and len(second) == 4  # D's own prefix reused
    # D read every prompt position from what P's process wrote, per layer.
    assert out["d_mismatches"] == 0 and out["d_positions_checked"] > 0
    assert out["committed"] == 2 and out["sends_finished"] == 2
    assert sum(out["bytes_sent"]) == sum(out["bytes_received"]) > 0
    # P prefilled the first prompt in chunks (16 tokens a step): each P rank got
    # each send once and a chunk with every step that prefilled it, all off the
    # steps' batches; D's ranks got theirs off the drained tasks only.
    assert out["chunked_prefills"] >= 1
    for got in out["arrivals"]["p"]:
        assert got["drained"] == []
        assert got["batch"][0] == "send" and got["batch"].count("send") == 2
        assert got["batch"].count("chunk") == 3 and len(got["batch"]) == 5
    for got in out["arrivals"]["d"]:
        assert got["batch"] == []
        assert got["drained"][0] == "expect" and len(got["drained"]) == 4
        assert got["drained"].count("expect") == got["drained"].count("forget") == 2
