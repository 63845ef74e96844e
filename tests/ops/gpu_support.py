"""Shared by the GPU tests: why they skip, CuPy, holding a stream on the host, and
the FASTKV_REQUIRE_GPU switch `make gpu-test` sets so a GPU test can never skip
quietly on a GPU machine."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from fastkv.ops import core

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
    """Under FASTKV_REQUIRE_GPU=1 a skipped `gpu` test fails (except Paddle-GPU
    parts where Paddle has no CUDA): `make gpu-test` proves, it does not skip."""
    if not os.environ.get("FASTKV_REQUIRE_GPU") or not report.skipped:
        return
    if item.get_closest_marker("gpu") is None:
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if PADDLE_GPU_TAG in reason:
        return
    report.outcome = "failed"
    report.longrepr = f"GPU test skipped under FASTKV_REQUIRE_GPU=1: {reason}"


def synchronize_all() -> None:
    import cupy as cp

    cp.cuda.Device().synchronize()


Callback = Callable[[], None]
