"""The worker's cache controller: owns the KV tensors and the host cache, and runs
the scheduler's swap metadata on them.

Layout. The flat list `caches` is layer-major (model layers, then extra layers),
each layer's tensors together: K0, V0, (K0 scale, V0 scale), K1, ... (see
`KVCacheSpec` for the tensors a controller makes). The host cache is one allocation
per tier, pinned and bound to the GPU's NUMA node on a CUDA machine. Host block b
is one contiguous region of `host_stride` = sum(block_bytes) bytes at
`host_base + b * host_stride`, holding every tensor's block in tensor order with no
padding: tensor i's part is at `host_ptrs[i] + b * host_stride`, host_ptrs[i] =
host_base + sum(block_bytes[:i]). So a host block is exactly the bytes storage
stores for it (one buffer to a backend, not one per tensor).

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
import dataclasses
import logging
import operator
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from fastkv.config import CacheConfig
from fastkv.metadata import (
    CacheLevel,
    CacheSwapMetadata,
    Epoch,
    LookupResult,
    StorageLookup,
    TransferListener,
    TransferResult,
)
from fastkv.ops import core, paddle_ops
from fastkv.ops.core import CudaCaptureError, Direction
from fastkv.storage.base import BlockLayout, StorageBackend
from fastkv.worker.cache_shape import (
    CacheShape,
    KVCacheSpec,
    MemoryPlan,
    adopted_shape,
    check_memory,
    host_block_bytes,
    tensor_block_bytes,
)
from fastkv.worker.device import init_cuda, paddle_stream_handle, parse_device
from fastkv.worker.faults import FaultInjector
from fastkv.worker.numa import host_numa_node
from fastkv.worker.stats import ControllerStats, CopyCounters, StorageCounters
from fastkv.worker.storage_bridge import HostTier, StorageBridge
from fastkv.worker.streams import (
    CopyLayer,
    CopyLayers,
    CudaEventPool,
    CudaStream,
    HostStream,
    InlineStream,
    LayerWaits,
    Stream,
)
from fastkv.worker.transfer_manager import (
    DEFAULT_TIMEOUT,
    LayerDoneCounter,
    TransferManager,
)

paddle = paddle_ops.paddle
log = logging.getLogger(__name__)


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
        config: the scheduler's CacheConfig, checked against `spec`
            (`CacheShape.check_against`); None: not checked.
        storage: the storage tier's backend (`fastkv.storage`), or None; its block
            layout must be this cache's (`storage_layout()`). The controller runs
            storage transfers and lookups on an I/O engine of its own.
        storage_namespace: `StorageNamespace.of(config, model_kv).digest()` of
            this cache (every field that changes a block's bytes); required with
            `storage`.
        tp_rank: this worker's rank: part of every storage key.

    Attributes:
        transfers: the TransferManager ordering this controller's copies, to read
            (tests, an engine adapter that exposes it); never submit to it directly.

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
        config: CacheConfig | None = None,
        storage: StorageBackend | None = None,
        storage_namespace: bytes = b"",
        tp_rank: int = 0,
    ) -> None:
        shape = spec.shape()
        if config is not None:
            shape.check_against(config)
        block_bytes = spec.block_bytes()
        plan = MemoryPlan.of(
            block_bytes, spec.num_device_blocks, spec.num_host_blocks, allocates_device=True
        )
        self.spec: KVCacheSpec | None = spec
        self._start(
            shape,
            plan,
            device,
            lambda: spec.make_tensors(device if device != "gpu" else "gpu:0"),
            num_threads,
            numa_node,
            streams,
            fail_rate,
        )
        self._attach_storage(storage, storage_namespace, tp_rank)

    @classmethod
    def adopt(
        cls,
        caches: Sequence[paddle.Tensor],
        config: CacheConfig,
        *,
        tensors_per_layer: int,
        num_extra_layers: int = 0,
        block_axis: int = 2,
        num_threads: int = 0,
        numa_node: int | None = None,
        streams: tuple[Stream, Stream, Stream] | None = None,
        fail_rate: float = 0.0,
        storage: StorageBackend | None = None,
        storage_namespace: bytes = b"",
        tp_rank: int = 0,
    ) -> CacheController:
        """A controller over KV tensors the engine already made (FastDeploy's
        attention backends create them), with a host tier sized from them.

        Any per-block shape works: a block is one `[b, ...]` slice of a contiguous
        tensor. `caches` is layer-major, `tensors_per_layer` tensors per layer: K, V
        (`[blocks, kv_heads, block_size, head_dim]`); K, V, K scale, V scale for
        block-wise fp8 (uint8 K/V; scales in any float dtype); one latent tensor for
        MLA (`[blocks, 1, block_size, dim]`). The last `num_extra_layers` layers
        (speculative decoding) may have more blocks than the scheduler hands out;
        only ids below `config.num_device_blocks` are ever moved.

        Args:
            caches: the engine's cache tensors, all on one place (CPU or one GPU).
            config: the scheduler's CacheConfig: block size, device and host block
                counts and KV dtype are checked against the tensors.
            tensors_per_layer: tensors per layer, dividing len(caches).
            num_extra_layers: trailing layers allowed more blocks.
            block_axis: the axis of each tensor holding the block's tokens (2 in
                FastDeploy's layouts); tensors without it are not checked for it.
            num_threads, numa_node, streams, fail_rate, storage, storage_namespace,
                tp_rank: as for the constructor.

        Raises:
            ValueError: a tensor that cannot be swapped (not contiguous, another
                place, too few blocks or a block count that disagrees, a block not a
                multiple of 4 bytes, another block size or dtype), a bad count, or
                a host tier larger than the memory available; nothing is allocated.
        """
        caches = list(caches)
        shape, block_bytes, device = adopted_shape(
            caches, config, tensors_per_layer, num_extra_layers, block_axis
        )
        plan = MemoryPlan.of(
            block_bytes,
            config.num_device_blocks,
            config.num_host_blocks,
            allocates_device=False,
        )
        self = cls.__new__(cls)
        self.spec = None
        self._start(
            shape, plan, device, lambda: caches, num_threads, numa_node, streams, fail_rate
        )
        self._attach_storage(storage, storage_namespace, tp_rank)
        return self

    def _start(
        self,
        shape: CacheShape,
        plan: MemoryPlan,
        device: str,
        make_caches: Callable[[], list[paddle.Tensor]],
        num_threads: int,
        numa_node: int | None,
        streams: tuple[Stream, Stream, Stream] | None,
        fail_rate: float,
    ) -> None:
        self.faults = FaultInjector(fail_rate)
        self.shape = shape
        self.num_threads = num_threads
        self.device = device
        gpu_index = parse_device(device)
        self.gpu_index = gpu_index
        check_memory(plan, gpu_index)
        self.memory = plan
        log.info("fastkv cache on %s: %s", device, plan.describe())
        self._layout: core.Layout | None = None
        self._pool: CudaEventPool | None = None
        self._fixed_compute: Stream | None = None
        self._external: dict[int, CudaStream] = {}
        if gpu_index is not None:
            init_cuda(device, gpu_index)
        self.caches = make_caches()
        self.block_bytes = [tensor_block_bytes(t) for t in self.caches]
        # The ops see every tensor with exactly the block ids the scheduler hands out
        # (extra layers may hold more): a leading slice is a contiguous view.
        n = shape.num_device_blocks
        self._op_caches = [t if t.shape[0] == n else t[:n] for t in self.caches]
        self._allocate_host(gpu_index, numa_node)
        try:
            if streams is None:
                self._make_streams(gpu_index)
            else:
                self._input, self._output, self._compute = streams
                self._fixed_compute = self._compute
            if gpu_index is not None and shape.num_host_blocks > 0:
                self._layout = self._make_layout(gpu_index)
        except BaseException:
            self._release_gpu()
            self._release_host()
            raise
        self.transfers = TransferManager(
            self._input, self._output, self._compute, shape.num_layers
        )
        self._counter = self.transfers.guard_writes(())
        self._d2h = CopyCounters()
        self._h2d = CopyCounters()
        self._failed = 0
        self._freed = False
        self._listeners: list[TransferListener] = []
        self._launched: dict[int, tuple[bool, int, float]] = {}  # id -> (to host, blocks, t)
        self._epochs: dict[int, Epoch] = {}  # id -> its metadata's epoch, where not 0

    # -- tensors --------------------------------------------------------------

    def layer_caches(self, layer: int) -> list[paddle.Tensor]:
        """Layer `layer`'s tensors: [K, V] or, for fp8, [K, V, K scale, V scale]."""
        n = self.shape.tensors_per_layer
        return self.caches[layer * n : (layer + 1) * n]

    @property
    def key_caches(self) -> list[paddle.Tensor]:
        return self.caches[0 :: self.shape.tensors_per_layer]

    @property
    def value_caches(self) -> list[paddle.Tensor]:
        return self.caches[1 :: self.shape.tensors_per_layer]

    def host_tier(self) -> np.ndarray:
        """A zero-copy uint8 view `[num_host_blocks, host_stride]` of the host tier:
        row b is host block b, every tensor's block in tensor order."""
        self._check_live()
        n, stride = self.shape.num_host_blocks, self.host_stride
        raw = (ctypes.c_uint8 * (n * stride)).from_address(self._host_base)
        return np.ctypeslib.as_array(raw).reshape(n, stride)

    def host_blocks(self, tensor_index: int) -> np.ndarray:
        """A zero-copy (strided) uint8 view `[num_host_blocks, block_bytes]` of one
        tensor's part of every host block (for checks and the storage tier)."""
        start = self.host_ptrs[tensor_index] - self._host_base
        return self.host_tier()[:, start : start + self.block_bytes[tensor_index]]

    def device_blocks(self, tensor_index: int) -> np.ndarray:
        """The bytes of one device tensor as `[num_device_blocks, block_bytes]` uint8:
        a zero-copy view on CPU, a copy from a GPU."""
        self._check_live()
        tensor = self.caches[tensor_index]
        shape = (self.shape.num_device_blocks, self.block_bytes[tensor_index])
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
        fire-and-forget; the host-to-device load runs on the input stream. Both run
        layer by layer, each layer ordered after the same layer of every in-flight
        copy touching the same blocks, and after the model's work so far on the
        step's compute stream.

        The model's work queued after this call is ordered after every in-flight
        read of a block handed to a new owner (`reused_block_ids` of this or an
        earlier eviction still running): device-side on a GPU, the host goes on; on
        the CPU stand-in this call returns once those reads are done. So the model
        may write its new blocks at once, with or without `write_block_ids`.

        Args:
            evict_metadata: DEVICE -> HOST copy, or None.
            swap_in_metadata: HOST -> DEVICE copy, or None.
            write_block_ids: device blocks the model writes this step, beyond the
                handed-over ones ordered anyway: the counter's wait for layer L
                also waits until no in-flight copy still reads them at layer L
                (write layer L after waiting for it).
            compute_stream: the stream the model runs this step on, as a
                cudaStream_t int or a Stream (GPU); None: the `streams` given at
                construction, else Paddle's current stream on this GPU.

        Returns:
            The step's LayerDoneCounter (also kept for `wait_for_layer`).

        Raises:
            ValueError: wrong levels, ids (or `write_block_ids`) out of range,
                duplicate destinations, or a transfer id already in flight; nothing
                is launched.
            CudaCaptureError: the compute stream is capturing a CUDA graph (launch
                transfers outside the captured region); nothing is launched.
        """
        self._check_live()
        writes = self._write_ids(write_block_ids)
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
            # Layer by layer only where something will write its blocks while it
            # reads them (a new owner, or this step's load); else one launch.
            per_layer = bool(len(evict_metadata.reused_block_ids)) or (  # type: ignore[union-attr]
                swap_in is not None and bool(np.intersect1d(evict[0], swap_in[0]).size)
            )
            self._submit_to_host(
                evict_metadata.transfer_id,  # type: ignore[union-attr]
                *evict,
                compute,
                evict_metadata.reused_block_ids,  # type: ignore[union-attr]
                per_layer,
                evict_metadata.epoch,  # type: ignore[union-attr]
            )
        if swap_in is not None:
            self._counter = self._submit_to_device(
                swap_in_metadata.transfer_id,  # type: ignore[union-attr]
                *swap_in,
                writes,
                compute,
                swap_in_metadata.epoch,  # type: ignore[union-attr]
            )
        else:
            self._counter = self.transfers.guard_writes(writes, compute)
        # Last, after the loads took the compute stream's work so far: the model's
        # writes wait for every in-flight read of a block handed to a new owner.
        self.transfers.order_compute(compute)
        return self._counter

    def add_transfer_listener(self, listener: TransferListener) -> None:
        """Call `listener` for every copy result collected from now on (metrics):
        `listener(src_level, dst_level, num_blocks, seconds since launch, success)`,
        as the scheduler's `CacheManager.add_transfer_listener` does for results it
        applies.

        Raises:
            ValueError: `listener` is not callable.
        """
        if not callable(listener):
            raise ValueError(f"listener: expected a callable, got {listener!r}")
        self._listeners.append(listener)

    def is_inflight(self, transfer_id: int) -> bool:
        """Whether the device/host copy `transfer_id` was launched and its result is
        not yet collected (`poll_results`, `wait_all`): it still reads or writes its
        blocks, or its result waits to be reported."""
        return self.transfers.is_inflight(transfer_id)

    @property
    def host_memory(self) -> tuple[int, int]:
        """(address, bytes) of the host tier's one allocation, e.g. to register it
        once with Mooncake Store for zero-copy transfers."""
        return self._host_base, self._host_bytes

    def storage_layout(self) -> BlockLayout:
        """A block as it sits in the host tier: one segment per cache tensor (the
        layout a storage backend for this cache must have)."""
        return BlockLayout(tuple(self.block_bytes))

    def submit_storage_tasks(
        self,
        load: CacheSwapMetadata | None,
        store: CacheSwapMetadata | None,
        lookups: Sequence[StorageLookup] = (),
    ) -> None:
        """Start the step's storage work on the I/O engine's threads (never waits):
        lookups first, then loads (STORAGE -> HOST), then writes (HOST -> STORAGE).

        Results come with `poll_results` / `wait_all`: a TransferResult per
        transfer (`failed_blocks` names the blocks that failed) and a LookupResult
        per lookup (the leading blocks this rank's storage holds). A transfer's
        result is reported only once no I/O touches its host blocks any more, even
        after its deadline (the scheduler then reuses them safely).

        Raises:
            ValueError: no storage tier, wrong levels, host ids out of range, keys
                that are not 32-byte block hashes, an id already in flight, or host
                blocks the load and the write (or an outstanding request) both
                touch; nothing is started.
        """
        self._check_live()
        if self._storage is None:
            if load is None and store is None and not lookups:
                return
            raise ValueError("storage: this controller has no storage tier")
        self._storage.submit(load, store, lookups)

    def wait_for_layer(self, layer: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """`LayerDoneCounter.wait_for_layer` on the latest step's counter (on a GPU
        a device-side wait of the step's compute stream; on the CPU a host wait).

        Inside a CUDA graph capture of the compute stream it waits for nothing when
        the layer is known to be loaded, and raises CudaCaptureError (touching
        nothing) when it is not. Every other call into CUDA (`poll_results`, event
        checks, a dropped event) is safe beside a capture in any mode.
        """
        self._counter.wait_for_layer(layer, timeout)

    def poll_results(self) -> list[TransferResult | LookupResult]:
        """Results of the copies, storage transfers and lookups finished since the
        last call (non-blocking)."""
        results: list[TransferResult | LookupResult] = []
        results += self._count_failures(self.transfers.poll())
        if self._storage is not None:
            results += self._storage.poll()
        return results

    def wait_all(self, timeout: float = DEFAULT_TIMEOUT) -> list[TransferResult | LookupResult]:
        """Wait for every in-flight copy and storage request (each bounded by its own
        deadline); return the results not yet reported.

        Raises:
            TransferTimeoutError: a copy is still running after `timeout` seconds.
        """
        end = time.monotonic() + timeout
        results: list[TransferResult | LookupResult] = []
        results += self._count_failures(self.transfers.wait_all(timeout))
        if self._storage is not None:
            results += self._storage.wait_all(max(0.0, end - time.monotonic()))
        return results

    # -- lifecycle ------------------------------------------------------------

    def get_stats(self) -> ControllerStats:
        return ControllerStats(
            device_to_host_transfers=self._d2h.transfers,
            host_to_device_transfers=self._h2d.transfers,
            device_to_host_blocks=self._d2h.blocks,
            host_to_device_blocks=self._h2d.blocks,
            device_to_host_bytes=self._d2h.nbytes,
            host_to_device_bytes=self._h2d.nbytes,
            failed_transfers=self._failed + self._storage_counts.failed_transfers,
            inflight_transfers=self.transfers.num_inflight,
            ordering_waits=self.transfers.ordering_waits,
            device_cache_bytes=sum(self.block_bytes) * self.shape.num_device_blocks,
            host_cache_bytes=self._host_bytes,
            numa_node=self.numa_node,
            storage_blocks_read=self._storage_counts.blocks_read,
            storage_blocks_written=self._storage_counts.blocks_written,
        )

    def reset_cache(
        self, timeout: float = DEFAULT_TIMEOUT
    ) -> list[TransferResult | LookupResult]:
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

    def free_cache(
        self, timeout: float = DEFAULT_TIMEOUT
    ) -> list[TransferResult | LookupResult]:
        """Wait for in-flight copies, release the host allocation, drop the tensors
        and stop the streams. The controller is unusable afterwards.

        A storage read or write stuck in its backend past `timeout` may still write
        into the host tier when it returns: then the host allocation is left
        mapped (and logged) rather than freed under it.

        On a GPU, releasing the device side ends in a cudaFree, which waits for
        all work on the device (the engine's included): it is bounded by what is
        left of `timeout` (at least 1 s); past that it is logged, says what it waits
        for, and finishes in the background.

        Raises:
            TransferTimeoutError: a copy of this controller is still running after
                `timeout` seconds; nothing is released (call again, or let it go:
                a dropped layout never blocks the garbage collector).

        Returns:
            The results of the copies and storage requests still in flight.
        """
        if self._freed:
            return []
        end = time.monotonic() + timeout
        results: list[TransferResult | LookupResult] = list(self.wait_all(timeout))
        bridge = self._storage
        stuck: frozenset[int] = frozenset()
        if bridge is not None:
            results += bridge.close(timeout)
            stuck = bridge.busy_host_blocks()
            self._storage = None
        self._release_gpu(max(1.0, end - time.monotonic()))
        if stuck:
            log.error(
                "free_cache: storage I/O still touches host blocks %s after %.1f s; "
                "leaving the host tier's %d bytes mapped so it cannot write into freed memory",
                sorted(stuck)[:8],
                timeout,
                self._host_bytes,
            )
            self._host_base = 0
        self._release_host()
        self.caches = []
        self._op_caches = []
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

    def _release_gpu(self, timeout: float = core.CLOSE_TIMEOUT_S) -> None:
        """Layout, owned streams and pooled events (after the last copy finished).

        The layout's release is a cudaFree, which waits for the whole device (the
        engine's streams too): it is bounded by `timeout` and, past it, logged and
        left to finish in the background (see `core.Layout.close`)."""
        if self._layout is not None:
            self._layout.close(timeout)
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
        # Events for a few steps of per-layer loads and evictions, created now
        # rather than on the launch path; the pool grows only if an engine keeps
        # more alive at once (a dropped event goes back at once, see streams).
        self._pool = CudaEventPool(gpu_index, prefill=4 * self.shape.num_layers + 16)
        # Loads gate the model's next layer: highest priority. Evictions and backups
        # are fire-and-forget: lowest, so they yield to everything else.
        self._input = CudaStream.new(gpu_index, self._pool, priority=1)
        self._output = CudaStream.new(gpu_index, self._pool, priority=-1)
        self._compute = self._external_stream(paddle_stream_handle(gpu_index))

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
                compute = self._external_stream(paddle_stream_handle(self.gpu_index))
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
            (t.data_ptr(), host, block_bytes, self.host_stride)
            for t, host, block_bytes in zip(
                self.caches, self.host_ptrs, self.block_bytes, strict=True
            )
        ]
        return core.Layout(
            segments,
            self.shape.tensors_per_layer,
            self.shape.num_device_blocks,
            self.shape.num_host_blocks,
            gpu_index,
        )

    def _allocate_host(self, gpu_index: int | None, numa_node: int | None) -> None:
        self.host_stride = host_block_bytes(self.block_bytes)
        self._host_bytes = self.host_stride * self.shape.num_host_blocks
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
        offsets = np.concatenate([[0], np.cumsum(self.block_bytes)[:-1]]).astype(np.int64)
        self.host_ptrs = [self._host_base + int(o) for o in offsets]
        self._host_ptrs_tensor = paddle_ops.int64_tensor(np.asarray(self.host_ptrs, np.int64))

    def _write_ids(self, write_block_ids: Iterable[int]) -> list[int]:
        """The step's written device blocks, checked before anything is launched (a
        bad id found after the eviction started would leave it running unreported)."""
        limit = self.shape.num_device_blocks
        writes = []
        for i, block in enumerate(write_block_ids):
            try:
                block = operator.index(block)
            except TypeError:
                raise ValueError(
                    f"write_block_ids[{i}]: expected a device block id, got {block!r}"
                ) from None
            if not 0 <= block < limit:
                raise ValueError(f"write_block_ids[{i}]: {block} is outside [0, {limit})")
            writes.append(block)
        return writes

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
            ("device ids", device, self.shape.num_device_blocks),
            ("host ids", host, self.shape.num_host_blocks),
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
        self,
        transfer_id: int,
        device: np.ndarray,
        host: np.ndarray,
        compute: Stream,
        reused: Sequence[int] = (),
        per_layer: bool = True,
        epoch: int = 0,
    ) -> None:
        copy_layer, copy_layers = self._layer_copies(device, host, Direction.D2H)
        copy_all = None if per_layer else self.faults.wrap(self._all_layers_copy(device, host))
        # Fault injection counts one copy call per eviction, whether its layers go
        # one by one (CPU, or ordered per layer) or in one native call.
        inject = self.faults.wrap(_no_op)

        def copy_first_checked(layer: int, stream: int) -> None:
            if layer == 0:
                inject()
            copy_layer(layer, stream)

        self.transfers.submit_to_host(
            transfer_id,
            device.tolist(),
            host.tolist(),
            copy_first_checked,
            compute,
            None if copy_layers is None else self.faults.wrap(copy_layers),
            list(reused),
            copy_all,
        )
        self._d2h.add(device.size, sum(self.block_bytes))
        self._launched[transfer_id] = (True, device.size, time.monotonic())
        if epoch:  # echoed in its result
            self._epochs[transfer_id] = Epoch(epoch)

    def _submit_to_device(
        self,
        transfer_id: int,
        device: np.ndarray,
        host: np.ndarray,
        writes: list[int],
        compute: Stream,
        epoch: int = 0,
    ) -> LayerDoneCounter:
        copy_layer, copy_layers = self._layer_copies(device, host, Direction.H2D)
        counter = self.transfers.submit_to_device(
            transfer_id,
            host.tolist(),
            device.tolist(),
            self.faults.wrap(copy_layer),
            writes,
            compute,
            None if copy_layers is None else self.faults.wrap(copy_layers),
        )
        self._h2d.add(device.size, sum(self.block_bytes))
        self._launched[transfer_id] = (False, device.size, time.monotonic())
        if epoch:  # echoed in its result
            self._epochs[transfer_id] = Epoch(epoch)
        return counter

    def _all_layers_copy(self, device: np.ndarray, host: np.ndarray) -> Callable[[int], None]:
        """A device-to-host copy of every layer in one call: on a GPU one kernel
        launch per staged slot of ids over the whole segment table."""
        layout = self._layout
        if layout is not None:

            def copy_gpu(stream: int) -> None:
                layout.swap(device, host, Direction.D2H, 0, None, stream)

            return copy_gpu
        device_t = paddle_ops.int64_tensor(device, "device_ids")
        host_t = paddle_ops.int64_tensor(host, "host_ids")

        def copy_cpu(stream: int) -> None:
            paddle_ops.swap_all_layers(
                self._op_caches,
                device_t,
                host_t,
                self._host_ptrs_tensor,
                self.shape.num_host_blocks,
                Direction.D2H,
                stream,
                self.num_threads,
                host_stride=self.host_stride,
            )

        return copy_cpu

    def _layer_copies(
        self, device: np.ndarray, host: np.ndarray, direction: Direction
    ) -> tuple[CopyLayer, CopyLayers | None]:
        """(copy one layer, copy every layer in one native call or None) of a
        transfer, in either direction."""
        layout = self._layout
        if layout is not None:
            # GPU: the ids are validated and staged once, and every layer is
            # launched from this one call, recording the pooled per-layer events.
            def copy_layer(layer: int, stream: int) -> None:
                layout.swap(device, host, direction, layer, 1, stream)

            def copy_layers(
                stream: int,
                events: ctypes.Array,  # type: ignore[type-arg]
                waits: LayerWaits | None = None,
            ) -> None:
                # waits: a load ordered per layer after a same-step eviction,
                # still one call (one validation, one staging of the ids).
                handles, per_layer = (None, 0) if waits is None else waits.astuple()
                layout.swap(
                    device, host, direction, 0, None, stream, events, 0, handles, per_layer
                )

            return copy_layer, copy_layers
        device_t = paddle_ops.int64_tensor(device, "device_ids")
        host_t = paddle_ops.int64_tensor(host, "host_ids")
        per_layer = self.shape.tensors_per_layer

        def copy_one(layer: int, stream: int) -> None:
            paddle_ops.swap_layer(
                self._op_caches,
                device_t,
                host_t,
                self._host_ptrs_tensor,
                layer,
                per_layer,
                self.shape.num_host_blocks,
                direction,
                stream,
                self.num_threads,
                host_stride=self.host_stride,
            )

        return copy_one, None

    def _attach_storage(
        self, storage: StorageBackend | None, namespace: bytes, tp_rank: int
    ) -> None:
        self._storage: StorageBridge | None = None
        self._storage_counts = StorageCounters()
        if storage is None:
            return
        host = HostTier(self._host_base, tuple(self.block_bytes), self.shape.num_host_blocks)
        try:
            self._storage = StorageBridge.open(storage, host, namespace, tp_rank)
        except BaseException:
            self.free_cache()
            raise
        self._storage_counts = self._storage.counts  # kept after free_cache

    def _count_failures(self, results: list[TransferResult]) -> list[TransferResult]:
        if self._epochs:  # each result carries its metadata's epoch
            epochs = self._epochs
            results = [
                dataclasses.replace(r, epoch=epochs.pop(r.transfer_id))
                if r.transfer_id in epochs
                else r
                for r in results
            ]
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


def _no_op() -> None:
    pass


__all__ = ["CacheController"]
