"""GPU test policy for tests/ops (see gpu_support.require_gpu_hook)."""

from __future__ import annotations

import pytest

from .gpu_support import GPUS_MARK, require_gpu_hook


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{GPUS_MARK}(n): needs n CUDA GPUs (set by gpu_support.needs_gpus)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    require_gpu_hook(item, outcome.get_result())
