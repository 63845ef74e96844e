"""Scratch copies of the checkout and scratch Python environments for the tests that
run the build the way a user does (make gpu-test, make install PYTHON_ENV=...),
without touching this checkout's build or its .venv."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_SITE = Path(site.getsitepackages()[0])
"""The project .venv's site-packages: numpy, pip, setuptools, (CPU) paddle."""


def copy_checkout(dest: Path) -> Path:
    """The sources of the checkout at `dest`, without anything built or installed."""
    dest.mkdir(parents=True, exist_ok=True)
    junk = shutil.ignore_patterns(
        "*.so", "*.o", "__pycache__", ".venv", "build", "*.egg-info", ".pytest_cache"
    )
    for name in ("Makefile", "setup.py", "pyproject.toml", "requirements.txt"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("fastkv", "custom_ops", "tests", "tools"):
        shutil.copytree(ROOT / name, dest / name, ignore=junk)
    return dest


def make_env(dest: Path) -> tuple[Path, Path]:
    """A new virtualenv (this interpreter's base, no pip of its own) that also sees
    the .venv's packages, after its own: (its python, its site-packages). What a
    test puts in its own site-packages (a paddle) wins over the .venv's."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(dest)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    python = dest / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(own) / "zz_project_venv.pth").write_text(f"{VENV_SITE}\n")
    return python, Path(own)


def fake_paddle(site_packages: Path, cuda: str) -> None:
    """A `paddle` whose version.cuda() says `cuda` (what paddlepaddle-gpu reports)."""
    pkg = site_packages / "paddle"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import version\n")
    (pkg / "version.py").write_text(f"def cuda():\n    return {cuda!r}\n")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the knobs that change a build or a test run."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FASTKV_", "PYTEST_", "VIRTUAL_ENV", "PYTHON", "CUDA_", "PIP_"))
    }
    env["MAKEFLAGS"] = ""
    env.update(extra)
    return env
