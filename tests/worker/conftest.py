"""GPU test policy for tests/worker, shared with tests/ops (ops/gpu_support.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)  # so `ops.gpu_support` imports like it does for tests/ops

from ops.gpu_support import require_gpu_hook  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    require_gpu_hook(item, outcome.get_result())
