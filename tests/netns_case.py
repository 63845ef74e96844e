"""Run one scenario script in a private network namespace (`unshare --net`) and
read its result: the script prints one line `RESULT <json>`. Used by the tests
that run a real Mooncake master or Transfer Engine on loopback; without `unshare`
(or with the script failing) the test fails with the script's output and logs,
never skips."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

LOG_TAIL = 3000
OUTPUT_TAIL = 4000


def run_in_netns(
    script: Path, args: Sequence[str], tmp_path: Path, *, timeout_s: float = 120
) -> dict[str, Any]:
    """`script args...` in a fresh network namespace; its last RESULT line, parsed.
    Logs the script wrote as `tmp_path/*.log` are shown when it fails."""
    proc = subprocess.run(
        ["unshare", "--net", "--fork", sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-LOG_TAIL:]}"
            for p in tmp_path.glob("*.log")
        )
        pytest.fail(
            f"{script.name} {' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-OUTPUT_TAIL:]}\nstderr:\n{proc.stderr[-OUTPUT_TAIL:]}\n{logs}"
        )
    return json.loads(lines[-1][len("RESULT ") :])
