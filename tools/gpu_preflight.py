#!/usr/bin/env python3
"""What `make gpu-test` checks before it builds or runs anything.

It runs with the interpreter the GPU tests will run with (GPU_PYTHON), as it is:
it makes no virtualenv, installs nothing and fetches nothing. It needs:

  - a GPU that `nvidia-smi -L` lists;
  - this interpreter importing CuPy (with cupyx), numpy and pytest;
  - an nvcc (CUDA_HOME, /usr/local/cuda*, PATH) and a C++ compiler ($CXX or c++).

It prints what it found, and when anything is missing, every missing thing with
what to do about it, then exits 1. Paddle is optional (the Paddle-op and controller
GPU tests run only where this interpreter has paddlepaddle-gpu).

    python tools/gpu_preflight.py        # exit 0: ready, 1: something missing

`--archs REQUESTED` prints the SASS targets `make gpu-test` builds instead: the
compute capability of every GPU `nvidia-smi` lists, plus REQUESTED (its
GPU_ARCHS, e.g. "80"). The tests run on this GPU only, so the other defaults are
not built; when no compute capability can be read and nothing is requested it
exits 1 rather than fall back to building every target.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("cupy", "cupyx", "numpy", "pytest")


def _cuda_build() -> ModuleType:
    """fastkv/ops/cuda_build.py by path: importing fastkv would need numpy."""
    path = ROOT / "fastkv" / "ops" / "cuda_build.py"
    spec = importlib.util.spec_from_file_location("fastkv_cuda_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def list_gpus() -> tuple[list[str], str | None]:
    """(the GPU lines of `nvidia-smi -L`, why there are none or None)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi is not installed (no NVIDIA driver on this machine)"
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return [], f"nvidia-smi -L did not run: {e}"
    gpus = [line for line in proc.stdout.splitlines() if line.startswith("GPU ")]
    if proc.returncode != 0 or not gpus:
        said = (proc.stdout + proc.stderr).strip()[:300]
        return [], f"nvidia-smi -L lists no GPU (exit {proc.returncode}): {said}"
    return gpus, None


def gpu_compute_caps() -> tuple[list[str], str | None]:
    """(compute capabilities of the GPUs here as "90", "120", ...; why there are
    none, or None)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi is not installed"
    query = [smi, "--query-gpu=compute_cap", "--format=csv,noheader"]
    try:
        proc = subprocess.run(query, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return [], f"{' '.join(query[1:])} did not run: {e}"
    caps: list[str] = []
    for line in proc.stdout.split():
        major, dot, minor = line.strip().partition(".")
        if dot and major.isdigit() and minor.isdigit() and f"{major}{minor}" not in caps:
            caps.append(f"{major}{minor}")
    if proc.returncode != 0 or not caps:
        said = (proc.stdout + proc.stderr).strip()[:200] or "nothing"
        return [], f"nvidia-smi {' '.join(query[1:])} said {said!r} (exit {proc.returncode})"
    return caps, None


def gpu_test_archs(requested: str) -> tuple[str | None, str | None]:
    """(the targets `make gpu-test` builds: this machine's GPUs and `requested`,
    space-separated; or None and why not)."""
    caps, why = gpu_compute_caps()
    wanted = " ".join([*caps, *requested.replace(",", " ").split()])
    if not wanted:
        return None, (
            f"gpu-test: cannot tell which GPU to build for ({why}); name the targets "
            'with GPU_ARCHS (e.g. make gpu-test GPU_ARCHS="90")'
        )
    return wanted, None


def import_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """name -> its version, "present" when it imports but has no `__version__`
    (cupyx ships inside the cupy package and has none), or None when it does not
    import. An import that raises something other than ImportError is reported as
    such."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            found[name] = None
            continue
        except Exception as e:  # a broken install is reported, not raised
            found[name] = None
            print(f"  {name}: import failed: {type(e).__name__}: {e}")
            continue
        version = getattr(module, "__version__", None)
        found[name] = str(version) if version else "present"
    return found


def main() -> int:
    problems: list[str] = []
    venv = sys.prefix != sys.base_prefix
    print(
        f"gpu-test: python {sys.executable} ({sys.version.split()[0]}"
        + (f", a virtualenv over {sys.base_prefix}" if venv else "")
        + "), used as it is: no venv is made and nothing is installed or fetched"
    )
    gpus, why = list_gpus()
    if why:
        problems.append(f"no GPU: {why}. `make gpu-test` needs an NVIDIA GPU.")
    for line in gpus:
        print(f"  {line}")

    versions = import_versions(REQUIRED)
    missing = [name for name, version in versions.items() if version is None]
    print("  " + ", ".join(f"{n} {v}" for n, v in versions.items() if v is not None))
    if missing:
        problems.append(
            f"{sys.executable} does not import {', '.join(missing)}. Run with the "
            "interpreter that has CuPy (make gpu-test GPU_PYTHON=/path/to/bin/python), "
            "or install what is missing into it (e.g. pip install cupy-cuda13x numpy "
            "pytest, with the CuPy build for your CUDA major version)."
        )
    paddle = import_versions(("paddle",))["paddle"]
    if paddle is None:
        print("  paddle: not installed (the Paddle-op and controller GPU tests skip)")
    else:
        print(f"  paddle {paddle} (the Paddle ops are built against it)")

    cb = _cuda_build()
    nvccs = cb.candidate_nvccs(dict(os.environ))
    if nvccs:
        print(f"  nvcc: {', '.join(nvccs)}")
    else:
        problems.append(
            "no nvcc (looked at CUDA_HOME, CUDA_PATH, /usr/local/cuda*, PATH): install a "
            "CUDA toolkit or set CUDA_HOME to one."
        )
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    if not cxx or shutil.which(cxx[0]) is None:
        problems.append(f"no C++ compiler ({' '.join(cxx) or 'CXX is empty'}): install g++.")

    if problems:
        print("gpu-test cannot run here:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    return 0


def print_archs(requested: str) -> int:
    archs, why = gpu_test_archs(requested)
    if archs is None:
        print(why, file=sys.stderr)
        return 1
    print(archs)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--archs"]:
        sys.exit(print_archs(" ".join(sys.argv[2:])))
    sys.exit(main())
