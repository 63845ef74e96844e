"""ctypes binding of the framework-free core, `libfastkv_core.so`.

This is the path that needs neither Paddle nor a GPU build of it: CI drives the CPU
core through it, and a CUDA machine with only CuPy drives `fkv_swap_cuda` with
CuPy device arrays and pinned host arrays. ctypes releases the GIL for the whole
native call, so a copy on one Python thread runs concurrently with the others.

Layout contract (see custom_ops/csrc/fastkv_core.h): a segment is one cache tensor
(layer L's K, layer L's V, a scale tensor, ...). Device block b of segment s is at
`device_base + b * block_bytes` for b < num_device_blocks; host block b is at
`host_base + b * host_stride` for b < num_host_blocks (host_stride >= block_bytes).
The worker's host tier interleaves its segments: host block b is one contiguous
region of S = sum(block_bytes) bytes, segment s's part at prefix_s =
sum(block_bytes[:s]), so host_base = tier + prefix_s and host_stride = S. A swap
copies, for every segment and every i, device block `device_ids[i]` <-> host block
`host_ids[i]`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

LIB_PATH = Path(__file__).resolve().with_name("libfastkv_core.so")
ABI_VERSION = 4
MIN_ACCESS_BYTES = 4
CLOSE_TIMEOUT_S = 10.0
"""How long `Layout.close` waits for its release (a cudaFree) by default."""

_EINVAL = 1
_ETIMEDOUT = 6
_ECAPTURE = 7
_ENOTREADY = 8


class CudaCaptureError(RuntimeError):
    """A transfer was refused because its stream is capturing a CUDA graph."""


class CudaTimeoutError(TimeoutError):
    """A bounded wait in the core ran out (an event wait, the staging ring)."""


class Direction(IntEnum):
    """Which way a swap copies."""

    H2D = 0
    """host -> device: swap-in."""
    D2H = 1
    """device -> host: evict or back up."""


class _CudaInfo(ctypes.Structure):
    _fields_ = (
        ("built_with_cuda", ctypes.c_int32),
        ("runtime_version", ctypes.c_int32),
        ("driver_version", ctypes.c_int32),
        ("device_count", ctypes.c_int32),
        ("archs", ctypes.c_char * 256),
        ("status", ctypes.c_char * 512),
    )


class Segment(ctypes.Structure):
    """One `fkv_segment`: a cache tensor's device base, host base, block size and
    host block stride."""

    _fields_ = (
        ("device_base", ctypes.c_void_p),
        ("host_base", ctypes.c_void_p),
        ("block_bytes", ctypes.c_int64),
        ("host_stride", ctypes.c_int64),
    )


_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_pp, _pint = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)
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
        "fkv_cuda_get_info": ([ctypes.POINTER(_CudaInfo)], ctypes.c_int),
        "fkv_cuda_init": ([ctypes.c_int], ctypes.c_int),
        "fkv_cuda_staging_stats": ([ctypes.c_int, *[ctypes.POINTER(_i64)] * 3], ctypes.c_int),
        "fkv_cuda_stream_create": ([ctypes.c_int, ctypes.c_int, _pp], ctypes.c_int),
        "fkv_cuda_stream_destroy": ([ctypes.c_int, _ptr], ctypes.c_int),
        "fkv_cuda_stream_priority": ([ctypes.c_int, _ptr, _pint], ctypes.c_int),
        "fkv_cuda_stream_capturing": ([ctypes.c_int, _ptr, _pint], ctypes.c_int),
        "fkv_cuda_event_create": ([ctypes.c_int, _pp], ctypes.c_int),
        "fkv_cuda_event_destroy": ([ctypes.c_int, _ptr], ctypes.c_int),
        "fkv_cuda_event_record": ([ctypes.c_int, _ptr, _ptr], ctypes.c_int),
        "fkv_cuda_stream_wait_event": ([ctypes.c_int, _ptr, _ptr], ctypes.c_int),
        "fkv_cuda_event_query": ([ctypes.c_int, _ptr], ctypes.c_int),
        "fkv_cuda_event_wait": ([ctypes.c_int, _ptr, _i64], ctypes.c_int),
        "fkv_cuda_set_tuning": ([_i64, _i32], ctypes.c_int),
        "fkv_cuda_get_tuning": ([ctypes.POINTER(_i64), ctypes.POINTER(_i32)], None),
        "fkv_cuda_set_evict_launch_bytes": ([_i64], ctypes.c_int),
        "fkv_cuda_get_evict_launch_bytes": ([], _i64),
        "fkv_layout_create": (
            [ctypes.POINTER(Segment), _i32, _i32, _i64, _i64, _i32, _pp],
            ctypes.c_int,
        ),
        "fkv_layout_destroy": ([_ptr], ctypes.c_int),
        "fkv_layout_swap": (
            [_ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _i32, ctypes.POINTER(_i32)],
            ctypes.c_int,
        ),
        "fkv_layout_swap_ordered": (
            [*[_ptr] * 3, _i64, *[_i32] * 3, *[_ptr] * 3, _i32, _i32, ctypes.POINTER(_i32)],
            ctypes.c_int,
        ),
        "fkv_host_alloc": ([ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int], _ptr),
        "fkv_host_free": ([_ptr, ctypes.c_size_t, ctypes.c_int], ctypes.c_int),
        "fkv_numa_node_of": ([_ptr], ctypes.c_int),
        "fkv_cuda_crc3way": (
            [ctypes.c_int, _ptr, _i64, _ptr, _i64, ctypes.POINTER(ctypes.c_uint32)],
            ctypes.c_int,
        ),
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
    if rc == _ECAPTURE:
        raise CudaCaptureError(msg)
    if rc == _ETIMEDOUT:
        raise CudaTimeoutError(msg)
    raise RuntimeError(msg)


SegmentEntry = tuple[int, int, int] | tuple[int, int, int, int]
SegmentsLike = ctypes.Array | Sequence[SegmentEntry]  # type: ignore[type-arg]


def make_segments(segments: Sequence[SegmentEntry]) -> ctypes.Array:  # type: ignore[type-arg]
    """Builds the segment table once, so repeated swaps skip the conversion.

    Args:
        segments: (device_base, host_base, block_bytes, host_stride) per cache
            tensor, as ints (raw addresses: `tensor.data_ptr()`, `array.ctypes.data`,
            `cupy_array.data.ptr`); a triple without host_stride has its host
            blocks back to back (host_stride = block_bytes).

    Returns:
        A ctypes array of `Segment`, accepted by `swap_cpu` and `swap_cuda`.

    Raises:
        ValueError: an entry is not a triple or quadruple of ints, or a value does
            not fit its field (ctypes would wrap it silently).
    """
    table = (Segment * len(segments))()
    for i, entry in enumerate(segments):
        try:
            values = [int(v) for v in entry]
            if len(values) == 3:
                values.append(values[2])
            dev, host, block_bytes, stride = values
        except (TypeError, ValueError):
            raise ValueError(
                f"segments[{i}]: expected (device_base, host_base, block_bytes[, "
                f"host_stride]), got {entry!r}"
            ) from None
        _check_fields(i, dev, host, block_bytes, stride)
        table[i] = Segment(dev, host, block_bytes, stride)
    return table


_SEGMENT_FIELDS = (
    ("device_base", 0, 1 << 64),
    ("host_base", 0, 1 << 64),
    ("block_bytes", -(1 << 63), 1 << 63),
    ("host_stride", -(1 << 63), 1 << 63),
)


def _check_fields(i: int, *values: int) -> None:
    """Raises ValueError naming the first value outside its C field's range (the
    native checks then see what the caller gave, not a wrapped value)."""
    for (name, low, high), v in zip(_SEGMENT_FIELDS, values, strict=True):
        if not low <= v < high:
            raise ValueError(f"segments[{i}].{name}: {v} is outside [{low}, {high})")


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


def host_alloc(nbytes: int, numa_node: int = -1, pin: bool = False, device: int = -1) -> int:
    """Allocates host memory for a cache tier (see `fkv_host_alloc`).

    The memory is marked MADV_DONTFORK: a child process forked afterwards does not
    have it.

    Args:
        nbytes: size in bytes, > 0.
        numa_node: NUMA node to bind the pages to (preferred policy); -1 = no binding.
        pin: page-lock and map it for CUDA (requires a CUDA build and device).
        device: the CUDA device to register it on (its context, not a hidden
            device 0's); -1 = the calling thread's current device.

    Returns:
        The address, 2 MiB-aligned for allocations of 2 MiB or more, page-aligned
        otherwise; the memory is zero-filled.

    Raises:
        ValueError: bad nbytes or numa_node.
        RuntimeError: out of memory, mbind refused, or CUDA registration failed.
    """
    ptr = _lib.fkv_host_alloc(nbytes, numa_node, int(pin), device)
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


@dataclass(frozen=True, slots=True)
class CudaInfo:
    """What the core was built with and what this machine offers.

    Attributes:
        built_with_cuda: compiled with nvcc.
        runtime_version: the CUDA runtime compiled in (13000 = 13.0); 0 without CUDA.
        driver_version: newest CUDA the installed driver supports; 0 = no driver.
        device_count: usable devices.
        archs: compiled targets, e.g. ("sm_75", ..., "compute_75").
        status: "ok", or why there is no usable device and what to do.
    """

    built_with_cuda: bool
    runtime_version: int
    driver_version: int
    device_count: int
    archs: tuple[str, ...]
    status: str

    @staticmethod
    def version_text(version: int) -> str:
        return f"{version // 1000}.{version % 1000 // 10}" if version else "none"

    def describe(self) -> str:
        """One line for logs and error messages."""
        return (
            f"fastkv core: CUDA runtime {self.version_text(self.runtime_version)}, driver "
            f"supports {self.version_text(self.driver_version)}, {self.device_count} "
            f"device(s), targets {' '.join(self.archs) or 'none'}: {self.status}"
        )


def cuda_info() -> CudaInfo:
    """The core's CUDA build and the machine's driver and devices (never raises)."""
    raw = _CudaInfo()
    _lib.fkv_cuda_get_info(ctypes.byref(raw))
    return CudaInfo(
        bool(raw.built_with_cuda),
        int(raw.runtime_version),
        int(raw.driver_version),
        int(raw.device_count),
        tuple(raw.archs.decode().split()) if raw.built_with_cuda else (),
        raw.status.decode(errors="replace"),
    )


def cuda_init(device: int) -> None:
    """Creates what the CUDA path of `device` needs (staging ring, the kernel's
    module) now rather than at the first transfer.

    Raises:
        ValueError: no such device.
        RuntimeError: no usable device (the message says why), out of memory, or no
            kernel image for this GPU's architecture.
    """
    rc = _lib.fkv_cuda_init(device)
    if rc:
        _raise(rc, "fkv_cuda_init")


def cuda_staging_stats(device: int) -> tuple[int, int, int]:
    """(slots, bytes per slot, times grown) of `device`'s staging ring."""
    slots, slot_bytes, grows = _i64(), _i64(), _i64()
    rc = _lib.fkv_cuda_staging_stats(
        device, ctypes.byref(slots), ctypes.byref(slot_bytes), ctypes.byref(grows)
    )
    if rc:
        _raise(rc, "fkv_cuda_staging_stats")
    return slots.value, slot_bytes.value, grows.value


def stream_create(device: int, priority: int = 0) -> int:
    """A non-blocking CUDA stream on `device` (> 0: the highest priority the device
    offers, < 0: the lowest, 0: default); returns the cudaStream_t as an int."""
    out = ctypes.c_void_p()
    rc = _lib.fkv_cuda_stream_create(device, priority, ctypes.byref(out))
    if rc:
        _raise(rc, "fkv_cuda_stream_create")
    return int(out.value or 0)


def stream_destroy(device: int, stream: int) -> None:
    rc = _lib.fkv_cuda_stream_destroy(device, stream)
    if rc:
        _raise(rc, "fkv_cuda_stream_destroy")


def stream_priority(device: int, stream: int) -> int:
    """The stream's priority (numerically lower = higher priority)."""
    out = ctypes.c_int()
    rc = _lib.fkv_cuda_stream_priority(device, stream or None, ctypes.byref(out))
    if rc:
        _raise(rc, "fkv_cuda_stream_priority")
    return out.value


def stream_capturing(device: int, stream: int) -> bool:
    """True while the stream is capturing a CUDA graph."""
    out = ctypes.c_int()
    rc = _lib.fkv_cuda_stream_capturing(device, stream or None, ctypes.byref(out))
    if rc:
        _raise(rc, "fkv_cuda_stream_capturing")
    return bool(out.value)


def event_create(device: int) -> int:
    out = ctypes.c_void_p()
    rc = _lib.fkv_cuda_event_create(device, ctypes.byref(out))
    if rc:
        _raise(rc, "fkv_cuda_event_create")
    return int(out.value or 0)


def event_destroy(device: int, event: int) -> None:
    rc = _lib.fkv_cuda_event_destroy(device, event)
    if rc:
        _raise(rc, "fkv_cuda_event_destroy")


def event_record(device: int, event: int, stream: int) -> None:
    rc = _lib.fkv_cuda_event_record(device, event, stream or None)
    if rc:
        _raise(rc, "fkv_cuda_event_record")


def stream_wait_event(device: int, stream: int, event: int) -> None:
    """Work enqueued on `stream` afterwards waits on the device for `event`."""
    rc = _lib.fkv_cuda_stream_wait_event(device, stream or None, event)
    if rc:
        _raise(rc, "fkv_cuda_stream_wait_event")


def event_query(device: int, event: int) -> bool:
    """True once the event completed (or was never recorded).

    Raises:
        RuntimeError: a CUDA error, e.g. a sticky one from an earlier fault.
    """
    rc = _lib.fkv_cuda_event_query(device, event)
    if rc == 0:
        return True
    if rc == _ENOTREADY:
        return False
    _raise(rc, "fkv_cuda_event_query")
    return False  # unreachable


def event_wait(device: int, event: int, timeout: float) -> bool:
    """Waits at most `timeout` seconds (precisely: polls, then 20 us sleeps) with the
    GIL released; True if the event completed.

    Raises:
        RuntimeError: a CUDA error.
    """
    rc = _lib.fkv_cuda_event_wait(device, event, max(0, int(timeout * 1e9)))
    if rc == 0:
        return True
    if rc == _ETIMEDOUT:
        return False
    _raise(rc, "fkv_cuda_event_wait")
    return False  # unreachable


class LayerCopyError(RuntimeError):
    """A layout transfer failed; layers before `failed_layer` were enqueued intact."""

    def __init__(self, message: str, failed_layer: int) -> None:
        super().__init__(message)
        self.failed_layer = failed_layer


class Layout:
    """A cache's segment table, validated (and on CUDA resolved and uploaded) once.

    Segments are grouped into layers of `segments_per_layer` consecutive segments.
    A transfer then validates and stages only its ids, and on CUDA launches every
    layer it covers from one native call, recording one event per layer.

    Args:
        segments: (device_base, host_base, block_bytes[, host_stride]) per
            tensor, layer-major (see `make_segments`).
        segments_per_layer: tensors per layer, dividing len(segments).
        num_device_blocks, num_host_blocks: blocks per segment on each side.
        device: CUDA device ordinal, or -1 for the CPU core.

    Raises:
        ValueError: a segment or count fails validation (the message names it), a
            device base is not memory of `device`, or a host region is not pinned.
        RuntimeError: CUDA failed (no device, out of memory, no kernel image).
    """

    def __init__(
        self,
        segments: SegmentsLike,
        segments_per_layer: int,
        num_device_blocks: int,
        num_host_blocks: int,
        device: int = -1,
    ) -> None:
        self._handle: int | None = None
        table = _segments(segments)
        out = ctypes.c_void_p()
        rc = _lib.fkv_layout_create(
            table,
            len(table),
            segments_per_layer,
            num_device_blocks,
            num_host_blocks,
            device,
            ctypes.byref(out),
        )
        if rc:
            _raise(rc, "fkv_layout_create")
        self._handle = out.value
        self.device = device
        self.num_layers = len(table) // segments_per_layer
        self._destroy: Callable[[int], object] = _lib.fkv_layout_destroy

    def swap(
        self,
        device_ids: np.ndarray,
        host_ids: np.ndarray,
        direction: Direction | int,
        first_layer: int = 0,
        num_layers: int | None = None,
        stream: int = 0,
        layer_events: ctypes.Array | None = None,  # type: ignore[type-arg]
        num_threads: int = 0,
        wait_events: ctypes.Array | None = None,  # type: ignore[type-arg]
        waits_per_layer: int = 0,
    ) -> None:
        """Copies the blocks of layers [first_layer, first_layer + num_layers).

        Args:
            device_ids, host_ids: equal-length int64 arrays (contiguous; others are
                converted, which costs a copy).
            direction: Direction.H2D or Direction.D2H.
            first_layer, num_layers: the layers (num_layers None: through the last).
            stream: CUDA: the cudaStream_t to enqueue on. CPU: ignored.
            layer_events: CUDA: a ctypes array of cudaEvent_t, one per layer, each
                recorded right after its layer (None: record nothing).
            num_threads: CPU: copy threads (0 = default). CUDA: ignored.
            wait_events, waits_per_layer: CUDA: a ctypes array of cudaEvent_t,
                `waits_per_layer` per layer, layer-major (None entries skipped):
                the stream waits for layer k's before enqueuing layer k, so a load
                ordered after other copies per layer is still one call, one
                validation and one staging (fkv_layout_swap_ordered). CPU: ignored.

        Raises:
            ValueError: bad ids or arguments; nothing was enqueued.
            LayerCopyError: CUDA failed at `failed_layer`; the events of that layer
                and the later ones were still recorded.
            CudaCaptureError: the stream is capturing a CUDA graph; nothing enqueued.
        """
        dev = _ids("device_ids", device_ids)
        host = _ids("host_ids", host_ids)
        if dev.shape != host.shape:
            raise ValueError(f"host_ids: length {host.size} != device_ids length {dev.size}")
        count = self.num_layers - first_layer if num_layers is None else num_layers
        if wait_events is not None and len(wait_events) != count * waits_per_layer:
            raise ValueError(
                f"wait_events: {len(wait_events)} entries, expected num_layers * "
                f"waits_per_layer = {count} * {waits_per_layer}"
            )
        failed = _i32()  # per call: two streams' threads may share a layout
        rc = _lib.fkv_layout_swap_ordered(
            self._handle,
            dev.ctypes.data,
            host.ctypes.data,
            dev.size,
            int(direction),
            first_layer,
            count,
            stream or None,
            layer_events,
            wait_events,
            waits_per_layer,
            num_threads,
            ctypes.byref(failed),
        )
        if rc:
            msg = f"fkv_layout_swap: {_lib.fkv_last_error().decode(errors='replace')}"
            if rc in (_EINVAL, _ECAPTURE):
                _raise(rc, "fkv_layout_swap")
            raise LayerCopyError(msg, int(failed.value))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Releases the layout (after its last transfer has completed), waiting at
        most `timeout` seconds.

        On CUDA the release is a cudaFree, which waits for all work on the device
        to finish, the engine's included; behind a stuck stream it would never
        return. It runs on the layout reaper thread: past `timeout` this logs what
        it is waiting for and returns False, and the release completes in the
        background if the device ever drains.

        Returns:
            True once released (or already closed), False if still waiting.
        """
        handle, self._handle = self._handle, None
        if handle is None:
            return True
        released = _reaper.release(self._destroy, handle)
        if released.wait(timeout):
            return True
        where = "the CPU" if self.device < 0 else f"gpu:{self.device}"
        log.error(
            "Layout.close: releasing the layout of %s has not returned after %.1f s: "
            "cudaFree waits for all work on the device to finish (a stuck kernel or "
            "stream, %d release(s) queued); it completes in the background if the "
            "device drains",
            where,
            timeout,
            _reaper.pending,
        )
        return False

    def __del__(self) -> None:
        # Never waits: a finalizer queues the release on the reaper thread, so a
        # Layout dropped by the garbage collector cannot hang the thread it runs on.
        with contextlib.suppress(Exception):  # interpreter shutdown
            handle, self._handle = self._handle, None
            if handle is not None:
                _reaper.release(self._destroy, handle)


class _Reaper:
    """One daemon thread that releases layouts in order, off the caller's thread
    (a release may block in cudaFree for as long as the device is busy)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[int], object], int, threading.Event]]
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.pending = 0

    def release(self, destroy: Callable[[int], object], handle: int) -> threading.Event:
        """Queues `destroy(handle)`; the returned event is set once it returned."""
        done = threading.Event()
        with self._lock:
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fastkv-layout-reaper", daemon=True
                )
                self._thread.start()
        self._queue.put((destroy, handle, done))
        return done

    def _run(self) -> None:
        while True:
            destroy, handle, done = self._queue.get()
            try:
                destroy(handle)
            except Exception as e:  # nothing to hand it to: say so
                log.error("fastkv layout release failed: %s", e)
            with self._lock:
                self.pending -= 1
            done.set()


_reaper = _Reaper()


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


def set_cuda_evict_launch_bytes(nbytes: int) -> None:
    """Bounds the kernel work of one launch of a device -> host transfer (process-wide).

    A copy-kernel CTA holds its SM until its launch ends (stream priority never
    preempts it), so an eviction is cut into launches of at most `nbytes` of kernel
    work and the model's kernels get those SMs back between them. Loads are not cut.
    Default 2 MiB (FASTKV_CUDA_EVICT_LAUNCH_BYTES); see custom_ops/csrc/fkv_cuda_plan.h.

    Args:
        nbytes: the bound in bytes, rounded down to 16 KiB chunks and raised to one
            chunk per CTA of the grid; 0 sends every eviction as one launch.

    Raises:
        ValueError: nbytes is negative.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes: {nbytes} must be >= 0 (0: no bound)")
    rc = _lib.fkv_cuda_set_evict_launch_bytes(nbytes)
    if rc:
        _raise(rc, "fkv_cuda_set_evict_launch_bytes")


def get_cuda_evict_launch_bytes() -> int:
    """Returns the bound set_cuda_evict_launch_bytes sets (0: none)."""
    return int(_lib.fkv_cuda_get_evict_launch_bytes())


CRC_TIMEOUT_S = 30.0
"""How long `crc3way_cuda` waits for its kernels by default."""
_crc_streams = threading.local()


def crc3way_cuda(
    device: int, segments: np.ndarray, timeout: float = CRC_TIMEOUT_S, stream: int | None = None
) -> int:
    """Storage's crc32c-3way block checksum (`fastkv.storage._disk_io.block_checksum`,
    the same value bit for bit) of device memory: `segments` are int64 (pointer,
    length) rows into CUDA device `device`'s memory.

    The kernels run on `stream`, by default a low-priority non-blocking stream of
    the calling thread's own on that device (created at its first call, kept for
    the thread's life), so they never wait for the engine's work: the caller
    orders the call after whatever wrote the bytes. The calling thread waits at
    most `timeout` seconds, the GIL released.

    Raises:
        ValueError: `segments` not a non-empty (n, 2) array of lengths >= 0, or a
            timeout outside (0, 3600].
        CudaTimeoutError: the kernels did not finish in time (they finish and free
            their memory in the background).
        RuntimeError: no CUDA (core built without it, no such device) or a CUDA
            error (an invalid pointer among them).
    """
    segs = np.ascontiguousarray(segments, dtype=np.int64)
    if segs.ndim != 2 or segs.shape[1:] != (2,) or not len(segs) or (segs[:, 1] < 0).any():
        raise ValueError(f"segments: shape {segs.shape}: need (n >= 1, 2), lengths >= 0")
    if not 0 < timeout <= 3600:
        raise ValueError(f"timeout: {timeout!r} s not in (0, 3600]")
    if stream is None:
        streams = _crc_streams.__dict__.setdefault("by_device", {})
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = stream_create(device, -1)
    out = ctypes.c_uint32()
    rc = _lib.fkv_cuda_crc3way(
        device, segs.ctypes.data, len(segs), stream, int(timeout * 1e9), ctypes.byref(out)
    )
    if rc:
        _raise(rc, "fkv_cuda_crc3way")
    return int(out.value)
