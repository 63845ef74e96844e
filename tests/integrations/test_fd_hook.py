"""The sitecustomize route: fastkv goes into FastDeploy when FastDeploy imports its
cache manager package, and a process that never imports FastDeploy imports neither
it nor paddle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastkv.integrations import fastdeploy as fd
from fastkv.integrations import fd_hook

REPO = Path(__file__).resolve().parents[2]


def _fake_fastdeploy(root: Path) -> None:
    """A FastDeploy-shaped package on disk (the real one needs its own venv): v1's
    package imports its CacheManager and CacheController from their modules, and an
    engine module imports them from the package."""
    v1 = root / "fastdeploy" / "cache_manager" / "v1"
    v1.mkdir(parents=True)
    (root / "fastdeploy" / "__init__.py").write_text("")
    (root / "fastdeploy" / "cache_manager" / "__init__.py").write_text("")
    (v1 / "cache_manager.py").write_text("class CacheManager:\n    pass\n")
    (v1 / "cache_controller.py").write_text("class CacheController:\n    pass\n")
    (v1 / "__init__.py").write_text(
        "from .cache_manager import CacheManager\n"
        "from .cache_controller import CacheController\n"
    )
    (root / "fastdeploy" / "engine.py").write_text(
        "from fastdeploy.cache_manager.v1 import CacheManager\n"
    )


@pytest.fixture
def fake_fastdeploy(tmp_path: Path, monkeypatch):
    _fake_fastdeploy(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "fastdeploy" or m.startswith("fastdeploy.")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    fd_hook.remove()
    fd.uninstall()
    for name in [m for m in sys.modules if m == "fastdeploy" or m.startswith("fastdeploy.")]:
        del sys.modules[name]
    fd_hook._hook = None


def test_the_hook_installs_when_fastdeploy_imports_its_cache_manager(fake_fastdeploy) -> None:
    hook = fd_hook.install_on_import()
    assert hook in sys.meta_path and not hook.fired
    import fastdeploy  # noqa: F401  the package alone does not trigger it

    assert not hook.fired
    import fastdeploy.engine as engine  # imports the v1 package: installs

    assert hook.fired and hook not in sys.meta_path
    assert engine.CacheManager is fd.CacheManager  # taken before install(), replaced
    import fastdeploy.cache_manager.v1 as v1

    assert v1.CacheController is fd.CacheController
    assert (
        sys.modules["fastdeploy.cache_manager.v1.cache_manager"].CacheManager is fd.CacheManager
    )
    assert fd_hook.install_on_import() is hook  # idempotent


def test_the_hook_installs_at_once_when_fastdeploy_is_already_imported(
    fake_fastdeploy,
) -> None:
    import fastdeploy.cache_manager.v1 as v1

    hook = fd_hook.install_on_import()
    assert hook.fired and v1.CacheManager is fd.CacheManager


def test_a_sitecustomize_with_the_hook_imports_nothing_heavy(fake_fastdeploy: Path) -> None:
    site = fake_fastdeploy / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from fastkv.integrations.fd_hook import install_on_import\ninstall_on_import()\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(fake_fastdeploy), str(REPO)])
    probe = "import sys; print(sorted({'fastdeploy', 'paddle', 'numpy'} & set(sys.modules)))"
    plain = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 0 and plain.stdout.strip() == "[]", plain.stderr[-2000:]
    engine = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import fastdeploy.engine as e, fastdeploy.cache_manager.v1 as v1
                print(e.CacheManager.__module__, v1.CacheController.__module__)
                """
            ),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert engine.returncode == 0, engine.stderr[-2000:]
    assert engine.stdout.split() == [
        "fastkv.integrations.fd_scheduler",
        "fastkv.integrations.fd_worker",
    ]
