"""Fences: what orders P's write of a layer after the kernel that wrote it.

On a GPU the engine calls `PDSender.after_layer(L)` right after it LAUNCHED layer
L: the KV of that layer is written only once the kernel ran. The hook therefore
records a fence on the engine's stream and returns; the sender's waiter thread
hands the layer's writes to the transport once the fence completed (in layer
order). On host memory the engine calls the hook once the layer is computed and
no fence is needed (the default).

A `FenceSource` records fences; a `Fence` says whether everything enqueued before
it completed. `CudaFences` records pooled CUDA events through the fastkv core
(`fastkv.worker.streams`: the events the swaps use), on the stream the engine
passes to the hook or on its current one. Tests inject their own source to hold
a layer's fence open deterministically.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol


class Fence(Protocol):
    def query(self) -> bool:
        """Has everything enqueued before the fence completed? Never blocks;
        raises RuntimeError on a device error (the layer's send then fails)."""
        ...

    def synchronize(self, timeout: float) -> bool:
        """Block at most `timeout` seconds for the fence; True once complete."""
        ...


class FenceSource(Protocol):
    def record(self, stream: int | None) -> Fence:
        """A fence after the work enqueued so far on `stream` (a cudaStream_t as an
        int), or on the engine's current stream when None."""
        ...


def current_stream_of(device: int) -> Callable[[], int]:
    """How to read the engine's current CUDA stream on `device`: from the framework
    that owns the caches, taken among those already imported (Paddle with CUDA,
    then CuPy, then PyTorch), so nothing heavy is imported here.

    Raises:
        RuntimeError: none of them is imported (pass the stream to the hook, or a
            `current_stream` to `CudaFences`)."""
    paddle = sys.modules.get("paddle")
    if paddle is not None and paddle.is_compiled_with_cuda():

        def of_paddle() -> int:
            return int(paddle.device.cuda.current_stream(device).cuda_stream)

        return of_paddle
    cupy = sys.modules.get("cupy")
    if cupy is not None:

        def of_cupy() -> int:
            with cupy.cuda.Device(device):
                return int(cupy.cuda.get_current_stream().ptr)

        return of_cupy
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():

        def of_torch() -> int:
            return int(torch.cuda.current_stream(device).cuda_stream)

        return of_torch
    raise RuntimeError(
        f"device {device}: no framework with CUDA is imported (paddle, cupy, torch) to "
        "read the engine's current stream from; pass CudaFences(current_stream=...)"
    )


class CudaFences:
    """Records a pooled CUDA event per fence through the fastkv core.

    Args:
        device: the CUDA ordinal of the caches.
        current_stream: returns the engine's current stream handle (used when the
            hook passes none); default `current_stream_of(device)`.
        pool: a `fastkv.worker.streams.CudaEventPool` of `device` to take events
            from (default: a pool of its own).

    Raises:
        RuntimeError: the core was built without CUDA or sees no such device.
    """

    def __init__(
        self,
        device: int,
        *,
        current_stream: Callable[[], int] | None = None,
        pool: Any = None,
    ) -> None:
        from fastkv.ops import core
        from fastkv.worker.streams import CudaEventPool, CudaStream

        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device: {device!r} is not a CUDA ordinal")
        count = core.cuda_device_count()
        if device >= count:
            raise RuntimeError(
                f"device {device}: the fastkv core sees {count} CUDA device(s): "
                f"{core.cuda_info().describe()}"
            )
        self.device = device
        self._pool = pool if pool is not None else CudaEventPool(device, prefill=8)
        self._current = current_stream or current_stream_of(device)
        self._stream_of = CudaStream.external
        self._streams: dict[int, Any] = {}

    def record(self, stream: int | None) -> Fence:
        """An event recorded on the stream.

        Raises:
            RuntimeError: the stream is capturing a CUDA graph (an event recorded
                there would be a node of the graph, not a point the writes can
                wait for: the hook then fails the send), or a CUDA error."""
        handle = self._current() if stream is None else stream
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = self._stream_of(self.device, handle, self._pool)
        if s.capturing():
            raise RuntimeError(
                f"stream {handle:#x} is capturing a CUDA graph: PD's hook needs the "
                "layer's kernels launched outside a capture (the send fails)"
            )
        return s.record()


__all__ = ["CudaFences", "Fence", "FenceSource", "current_stream_of"]
