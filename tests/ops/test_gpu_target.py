"""`make gpu-test`'s own logic, run here on a copy of the checkout with a stand-in
`nvidia-smi` that lists an H100 (the GPU tests themselves then fail, as they must
without a real GPU): it uses GPU_PYTHON as it is even when that is a virtualenv (no
venv made from it, nothing installed or fetched), says what that interpreter lacks,
and builds the core alone, without setuptools, Python headers or the other
extensions. On a machine with a GPU `make gpu-test` runs for real instead."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastkv.ops import core

from .scratch_env import copy_checkout

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = Path(sys.executable)  # the project's .venv: itself a virtualenv

pytestmark = pytest.mark.skipif(
    core.cuda_device_count() > 0,
    reason="checks gpu-test's logic with a stand-in GPU; on this GPU machine "
    "`make gpu-test` runs for real",
)

FAKE_SMI = """#!/bin/sh
case "$*" in
  *-L*) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
  *compute_cap*) printf "COMPUTE_CAP" ;;
  *) echo "NVIDIA-SMI 580.00  Driver Version: 580.00  CUDA Version: 13.0" ;;
esac
"""


def _fake_smi(folder: Path, compute_cap: str = "9.0\n") -> Path:
    """A stand-in nvidia-smi in `folder` listing an H100 whose compute-capability
    query prints `compute_cap`."""
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(FAKE_SMI.replace("COMPUTE_CAP", compute_cap.replace("\n", "\\n")))
    smi.chmod(0o755)
    return folder


def _fake_cupy(folder: Path) -> Path:
    """Stand-in cupy and cupyx packages (cupyx, as the real one, has no version)."""
    for name in ("cupy", "cupyx"):
        (folder / name).mkdir(parents=True)
    (folder / "cupy" / "__init__.py").write_text('__version__ = "0+stand-in"\n')
    (folder / "cupyx" / "__init__.py").write_text("")
    return folder


def _make_gpu_test(
    tmp_path: Path,
    python: Path,
    extra_pythonpath: Path | None = None,
    as_python3: bool = False,
    compute_cap: str = "9.0\n",
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`make gpu-test` in a copy of the checkout, nvidia-smi listing an H100 (its
    compute-capability query printing `compute_cap`), with GPU_PYTHON=`python`, or
    (as_python3) with `python`'s folder first on PATH and GPU_PYTHON left at its
    default, python3."""
    tree = copy_checkout(tmp_path / "checkout")
    fake_bin = _fake_smi(tmp_path / "bin", compute_cap)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FASTKV_", "PYTEST_", "VIRTUAL_ENV", "PYTHONHOME"))
    }
    path = [str(fake_bin), *([str(python.parent)] if as_python3 else []), env.get("PATH", "")]
    env.update(
        PATH=os.pathsep.join(path),
        # Nothing may be fetched: any pip install would fail here.
        PIP_NO_INDEX="1",
        PIP_INDEX_URL="http://127.0.0.1:9/simple",
        MAKEFLAGS="",
    )
    env.pop("PYTHONPATH", None)
    if extra_pythonpath is not None:
        env["PYTHONPATH"] = str(extra_pythonpath)
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-test"]
        + ([] if as_python3 else [f"GPU_PYTHON={python}"]),
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    return tree, proc


def _site_packages(python: Path) -> list[str]:
    out = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return sorted(os.listdir(out))


def test_an_interpreter_without_cupy_is_named_and_nothing_is_installed(tmp_path: Path) -> None:
    """The default GPU_PYTHON, python3, is a virtualenv here (the .venv's) as on the
    machines lent: it is used as it is, and what it lacks is named."""
    before = _site_packages(VENV_PYTHON)
    tree, proc = _make_gpu_test(tmp_path, VENV_PYTHON, as_python3=True)
    out = proc.stdout + proc.stderr
    python3 = VENV_PYTHON.parent / "python3"
    assert proc.returncode != 0, out
    assert f"gpu-test: python {python3} (" in out and "a virtualenv over" in out, out
    assert f"{python3} does not import cupy, cupyx" in out, out
    assert "GPU_PYTHON=/path/to/bin/python" in out
    assert "GPU 0: NVIDIA H100" in out
    assert not (tree / "build" / "venv-gpu").exists()
    assert not list(tree.rglob("*.so")), "nothing is built before the check passes"
    assert _site_packages(VENV_PYTHON) == before


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="builds the CUDA core: needs nvcc")
def test_the_interpreter_is_used_as_it_is_and_only_the_core_is_built(tmp_path: Path) -> None:
    """GPU_PYTHON is a virtualenv (like python3 on the machines lent), with a stand-in
    `cupy` package only so that the check passes: the target goes on with that very
    interpreter (no venv made from it), builds the CUDA core alone for the listed
    GPU, runs the GPU tests with it, and is red because there is no GPU."""
    fake_cupy = _fake_cupy(tmp_path / "fake_cupy")
    before = _site_packages(VENV_PYTHON)
    tree, proc = _make_gpu_test(tmp_path, VENV_PYTHON, fake_cupy)
    out = proc.stdout + proc.stderr
    assert f"gpu-test: python {VENV_PYTHON}" in out and "cupy 0+stand-in" in out, out
    assert "cupyx present" in out, out
    # This GPU's target alone (and its PTX), not every default one.
    assert "targets sm_90 compute_90" in out, out
    assert f"[fastkv] built {tree}/fastkv/ops/libfastkv_core.so (with CUDA)" in out, out
    built = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.so"))
    paddle = "fastkv/ops/libfastkv_paddle_ops.so"  # .venv has (CPU) paddle
    assert built == ["fastkv/ops/libfastkv_core.so", paddle], built
    assert "_disk_io" not in out and "_chain_hash" not in out
    assert not (tree / "build" / "venv-gpu").exists()
    assert _site_packages(VENV_PYTHON) == before
    # The GPU tests ran with that interpreter and failed rather than skipped.
    assert "FASTKV_REQUIRE_GPU=1" in out and "passed" not in out.split("short test summary")[0]
    assert "skipped under FASTKV_REQUIRE_GPU=1: Skipped: no usable CUDA device" in out, out
    assert proc.returncode != 0


def test_gpu_test_builds_the_core_with_the_standard_library_alone(tmp_path: Path) -> None:
    """`python -I -S`: no site-packages (no setuptools), and the core's compile lines
    name no Python include directory (no Python.h needed)."""
    tree = copy_checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTKV_")}
    env["FASTKV_WITH_CUDA"] = "0"  # the compile lines are what is checked
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "fastkv/ops/native_build.py"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert (tree / "fastkv" / "ops" / "libfastkv_core.so").exists()
    assert "paddle is not importable" in out  # -S: no site-packages, so no paddle
    compile_lines = [line for line in out.splitlines() if line.startswith("[fastkv] compile")]
    assert len(compile_lines) == 6, out  # five core sources and the CUDA stub
    for line in compile_lines:
        includes = [a for a in line.split() if a.startswith(("-I", "-isystem"))]
        assert includes == [f"-I{tree / 'custom_ops' / 'csrc'}"], line


def test_the_gpu_tests_collect_where_paddle_is_absent(tmp_path: Path) -> None:
    """The machines lent have no Paddle: a test module under tests/ops or tests/worker
    that imports paddle (directly or through fastkv.worker's controller) at module
    level must skip, not break the collection of `make gpu-test`'s run."""
    blocker = tmp_path / "no_paddle" / "paddle"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'paddle\'", name="paddle")\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTKV_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), str(ROOT)])
    collect = ["--co", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/ops", "tests/worker"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *collect],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "error" not in out.lower(), out[-3000:]
    assert "tests/ops/test_cuda_gpu.py::test_cuda_info_reports_this_gpu" in out


def test_gpu_test_refuses_to_guess_the_targets_and_builds_nothing(tmp_path: Path) -> None:
    """nvidia-smi lists a GPU but not its compute capability, and GPU_ARCHS is
    empty: the target stops and says how to name one, instead of building all."""
    fake_cupy = _fake_cupy(tmp_path / "fake_cupy")
    tree, proc = _make_gpu_test(tmp_path, VENV_PYTHON, fake_cupy, compute_cap="[N/A]\n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "gpu-test: cannot tell which GPU to build for" in out, out
    assert 'make gpu-test GPU_ARCHS="90"' in out, out
    assert "[fastkv] compile" not in out and not list(tree.rglob("*.so")), out


def _preflight():
    path = ROOT / "tools" / "gpu_preflight.py"
    spec = importlib.util.spec_from_file_location("fastkv_gpu_preflight", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("compute_cap", "requested", "archs"),
    [
        ("9.0\n", "", "90"),  # this GPU only
        ("9.0\n9.0\n8.0\n", "", "90 80"),  # every GPU here, once each
        ("12.0\n", "80, 90", "120 80 90"),  # plus what GPU_ARCHS asks for
        ("[N/A]\n", "8.6", "8.6"),  # nothing readable: what was asked for alone
        ("[N/A]\n", "", None),  # nothing at all: refused, not every target
    ],
)
def test_gpu_test_targets_are_the_gpus_here_plus_those_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compute_cap: str, requested: str, archs
) -> None:
    monkeypatch.setenv("PATH", f"{_fake_smi(tmp_path, compute_cap)}{os.pathsep}/usr/bin:/bin")
    got, why = _preflight().gpu_test_archs(requested)
    assert got == archs
    if archs is None:
        assert "compute_cap" in why and "GPU_ARCHS" in why, why


def test_preflight_reports_a_module_without_a_version_as_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cupyx has no __version__; it used to read "cupyx -", as if missing."""
    monkeypatch.syspath_prepend(str(_fake_cupy(tmp_path)))
    for name in ("cupy", "cupyx"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    found = _preflight().import_versions(("cupy", "cupyx", "no_such_module_here"))
    assert found == {"cupy": "0+stand-in", "cupyx": "present", "no_such_module_here": None}
