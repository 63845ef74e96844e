"""Compiles fastkv's two native libraries with direct compiler calls.

  libfastkv_core.so        the framework-free copy core with a C ABI (ctypes); CPU
                           always, CUDA whenever nvcc is found
  libfastkv_paddle_ops.so  Paddle custom ops, dynamically linked against the core

Standard library only, so it runs in any interpreter: setup.py loads it by path for
`pip install` / `make install`, and `make gpu-test` runs it directly
(`python fastkv/ops/native_build.py`) to build these two libraries in place and
nothing else: no setuptools, no Python headers, no other extension.

Every compiler call is checked and the build stops at the first error with the
compiler's own output above it (`paddle.utils.cpp_extension` prints a compile error
and carries on). The toolkit rules live in cuda_build.py (next to this file).

Environment (read by both entry points):
  FASTKV_WITH_CUDA=auto|0|1        compile the CUDA core (auto: when nvcc is found;
                                   1: fail if it is not)
  FASTKV_BUILD_PADDLE_OPS=auto|0|1 build the Paddle op library (auto: when paddle imports)
  FASTKV_CUDA_ARCHS, FASTKV_CUDA_EXTRA_ARCHS, CUDA_HOME: see cuda_build.py
  CXX                              C++ compiler (default c++)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "custom_ops" / "csrc"
CORE_CXX = ["fkv_common.cc", "fkv_pool.cc", "fkv_cpu.cc", "fkv_host_alloc.cc", "fkv_layout.cc"]
CORE_CUDA = "fkv_cuda.cu"
CORE_CUDA_STUB = "fkv_cuda_stub.cc"
PADDLE_OPS = "fastkv_paddle_ops.cc"
HEADERS = [
    "fastkv_core.h",
    "fkv_internal.h",
    "fkv_cuda_plan.h",
    "fkv_staging_ring.h",
    "fkv_layout_launch.h",
    "fkv_crc32c.h",
    "fkv_crc_cuda.h",
    "fkv_crc_cuda.cuh",
]
CORE_LIB = "libfastkv_core.so"
PADDLE_LIB = "libfastkv_paddle_ops.so"
CUDA_BUILD = HERE / "cuda_build.py"
STATIC_CUDART = "libcudart_static.a"


class NativeBuildError(RuntimeError):
    """A build step failed or cannot start; the message says why and what to do."""


def load_cuda_build() -> ModuleType:
    """cuda_build.py by path: importing the fastkv package would need numpy."""
    name = "fastkv_cuda_build"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, CUDA_BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def env_mode(name: str) -> str:
    """FASTKV_WITH_CUDA / FASTKV_BUILD_PADDLE_OPS: "auto", "0" or "1"."""
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise NativeBuildError(f"{name}={value!r}: expected auto, 0 or 1")
    return value


def choose_toolkit(
    mode: str, python: str = sys.executable
) -> tuple[str | None, list[str], str]:
    """(nvcc or None, gencode flags, architecture list) for the core.

    Args:
        mode: FASTKV_WITH_CUDA ("auto", "0", "1").
        python: the interpreter whose Paddle decides the CUDA major version.

    Raises:
        NativeBuildError: Paddle has CUDA and no toolkit of its major version is
            found, FASTKV_WITH_CUDA=1 without nvcc, or bad FASTKV_CUDA_ARCHS.
    """
    if mode == "0":
        return None, [], ""
    cb = load_cuda_build()
    env = dict(os.environ)
    toolkits = []
    for nvcc in cb.candidate_nvccs(env):
        version = cb.nvcc_version(nvcc)
        if version is not None:
            toolkits.append(cb.Toolkit(nvcc, version))
    paddle_cuda = cb.paddle_cuda_version(python)
    try:
        toolkit = cb.select_toolkit(paddle_cuda, toolkits, cb.explicit_nvcc(env))
    except cb.ToolkitError as e:
        raise NativeBuildError(f"fastkv: {e}") from None
    if toolkit is None:
        if mode == "1":
            raise NativeBuildError("FASTKV_WITH_CUDA=1 but no nvcc found (CUDA_HOME, PATH)")
        return None, [], ""
    try:
        archs, ptx = cb.select_archs(
            cb.supported_archs(toolkit.nvcc),
            os.environ.get("FASTKV_CUDA_ARCHS"),
            os.environ.get("FASTKV_CUDA_EXTRA_ARCHS"),
        )
    except cb.ToolkitError as e:
        raise NativeBuildError(f"fastkv: {e}") from None
    why = (
        f"Paddle is built for CUDA {paddle_cuda}" if paddle_cuda else "CPU-only Paddle or none"
    )
    print(
        f"[fastkv] CUDA {toolkit.version_text} ({toolkit.nvcc}; {why}); "
        f"targets {cb.arch_list(archs, ptx)}",
        flush=True,
    )
    return toolkit.nvcc, cb.gencode_flags(archs, ptx), cb.arch_list(archs, ptx)


def _nvcc_library_dirs(nvcc: str) -> tuple[list[Path], list[Path]]:
    """(library folders, toolkit roots) nvcc itself reports (`--dryrun` prints its
    profile's TOP and LIBRARIES), which holds through wrapper scripts and conda's
    nvcc.profile; empty when it cannot say."""
    try:
        proc = subprocess.run(
            [nvcc, "--dryrun", "-c", "fastkv_probe.cu", "-o", "fastkv_probe.o"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return [], []
    libdirs: list[Path] = []
    tops: list[Path] = []
    for line in (proc.stdout + proc.stderr).splitlines():
        line = line.removeprefix("#$ ").strip()
        if line.startswith("TOP="):
            tops.append(Path(os.path.normpath(line[4:].strip().strip('"'))))
        elif line.startswith("LIBRARIES="):
            for arg in shlex.split(line[len("LIBRARIES=") :]):
                if arg.startswith("-L") and not arg.rstrip("/").endswith("stubs"):
                    libdirs.append(Path(os.path.normpath(arg[2:])))
    return libdirs, tops


def static_cudart(nvcc: str) -> Path:
    """The static CUDA runtime of the toolkit `nvcc` belongs to.

    Looked up in the library folders nvcc reports, then under the toolkit root (nvcc's
    TOP, and its `..` as named and with symlinks resolved) in lib64/ (NVIDIA's
    packages), lib/ and targets/<arch>/lib/ (conda's CUDA 12+ packages keep static
    libraries only there).

    Raises:
        NativeBuildError: none of those holds it; the message says what to install.
    """
    libdirs, tops = _nvcc_library_dirs(nvcc)
    roots = [*tops, Path(nvcc).parent.parent, Path(nvcc).resolve().parent.parent]
    for root in roots:
        libdirs += [root / "lib64", root / "lib", *sorted(root.glob("targets/*/lib"))]
    searched: list[Path] = []
    for libdir in libdirs:
        if libdir in searched:
            continue
        searched.append(libdir)
        if (libdir / STATIC_CUDART).is_file():
            return libdir / STATIC_CUDART
    raise NativeBuildError(
        f"fastkv: nvcc found at {nvcc} but its toolkit has no {STATIC_CUDART} (looked in "
        f"{', '.join(map(str, searched))}). Install the toolkit's static CUDA runtime "
        "(NVIDIA's apt repository: cuda-cudart-dev-<major>-<minor>; conda: "
        "cuda-cudart-static), or point CUDA_HOME at a complete toolkit. pip's "
        "nvidia-cuda-nvcc-cu12 wheels carry no nvcc and cannot build the core."
    )


def _run(cmd: list[str], what: str) -> None:
    print(f"[fastkv] {what}: {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.stdout.strip() or proc.stderr.strip():
        print(proc.stdout + proc.stderr, file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise NativeBuildError(
            f"fastkv: {what} failed (exit {proc.returncode}); the compiler output is above:\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )


def _run_all(jobs: list[tuple[list[str], str]]) -> None:
    """Runs compile jobs in parallel; raises the first failure after all have ended."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        futures = [pool.submit(_run, cmd, what) for cmd, what in jobs]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def _up_to_date(output: Path, inputs: Sequence[Path], stamp: Path, config: str) -> bool:
    """`output` is newer than every input and was built with `config` (recorded in
    `stamp`): a change of toolkit, architectures or Paddle rebuilds it."""
    if not output.exists() or not stamp.exists() or stamp.read_text() != config:
        return False
    built = output.stat().st_mtime
    return all(p.stat().st_mtime <= built for p in inputs)


def _stamp(tmp: Path, out: Path) -> Path:
    """Where the configuration `out` was built with is recorded: in the temporary
    build folder (never packaged), one file per output path."""
    key = hashlib.sha1(str(out).encode()).hexdigest()[:12]
    return tmp / f"{out.name}.{key}.json"


def _cxx() -> list[str]:
    return shlex.split(os.environ.get("CXX", "c++"))


def build_core(out: Path, tmp: Path, force: bool = False) -> None:
    """Builds libfastkv_core.so at `out` (objects in `tmp`).

    Raises:
        NativeBuildError: a toolkit rule refuses the build, or a compiler call failed.
    """
    out, tmp = out.resolve(), tmp.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    nvcc, gencode, archs = choose_toolkit(env_mode("FASTKV_WITH_CUDA"))
    cudart = static_cudart(nvcc) if nvcc else None
    cuda_src = CORE_CUDA if nvcc else CORE_CUDA_STUB
    inputs = [CSRC / s for s in [*CORE_CXX, cuda_src, *HEADERS]]
    inputs += [Path(__file__).resolve(), CUDA_BUILD]
    stamp = _stamp(tmp, out)
    config = json.dumps({"nvcc": nvcc, "gencode": gencode, "cxx": _cxx()}, sort_keys=True)
    if not force and _up_to_date(out, inputs, stamp, config):
        print(f"[fastkv] {out.name} is up to date", flush=True)
        return
    cxx_flags = [
        "-std=c++17",
        "-O3",
        "-fPIC",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        "-Wall",
        "-Wextra",
    ]
    jobs = []
    objects = []
    for src in CORE_CXX if nvcc else [*CORE_CXX, CORE_CUDA_STUB]:
        obj = tmp / (src + ".o")
        objects.append(obj)
        cmd = [*_cxx(), *cxx_flags, f"-I{CSRC}", "-c", str(CSRC / src), "-o", str(obj)]
        jobs.append((cmd, f"compile {src}"))
    link_extra: list[str] = []
    if nvcc:
        obj = tmp / (CORE_CUDA + ".o")
        objects.append(obj)
        cmd = [
            nvcc,
            "-std=c++17",
            "-O3",
            *gencode,
            # The core reports what it holds (fkv_cuda_get_info).
            f'-DFKV_CUDA_ARCH_LIST="{archs}"',
            "-Xcompiler",
            "-fPIC,-fvisibility=hidden,-Wall,-Wextra",
            f"-I{CSRC}",
            "-c",
            str(CSRC / CORE_CUDA),
            "-o",
            str(obj),
        ]
        jobs.append((cmd, f"nvcc {CORE_CUDA}"))
        # Static cudart: the library loads where no libcudart.so is on the path (CI,
        # CPU-only hosts) and cannot clash with Paddle's or CuPy's cudart.
        link_extra = [str(cudart), "-ldl", "-lrt"]
    _run_all(jobs)
    link = [
        *_cxx(),
        "-shared",
        "-o",
        str(out),
        *map(str, objects),
        f"-Wl,-soname,{CORE_LIB}",
        # Keep cudart's symbols private to the core.
        "-Wl,--exclude-libs,ALL",
        "-Wl,--no-undefined",
        "-pthread",
        *link_extra,
    ]
    _run(link, f"link {CORE_LIB}")
    for old in out.parent.glob(out.name + ".*"):
        if old.name.endswith(("cuda", ".build.json")):
            old.unlink()  # stamps that earlier versions kept next to the library
    stamp.write_text(config)
    print(f"[fastkv] built {out} ({'with' if nvcc else 'without'} CUDA)", flush=True)


def pip_build_isolation() -> bool:
    """Whether this build runs in pip's isolated build environment (its overlay of
    build requirements is on sys.path; the environment's own packages are not)."""
    return any("pip-build-env-" in entry for entry in sys.path)


def paddle_ops_config() -> tuple[list[str], list[str], str]:
    """(include folders, library folders, build configuration) of the Paddle this
    interpreter imports. Which Paddle the op library links is part of what it was
    built with: a build against another environment's Paddle in the same folder (a
    CPU Paddle in .venv, paddlepaddle-gpu elsewhere) is never up to date.

    Raises:
        ImportError: paddle does not import.
    """
    from paddle.utils.cpp_extension import extension_utils as pd

    includes = [*pd.find_paddle_includes(use_cuda=False), *pd.find_python_includes()]
    lib_dirs = pd.find_paddle_libraries(use_cuda=False)
    config = {"includes": includes, "lib_dirs": lib_dirs, "cxx": _cxx()}
    return includes, lib_dirs, json.dumps(config, sort_keys=True)


def build_paddle_ops(out: Path, tmp: Path, force: bool = False) -> bool:
    """Builds libfastkv_paddle_ops.so at `out` against the Paddle this interpreter
    imports, linked to the core already built next to it.

    Returns:
        False when it was deliberately not built (FASTKV_BUILD_PADDLE_OPS=0, or auto
        and paddle does not import), True otherwise.

    Raises:
        NativeBuildError: FASTKV_BUILD_PADDLE_OPS=1 without paddle, no core next to
            `out`, or a compiler call failed.
    """
    out, tmp = out.resolve(), tmp.resolve()
    mode = env_mode("FASTKV_BUILD_PADDLE_OPS")
    if mode == "0":
        print(f"[fastkv] FASTKV_BUILD_PADDLE_OPS=0: not building {PADDLE_LIB}", flush=True)
        return False
    try:
        import paddle.utils.cpp_extension  # noqa: F401
    except ImportError as e:
        if mode == "1":
            raise NativeBuildError(f"FASTKV_BUILD_PADDLE_OPS=1 but paddle: {e}") from None
        if pip_build_isolation():
            advice = (
                "pip's build isolation hides the environment's packages, so neither the "
                "Paddle ops nor the check of the CUDA toolkit against Paddle's can be "
                "done: build with `pip install --no-build-isolation .` (or `make install "
                "PYTHON_ENV=<that python>`)"
            )
        else:
            advice = "install paddlepaddle and rebuild for the Paddle ops"
        print(
            f"[fastkv] WARNING: paddle is not importable ({e}); {PADDLE_LIB} not built. "
            f"fastkv.ops.core (ctypes) still works; {advice}.",
            file=sys.stderr,
            flush=True,
        )
        return False
    core = out.parent / CORE_LIB
    if not core.exists():
        raise NativeBuildError(f"fastkv: {PADDLE_LIB} links {core}, which is not built")
    tmp.mkdir(parents=True, exist_ok=True)
    includes, lib_dirs, config = paddle_ops_config()
    inputs = [CSRC / PADDLE_OPS, CSRC / "fastkv_core.h", Path(__file__).resolve(), core]
    stamp = _stamp(tmp, out)
    if not force and _up_to_date(out, inputs, stamp, config):
        print(f"[fastkv] {out.name} is up to date", flush=True)
        return True
    obj = tmp / (PADDLE_OPS + ".o")
    compile_cmd = [
        *_cxx(),
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-Wall",
        # Same ABI as libpaddle.so, and the header set meant for out-of-tree ops.
        "-D_GLIBCXX_USE_CXX11_ABI=1",
        "-DPADDLE_WITH_CUSTOM_KERNEL",
        f"-I{CSRC}",
        # -isystem: Paddle's headers are not ours to warn about.
        *[f"-isystem{d}" for d in includes],
        "-c",
        str(CSRC / PADDLE_OPS),
        "-o",
        str(obj),
    ]
    _run(compile_cmd, f"compile {PADDLE_OPS}")
    link = [
        *_cxx(),
        "-shared",
        "-o",
        str(out),
        str(obj),
        f"-L{out.parent}",
        f"-l:{CORE_LIB}",
        # The core sits next to this library in every layout (editable or wheel).
        "-Wl,-rpath,$ORIGIN",
        *[f"-L{d}" for d in lib_dirs],
        "-Wl,--no-as-needed",
        "-l:libpaddle.so",
        "-Wl,--as-needed",
        *[f"-Wl,-rpath,{d}" for d in lib_dirs],
    ]
    _run(link, f"link {PADDLE_LIB}")
    stamp.write_text(config)
    print(f"[fastkv] built {out}", flush=True)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Builds the core (and the Paddle ops where paddle imports) in place, under
    fastkv/ops/, with objects in build/native/. Exit 0, or 1 with the reason."""
    parser = argparse.ArgumentParser(
        description="Build fastkv/ops/libfastkv_core.so (and libfastkv_paddle_ops.so where "
        "paddle imports) in place, with this interpreter and nothing but the standard "
        "library and the compilers."
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    tmp = ROOT / "build" / "native"
    try:
        build_core(HERE / CORE_LIB, tmp / "fastkv_core", args.force)
        build_paddle_ops(HERE / PADDLE_LIB, tmp / "fastkv_paddle_ops", args.force)
    except NativeBuildError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0]; its modules (core.py, ...) must
    # not shadow anything paddle imports.
    if sys.path and Path(sys.path[0]).resolve() == HERE:
        del sys.path[0]
    sys.exit(main())
