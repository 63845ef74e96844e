"""Shared by the GPU tests: why they skip, CuPy, holding a stream on the host, and
the FASTKV_REQUIRE_GPU switch `make gpu-test` sets so a GPU test can never skip
quietly on a GPU machine (a test that needs more GPUs than the machine has is the
one exception: absent hardware, said so, not a failure)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from fastkv.ops import core

T = TypeVar("T")

PADDLE_GPU_TAG = "needs paddlepaddle-gpu"
"""Skips whose reason contains this are allowed under FASTKV_REQUIRE_GPU: the GPU
runner has CuPy but no Paddle build with CUDA."""


def gpu_skip_reason() -> str | None:
    """Why the C-ABI GPU tests cannot run here, or None when they can."""
    if not core.built_with_cuda():
        return "fastkv core built without CUDA (no nvcc at build time)"
    info = core.cuda_info()
    if info.device_count == 0:
        return f"no usable CUDA device: {info.status}"
    try:
        import cupy  # noqa: F401
        import cupyx  # noqa: F401
    except ImportError:
        return (
            "a CUDA device is present but CuPy is not installed in this environment "
            "(pip install cupy-cuda12x / cupy-cuda13x, or run `make gpu-test`)"
        )
    return None


GPU_REASON = gpu_skip_reason()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")

GPUS_MARK = "gpus"
"""`@pytest.mark.gpus(n)`, set by needs_gpus(n): the test needs n devices."""


def gpu_count_reason(count: int, present: int) -> str:
    """The skip reason of a test that needs `count` GPUs where `present` are."""
    return f"needs {count} GPUs, this machine has {present}: absent hardware, not a failure"


def needs_gpus(count: int) -> Callable[[T], T]:
    """Marks a test that needs `count` GPUs: with fewer it skips, saying so, and that
    skip stands under FASTKV_REQUIRE_GPU (see require_gpu_hook). Its body never runs
    with fewer, so no other skip of it can pass as this one."""
    if count < 1:
        raise ValueError(f"count: {count} GPUs; expected >= 1")
    present = core.cuda_device_count()

    def apply(test: T) -> T:
        test = pytest.mark.gpus(count)(test)
        return pytest.mark.skipif(present < count, reason=gpu_count_reason(count, present))(
            test
        )

    return apply


def cuda_runtime_problem(info: core.CudaInfo, cc: int) -> str | None:
    """Why the core, as built, cannot run its kernel on a GPU of compute capability
    `cc` (e.g. 90) with this machine's driver; None when it can.

    CUDA's rules, not stricter ones:
      - the driver must support the runtime's major version (a CUDA 13 runtime needs
        a CUDA 13 driver); an older minor than the runtime's is allowed (minor-version
        compatibility), so driver < runtime is no failure by itself;
      - SASS sm_XY runs on GPUs of major X with minor >= Y;
      - PTX compute_P is JIT-compiled on GPUs with cc >= P, but only by a driver at
        least as new as the runtime that wrote it: under minor-version compatibility
        only SASS loads.
    """
    if info.status != "ok":
        return f"no usable device: {info.status}"
    runtime, driver = info.runtime_version, info.driver_version
    if driver // 1000 < runtime // 1000:
        return (
            f"the driver supports CUDA {core.CudaInfo.version_text(driver)}, older than the "
            f"runtime's major version ({core.CudaInfo.version_text(runtime)})"
        )
    sass = [int(a[3:]) for a in info.archs if a.startswith("sm_") and a[3:].isdigit()]
    ptx = [int(a[8:]) for a in info.archs if a.startswith("compute_") and a[8:].isdigit()]
    if any(a // 10 == cc // 10 and a % 10 <= cc % 10 for a in sass):
        return None
    if driver >= runtime and any(p <= cc for p in ptx):
        return None
    jit = "PTX that this driver can JIT" if driver >= runtime else "PTX (the driver is older"
    jit += "" if driver >= runtime else " than the runtime, so it cannot JIT the PTX)"
    return (
        f"no kernel image for sm_{cc}: targets {' '.join(info.archs) or 'none'} hold "
        f"neither SASS for it nor {jit}"
    )


def paddle_gpu_skip_reason() -> str | None:
    try:
        import paddle
    except ImportError:
        return f"{PADDLE_GPU_TAG}: paddle is not installed"
    if not paddle.is_compiled_with_cuda():
        return f"{PADDLE_GPU_TAG}: this Paddle build has no CUDA"
    if paddle.device.cuda.device_count() == 0:
        return f"{PADDLE_GPU_TAG}: Paddle sees no CUDA device"
    return GPU_REASON


class StreamGate:
    """Holds a CUDA stream from the host: work enqueued after `close()` waits until
    `open()` (a host function blocks the stream, bounded by `limit` seconds)."""

    def __init__(self, stream_ptr: int, device: int = 0, limit: float = 60.0) -> None:
        import cupy as cp

        self._stream = cp.cuda.ExternalStream(stream_ptr, device)
        self._gate = threading.Event()
        self._limit = limit
        self.reached = threading.Event()
        self.timed_out = False  # released by its limit rather than by open()

    def close(self) -> StreamGate:
        def hold(_: object) -> None:
            self.reached.set()
            self.timed_out = not self._gate.wait(self._limit)

        self._stream.launch_host_func(hold, None)
        return self

    def open(self) -> None:
        self._gate.set()


def require_gpu_hook(item: pytest.Item, report: pytest.TestReport) -> None:
    """Under FASTKV_REQUIRE_GPU=1 a skipped `gpu` test fails: `make gpu-test` proves,
    it does not skip. Two skips stand: Paddle-GPU parts where Paddle has no CUDA, and
    a needs_gpus(n) test skipped because this machine has fewer than n GPUs (the
    reason must be exactly that one; any other skip of such a test fails)."""
    if not os.environ.get("FASTKV_REQUIRE_GPU") or not report.skipped:
        return
    if item.get_closest_marker("gpu") is None:
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if PADDLE_GPU_TAG in reason:
        return
    wanted = item.get_closest_marker(GPUS_MARK)
    if wanted is not None:
        count, present = int(wanted.args[0]), core.cuda_device_count()
        if present < count and reason.endswith(gpu_count_reason(count, present)):
            return
    report.outcome = "failed"
    report.longrepr = f"GPU test skipped under FASTKV_REQUIRE_GPU=1: {reason}"


def synchronize_all() -> None:
    import cupy as cp

    cp.cuda.Device().synchronize()


Callback = Callable[[], None]


_SPIN_SOURCE = r"""
extern "C" __global__ void fastkv_spin(volatile int* release, unsigned long long limit_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (*release == 0 && now - start < limit_ns);
}
"""


class SpinningKernel:
    """A one-thread kernel that keeps a stream (and the device) busy until
    `release()` or `limit` seconds: the stand-in for an engine kernel stuck on its
    stream. Unlike a host function it occupies the GPU, so whatever waits for the
    device (cudaFree, a synchronizing call) waits for it."""

    def __init__(self, limit: float = 30.0) -> None:
        import cupy as cp

        self._cp = cp
        self._flag = cp.zeros(1, dtype=cp.int32)
        self._kernel = cp.RawKernel(_SPIN_SOURCE, "fastkv_spin")
        self._limit_ns = int(limit * 1e9)
        self._setter = cp.cuda.Stream(non_blocking=True)

    def launch(self, stream_ptr: int, device: int = 0) -> SpinningKernel:
        cp = self._cp
        with cp.cuda.ExternalStream(stream_ptr, device):
            self._kernel((1,), (1,), (self._flag, cp.uint64(self._limit_ns)))
        return self

    def release(self) -> None:
        """Ends the spin: the flag is written from another stream (a copy engine)."""
        import numpy as np

        self._flag.set(np.ones(1, dtype=np.int32), stream=self._setter)
        self._setter.synchronize()
