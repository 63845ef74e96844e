"""FastDeploy's P and D instances (real ResourceManagerV1s) with fastkv's PD path over
a real Mooncake Transfer Engine on TCP loopback, in a private network namespace
(pd_te_case.py). Not skipped: without Mooncake or `unshare` it fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from netns_case import run_in_netns  # noqa: E402


@pytest.mark.parametrize("tp", [1, 2])
def test_p_and_d_over_mooncake_te(tp: int, tmp_path: Path) -> None:
    out = run_in_netns(
        HERE / "pd_te_case.py", [str(tmp_path), str(tp)], tmp_path, timeout_s=300
    )
    assert all(a.startswith("127.0.0.1:") for a in out["addresses"]), out["addresses"]
    assert out["errors"] == [None, None]
    first, second = out["dest"]
    assert len(first) == 4 and -1 not in first
    assert second[:2] == [-1, -1] and len(second) == 4  # D's own prefix: only the tail sent
    assert out["bytes"][1] * 2 == out["bytes"][0]  # 2 of 4 blocks
    assert out["d_mismatches"] == 0 and out["d_positions_checked"] > 0
    assert out["committed"] == 2 and out["received_verified"] == sum(out["bytes"])
