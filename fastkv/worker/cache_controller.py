"""The worker's cache controller: owns the KV tensors and the host cache, and runs
the scheduler's swap metadata on them.

Layout. Per layer (model layers, then extra speculative-decoding layers) the cache
holds K and V tensors `[num_device_blocks, num_kv_heads, block_size, head_dim]`;
with `dtype="fp8"` they are uint8 and each has a float32 scale tensor
`[num_device_blocks, num_kv_heads]` that moves with its block. The flat list
`caches` is layer-major: K0, V0, (K0 scale, V0 scale), K1, ... The host cache is
one allocation per tier, pinned and bound to the GPU's NUMA node on a CUDA machine,
carved into one region per cache tensor: host block b of tensor i sits at
`host_ptrs[i] + b * block_bytes[i]`, so the blocks of one layer are contiguous and
consecutive ids coalesce into one copy.

On a GPU the controller initialises the CUDA path when it is created (staging ring,
kernel module, events, streams: nothing is allocated at the first swap, after an
engine has sized its KV cache to fill the GPU), uses its own device for every
stream and event, loads on a highest-priority stream and evicts on a lowest-priority
one, and moves bytes through a core layout: the cache is validated and resolved
once, a transfer's ids are validated and staged once, and a swap-in launches every
layer from one native call with one reused event per layer. The compute stream is
the engine's: passed per step, or Paddle's current stream on the controller's GPU.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from fastkv.metadata import CacheLevel, CacheSwapMetadata, TransferResult
from fastkv.ops import core, paddle_ops
from fastkv.ops.core import CudaCaptureError, Direction
from fastkv.worker.faults import FaultInjector
from fastkv.worker.numa import host_numa_node
from fastkv.worker.streams import (
    CudaEventPool,
    CudaStream,
    HostStream,
    InlineStream,
    Stream,
)
from fastkv.worker.transfer_manager import (
    DEFAULT_TIMEOUT,
    LayerDoneCounter,
    TransferManager,
)

paddle = paddle_ops.paddle
log = logging.getLogger(__name__)

ResultListener = Callable[[CacheLevel, CacheLevel, int, float, bool], None]
"""`listener(src_level, dst_level, num_blocks, seconds, success)` for each transfer
result the controller reports; `seconds` from launch to the result being collected."""

KV_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "fp8": "uint8"}
_HOST_REGION_ALIGN = 4096


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shapes of one worker's KV cache.

    Raises:
        ValueError: a field is out of range (the message names it).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    dtype: str = "bfloat16"
    num_extra_layers: int = 0

    def __post_init__(self) -> None:
        for name, low in (
            ("num_layers", 1),
            ("num_kv_heads", 1),
            ("head_dim", 1),
            ("block_size", 1),
            ("num_device_blocks", 1),
            ("num_host_blocks", 0),
            ("num_extra_layers", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(KV_DTYPES)}")

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_extra_layers

    @property
    def tensors_per_layer(self) -> int:
        return 4 if self.dtype == "fp8" else 2


@dataclass(frozen=True, slots=True)
class ControllerStats:
    device_to_host_transfers: int
    host_to_device_transfers: int
    device_to_host_blocks: int
    host_to_device_blocks: int
    device_to_host_bytes: int
    host_to_device_bytes: int
    failed_transfers: int
    inflight_transfers: int
    ordering_waits: int
    device_cache_bytes: int
    host_cache_bytes: int
    numa_node: int


class CacheController:
    """Creates the KV cache tensors and the host cache, and executes swaps.

    Args:
        spec: shapes and dtype.
        device: "cpu", or "gpu" / "gpu:N" on a CUDA build of Paddle (needs CuPy).
        num_threads: CPU copy threads per call; 0 = the core's default.
        numa_node: host-cache NUMA node; None finds the GPU's (see fastkv.worker.numa).
        streams: (input, output, compute) streams to use instead of the device's
            own, e.g. instrumented streams in tests. On a GPU the compute stream is
            otherwise the one `submit_swap_tasks` is given, or Paddle's current
            stream on this controller's GPU, looked up at every step.
        fail_rate: fault injection: this fraction of copy calls fail before they
            touch memory (see `fastkv.worker.faults`); 0 in production.

    Raises:
        ValueError: bad device string, or a GPU ordinal the core does not see.
        RuntimeError: a GPU was asked for on a CPU-only Paddle, the core sees no
            usable CUDA device (the message says why: driver, build, devices), or
            initialising the CUDA path failed (out of memory, no kernel image).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        device: str = "cpu",
        num_threads: int = 0,
        numa_node: int | None = None,
        streams: tuple[Stream, Stream, Stream] | None = None,
        fail_rate: float = 0.0,
    ) -> None:
        self.faults = FaultInjector(fail_rate)
        self.spec = spec
        self.num_threads = num_threads
        self.device = device
        gpu_index = _parse_device(device)
        self.gpu_index = gpu_index
        self._layout: core.Layout | None = None
        self._pool: CudaEventPool | None = None
        self._fixed_compute: Stream | None = None
        self._external: dict[int, CudaStream] = {}
        if gpu_index is not None:
            _init_cuda(device, gpu_index)
        self.caches = self._make_device_caches()
        self.block_bytes = [_block_bytes(t) for t in self.caches]
        self._allocate_host(gpu_index, numa_node)
        try:
            if streams is None:
                self._make_streams(gpu_index)
            else:
                self._input, self._output, self._compute = streams
                self._fixed_compute = self._compute
            if gpu_index is not None and spec.num_host_blocks > 0:
                self._layout = self._make_layout(gpu_index)
        except BaseException:
            self._release_gpu()
            self._release_host()
            raise
        self.transfers = TransferManager(
            self._input, self._output, self._compute, spec.total_layers
        )
        self._counter = self.transfers.guard_writes(())
        self._d2h = [0, 0, 0]  # transfers, blocks, bytes
        self._h2d = [0, 0, 0]
        self._failed = 0
        self._freed = False
        self._listeners: list[ResultListener] = []
        self._launched: dict[int, tuple[bool, int, float]] = {}  # id -> (to host, blocks, t)

    # -- tensors --------------------------------------------------------------

    def layer_caches(self, layer: int) -> list[paddle.Tensor]:
        """Layer `layer`'s tensors: [K, V] or, for fp8, [K, V, K scale, V scale]."""
        n = self.spec.tensors_per_layer
        return self.caches[layer * n : (layer + 1) * n]

    @property
    def key_caches(self) -> list[paddle.Tensor]:
        return self.caches[0 :: self.spec.tensors_per_layer]

    @property
    def value_caches(self) -> list[paddle.Tensor]:
        return self.caches[1 :: self.spec.tensors_per_layer]

    def host_blocks(self, tensor_index: int) -> np.ndarray:
        """A zero-copy uint8 view `[num_host_blocks, block_bytes]` of one tensor's
        host region (for checks and the storage tier)."""
        self._check_live()
        nbytes = self.spec.num_host_blocks * self.block_bytes[tensor_index]
        raw = (ctypes.c_uint8 * nbytes).from_address(self.host_ptrs[tensor_index])
        return np.ctypeslib.as_array(raw).reshape(
            self.spec.num_host_blocks, self.block_bytes[tensor_index]
        )

    def device_blocks(self, tensor_index: int) -> np.ndarray:
        """The bytes of one device tensor as `[num_device_blocks, block_bytes]` uint8:
        a zero-copy view on CPU, a copy from a GPU."""
        self._check_live()
        tensor = self.caches[tensor_index]
        shape = (self.spec.num_device_blocks, self.block_bytes[tensor_index])
        if tensor.place.is_cpu_place():
            raw = (ctypes.c_uint8 * (shape[0] * shape[1])).from_address(tensor.data_ptr())
            return np.ctypeslib.as_array(raw).reshape(shape)
        return tensor.numpy().view(np.uint8).reshape(shape)

    # -- swaps ----------------------------------------------------------------

    def submit_swap_tasks(
        self,
        evict_metadata: CacheSwapMetadata | None,
        swap_in_metadata: CacheSwapMetadata | None,
        write_block_ids: Iterable[int] = (),
        compute_stream: int | Stream | None = None,
    ) -> LayerDoneCounter:
        """Start one step's transfers without waiting for them.

        The device-to-host copy (evictions and backups) runs on the output stream,
        fire-and-forget; the host-to-device load runs layer by layer on the input
        stream. Each is ordered after every in-flight copy touching the same blocks
        and after the model's work so far on the step's compute stream.

        Args:
            evict_metadata: DEVICE -> HOST copy, or None.
            swap_in_metadata: HOST -> DEVICE copy, or None.
            write_block_ids: device blocks the model writes this step; the returned
                counter also waits until no in-flight copy still reads them.
            compute_stream: the stream the model runs this step on, as a
                cudaStream_t int or a Stream (GPU); None: the `streams` given at
                construction, else Paddle's current stream on this GPU.

        Returns:
            The step's LayerDoneCounter (also kept for `wait_for_layer`).

        Raises:
            ValueError: wrong levels, ids out of range, duplicate destinations, or a
                transfer id already in flight; nothing is launched.
            CudaCaptureError: the compute stream is capturing a CUDA graph (launch
                transfers outside the captured region); nothing is launched.
        """
        self._check_live()
        writes = list(write_block_ids)
        compute = self._step_compute(compute_stream)
        evict = swap_in = None
        if (
            evict_metadata is not None
            and swap_in_metadata is not None
            and evict_metadata.transfer_id == swap_in_metadata.transfer_id
        ):
            raise ValueError(
                f"transfer_id: {evict_metadata.transfer_id} used by both transfers"
            )
        if evict_metadata is not None:
            evict = self._ids(evict_metadata, CacheLevel.DEVICE, CacheLevel.HOST)
        if swap_in_metadata is not None:
            swap_in = self._ids(swap_in_metadata, CacheLevel.HOST, CacheLevel.DEVICE)
        if evict is not None:
            self._submit_to_host(evict_metadata.transfer_id, *evict, compute)  # type: ignore[union-attr]
        if swap_in is not None:
            self._counter = self._submit_to_device(
                swap_in_metadata.transfer_id,  # type: ignore[union-attr]
                *swap_in,
                writes,
                compute,
            )
        else:
            self._counter = self.transfers.guard_writes(writes, compute)
        return self._counter

    def add_result_listener(self, listener: ResultListener) -> None:
        """Call `listener` for every transfer result reported from now on (metrics)."""
        self._listeners.append(listener)

    def wait_for_layer(self, layer: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """`LayerDoneCounter.wait_for_layer` on the latest step's counter (on a GPU
        a device-side wait of the step's compute stream; on the CPU a host wait)."""
        self._counter.wait_for_layer(layer, timeout)

    def poll_results(self) -> list[TransferResult]:
        """TransferResults of the copies finished since the last call (non-blocking)."""
        return self._count_failures(self.transfers.poll())

    def wait_all(self, timeout: float = DEFAULT_TIMEOUT) -> list[TransferResult]:
        """Wait for every in-flight copy; return the results not yet reported.

        Raises:
            TransferTimeoutError: a copy is still running after `timeout` seconds.
        """
        return self._count_failures(self.transfers.wait_all(timeout))

    # -- lifecycle ------------------------------------------------------------

    def get_stats(self) -> ControllerStats:
        return ControllerStats(
            device_to_host_transfers=self._d2h[0],
            host_to_device_transfers=self._h2d[0],
            device_to_host_blocks=self._d2h[1],
            host_to_device_blocks=self._h2d[1],
            device_to_host_bytes=self._d2h[2],
            host_to_device_bytes=self._h2d[2],
            failed_transfers=self._failed,
            inflight_transfers=self.transfers.num_inflight,
            ordering_waits=self.transfers.ordering_waits,
            device_cache_bytes=sum(self.block_bytes) * self.spec.num_device_blocks,
            host_cache_bytes=self._host_bytes,
            numa_node=self.numa_node,
        )

    def reset_cache(self, timeout: float = DEFAULT_TIMEOUT) -> list[TransferResult]:
        """Wait for in-flight copies, then zero every device and host block.

        Returns:
            The results of the copies that were still in flight.
        """
        results = self.wait_all(timeout)
        for tensor in self.caches:
            tensor.zero_()
        if self._host_bytes:
            ctypes.memset(self._host_base, 0, self._host_bytes)
        return results

    def free_cache(self, timeout: float = DEFAULT_TIMEOUT) -> list[TransferResult]:
        """Wait for in-flight copies, release the host allocation, drop the tensors
        and stop the streams. The controller is unusable afterwards.

        Returns:
            The results of the copies that were still in flight.
        """
        if self._freed:
            return []
        results = self.wait_all(timeout)
        self._release_gpu()
        self._release_host()
        self.caches = []
        for stream in (self._input, self._output):
            if isinstance(stream, HostStream):
                stream.close()
        self._freed = True
        return results

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free_cache()

    # -- internals ------------------------------------------------------------

    def _release_host(self) -> None:
        if self._host_base:
            paddle_ops.host_free(self._host_base, self._host_bytes, self._host_pinned)
            self._host_base = 0

    def _release_gpu(self) -> None:
        """Layout, owned streams and pooled events (after the last copy finished)."""
        if self._layout is not None:
            self._layout.close()
            self._layout = None
        for name in ("_input", "_output"):
            stream = getattr(self, name, None)
            if isinstance(stream, CudaStream):
                stream.close()
        if self._pool is not None:
            self._pool.close()

    def _make_streams(self, gpu_index: int | None) -> None:
        self._input: Stream
        self._output: Stream
        self._compute: Stream
        if gpu_index is None:
            self._input = HostStream("fastkv-h2d")
            self._output = HostStream("fastkv-d2h")
            self._compute = InlineStream()
            self._fixed_compute = self._compute
            return
        # Events for a few steps of per-layer loads, created now rather than on the
        # launch path; the pool grows if an engine keeps more in flight.
        self._pool = CudaEventPool(gpu_index, prefill=2 * self.spec.total_layers + 8)
        # Loads gate the model's next layer: highest priority. Evictions and backups
        # are fire-and-forget: lowest, so they yield to everything else.
        self._input = CudaStream.new(gpu_index, self._pool, priority=1)
        self._output = CudaStream.new(gpu_index, self._pool, priority=-1)
        self._compute = self._external_stream(_paddle_stream_handle(gpu_index))

    def _external_stream(self, handle: int) -> CudaStream:
        stream = self._external.get(handle)
        if stream is None:
            assert self._pool is not None and self.gpu_index is not None
            stream = CudaStream.external(self.gpu_index, handle, self._pool)
            self._external[handle] = stream
        return stream

    def _step_compute(self, compute_stream: int | Stream | None) -> Stream:
        """This step's compute stream; refuses one that is capturing a CUDA graph."""
        if compute_stream is None:
            compute = self._fixed_compute
            if compute is None:
                assert self.gpu_index is not None
                compute = self._external_stream(_paddle_stream_handle(self.gpu_index))
        elif isinstance(compute_stream, int):
            if self.gpu_index is None:
                raise ValueError(
                    f"compute_stream: {compute_stream} is a CUDA stream handle, but the "
                    "cache is on the CPU"
                )
            compute = self._external_stream(compute_stream)
        else:
            compute = compute_stream
        if isinstance(compute, CudaStream) and compute.capturing():
            raise CudaCaptureError(
                f"compute_stream: {compute.handle:#x} is capturing a CUDA graph; submit "
                "swaps before capture or replay, outside the captured region"
            )
        return compute

    def _make_layout(self, gpu_index: int) -> core.Layout:
        segments = [
            (t.data_ptr(), host, block_bytes)
            for t, host, block_bytes in zip(
                self.caches, self.host_ptrs, self.block_bytes, strict=True
            )
        ]
        return core.Layout(
            segments,
            self.spec.tensors_per_layer,
            self.spec.num_device_blocks,
            self.spec.num_host_blocks,
            gpu_index,
        )

    def _make_device_caches(self) -> list[paddle.Tensor]:
        s = self.spec
        place = self.device if self.device != "gpu" else "gpu:0"
        kv_shape = [s.num_device_blocks, s.num_kv_heads, s.block_size, s.head_dim]
        scale_shape = [s.num_device_blocks, s.num_kv_heads]
        dtype = KV_DTYPES[s.dtype]
        caches = []
        for _ in range(s.total_layers):
            caches.append(paddle.zeros(kv_shape, dtype=dtype, device=place))
            caches.append(paddle.zeros(kv_shape, dtype=dtype, device=place))
            if s.dtype == "fp8":
                caches.append(paddle.zeros(scale_shape, dtype="float32", device=place))
                caches.append(paddle.zeros(scale_shape, dtype="float32", device=place))
        return caches

    def _allocate_host(self, gpu_index: int | None, numa_node: int | None) -> None:
        sizes = [_align(self.spec.num_host_blocks * b) for b in self.block_bytes]
        self._host_bytes = sum(sizes)
        self.numa_node = host_numa_node(gpu_index) if numa_node is None else numa_node
        self._host_pinned = gpu_index is not None
        self._host_base = 0
        if self._host_bytes:
            try:
                self._host_base = paddle_ops.host_alloc(
                    self._host_bytes,
                    self.numa_node,
                    pin=self._host_pinned,
                    device=-1 if gpu_index is None else gpu_index,
                )
            except (RuntimeError, ValueError) as e:  # refused, or a node we may not use
                if self.numa_node < 0:
                    raise
                log.warning(
                    "binding the host cache to NUMA node %d failed (%s); unbound",
                    self.numa_node,
                    e,
                )
                self.numa_node = -1
                self._host_base = paddle_ops.host_alloc(
                    self._host_bytes,
                    -1,
                    pin=self._host_pinned,
                    device=-1 if gpu_index is None else gpu_index,
                )
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.host_ptrs = [self._host_base + int(o) for o in offsets]
        self._host_ptrs_tensor = paddle_ops.int64_tensor(np.asarray(self.host_ptrs, np.int64))

    def _ids(
        self, meta: CacheSwapMetadata, src: CacheLevel, dst: CacheLevel
    ) -> tuple[np.ndarray, np.ndarray]:
        """(device ids, host ids) of a transfer, validated before anything runs."""
        if meta.src_level != src or meta.dst_level != dst:
            raise ValueError(
                f"transfer {meta.transfer_id}: expected {src.name}->{dst.name}, got "
                f"{meta.src_level.name}->{meta.dst_level.name}"
            )
        src_ids = np.asarray(meta.src_block_ids, dtype=np.int64)
        dst_ids = np.asarray(meta.dst_block_ids, dtype=np.int64)
        device, host = (src_ids, dst_ids) if src == CacheLevel.DEVICE else (dst_ids, src_ids)
        for name, ids, limit in (
            ("device ids", device, self.spec.num_device_blocks),
            ("host ids", host, self.spec.num_host_blocks),
        ):
            if ids.size and (ids.min() < 0 or ids.max() >= limit):
                bad = ids[(ids < 0) | (ids >= limit)][0]
                raise ValueError(
                    f"transfer {meta.transfer_id}: {name} contain {bad}, outside [0, {limit})"
                )
        unique, counts = np.unique(dst_ids, return_counts=True)
        if unique.size != dst_ids.size:
            raise ValueError(
                f"transfer {meta.transfer_id}: dst_block_ids lists block "
                f"{unique[counts > 1][0]} more than once"
            )
        if self.transfers.is_inflight(meta.transfer_id):
            raise ValueError(f"transfer_id: {meta.transfer_id} is already in flight")
        return device, host

    def _submit_to_host(
        self, transfer_id: int, device: np.ndarray, host: np.ndarray, compute: Stream
    ) -> None:
        layout = self._layout
        if layout is not None:

            def copy(stream: int) -> None:
                layout.swap(device, host, Direction.D2H, stream=stream)

        else:
            device_t = paddle_ops.int64_tensor(device, "device_ids")
            host_t = paddle_ops.int64_tensor(host, "host_ids")

            def copy(stream: int) -> None:
                paddle_ops.swap_all_layers(
                    self.caches,
                    device_t,
                    host_t,
                    self._host_ptrs_tensor,
                    self.spec.num_host_blocks,
                    Direction.D2H,
                    stream,
                    self.num_threads,
                )

        self.transfers.submit_to_host(
            transfer_id, device.tolist(), host.tolist(), self.faults.wrap(copy), compute
        )
        self._account(self._d2h, device.size)
        self._launched[transfer_id] = (True, device.size, time.monotonic())

    def _submit_to_device(
        self,
        transfer_id: int,
        device: np.ndarray,
        host: np.ndarray,
        writes: list[int],
        compute: Stream,
    ) -> LayerDoneCounter:
        layout = self._layout
        copy_layers = None
        if layout is not None:
            # GPU: the ids are validated and staged once, and every layer is
            # launched from this one call, recording the pooled per-layer events.
            def copy_layer(layer: int, stream: int) -> None:
                layout.swap(device, host, Direction.H2D, layer, 1, stream)

            def copy_layers(stream: int, events: ctypes.Array) -> None:  # type: ignore[type-arg]
                layout.swap(device, host, Direction.H2D, 0, None, stream, events)

        else:
            device_t = paddle_ops.int64_tensor(device, "device_ids")
            host_t = paddle_ops.int64_tensor(host, "host_ids")
            per_layer = self.spec.tensors_per_layer

            def copy_layer(layer: int, stream: int) -> None:
                paddle_ops.swap_layer(
                    self.caches,
                    device_t,
                    host_t,
                    self._host_ptrs_tensor,
                    layer,
                    per_layer,
                    self.spec.num_host_blocks,
                    Direction.H2D,
                    stream,
                    self.num_threads,
                )

        counter = self.transfers.submit_to_device(
            transfer_id,
            host.tolist(),
            device.tolist(),
            self.faults.wrap(copy_layer),
            writes,
            compute,
            None if copy_layers is None else self.faults.wrap(copy_layers),
        )
        self._account(self._h2d, device.size)
        self._launched[transfer_id] = (False, device.size, time.monotonic())
        return counter

    def _account(self, counters: list[int], num_blocks: int) -> None:
        counters[0] += 1
        counters[1] += num_blocks
        counters[2] += num_blocks * sum(self.block_bytes)

    def _count_failures(self, results: list[TransferResult]) -> list[TransferResult]:
        self._failed += sum(not r.success for r in results)
        now = time.monotonic()
        for r in results:
            to_host, blocks, launched = self._launched.pop(r.transfer_id, (True, 0, now))
            levels = (CacheLevel.DEVICE, CacheLevel.HOST)
            src, dst = levels if to_host else levels[::-1]
            for listener in self._listeners:
                listener(src, dst, blocks, now - launched, r.success)
        return results

    def _check_live(self) -> None:
        if self._freed:
            raise RuntimeError("the cache was freed (free_cache); create a new controller")


def _parse_device(device: str) -> int | None:
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


def _init_cuda(device: str, gpu_index: int) -> None:
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


def _paddle_stream_handle(gpu_index: int) -> int:
    """cudaStream_t of Paddle's current stream on `gpu_index` (where the model's
    kernels run), whatever device the calling thread has current."""
    stream = paddle.device.cuda.current_stream(gpu_index)
    return int(stream.cuda_stream)


def _block_bytes(tensor: paddle.Tensor) -> int:
    return int(np.prod(tensor.shape[1:])) * tensor.element_size()


def _align(n: int) -> int:
    return (n + _HOST_REGION_ALIGN - 1) // _HOST_REGION_ALIGN * _HOST_REGION_ALIGN


__all__ = ["CacheController", "ControllerStats", "KVCacheSpec"]
