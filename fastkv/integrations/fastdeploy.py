"""fastkv as a drop-in for FastDeploy's cache manager v1.

    from fastkv.integrations.fastdeploy import CacheManager      # scheduler process
    from fastkv.integrations.fastdeploy import CacheController   # each worker

`CacheManager(fd_config)` and `CacheController(fd_config, local_rank, device_id)`
take FastDeploy's constructor arguments and answer its calls (see
`fd_scheduler.FastDeployCacheManager`, `fd_worker.FastDeployCacheController`).
Either change the two places FastDeploy builds them to import these, or call
`install()` in every FastDeploy process before it builds them, which replaces
FastDeploy's classes in its modules; from a `sitecustomize.py`, call
`fd_hook.install_on_import()` instead, which runs `install()` when FastDeploy
imports its cache manager package (not in every Python process).

Nothing here imports fastdeploy (or paddle) at module level: FastDeploy's classes
and metrics object are looked up when an adapter is built or `install()` runs.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from fastkv.integrations.fd_config import (
    CHANNEL_ENV,
    cache_config_from_fastdeploy,
    results_channel_name,
)
from fastkv.integrations.fd_pd import patch_resource_manager, unpatch_resource_manager
from fastkv.integrations.fd_scheduler import FastDeployCacheManager, FastDeployMatchResult
from fastkv.integrations.fd_worker import (
    FastDeployCacheController,
    StepLayerCounter,
    SwapInFailedError,
)

CacheManager = FastDeployCacheManager
CacheController = FastDeployCacheController

# (module, attribute, replacement): where FastDeploy v1 defines and exports them.
_V1 = "fastdeploy.cache_manager.v1"
_TARGETS = (
    (f"{_V1}.cache_manager", "CacheManager", FastDeployCacheManager),
    (f"{_V1}.cache_controller", "CacheController", FastDeployCacheController),
    (_V1, "CacheManager", FastDeployCacheManager),
    (_V1, "CacheController", FastDeployCacheController),
)
_originals: dict[tuple[str, str], Any] = {}


def install() -> list[str]:
    """Replace FastDeploy's v1 CacheManager and CacheController with fastkv's: in
    the modules that define and export them, and in every `fastdeploy.*` module
    already imported that holds them (a `from ... import CacheManager` done
    before). Idempotent; `uninstall()` undoes it.

    Returns:
        The "module.attribute" names replaced.

    Raises:
        ImportError: FastDeploy's cache_manager.v1 is not importable.
    """
    replaced: list[str] = []
    originals: dict[int, Any] = {}
    _patch_pd()
    for module_name, attr, ours in _TARGETS:
        module = importlib.import_module(module_name)
        current = getattr(module, attr, None)
        if current is None or current is ours:
            continue
        _originals.setdefault((module_name, attr), current)
        originals[id(current)] = ours
        setattr(module, attr, ours)
        replaced.append(f"{module_name}.{attr}")
    for name, module in list(sys.modules.items()):
        if not name.startswith("fastdeploy") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            ours = originals.get(id(value))
            if ours is not None and value is not ours:
                _originals.setdefault((name, attr), value)
                setattr(module, attr, ours)
                replaced.append(f"{name}.{attr}")
    return replaced


def _patch_pd() -> None:
    """ResourceManagerV1's PD methods, wrapped (fd_pd); skipped where FastDeploy's
    engine package does not import."""
    try:
        from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
    except ImportError:
        return
    patch_resource_manager(ResourceManagerV1)


def uninstall() -> None:
    """Put back what `install()` replaced (in modules still imported)."""
    unpatch_resource_manager()
    for (module_name, attr), original in _originals.items():
        module = sys.modules.get(module_name)
        if module is not None:
            setattr(module, attr, original)
    _originals.clear()


__all__ = [
    "CHANNEL_ENV",
    "CacheController",
    "CacheManager",
    "FastDeployCacheController",
    "FastDeployCacheManager",
    "FastDeployMatchResult",
    "StepLayerCounter",
    "SwapInFailedError",
    "cache_config_from_fastdeploy",
    "install",
    "results_channel_name",
    "uninstall",
]
