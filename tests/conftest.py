"""Collection rules for the whole test tree.

`tests/fastdeploy_real/` runs against FastDeploy's real code, in its own venv with
FastDeploy on PYTHONPATH (`make fd-test`). Where FastDeploy or its engine-side
dependencies are not importable (.venv, even with FastDeploy on PYTHONPATH) it is
not collected at all: its modules would fail at import.
"""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if any(importlib.util.find_spec(name) is None for name in ("fastdeploy", "paddleformers")):
    collect_ignore.append("fastdeploy_real")
