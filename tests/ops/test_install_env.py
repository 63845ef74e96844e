"""Installing fastkv into an environment that already has its Paddle (FastDeploy's,
with paddlepaddle-gpu): `make install PYTHON_ENV=<its python>` builds with that
interpreter and no build isolation, so the toolkit check sees that Paddle (a toolkit
of another CUDA major version is refused, saying what works instead) and the Paddle
ops link that Paddle's libpaddle.so, not the one in the project's .venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastkv.ops import cuda_build as cb
from fastkv.ops import native_build as nb

from .scratch_env import VENV_SITE, clean_env, copy_checkout, fake_paddle, make_env


def _real_toolkit() -> Path | None:
    """The root (nvcc's TOP) of the first CUDA toolkit found, or None."""
    found = cb.candidate_nvccs(dict(os.environ))
    tops = nb._nvcc_library_dirs(found[0])[1] if found else []
    return tops[0] if tops and (tops[0] / "bin" / "nvcc").is_file() else None


REAL_TOOLKIT = _real_toolkit()
needs_nvcc = pytest.mark.skipif(REAL_TOOLKIT is None, reason="builds with a real nvcc")


def _make_install(tree: Path, python: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "install", f"PYTHON_ENV={python}"],
        cwd=tree,
        env=clean_env(PIP_NO_INDEX="1", **env),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def _installed(site_packages: Path) -> list[str]:
    return sorted(p.name for p in site_packages.glob("fastkv*"))


@needs_nvcc
def test_a_toolkit_of_another_major_than_the_envs_paddle_is_refused(tmp_path: Path) -> None:
    """The environment's Paddle says CUDA 12.6; only CUDA 13 is installed. Nothing is
    installed, and the message says how to get a CUDA 12 toolkit that works."""
    tree = copy_checkout(tmp_path / "checkout")
    python, own = make_env(tmp_path / "env")
    fake_paddle(own, "12.6")
    assert REAL_TOOLKIT is not None
    version = cb.nvcc_version(str(REAL_TOOLKIT / "bin" / "nvcc"))
    assert version is not None and version[0] != 12
    conda = "conda install -c conda-forge cuda-nvcc cuda-cudart-dev cuda-cudart-static"
    # No CUDA_HOME: the toolkits found are all CUDA 13.
    proc = _make_install(tree, python)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "built for CUDA 12.6" in out and "CUDA 12.x toolkit" in out, out[-3000:]
    assert f"{conda} cuda-version=12.6, then CUDA_HOME=$CONDA_PREFIX" in out
    assert "apt-get install cuda-toolkit-12-6" in out and "FASTKV_WITH_CUDA=0" in out
    assert "--no-build-isolation" in out  # the build ran in that environment
    # CUDA_HOME naming a CUDA 13 toolkit.
    proc = _make_install(tree, python, CUDA_HOME=str(REAL_TOOLKIT))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"CUDA_HOME: {REAL_TOOLKIT}/bin/nvcc is CUDA {version[0]}." in out, out[-3000:]
    assert f"{conda} cuda-version=12.6 makes $CONDA_PREFIX one" in out
    assert not (tree / ".venv").exists()  # no project venv made
    assert _installed(own) == []
    assert not list(tree.rglob("libfastkv_core.so"))  # refused before compiling it


@needs_nvcc
def test_the_build_in_the_env_links_the_paddle_of_that_env(tmp_path: Path) -> None:
    """A scratch environment whose own site-packages holds a (CPU) Paddle: fastkv is
    installed into it, its Paddle ops link that Paddle (not the .venv's), and they load
    there from outside the checkout."""
    tree = copy_checkout(tmp_path / "checkout")
    python, own = make_env(tmp_path / "env")
    (own / "paddle").symlink_to(VENV_SITE / "paddle", target_is_directory=True)
    proc = _make_install(tree, python, FASTKV_CUDA_ARCHS="75")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not (tree / ".venv").exists()
    assert "fastkv-0.1.0.dist-info" in _installed(own), _installed(own)
    ops = own / "fastkv" / "ops"
    assert (ops / "libfastkv_core.so").exists()
    runpath = subprocess.run(
        ["readelf", "-d", str(ops / "libfastkv_paddle_ops.so")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"{own}/paddle/libs" in runpath and str(VENV_SITE) not in runpath, runpath
    code = (
        "import fastkv, numpy as np\n"
        "from fastkv.ops import core, paddle_ops\n"
        "print(fastkv.__file__)\n"
        "print(core.cuda_info().archs)\n"
        "print(paddle_ops.int64_tensor([3, 1]).numpy().tolist())\n"
    )
    run = subprocess.run(
        [str(python), "-c", code],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith(str(own)), lines
    assert lines[1] == "('sm_75', 'compute_75')" and lines[2] == "[3, 1]", lines


def test_make_install_into_a_missing_or_bare_interpreter_says_what_is_wrong(
    tmp_path: Path,
) -> None:
    tree = copy_checkout(tmp_path / "checkout")
    proc = _make_install(tree, tmp_path / "nope" / "python")
    assert proc.returncode != 0 and "no such interpreter" in proc.stdout + proc.stderr
    bare = tmp_path / "bare"
    subprocess.run(
        ["python3", "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120
    )
    proc = _make_install(tree, bare / "bin" / "python")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "lacks pip or setuptools" in out, out
    assert not (tree / ".venv").exists()


# ----------------------------------------------------------- toolkit layouts


def _toolkit(root: Path, libdir: str) -> Path:
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    lib = root / libdir / "libcudart_static.a"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"!<arch>\n")
    return nvcc


def test_the_static_runtime_is_found_in_nvidia_and_conda_layouts(tmp_path: Path) -> None:
    system = _toolkit(tmp_path / "cuda-12.6", "lib64")
    assert nb.static_cudart(str(system)) == tmp_path / "cuda-12.6/lib64/libcudart_static.a"
    # conda's CUDA 12+ packages keep static libraries under targets/<arch>/lib only
    conda = _toolkit(tmp_path / "conda", "targets/x86_64-linux/lib")
    found = nb.static_cudart(str(conda))
    assert found == tmp_path / "conda/targets/x86_64-linux/lib/libcudart_static.a"
    # nvcc reached through a symlink: the toolkit it resolves to counts too
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(system)
    assert nb.static_cudart(str(tmp_path / "bin" / "nvcc")).parent.name == "lib64"


def test_a_toolkit_without_the_static_runtime_says_what_to_install(tmp_path: Path) -> None:
    nvcc = tmp_path / "pip" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    with pytest.raises(nb.NativeBuildError) as info:
        nb.static_cudart(str(nvcc))
    msg = str(info.value)
    assert str(tmp_path / "pip" / "lib64") in msg and "targets/*" not in msg
    assert "cuda-cudart-static" in msg and "cuda-cudart-dev-" in msg and "CUDA_HOME" in msg


@needs_nvcc
def test_a_conda_layout_toolkit_builds_the_core(tmp_path: Path) -> None:
    """What the refusal suggests (`conda install -c conda-forge cuda-nvcc
    cuda-cudart-dev cuda-cudart-static`, CUDA_HOME=$CONDA_PREFIX) gives a prefix with
    bin/nvcc and its nvcc.profile, and the static runtime only under
    targets/x86_64-linux/lib (no lib64). The real setup.py builds the core from such a
    prefix, made here of this machine's toolkit (conda itself is not reachable here)."""
    assert REAL_TOOLKIT is not None
    prefix = tmp_path / "conda_env"
    (prefix / "bin").mkdir(parents=True)
    for tool in (REAL_TOOLKIT / "bin").iterdir():
        if tool.name in ("nvcc", "nvcc.profile"):  # real files: the profile's TOP is here
            shutil.copy2(tool, prefix / "bin" / tool.name)
        else:
            (prefix / "bin" / tool.name).symlink_to(tool)
    (prefix / "nvvm").symlink_to(REAL_TOOLKIT / "nvvm")
    target = prefix / "targets" / "x86_64-linux"
    (target / "lib").mkdir(parents=True)
    real_target = REAL_TOOLKIT / "targets" / "x86_64-linux"
    (target / "include").symlink_to(real_target / "include")
    (target / "lib" / "libcudart_static.a").symlink_to(
        nb.static_cudart(str(REAL_TOOLKIT / "bin" / "nvcc"))
    )
    assert not (prefix / "lib64").exists() and not (prefix / "lib").exists()
    tree = copy_checkout(tmp_path / "checkout")
    proc = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", "out", "--build-temp", "tmp"],
        cwd=tree,
        env=clean_env(
            CUDA_HOME=str(prefix), FASTKV_CUDA_ARCHS="75", FASTKV_BUILD_PADDLE_OPS="0"
        ),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"{target}/lib/libcudart_static.a" in out, out
    assert f"({prefix}/bin/nvcc;" in out
    assert (tree / "out" / "fastkv" / "ops" / "libfastkv_core.so").exists()


def test_an_isolated_pip_build_says_it_cannot_see_paddle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pip install .` without --no-build-isolation builds where the environment's
    Paddle is invisible: the build says so and how to build instead."""
    monkeypatch.setitem(sys.modules, "paddle", None)  # what the isolated build sees
    monkeypatch.delenv("FASTKV_BUILD_PADDLE_OPS", raising=False)
    monkeypatch.setattr(sys, "path", [*sys.path, "/tmp/pip-build-env-x1/overlay/site-packages"])
    assert nb.build_paddle_ops(tmp_path / nb.PADDLE_LIB, tmp_path / "tmp") is False
    err = capsys.readouterr().err
    assert "pip's build isolation hides" in err and "--no-build-isolation" in err
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "pip-build-env-" not in p])
    assert nb.build_paddle_ops(tmp_path / nb.PADDLE_LIB, tmp_path / "tmp") is False
    assert "install paddlepaddle and rebuild" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["fastkv/ops/native_build.py", "fastkv/ops/cuda_build.py"])
def test_a_change_of_the_build_scripts_reinstalls_the_venv(tmp_path: Path, script: str) -> None:
    """`make install` rebuilds .venv's libraries when the code that builds them changes,
    not only their sources."""
    tree = copy_checkout(tmp_path)
    stamp = tree / ".venv" / ".installed"
    stamp.parent.mkdir()
    stamp.touch()
    later = stamp.stat().st_mtime + 60
    os.utime(stamp, (later, later))

    def up_to_date() -> bool:
        query = subprocess.run(["make", "-q", ".venv/.installed"], cwd=tree, env=clean_env())
        return query.returncode == 0

    assert up_to_date()
    os.utime(tree / script, (later + 60, later + 60))
    assert not up_to_date()
