"""Paddle custom ops over the fastkv core (`libfastkv_paddle_ops.so`).

Importing this module imports paddle and registers the ops. The ops take the
cache tensors themselves (one list, layer-major: layer 0's tensors, then layer 1's,
... with `tensors_per_layer` tensors per layer, e.g. K, V, K-scale, V-scale) and
dispatch on their place: CPU tensors use the CPU core (thread pool), GPU tensors
the CUDA core on `stream`. Block ids and host pointers travel as int64 CPU tensors:
Paddle passes tensors to the kernel without conversion, where a list attribute
would be rebuilt element by element on every call; numpy arrays are wrapped
zero-copy with `paddle.from_dlpack`.

Paddle's eager custom-op call releases the GIL while the kernel runs (measured by
tools/bench_transfer.py: another Python thread keeps running during a long swap),
so the worker's H2D and D2H threads copy concurrently.

Host layout contract: host block b of cache tensor i is the `block_bytes_i` bytes
(one `[i, ...]` slice) at `host_ptrs[i] + b * host_stride`, for b < num_host_blocks.
The worker's host tier interleaves its tensors: host block b is one contiguous
region of S = sum(block_bytes) bytes, tensor i's part at prefix_i =
sum(block_bytes[:i]), so `host_ptrs[i] = base + prefix_i` and `host_stride = S`.
`host_stride=0` gives each tensor a region of its own (its blocks back to back).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

with warnings.catch_warnings():
    # Importing paddle (its extension helpers) looks for ccache, which only matters
    # when compiling; we only load a prebuilt library.
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle
    from paddle import _C_ops
    from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

from fastkv.ops import core

LIB_PATH = Path(__file__).resolve().with_name("libfastkv_paddle_ops.so")

if not LIB_PATH.exists():
    raise ImportError(
        f"fastkv Paddle ops are not built ({LIB_PATH} is missing). Build them from the "
        "repository root with `make install` (paddle must be importable at build time)."
    )
_REGISTERED = set(load_op_meta_info_and_register_op(str(LIB_PATH)))
_EXPECTED = {
    "fastkv_swap_all_layers",
    "fastkv_swap_layer",
    "fastkv_host_alloc",
    "fastkv_host_free",
}
if not _EXPECTED <= _REGISTERED:
    raise ImportError(
        f"{LIB_PATH} registers {sorted(_REGISTERED)}; rebuild with `make install`"
    )

IdsLike = paddle.Tensor | np.ndarray | Sequence[int]


def int64_tensor(values: IdsLike, name: str = "ids") -> paddle.Tensor:
    """An int64 CPU tensor for ids or host pointers; zero-copy from an int64 array.

    Build it once and reuse it where the values do not change (host_ptrs).

    Raises:
        ValueError: values are not a 1-D integer sequence.
    """
    if isinstance(values, paddle.Tensor):
        return values
    arr = np.asarray(values)
    if arr.size == 0:
        arr = np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
    return paddle.from_dlpack(np.ascontiguousarray(arr, dtype=np.int64))


def _check_contiguous(caches: Sequence[paddle.Tensor], first: int, count: int) -> None:
    # Paddle hands a custom op a contiguous *copy* of a strided input, so an in-place
    # swap into a strided view would land in a temporary and vanish; refuse it here.
    for i in range(first, min(first + count, len(caches))):
        if not caches[i].is_contiguous():
            shape = list(caches[i].shape)
            raise ValueError(f"fastkv[EINVAL] caches[{i}]: must be contiguous (shape {shape})")


def _call(op: str, *args: object) -> list[paddle.Tensor]:
    try:
        return _C_ops._run_custom_op(op, *args)
    except Exception as e:
        text = str(e)
        at = text.find("fastkv[")
        if at < 0:
            raise
        # Drop Paddle's "[file:line]" trailer; the original stays as __cause__.
        msg = text[at:].split("\n")[0].strip()
        if msg.startswith("fastkv[EINVAL]"):
            raise ValueError(msg) from e
        raise RuntimeError(msg) from e


def swap_all_layers(
    caches: Sequence[paddle.Tensor],
    device_ids: IdsLike,
    host_ids: IdsLike,
    host_ptrs: IdsLike,
    num_host_blocks: int,
    direction: core.Direction | int,
    stream: int = 0,
    num_threads: int = 0,
    *,
    host_stride: int = 0,
) -> None:
    """Copies the given blocks of every cache tensor in one call.

    Args:
        caches: cache tensors `[num_device_blocks, ...]`, all on one place, contiguous
            (a strided view is rejected: Paddle would pass the op a copy).
        device_ids, host_ids: equal-length int64 ids (CPU tensors or arrays).
        host_ptrs: host region address per cache tensor (len(caches) entries).
        num_host_blocks: blocks per host region.
        direction: `Direction.H2D` (0, host -> device) or `Direction.D2H` (1).
        stream: cudaStream_t as int for GPU tensors (ignored on CPU).
        num_threads: CPU threads for CPU tensors, 0 = default (ignored on GPU).
        host_stride: bytes from one host block to the next, the same for every
            tensor (the host tier's block size); 0: each tensor's own block size.

    Raises:
        ValueError: an argument fails validation (names it); no memory was touched.
        RuntimeError: the copy failed (CUDA error, CUDA not built).
    """
    _check_contiguous(caches, 0, len(caches))
    _call(
        "fastkv_swap_all_layers",
        list(caches),
        int64_tensor(device_ids, "device_ids"),
        int64_tensor(host_ids, "host_ids"),
        int64_tensor(host_ptrs, "host_ptrs"),
        int(num_host_blocks),
        int(host_stride),
        int(direction),
        int(stream),
        int(num_threads),
    )


def swap_layer(
    caches: Sequence[paddle.Tensor],
    device_ids: IdsLike,
    host_ids: IdsLike,
    host_ptrs: IdsLike,
    layer: int,
    tensors_per_layer: int,
    num_host_blocks: int,
    direction: core.Direction | int,
    stream: int = 0,
    num_threads: int = 0,
    *,
    host_stride: int = 0,
) -> None:
    """Copies the given blocks of one layer's tensors:
    `caches[layer * tensors_per_layer : (layer + 1) * tensors_per_layer]`.

    The full list is passed so the per-layer loop does not slice lists; only the
    selected tensors are checked and copied.

    Args:
        caches, device_ids, host_ids, host_ptrs, num_host_blocks, direction, stream,
            num_threads, host_stride: as for `swap_all_layers` (host_ptrs covers all
            of caches).
        layer: index in [0, len(caches) // tensors_per_layer).
        tensors_per_layer: tensors per layer, > 0, dividing len(caches).

    Raises:
        ValueError: an argument fails validation; no memory was touched.
        RuntimeError: the copy failed.
    """
    if tensors_per_layer > 0 and layer >= 0:
        _check_contiguous(caches, layer * tensors_per_layer, tensors_per_layer)
    _call(
        "fastkv_swap_layer",
        list(caches),
        int64_tensor(device_ids, "device_ids"),
        int64_tensor(host_ids, "host_ids"),
        int64_tensor(host_ptrs, "host_ptrs"),
        int(layer),
        int(tensors_per_layer),
        int(num_host_blocks),
        int(host_stride),
        int(direction),
        int(stream),
        int(num_threads),
    )


def host_alloc(
    nbytes: int, numa_node: int = -1, pin: bool | None = None, device: int = -1
) -> int:
    """Allocates one host cache tier (zero-filled, pre-faulted, NUMA-bound, absent
    from forked children).

    Args:
        nbytes: size in bytes, > 0.
        numa_node: node to bind to (see fastkv.worker.numa); -1 = no binding.
        pin: page-lock and map for CUDA; None = pin when a CUDA device is usable.
        device: CUDA device whose context registers the memory; -1 = current.

    Returns:
        The address as an int; free it with `host_free(ptr, nbytes, pinned)`.

    Raises:
        ValueError: bad nbytes or numa_node.
        RuntimeError: allocation, NUMA binding or CUDA registration failed.
    """
    if pin is None:
        pin = core.cuda_device_count() > 0
    (out,) = _call("fastkv_host_alloc", int(nbytes), int(numa_node), bool(pin), int(device))
    return int(out.numpy()[0])


def host_free(ptr: int, nbytes: int, pinned: bool) -> None:
    """Frees a `host_alloc` allocation.

    Args:
        ptr: the address host_alloc returned.
        nbytes, pinned: as allocated (checked; pinned is the value pin resolved to).

    Raises:
        ValueError: unknown ptr or mismatching nbytes/pinned; nothing was freed.
        RuntimeError: unregistering or unmapping failed.
    """
    _call("fastkv_host_free", int(ptr), int(nbytes), bool(pinned))
