"""Builds fastkv: the Python package and its native parts.

Native outputs (next to the Python sources under `pip install -e .`):
  fastkv/_chain_hash*.so               C extension for block hashing (optional)
  fastkv/ops/libfastkv_core.so         the framework-free copy core with a C ABI (ctypes);
                                       CPU always, CUDA whenever nvcc is found
  fastkv/ops/libfastkv_paddle_ops.so   Paddle custom ops, dynamically linked against the
                                       core so a process holds one thread pool and one
                                       CUDA staging ring however it reaches the core

The two libraries are compiled with direct compiler calls rather than through
`paddle.utils.cpp_extension`: its build step prints a compile error and carries on,
so a broken source surfaces later as a misleading `ld: cannot find *.o`, and its
CUDAExtension needs GPU-Paddle headers. Here every compiler call is checked and the
build stops at the first error, with the compiler's own output above it.

CUDA toolkit (fastkv/ops/cuda_build.py has the rules): the core links a static CUDA
runtime, which needs a driver for that runtime's major version. With paddlepaddle-gpu
installed the core is built with a toolkit of Paddle's CUDA major version
(`paddle.version.cuda()`), found through CUDA_HOME / CUDA_PATH, /usr/local/cuda,
/usr/local/cuda-X.Y or PATH; if there is none the build stops and says what to
install. With a CPU-only Paddle (or none) any nvcc found builds the CUDA core.

Environment:
  FASTKV_WITH_CUDA=auto|0|1        compile the CUDA core (auto: when nvcc is found;
                                   1: fail if it is not)
  FASTKV_BUILD_PADDLE_OPS=auto|0|1 build the Paddle op library (auto: when paddle imports)
  FASTKV_CUDA_ARCHS="80 90"        SASS targets instead of the default sm_75 80 86 89 90
                                   (+100 120 where nvcc has them); PTX of the lowest
  FASTKV_CUDA_EXTRA_ARCHS="8.7"    SASS targets added to those (make gpu-test: this GPU)
  CUDA_HOME                        the toolkit to use (must match Paddle's CUDA major)
  CXX                              C++ compiler (default c++)
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import importlib.util
import json

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "custom_ops" / "csrc"
CORE_CXX = ["fkv_common.cc", "fkv_pool.cc", "fkv_cpu.cc", "fkv_host_alloc.cc", "fkv_layout.cc"]
CORE_CUDA = "fkv_cuda.cu"
CORE_CUDA_STUB = "fkv_cuda_stub.cc"
PADDLE_OPS = "fastkv_paddle_ops.cc"
HEADERS = ["fastkv_core.h", "fkv_internal.h", "fkv_cuda_plan.h"]
CUDA_BUILD = ROOT / "fastkv" / "ops" / "cuda_build.py"


def _load_cuda_build():
    """fastkv/ops/cuda_build.py by path: importing the package would need numpy."""
    spec = importlib.util.spec_from_file_location("fastkv_cuda_build", CUDA_BUILD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
CORE_LIB = "libfastkv_core.so"
PADDLE_LIB = "libfastkv_paddle_ops.so"


class NativeBuildError(RuntimeError):
    pass


class NativeLibrary(Extension):
    """A plain shared library (no Python module init) placed in a package directory.

    `optional` marks a library the build may deliberately skip (the Paddle ops where
    paddle is absent); it does not hide failures: those raise SystemExit, which
    setuptools' optional-extension handling does not catch.
    """

    def __init__(self, name: str, filename: str, sources: list[str], optional: bool) -> None:
        super().__init__(name, sources=sources, optional=optional)
        self.filename = filename


def _env_mode(name: str) -> str:
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise NativeBuildError(f"{name}={value!r}: expected auto, 0 or 1")
    return value


def choose_toolkit(mode: str) -> tuple[str | None, list[str], str]:
    """(nvcc or None, gencode flags, architecture list) for the core.

    Raises:
        NativeBuildError: Paddle has CUDA and no toolkit of its major version is
            found, FASTKV_WITH_CUDA=1 without nvcc, or bad FASTKV_CUDA_ARCHS.
    """
    if mode == "0":
        return None, [], ""
    cb = _load_cuda_build()
    env = dict(os.environ)
    toolkits = []
    for nvcc in cb.candidate_nvccs(env):
        version = cb.nvcc_version(nvcc)
        if version is not None:
            toolkits.append(cb.Toolkit(nvcc, version))
    paddle_cuda = cb.paddle_cuda_version(sys.executable)
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
    why = f"Paddle is built for CUDA {paddle_cuda}" if paddle_cuda else "CPU-only Paddle"
    print(
        f"[fastkv] CUDA {toolkit.version_text} ({toolkit.nvcc}; {why}); "
        f"targets {cb.arch_list(archs, ptx)}",
        flush=True,
    )
    return toolkit.nvcc, cb.gencode_flags(archs, ptx), cb.arch_list(archs, ptx)


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


def _up_to_date(output: Path, inputs: list[Path]) -> bool:
    if not output.exists():
        return False
    built = output.stat().st_mtime
    return all(p.stat().st_mtime <= built for p in inputs)


class NativeBuild(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # distutils asks with the last name component, setuptools' in-place copy
        # with the full dotted name; answer both with the plain library name.
        for ext in self.extensions:
            if isinstance(ext, NativeLibrary):
                if fullname == ext.name:
                    return os.path.join(*fullname.split(".")[:-1], ext.filename)
                if fullname == ext.name.rpartition(".")[2]:
                    return ext.filename
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, NativeLibrary):
            super().build_extension(ext)
            return
        try:
            if ext.filename == CORE_LIB:
                self._build_core(ext)
            else:
                self._build_paddle_ops(ext)
        except NativeBuildError as e:
            # SystemExit stops pip with this message instead of a traceback through
            # setuptools internals.
            raise SystemExit(str(e)) from None

    def _cxx(self) -> list[str]:
        return shlex.split(os.environ.get("CXX", "c++"))

    def _tmp(self, name: str) -> Path:
        tmp = Path(self.build_temp).resolve() / name
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def _build_core(self, ext: NativeLibrary) -> None:
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        mode = _env_mode("FASTKV_WITH_CUDA")
        nvcc, gencode, archs = choose_toolkit(mode)
        cuda_src = CORE_CUDA if nvcc else CORE_CUDA_STUB
        inputs = [CSRC / s for s in [*CORE_CXX, cuda_src, *HEADERS]] + [ROOT / "setup.py"]
        inputs.append(CUDA_BUILD)
        # The stamp records what the library was built with: a change of toolkit or
        # architectures rebuilds it even when no source changed.
        stamp = out.with_suffix(".so.build.json")
        config = json.dumps({"nvcc": nvcc, "gencode": gencode}, sort_keys=True)
        if (
            not self.force
            and stamp.exists()
            and stamp.read_text() == config
            and _up_to_date(out, inputs)
        ):
            print(f"[fastkv] {out.name} is up to date", flush=True)
            return
        tmp = self._tmp("fastkv_core")
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
        cxx_sources = CORE_CXX if nvcc else [*CORE_CXX, CORE_CUDA_STUB]
        for src in cxx_sources:
            obj = tmp / (src + ".o")
            objects.append(obj)
            jobs.append(
                (
                    [
                        *self._cxx(),
                        *cxx_flags,
                        f"-I{CSRC}",
                        "-c",
                        str(CSRC / src),
                        "-o",
                        str(obj),
                    ],
                    f"compile {src}",
                )
            )
        link_extra: list[str] = []
        if nvcc:
            obj = tmp / (CORE_CUDA + ".o")
            objects.append(obj)
            jobs.append(
                (
                    [
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
                    ],
                    f"nvcc {CORE_CUDA}",
                )
            )
            cudart = Path(nvcc).resolve().parent.parent / "lib64" / "libcudart_static.a"
            if not cudart.exists():
                raise NativeBuildError(f"nvcc found at {nvcc} but {cudart} is missing")
            # Static cudart: the library loads where no libcudart.so is on the path
            # (CI, CPU-only hosts) and cannot clash with Paddle's or CuPy's cudart.
            link_extra = [str(cudart), "-ldl", "-lrt"]
        _run_all(jobs)
        _run(
            [
                *self._cxx(),
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
            ],
            f"link {CORE_LIB}",
        )
        for old in out.parent.glob(out.name + ".*cuda"):
            old.unlink()  # stamps of earlier versions of this script
        stamp.write_text(config)
        print(f"[fastkv] built {out} ({'with' if nvcc else 'without'} CUDA)", flush=True)

    def _build_paddle_ops(self, ext: NativeLibrary) -> None:
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        mode = _env_mode("FASTKV_BUILD_PADDLE_OPS")
        if mode == "0":
            print(f"[fastkv] FASTKV_BUILD_PADDLE_OPS=0: not building {PADDLE_LIB}", flush=True)
            return
        try:
            from paddle.utils.cpp_extension import extension_utils as pd
        except ImportError as e:
            if mode == "1":
                raise NativeBuildError(f"FASTKV_BUILD_PADDLE_OPS=1 but paddle: {e}") from None
            print(
                f"[fastkv] WARNING: paddle is not importable ({e}); {PADDLE_LIB} not built. "
                "fastkv.ops.core (ctypes) still works; install paddlepaddle and rerun "
                "`make install` for the Paddle ops.",
                file=sys.stderr,
                flush=True,
            )
            return
        core = out.parent / CORE_LIB
        inputs = [CSRC / PADDLE_OPS, CSRC / "fastkv_core.h", ROOT / "setup.py", core]
        if not self.force and _up_to_date(out, inputs):
            print(f"[fastkv] {out.name} is up to date", flush=True)
            return
        tmp = self._tmp("fastkv_paddle_ops")
        obj = tmp / (PADDLE_OPS + ".o")
        includes = [*pd.find_paddle_includes(use_cuda=False), *pd.find_python_includes()]
        lib_dirs = pd.find_paddle_libraries(use_cuda=False)
        _run(
            [
                *self._cxx(),
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
            ],
            f"compile {PADDLE_OPS}",
        )
        _run(
            [
                *self._cxx(),
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
            ],
            f"link {PADDLE_LIB}",
        )
        print(f"[fastkv] built {out}", flush=True)


chain_hash = Extension(
    "fastkv._chain_hash",
    sources=["fastkv/_chain_hash.c"],
    libraries=["crypto"],
    extra_compile_args=["-O3"],
    optional=True,  # fastkv.hashing falls back to an equivalent pure-Python loop
)

# Radix tree nodes outside the garbage collector (fastkv/scheduler/radix_tree.py
# falls back to equivalent pure-Python classes).
tree_node = Extension(
    "fastkv.scheduler._tree_node",
    sources=["fastkv/scheduler/_tree_node.c"],
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    optional=True,
)

# The storage tier's batched, verified block I/O (fastkv/storage/local_disk.py needs it).
disk_io = Extension(
    "fastkv.storage._disk_io",
    sources=["fastkv/storage/_disk_io.c"],
    extra_compile_args=["-O3", "-Wall", "-Wextra"],
)

setup(
    name="fastkv",
    version="0.1.0",
    description="PaddlePaddle-native hierarchical KV-cache manager for LLM serving",
    python_requires=">=3.11",
    packages=find_packages(include=["fastkv", "fastkv.*"]),
    install_requires=["numpy"],
    ext_modules=[
        chain_hash,
        tree_node,
        disk_io,
        # Order matters: the Paddle op library links against the core.
        NativeLibrary(
            "fastkv.ops.libfastkv_core",
            CORE_LIB,
            [f"custom_ops/csrc/{CORE_CUDA}"],
            optional=False,
        ),
        NativeLibrary(
            "fastkv.ops.libfastkv_paddle_ops",
            PADDLE_LIB,
            [f"custom_ops/csrc/{PADDLE_OPS}"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": NativeBuild},
)
