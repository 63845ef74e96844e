"""ctypes binding of the framework-free core, `libfastkv_core.so`.

This is the path that needs neither Paddle nor a GPU build of it: CI drives the CPU
core through it, and a CUDA machine with only CuPy drives `fkv_swap_cuda` with
CuPy device arrays and pinned host arrays. ctypes releases the GIL for the whole
native call, so a copy on one Python thread runs concurrently with the others.

Layout contract (see custom_ops/csrc/fastkv_core.h): a segment is one cache tensor
(layer L's K, layer L's V, a scale tensor, ...). Device block b of segment s is at
`device_base + b * block_bytes` for b < num_device_blocks; host block b is at
`host_base + b * block_bytes` for b < num_host_blocks. A swap copies, for every
segment and every i, device block `device_ids[i]` <-> host block `host_ids[i]`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path

import numpy as np

LIB_PATH = Path(__file__).resolve().with_name("libfastkv_core.so")
ABI_VERSION = 1
MIN_ACCESS_BYTES = 4

_EINVAL = 1


class Direction(IntEnum):
    """Which way a swap copies."""

    H2D = 0
    """host -> device: swap-in."""
    D2H = 1
    """device -> host: evict or back up."""


class Segment(ctypes.Structure):
    """One `fkv_segment`: a cache tensor's device base, host base and block size."""

    _fields_ = (
        ("device_base", ctypes.c_void_p),
        ("host_base", ctypes.c_void_p),
        ("block_bytes", ctypes.c_int64),
    )


_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_SWAP_ARGS = [ctypes.POINTER(Segment), _i32, _i64, _i64, _ptr, _ptr, _i64, _i32]


def _load() -> ctypes.CDLL:
    if not LIB_PATH.exists():
        raise ImportError(
            f"fastkv native core is not built ({LIB_PATH} is missing). Build it from the "
            "repository root with `make install` (or `pip install --no-build-isolation "
            "--no-deps -e .` in an environment that has numpy and setuptools)."
        )
    lib = ctypes.CDLL(str(LIB_PATH))
    signatures: dict[str, tuple[list[object], object]] = {
        "fkv_abi_version": ([], ctypes.c_int),
        "fkv_last_error": ([], ctypes.c_char_p),
        "fkv_last_error_code": ([], ctypes.c_int),
        "fkv_default_num_threads": ([], ctypes.c_int),
        "fkv_swap_cpu": ([*_SWAP_ARGS, _i32], ctypes.c_int),
        "fkv_swap_cuda": ([*_SWAP_ARGS, _ptr], ctypes.c_int),
        "fkv_built_with_cuda": ([], ctypes.c_int),
        "fkv_cuda_device_count": ([], ctypes.c_int),
        "fkv_cuda_pci_bus_id": ([ctypes.c_int, ctypes.c_char_p, ctypes.c_int], ctypes.c_int),
        "fkv_cuda_set_tuning": ([_i64, _i32], ctypes.c_int),
        "fkv_cuda_get_tuning": ([ctypes.POINTER(_i64), ctypes.POINTER(_i32)], None),
        "fkv_host_alloc": ([ctypes.c_size_t, ctypes.c_int, ctypes.c_int], _ptr),
        "fkv_host_free": ([_ptr, ctypes.c_size_t, ctypes.c_int], ctypes.c_int),
        "fkv_numa_node_of": ([_ptr], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    if lib.fkv_abi_version() != ABI_VERSION:
        raise ImportError(
            f"{LIB_PATH} has ABI version {lib.fkv_abi_version()}, this module expects "
            f"{ABI_VERSION}: rebuild with `make install`"
        )
    return lib


_lib = _load()


def _raise(rc: int, what: str) -> None:
    msg = f"{what}: {_lib.fkv_last_error().decode(errors='replace')}"
    if rc == _EINVAL:
        raise ValueError(msg)
    raise RuntimeError(msg)


SegmentsLike = ctypes.Array | Sequence[tuple[int, int, int]]  # type: ignore[type-arg]


def make_segments(segments: Sequence[tuple[int, int, int]]) -> ctypes.Array:  # type: ignore[type-arg]
    """Builds the segment table once, so repeated swaps skip the conversion.

    Args:
        segments: (device_base, host_base, block_bytes) per cache tensor, as ints
            (raw addresses: `tensor.data_ptr()`, `array.ctypes.data`, `cupy_array.data.ptr`).

    Returns:
        A ctypes array of `Segment`, accepted by `swap_cpu` and `swap_cuda`.

    Raises:
        ValueError: an entry is not a triple of ints.
    """
    table = (Segment * len(segments))()
    for i, entry in enumerate(segments):
        try:
            dev, host, block_bytes = (int(v) for v in entry)
        except (TypeError, ValueError):
            raise ValueError(
                f"segments[{i}]: expected (device_base, host_base, block_bytes), got {entry!r}"
            ) from None
        table[i] = Segment(dev, host, block_bytes)
    return table


def _segments(segments: SegmentsLike) -> ctypes.Array:  # type: ignore[type-arg]
    if isinstance(segments, ctypes.Array):
        return segments
    return make_segments(segments)


def _ids(name: str, ids: np.ndarray | Sequence[int]) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _swap(
    name: str,
    segments: SegmentsLike,
    num_device_blocks: int,
    num_host_blocks: int,
    device_ids: np.ndarray | Sequence[int],
    host_ids: np.ndarray | Sequence[int],
    direction: Direction | int,
    last: object,
) -> None:
    """Calls fkv_swap_cpu or fkv_swap_cuda (`last` is num_threads or the stream)."""
    table = _segments(segments)
    dev = _ids("device_ids", device_ids)
    host = _ids("host_ids", host_ids)
    if dev.shape != host.shape:
        raise ValueError(f"host_ids: length {host.size} != device_ids length {dev.size}")
    rc = getattr(_lib, name)(
        table,
        len(table),
        num_device_blocks,
        num_host_blocks,
        dev.ctypes.data,
        host.ctypes.data,
        dev.size,
        int(direction),
        last,
    )
    if rc:
        _raise(rc, name)


def swap_cpu(
    segments: SegmentsLike,
    num_device_blocks: int,
    num_host_blocks: int,
    device_ids: np.ndarray | Sequence[int],
    host_ids: np.ndarray | Sequence[int],
    direction: Direction | int,
    num_threads: int = 0,
) -> None:
    """Copies blocks between two regions of ordinary host memory (the CPU core).

    Args:
        segments: `make_segments(...)` output or (device_base, host_base, block_bytes)
            triples.
        num_device_blocks, num_host_blocks: blocks per segment on each side.
        device_ids, host_ids: equal-length integer id arrays (int64 avoids a copy).
        direction: `Direction.H2D` (0) or `Direction.D2H` (1).
        num_threads: 0 = `default_num_threads()`.

    Raises:
        ValueError: any argument fails validation (the message names it); no byte
            has been copied.
        RuntimeError: the core failed for another reason.
    """
    _swap(
        "fkv_swap_cpu",
        segments,
        num_device_blocks,
        num_host_blocks,
        device_ids,
        host_ids,
        direction,
        num_threads,
    )


def swap_cuda(
    segments: SegmentsLike,
    num_device_blocks: int,
    num_host_blocks: int,
    device_ids: np.ndarray | Sequence[int],
    host_ids: np.ndarray | Sequence[int],
    direction: Direction | int,
    stream: int = 0,
) -> None:
    """Enqueues a block copy between device memory and pinned host memory on `stream`.

    Returns once the copy is queued (not finished); synchronize the stream or record
    an event on it before reading the destination or reusing a source block. The id
    arrays may be reused as soon as this returns.

    Args:
        segments: as for `swap_cpu`; device bases must be device memory of one GPU,
            host bases pinned, mapped memory (`host_alloc(pin=True)`,
            `cupyx.empty_pinned`).
        num_device_blocks, num_host_blocks, device_ids, host_ids, direction: as for
            `swap_cpu`.
        stream: a cudaStream_t as an int (`cupy.cuda.Stream().ptr`); 0 = legacy
            default stream.

    Raises:
        ValueError: an argument fails validation (nothing was enqueued).
        RuntimeError: a CUDA call failed, or the core was built without CUDA.
    """
    _swap(
        "fkv_swap_cuda",
        segments,
        num_device_blocks,
        num_host_blocks,
        device_ids,
        host_ids,
        direction,
        stream or None,
    )


def host_alloc(nbytes: int, numa_node: int = -1, pin: bool = False) -> int:
    """Allocates host memory for a cache tier (see `fkv_host_alloc`).

    Args:
        nbytes: size in bytes, > 0.
        numa_node: NUMA node to bind the pages to (preferred policy); -1 = no binding.
        pin: page-lock and map it for CUDA (requires a CUDA build and device).

    Returns:
        The address, 2 MiB-aligned for allocations of 2 MiB or more, page-aligned
        otherwise; the memory is zero-filled.

    Raises:
        ValueError: bad nbytes or numa_node.
        RuntimeError: out of memory, mbind refused, or CUDA registration failed.
    """
    ptr = _lib.fkv_host_alloc(nbytes, numa_node, int(pin))
    if not ptr:
        _raise(_lib.fkv_last_error_code(), "fkv_host_alloc")
    return int(ptr)


def host_free(ptr: int, nbytes: int, pinned: bool) -> None:
    """Frees memory from `host_alloc`.

    Args:
        ptr: the address `host_alloc` returned.
        nbytes, pinned: exactly as passed to `host_alloc` (they are checked).

    Raises:
        ValueError: ptr is unknown or nbytes/pinned do not match; nothing was freed.
        RuntimeError: unregistering or unmapping failed.
    """
    rc = _lib.fkv_host_free(ptr, nbytes, int(pinned))
    if rc:
        _raise(rc, "fkv_host_free")


def built_with_cuda() -> bool:
    """True if the core was compiled with nvcc."""
    return bool(_lib.fkv_built_with_cuda())


def cuda_device_count() -> int:
    """Usable CUDA devices; 0 without a CUDA build, driver or device (never raises)."""
    return int(_lib.fkv_cuda_device_count())


def cuda_pci_bus_id(device: int) -> str:
    """PCI bus id of CUDA device `device` as sysfs spells it ("0000:3b:00.0").

    Raises:
        RuntimeError: no such device, or the core was built without CUDA.
    """
    buf = ctypes.create_string_buffer(64)
    rc = _lib.fkv_cuda_pci_bus_id(device, buf, len(buf))
    if rc:
        _raise(rc, "fkv_cuda_pci_bus_id")
    return buf.value.decode()


def default_num_threads() -> int:
    """Threads a swap uses when num_threads=0 (FASTKV_NUM_THREADS, else the
    affinity CPU count capped at 8)."""
    return int(_lib.fkv_default_num_threads())


def numa_node_of(addr: int) -> int:
    """NUMA node of the page at `addr` (faulting it in if needed); -1 if unknown."""
    return int(_lib.fkv_numa_node_of(addr))


def set_cuda_tuning(memcpy_min_bytes: int | None = None, max_ctas: int | None = None) -> None:
    """Sets the CUDA path's knobs for the process (None leaves a knob unchanged).

    Args:
        memcpy_min_bytes: a consecutive run of at least this many bytes in a segment
            is copied with cudaMemcpyAsync instead of the kernel (0: every run;
            2**63 - 1: never).
        max_ctas: grid size bound of the copy kernel, > 0.

    Raises:
        ValueError: max_ctas is 0 or negative, or memcpy_min_bytes is negative.
    """
    if memcpy_min_bytes is not None and memcpy_min_bytes < 0:
        raise ValueError(f"memcpy_min_bytes: {memcpy_min_bytes} must be >= 0")
    if max_ctas is not None and max_ctas <= 0:
        raise ValueError(f"max_ctas: {max_ctas} must be > 0")
    rc = _lib.fkv_cuda_set_tuning(
        -1 if memcpy_min_bytes is None else memcpy_min_bytes,
        -1 if max_ctas is None else max_ctas,
    )
    if rc:
        _raise(rc, "fkv_cuda_set_tuning")


def get_cuda_tuning() -> tuple[int, int]:
    """Returns (memcpy_min_bytes, max_ctas) currently in effect."""
    memcpy_min = _i64()
    ctas = _i32()
    _lib.fkv_cuda_get_tuning(ctypes.byref(memcpy_min), ctypes.byref(ctas))
    return memcpy_min.value, ctas.value
