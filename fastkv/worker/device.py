"""The device a worker's cache lives on: the device string, the CUDA path made
ready before the first swap, and Paddle's current stream there (where the model's
kernels run)."""

from __future__ import annotations

from fastkv.ops import core, paddle_ops

paddle = paddle_ops.paddle


def parse_device(device: str) -> int | None:
    """None for the CPU, else the CUDA ordinal."""
    if device == "cpu":
        return None
    name, _, index = device.partition(":")
    if name != "gpu" or (index and not index.isdigit()):
        raise ValueError(f"device: expected 'cpu', 'gpu' or 'gpu:N', got {device!r}")
    if not paddle.is_compiled_with_cuda():
        raise RuntimeError(
            f"device {device!r}: this Paddle build has no CUDA (install paddlepaddle-gpu); "
            f"{core.cuda_info().describe()}"
        )
    return int(index or 0)


def init_cuda(device: str, gpu_index: int) -> None:
    """Checks the core can use the GPU and initialises its CUDA path now (staging
    ring, kernel module), so problems surface here and not at the first swap."""
    info = core.cuda_info()
    if info.device_count == 0:
        raise RuntimeError(f"device {device!r}: no usable CUDA device. {info.describe()}")
    if gpu_index >= info.device_count:
        raise ValueError(
            f"device: {device!r} out of range: the core sees {info.device_count} device(s)"
        )
    core.cuda_init(gpu_index)


def paddle_stream_handle(gpu_index: int) -> int:
    """cudaStream_t of Paddle's current stream on `gpu_index` (where the model's
    kernels run), whatever device the calling thread has current."""
    stream = paddle.device.cuda.current_stream(gpu_index)
    return int(stream.cuda_stream)


__all__ = ["init_cuda", "paddle_stream_handle", "parse_device"]
