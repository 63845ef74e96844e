"""GPU test policy for tests/ops (see gpu_support.require_gpu_hook)."""

from __future__ import annotations

import pytest

from .gpu_support import require_gpu_hook


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    require_gpu_hook(item, outcome.get_result())
