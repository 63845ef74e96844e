"""Builds a host harness (a .cc beside the tests) with the core's C sources."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "custom_ops" / "csrc"
CORE_SOURCES = [
    "fkv_common.cc",
    "fkv_pool.cc",
    "fkv_cpu.cc",
    "fkv_host_alloc.cc",
    "fkv_layout.cc",
    "fkv_cuda_stub.cc",
]


def build_harness(out_dir: Path, source: str | None) -> ctypes.CDLL:
    """Compiles tests/ops/<source> (None: nothing more, the core as a machine
    without nvcc builds it) with the core's sources into a shared library in
    out_dir and loads it; fails (never skips) without a C++ compiler."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.fail(f"no C++ compiler ({cxx}): {source or 'the core'} needs one (it is in CI)")
    sources = [str(CSRC / s) for s in CORE_SOURCES]
    name = "fastkv_core_stub"
    if source is not None:
        harness = Path(__file__).resolve().with_name(source)
        sources.insert(0, str(harness))
        name = harness.stem
    out = out_dir / f"lib{name}.so"
    cmd = [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", f"-I{CSRC}", *sources, "-o", str(out)]
    proc = subprocess.run([*cmd, "-pthread"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(out))
