"""Builds fastkv: the Python package and its native parts.

Native outputs (next to the Python sources under `pip install -e .`):
  fastkv/_chain_hash*.so               C extension for block hashing (optional)
  fastkv/ops/libfastkv_core.so         the framework-free copy core with a C ABI (ctypes);
                                       CPU always, CUDA whenever nvcc is found
  fastkv/ops/libfastkv_paddle_ops.so   Paddle custom ops, dynamically linked against the
                                       core so a process holds one thread pool and one
                                       CUDA staging ring however it reaches the core

The two libraries are compiled by fastkv/ops/native_build.py (standard library only,
so `make gpu-test` runs it without setuptools or Python headers) with direct compiler
calls rather than through `paddle.utils.cpp_extension`: its build step prints a
compile error and carries on, and its CUDAExtension needs GPU-Paddle headers. Every
compiler call is checked and the build stops at the first error.

CUDA toolkit (fastkv/ops/cuda_build.py has the rules): the core links a static CUDA
runtime, which needs a driver for that runtime's major version. With paddlepaddle-gpu
installed the core is built with a toolkit of Paddle's CUDA major version
(`paddle.version.cuda()` of the interpreter running this build), found through
CUDA_HOME / CUDA_PATH, /usr/local/cuda, /usr/local/cuda-X.Y or PATH; if there is none
the build stops and says what to install. With a CPU-only Paddle (or none) any nvcc
found builds the CUDA core. So build in the environment that holds the Paddle fastkv
will run with: `pip install --no-build-isolation .` there, or
`make install PYTHON_ENV=/path/to/bin/python` (an isolated build sees no Paddle).

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

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
NATIVE_BUILD = ROOT / "fastkv" / "ops" / "native_build.py"


def _load_native_build():
    """fastkv/ops/native_build.py by path: importing the package would need numpy."""
    spec = importlib.util.spec_from_file_location("fastkv_native_build", NATIVE_BUILD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


nb = _load_native_build()


class NativeLibrary(Extension):
    """A plain shared library (no Python module init) placed in a package directory.

    `optional` marks a library the build may deliberately skip (the Paddle ops where
    paddle is absent); it does not hide failures: those raise SystemExit, which
    setuptools' optional-extension handling does not catch.
    """

    def __init__(self, name: str, filename: str, sources: list[str], optional: bool) -> None:
        super().__init__(name, sources=sources, optional=optional)
        self.filename = filename


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
        out = Path(self.get_ext_fullpath(ext.name))
        tmp = Path(self.build_temp) / ext.filename.removesuffix(".so").removeprefix("lib")
        try:
            if ext.filename == nb.CORE_LIB:
                nb.build_core(out, tmp, bool(self.force))
            else:
                nb.build_paddle_ops(out, tmp, bool(self.force))
        except nb.NativeBuildError as e:
            # SystemExit stops pip with this message instead of a traceback through
            # setuptools internals.
            raise SystemExit(str(e)) from None


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
    depends=[
        "fastkv/storage/_ghash.h",
        "fastkv/storage/_ghash_copy.h",
        "fastkv/storage/_crc32c.h",
    ],
    libraries=["crypto"],  # HMAC-SHA256 of authenticated blocks (OpenSSL)
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
            nb.CORE_LIB,
            [f"custom_ops/csrc/{nb.CORE_CUDA}"],
            optional=False,
        ),
        NativeLibrary(
            "fastkv.ops.libfastkv_paddle_ops",
            nb.PADDLE_LIB,
            [f"custom_ops/csrc/{nb.PADDLE_OPS}"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": NativeBuild},
)
