"""Which CUDA toolkit and GPU architectures the fastkv core is built with.

Used by setup.py (loaded by path, so it imports only the standard library) and by
the tests. The rules:

- A core linked with a static CUDA runtime of major version M needs a driver for
  CUDA M. When the installed Paddle has CUDA (`paddle.version.cuda()` says e.g.
  "12.6"), the core is built with a toolkit of that major version, so it runs on
  every driver Paddle runs on; if none is found the build stops and says what to
  install. With a CPU-only Paddle (`paddle.version.cuda()` is "False") or no
  Paddle, whatever nvcc is found builds the CUDA core.
- SASS for sm_75, 80, 86, 89, 90 (and 100, 120 where the toolkit has them), plus
  PTX of the lowest, so a newer GPU can JIT it; FASTKV_CUDA_ARCHS overrides.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ARCHS = (75, 80, 86, 89, 90)
"""SASS targets built whenever the toolkit supports them: T4, A100, A10/A40/3090,
L4/L40/4090, H100/H200."""
OPTIONAL_ARCHS = (100, 120)
"""Blackwell data-center and consumer parts, where the toolkit knows them."""


class ToolkitError(RuntimeError):
    """No usable toolkit, or one that does not match the installed Paddle."""


@dataclass(frozen=True, slots=True)
class Toolkit:
    nvcc: str
    version: tuple[int, int]

    @property
    def version_text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) from `nvcc --version`, or None when it does not run."""
    try:
        out = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def explicit_nvcc(env: Mapping[str, str]) -> str | None:
    """The nvcc named by CUDA_HOME or CUDA_PATH (the user's explicit choice)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            return str(Path(env[var]) / "bin" / "nvcc")
    return None


def candidate_nvccs(
    env: Mapping[str, str], roots: Sequence[str] = ("/usr/local",)
) -> list[str]:
    """Every nvcc to consider, in order: CUDA_HOME/CUDA_PATH, <root>/cuda,
    <root>/cuda-X.Y (newest first), then PATH. Duplicates (symlinks) removed."""
    found: list[str] = []
    explicit = explicit_nvcc(env)
    if explicit:
        found.append(explicit)
    for root in roots:
        found.append(f"{root}/cuda/bin/nvcc")
        versioned = glob.glob(f"{root}/cuda-*/bin/nvcc")
        found += sorted(versioned, key=_dir_version, reverse=True)
    on_path = shutil.which("nvcc", path=env.get("PATH"))
    if on_path:
        found.append(on_path)
    unique: list[str] = []
    seen: set[str] = set()
    for path in found:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            continue
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            unique.append(path)
    return unique


def _dir_version(nvcc: str) -> tuple[int, ...]:
    m = re.search(r"cuda-(\d+)(?:\.(\d+))?", nvcc)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else (0,)


def paddle_cuda_version(python: str = sys.executable) -> str | None:
    """`paddle.version.cuda()` of the Paddle that `python` imports: "12.6" on a GPU
    build, None for the CPU build ("False") or when paddle does not import."""
    code = "import paddle; print(paddle.version.cuda())"
    try:
        proc = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    value = lines[-1].strip() if proc.returncode == 0 and lines else ""
    return value if re.fullmatch(r"\d+(\.\d+)*", value) else None


def select_toolkit(
    paddle_cuda: str | None, toolkits: Sequence[Toolkit], explicit: str | None = None
) -> Toolkit | None:
    """The toolkit to build the CUDA core with.

    Args:
        paddle_cuda: Paddle's CUDA version ("12.6"), or None for a CPU Paddle / none.
        toolkits: the nvccs found, in preference order (see candidate_nvccs).
        explicit: the nvcc CUDA_HOME/CUDA_PATH names, if any.

    Returns:
        The toolkit, or None when no nvcc was found and none is required.

    Raises:
        ToolkitError: Paddle has CUDA but no toolkit of its major version was found,
            or CUDA_HOME names one of another major version; the message says what
            to install or set.
    """
    if paddle_cuda is None:
        return toolkits[0] if toolkits else None
    major = int(paddle_cuda.split(".")[0])
    minor = paddle_cuda.split(".")[1] if "." in paddle_cuda else "0"
    found = ", ".join(f"{t.version_text} at {t.nvcc}" for t in toolkits) or "none"
    if explicit is not None:
        chosen = next((t for t in toolkits if t.nvcc == explicit), None)
        if chosen is not None and chosen.version[0] != major:
            raise ToolkitError(
                f"CUDA_HOME: {chosen.nvcc} is CUDA {chosen.version_text}, but the installed "
                f"paddlepaddle-gpu is built for CUDA {paddle_cuda}; a core built with CUDA "
                f"{chosen.version[0]} would need a driver for CUDA {chosen.version[0]} that "
                f"Paddle's users may not have. Point CUDA_HOME at a CUDA {major}.x toolkit "
                f"(in a conda environment {conda_toolkit_command(major, minor)} makes "
                "$CONDA_PREFIX one), or set FASTKV_WITH_CUDA=0 to build the CPU core only."
            )
    for toolkit in toolkits:
        if toolkit.version[0] == major:
            return toolkit
    raise ToolkitError(
        f"the installed paddlepaddle-gpu is built for CUDA {paddle_cuda}, so the fastkv core "
        f"must be built with a CUDA {major}.x toolkit (nvcc found: {found}). Install one "
        f"and point CUDA_HOME at it: apt-get install cuda-toolkit-{major}-{minor} from "
        f"NVIDIA's repository, then CUDA_HOME=/usr/local/cuda-{major}.{minor}; or, in a conda "
        f"environment, {conda_toolkit_command(major, minor)}, then CUDA_HOME=$CONDA_PREFIX "
        f"(pip's nvidia-cuda-nvcc-cu{major} wheel has no nvcc). Or set FASTKV_WITH_CUDA=0 "
        "to build the CPU core only."
    )


def conda_toolkit_command(major: int, minor: int | str) -> str:
    """The conda packages that make a prefix a toolkit the core builds with: nvcc
    (bin/nvcc), the runtime headers and the static runtime, which conda's CUDA 12+
    packages keep under targets/<arch>/lib (see native_build.static_cudart)."""
    return (
        f"conda install -c conda-forge cuda-nvcc cuda-cudart-dev cuda-cudart-static "
        f"cuda-version={major}.{minor}"
    )


def supported_archs(nvcc: str) -> set[int] | None:
    """SASS architectures `nvcc --list-gpu-code` offers (None if it cannot say)."""
    try:
        out = subprocess.run(
            [nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    archs = {int(m) for m in re.findall(r"\bsm_(\d+)\b", out)}
    return archs or None


def _parse_archs(name: str, text: str, supported: set[int] | None) -> list[int]:
    try:
        archs = sorted({int(a) for a in text.replace(",", " ").replace(".", "").split()})
    except ValueError:
        raise ToolkitError(f"{name}: {text!r} is not a list of numbers like '80 90'") from None
    bad = [a for a in archs if supported is not None and a not in supported]
    if bad:
        raise ToolkitError(
            f"{name}: sm_{bad[0]} is not supported by this nvcc "
            f"(it offers {', '.join(f'sm_{a}' for a in sorted(supported or ()))})"
        )
    return archs


def select_archs(
    supported: set[int] | None, requested: str | None, extra: str | None = None
) -> tuple[list[int], int]:
    """(SASS architectures, PTX architecture) to build.

    Args:
        supported: what the toolkit can build (None: assume the defaults).
        requested: FASTKV_CUDA_ARCHS, e.g. "80 90" (None or "": the defaults).
        extra: FASTKV_CUDA_EXTRA_ARCHS, added to either (e.g. "8.7" for the GPU
            at hand, which `make gpu-test` passes).

    Raises:
        ToolkitError: a requested architecture is malformed or unsupported, or the
            toolkit supports none of the defaults.
    """
    if extra and extra.strip():
        added = _parse_archs("FASTKV_CUDA_EXTRA_ARCHS", extra, supported)
        archs, ptx = select_archs(supported, requested)
        return sorted({*archs, *added}), ptx
    if requested and requested.strip():
        archs = _parse_archs("FASTKV_CUDA_ARCHS", requested, supported)
    else:
        if supported is None:
            archs = list(DEFAULT_ARCHS)
        else:
            archs = [a for a in DEFAULT_ARCHS + OPTIONAL_ARCHS if a in supported]
        if not archs:
            raise ToolkitError(
                f"this nvcc supports none of sm_{', sm_'.join(map(str, DEFAULT_ARCHS))}"
            )
    return archs, archs[0]


def gencode_flags(archs: Sequence[int], ptx: int) -> list[str]:
    flags: list[str] = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    # PTX of the lowest: the most GPUs (and drivers) can JIT it.
    flags += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
    return flags


def arch_list(archs: Sequence[int], ptx: int) -> str:
    """The core's own report of what it holds: "sm_75 sm_80 ... compute_75"."""
    return " ".join([*(f"sm_{a}" for a in archs), f"compute_{ptx}"])
