"""The examples run as users run them, and do what they say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_minimal_loop_evicts_loads_back_and_reads_intact_bytes() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "minimal_loop.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "r1: 0 device hits, 0 host hits, 5 blocks computed"
    assert lines[3] == "r1-again: 2 device hits, 2 host hits, 1 blocks computed"
    assert "every cached block read back intact" in lines[4]
