"""Packaging contracts: the no-CUDA build of the core, import isolation, and the
error an unbuilt checkout gives."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .native_harness import ROOT, build_harness


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module")
def stub_core(tmp_path_factory) -> ctypes.CDLL:
    """The core as a machine without nvcc builds it (same sources, CUDA stub)."""
    return build_harness(tmp_path_factory.mktemp("stub"), None)


def test_core_without_cuda_says_so_and_still_copies(stub_core: ctypes.CDLL) -> None:
    from fastkv.ops import core

    lib = stub_core
    for name in ("fkv_last_error", "fkv_host_alloc", "fkv_swap_cpu", "fkv_swap_cuda"):
        fn = getattr(core._lib, name)
        getattr(lib, name).argtypes = fn.argtypes
        getattr(lib, name).restype = fn.restype
    assert lib.fkv_built_with_cuda() == 0
    assert lib.fkv_cuda_device_count() == 0

    dev = np.arange(8 * 16, dtype=np.uint8).reshape(8, 16)
    host = np.zeros((8, 16), np.uint8)
    segs = core.make_segments([(dev.ctypes.data, host.ctypes.data, 16)])
    ids = np.array([2, 5], np.int64)
    args = [segs, 1, 8, 8, ids.ctypes.data, ids.ctypes.data, 2, 1]
    assert lib.fkv_swap_cuda(*args, None) == 4
    assert b"built without CUDA" in lib.fkv_last_error()
    assert not host.any()
    assert lib.fkv_swap_cpu(*args, 1) == 0
    assert np.array_equal(host[[2, 5]], dev[[2, 5]])
    assert lib.fkv_host_alloc(1 << 20, -1, 1, -1) is None
    assert b"built without CUDA" in lib.fkv_last_error()


def test_importing_fastkv_loads_neither_paddle_nor_the_ops() -> None:
    proc = _python(
        "import sys, fastkv, fastkv.worker.numa; "
        "print(sorted(m for m in ('paddle', 'cupy', 'fastkv.ops', 'fastkv.ops.core') "
        "if m in sys.modules))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["core.py", "paddle_ops.py"])
def test_unbuilt_libraries_raise_import_error_saying_how_to_build(
    tmp_path: Path, module: str
) -> None:
    """A copy of the module next to no library behaves like an unbuilt checkout."""
    src = ROOT / "fastkv" / "ops" / module
    shutil.copy(src, tmp_path / module)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('probe', r'{tmp_path / module}')\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "try:\n"
        "    spec.loader.exec_module(mod)\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "ImportError:" in proc.stdout and "make install" in proc.stdout, proc.stdout


def test_built_libraries_sit_in_the_package() -> None:
    ops = ROOT / "fastkv" / "ops"
    assert (ops / "libfastkv_core.so").is_file()
    needed = subprocess.run(
        ["readelf", "-d", str(ops / "libfastkv_paddle_ops.so")],
        capture_output=True,
        text=True,
        check=False,
    )
    if needed.returncode != 0:
        pytest.skip("readelf unavailable or the Paddle op library is not built")
    # One core per process: the op library links the shared core, found via $ORIGIN.
    assert "[libfastkv_core.so]" in needed.stdout
    assert "$ORIGIN" in needed.stdout
