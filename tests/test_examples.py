"""The examples run as users run them, and do what they say."""

from __future__ import annotations

import ast
import re
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
    assert lines == readme_block_after("It prints:")  # what the README says it prints


def readme_block_after(marker: str) -> list[str]:
    """The lines of the README's first fenced block after `marker`."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(re.escape(marker) + r"\s*\n```\w*\n(.*?)^```$", readme, flags=re.M | re.S)
    assert found, f"README.md has no block after {marker!r}"
    return found.group(1).splitlines()


def test_the_readme_shows_the_minimal_loop_as_it_is() -> None:
    """The README's "whole loop in one process" is examples/minimal_loop.py's code
    (imports included, the module docstring left out), so what a newcomer copies runs."""
    source = (ROOT / "examples" / "minimal_loop.py").read_text()
    docstring_end = ast.parse(source).body[0].end_lineno
    code = "\n".join(source.splitlines()[docstring_end:]).strip("\n")
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", readme, flags=re.M | re.S)
    loops = [b.strip("\n") for b in blocks if "CacheManager(config)" in b]
    assert loops, "README.md has no python block with the minimal loop"
    assert loops[0] == code
