"""Collection rules for the whole test tree.

`tests/fastdeploy_real/` runs against FastDeploy's real code, in its own venv with
FastDeploy on PYTHONPATH (`make fd-test`). Where FastDeploy or its engine-side
dependencies are not importable (.venv, even with FastDeploy on PYTHONPATH) it is
not collected at all: its modules would fail at import.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Callable

import pytest

collect_ignore: list[str] = []
if any(importlib.util.find_spec(name) is None for name in ("fastdeploy", "paddleformers")):
    collect_ignore.append("fastdeploy_real")


@pytest.fixture
def use_python_radix_tree() -> Callable[[pytest.MonkeyPatch], None]:
    """A function that switches `fastkv.scheduler.radix_tree` to its pure-Python
    node, eviction-list and index classes for the life of the given monkeypatch
    (they behave as the C ones do, and, unlike them, can be deep-copied)."""
    from fastkv.scheduler import radix_tree as rt

    def use(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(rt, "TreeNode", rt._PyTreeNode)
        monkeypatch.setattr(rt, "_new_lru", rt._PyLRUList)
        monkeypatch.setattr(rt, "_new_index", rt._PyNodeIndex)
        for name in ("_unlock_path", "_discard_leaves", "_make_path", "_match_path"):
            monkeypatch.setattr(rt, name, None)

    return use


@pytest.fixture
def channel() -> str:
    """A results-channel name no other test (or test run) uses."""
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
