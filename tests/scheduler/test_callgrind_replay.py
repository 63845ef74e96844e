"""tools/callgrind_replay.py --full-hits counts only the measured pass of hits (inside
`sys.call_tracing`), one run per side."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tools import callgrind_replay as cr


@pytest.mark.parametrize("impl", cr.IMPLS)
def test_the_measured_body_serves_full_hits_after_a_warm_up(impl: str) -> None:
    cr._run_hits(impl, requests=3)  # raises unless every block hits


def test_full_hits_count_one_callgrind_run_per_side_inside_the_measured_call(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The count used to be a hits run less a fill-only run (two processes whose
    # start-up, fill and teardown differences landed in it, 2x apart run to run).
    commands: list[list[str]] = []
    per_side = {"fastkv": 600, "floor": 1200, "lookup_floor": 400}

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("--callgrind-out-file="))
        impl = cmd[cmd.index("--_child") + 1]
        Path(out).write_text(f"summary: {per_side[impl] * 2 * 128}\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cr.shutil, "which", lambda name: "/usr/bin/valgrind")
    monkeypatch.setattr(cr.subprocess, "run", fake_run)
    assert cr._full_hits("unused", requests=2, as_json=True) == 0
    assert len(commands) == len(cr.IMPLS)
    for cmd in commands:
        assert "--collect-atstart=no" in cmd
        assert "--toggle-collect=sys_call_tracing" in cmd
        assert cmd[cmd.index("--_mode") + 1] == "hits"
    result = json.loads(capsys.readouterr().out)
    assert result["fastkv_instructions_per_block"] == 600
    assert result["vs_lookup_floor"] == 1.5
    assert re.fullmatch(r"\d+", str(result["blocks"]))
