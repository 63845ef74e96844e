"""Collection rules for the whole test tree.

`tests/fastdeploy_real/` runs against FastDeploy's real code, in its own venv with
FastDeploy on PYTHONPATH (`make fd-test`). Where `fastdeploy` is not importable
(.venv) it is not collected at all: its modules would fail at import.
"""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("fastdeploy") is None:
    collect_ignore.append("fastdeploy_real")
