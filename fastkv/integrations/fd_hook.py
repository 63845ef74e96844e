"""Put fastkv into FastDeploy when FastDeploy loads its cache manager, not before.

A `sitecustomize.py` runs in every Python process of an environment. Calling
`fastdeploy.install()` there imported FastDeploy (and Paddle) into each of them,
8 s for `python -c "print(1)"`. Instead, put this in `sitecustomize.py`:

    from fastkv.integrations.fd_hook import install_on_import
    install_on_import()

It only adds an import hook (this module imports nothing beyond the standard
library and fastkv's package): the first time `fastdeploy.cache_manager.v1` is
imported, right after that package has run, `fastdeploy.install()` swaps in fastkv's
classes (in that package, its modules, and every fastdeploy module that already took
them); the hook then removes itself. If the package is already imported, it
installs at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

# No `typing`, no `threading`: this module runs in every Python process of the
# environment, and each import there is paid by all of them.

TRIGGER = "fastdeploy.cache_manager.v1"


class _Loader:
    """Runs the real loader, then `install()` (once)."""

    def __init__(self, inner: object, hook: _Hook) -> None:
        self._inner = inner
        self._hook = hook

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)  # type: ignore[attr-defined]
        self._hook.fire()

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ...
        return getattr(self._inner, name)


class _Hook:
    """A meta-path finder that answers only for TRIGGER, through the finders after
    it, with its loader wrapped."""

    def __init__(self) -> None:
        self.fired = False
        self.replaced: list[str] = []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != TRIGGER or self.fired:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None

    def fire(self) -> None:
        # Runs under the import system's lock on TRIGGER, or from install_on_import.
        if self.fired:
            return
        self.fired = True
        remove()
        from fastkv.integrations.fastdeploy import install

        self.replaced = install()


_hook: _Hook | None = None


def install_on_import() -> _Hook:
    """Install fastkv into FastDeploy when `fastdeploy.cache_manager.v1` is imported
    (at once if it already is). Idempotent.

    Returns:
        The hook (`fired` once installed; `replaced` lists what `install()` swapped).
    """
    global _hook
    if _hook is None:
        _hook = _Hook()
    if _hook.fired:
        return _hook
    if TRIGGER in sys.modules:
        _hook.fire()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
    return _hook


def remove() -> None:
    """Take the hook off `sys.meta_path` (nothing is installed later)."""
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


__all__ = ["TRIGGER", "install_on_import", "remove"]
