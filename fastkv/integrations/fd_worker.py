"""FastDeploy's worker-side cache controller, on fastkv's CacheController.

`FastDeployCacheController(fd_config, local_rank, device_id)` has the methods
FastDeploy's model runner calls: `initialize_kv_cache(attn_backend, num_gpu_blocks)`
makes the KV tensors through the attention backend (as v1 does) and adopts them,
with a host tier sized from them; `submit_swap_tasks(evict, swap_in)` runs the
step's merged metadata, which BatchRequest built from fastkv's tagged transfers.

Per step:
- the merged metadata of each direction becomes one fastkv transfer with a
  worker-local id, mapped back to the scheduler transfers it holds (by their
  `hash_values` tags); each scheduler transfer gets that copy's result;
- the model's writes are ordered after the reads of every eviction still in flight
  (the step's own included): with FastDeploy's synchronous allocation a block being
  evicted is already the allocating request's. The step's eviction is marked as
  handed over, and the controller makes the compute stream wait for those reads at
  submission (device-side on a GPU), whatever the runner does;
- results go to the scheduler over the results channel: at every submission, when
  the last layer's wait returns or a layer's wait fails, at `finish_step`, and from
  a reporter thread every `report_interval_s` (so evictions that end while the
  engine idles are still reported).

The one runner change fastkv needs: `wait_for_layer(L)` raises `SwapInFailedError`
when the step's swap-in failed at or before layer L (on a GPU also check
`finish_step()`'s return, which knows failures found after the launch). The runner
finishes the step for the other requests; for those whose block tables contain
`error.device_block_ids` it drops the sampled token and resets the slot as for a
preempted request. The scheduler rewinds them to the first failed block and sends
a prefill task from there.
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

from fastkv.channel import ResultsSender
from fastkv.config import as_int, check_int
from fastkv.integrations import fd_config as fdc
from fastkv.integrations import fd_pd_tasks as pd_tasks
from fastkv.integrations.fd_backend import LayerTensors, make_layers
from fastkv.integrations.fd_routes import ResultRoutes
from fastkv.integrations.fd_step import (
    StepHooks,
    StepLauncher,
    StepLayerCounter,
    SwapInFailedError,
    SwapInRetry,
)
from fastkv.integrations.fd_transfers import (
    EVICT,
    IDLE_EVICT,
    parse_merged,
    split_storage,
    step_epoch,
    tagged_ids,
)
from fastkv.integrations.fd_worker_storage import fail_storage, open_storage, submit_storage
from fastkv.metadata import LookupResult, TransferResult
from fastkv.worker.transfer_manager import DEFAULT_TIMEOUT

log = logging.getLogger(__name__)

DEFAULT_SWAP_IN_RETRIES = 8
FREE_FLUSH_S = 2.0  # free_gpu_cache waits this long at most for the scheduler's acks
"""Copies of a failed swap-in at most, inside the layer's wait (see `swap_in_retries`)."""


class FastDeployCacheController:
    """Drop-in for `fastdeploy.cache_manager.v1.CacheController`: the runner's
    calls, locked here; the cache's tensors and lifecycle here, the rest in rooms.

        FastDeployCacheController
          ├ controller    fastkv's CacheController, once the cache exists
          ├ _launcher     StepLauncher (fd_step): a step's launch or refusal, the
          │               StepLayerCounter the runner waits on
          ├ _retry        SwapInRetry (fd_step): a failed swap-in copied again
          ├ _routes       ResultRoutes (fd_routes): local ids -> scheduler ids,
          │               held-back failures, the results sender
          └ storage       fd_worker_storage: the rank's disk backend, storage work

    Args:
        fd_config: FastDeploy's FDConfig (see `fd_config` for the fields read).
        local_rank: this worker's rank; its tensor-parallel rank is
            `local_rank % tensor_parallel_size`.
        device_id: the GPU this worker's tensors live on (for names; the tensors'
            place decides where copies run).
        channel_name: the results channel; default `results_channel_name(fd_config)`.
        fail_rate: fault injection (a fraction of copies fail); 0 in production.
        report_interval_s: how often the reporter thread sends finished results
            (a finite number of seconds >= 0; a bool is refused); 0 disables it
            (results then go at the runner's calls only).
        block_axis: the axis of each KV tensor holding a block's tokens (2 for
            FastDeploy's `[blocks, heads, block_size, dim]`).
        swap_in_retries: how many times at most a failed swap-in is copied again
            (every layer), within the runner's wait timeout, before that wait
            raises; 0 raises at once. Default 8: a copy failure that is not
            permanent must not reach FastDeploy's unmodified runner, which dies
            of it (the host copy is intact, so copying again is always right).

    Raises:
        ValueError: a bad setting (the message names it).
    """

    def __init__(
        self,
        fd_config: Any,
        local_rank: int,
        device_id: int,
        *,
        channel_name: str | None = None,
        fail_rate: float = 0.0,
        report_interval_s: float = 0.05,
        block_axis: int = 2,
        swap_in_retries: int = DEFAULT_SWAP_IN_RETRIES,
    ) -> None:
        local_rank = as_int("local_rank", local_rank, 0)
        device_id = as_int("device_id", device_id, 0)
        report_interval_s = fdc.as_seconds("report_interval_s", report_interval_s)
        self.fd_config = fd_config
        self.local_rank = local_rank
        self.device_id = device_id
        self.tp_size = fdc.tensor_parallel_size(fd_config)
        self.rank = local_rank % self.tp_size
        num_layers = getattr(
            getattr(fd_config, "model_config", None), "num_hidden_layers", None
        )
        check_int("fd_config.model_config.num_hidden_layers", num_layers, 1)
        self._num_layers = num_layers
        check_int("swap_in_retries", swap_in_retries, 0)
        self.swap_in_retries = swap_in_retries
        self.fail_rate = fail_rate
        self.block_axis = block_axis
        self.report_interval_s = report_interval_s
        name = channel_name if channel_name is not None else fdc.results_channel_name(fd_config)
        self._routes = ResultRoutes(ResultsSender(name, self.rank))
        hooks = StepHooks(recover=self._recover, report=self.report_results)
        self._launcher = StepLauncher(
            self._routes, hooks, num_layers=num_layers, rank=self.rank
        )
        self._retry = SwapInRetry(self._routes, rank=self.rank)
        self.controller: Any = None  # fastkv CacheController, once caches exist
        self.cache_kvs_map: dict[str, Any] = {}
        self._caches: list[Any] = []
        self._tensors_per_layer = 0
        self._num_gpu_blocks = 0
        self._storage_dir = fdc.storage_target(fd_config, self.rank)
        self._storage_backend: Any = None  # fastkv's disk or Mooncake backend
        self.swap_layer_done_counter: StepLayerCounter | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        self.pd: Any = None  # fd_pd_worker.PDWorker, once attach_pd
        self._pd_next = {"batch": 0, "drain": 0}  # PD tasks run per route (fd_pd_tasks)

    @property
    def sender(self) -> ResultsSender:
        """This rank's results sender (a new one once a cache is made again after
        `free_cache` closed it)."""
        return self._routes.sender

    # -- caches -----------------------------------------------------------------

    def initialize_kv_cache(self, attn_backend: Any, num_gpu_blocks: int) -> list[Any]:
        """Make every model layer's cache tensors through `attn_backend` (either API,
        see `fd_backend`), adopt them and allocate the host tier.

        Returns:
            The flat list FastDeploy's attention indexes (layer-major; per layer K,
            V, K scale, V scale, those the model has).

        Raises:
            RuntimeError: a cache exists (free_gpu_cache first).
            ValueError: a backend of neither API, tensors fastkv cannot swap, or
                counts that disagree with the scheduler's config (the message says
                which); nothing is kept.
        """
        with self._lock:
            if self.controller is not None:
                raise RuntimeError(
                    "initialize_kv_cache: the cache exists; free_gpu_cache first"
                )
            num_gpu_blocks = as_int("num_gpu_blocks", num_gpu_blocks, 1)
            made = self._make(attn_backend, num_gpu_blocks, 0, self._num_layers)
            self._num_gpu_blocks = num_gpu_blocks
            self._adopt(made.tensors, made.per_layer, 0)
            self.cache_kvs_map.clear()
            self.cache_kvs_map.update(zip(made.names, made.tensors, strict=True))
            return list(made.tensors)

    def initialize_mtp_kv_cache(
        self, attn_backend: Any, num_gpu_blocks: int, num_mtp_layers: int, layer_offset: int
    ) -> list[Any]:
        """Make the speculative (MTP) layers' tensors; they move with their blocks
        like every other layer (block ids below the main cache's count). Call it
        right after `initialize_kv_cache`, before any swap.

        Returns:
            The MTP layers' tensors, flat.

        Raises:
            RuntimeError: no main cache yet, or swaps already ran.
            ValueError: as for `initialize_kv_cache`; the main cache is kept.
        """
        with self._lock:
            ctrl = self._require()
            num_gpu_blocks = as_int("num_gpu_blocks", num_gpu_blocks, 1)
            num_mtp_layers = as_int("num_mtp_layers", num_mtp_layers, 1)
            layer_offset = as_int("layer_offset", layer_offset, 0)
            stats = ctrl.get_stats()
            if stats.device_to_host_transfers or stats.host_to_device_transfers:
                raise RuntimeError("initialize_mtp_kv_cache: swaps already ran on this cache")
            made = self._make(attn_backend, num_gpu_blocks, layer_offset, num_mtp_layers)
            if made.per_layer != self._tensors_per_layer:
                raise ValueError(
                    f"attn_backend: MTP layers have {made.per_layer} tensors each, the "
                    f"model's {self._tensors_per_layer}"
                )
            main = self._caches
            self._routes.forward(
                ctrl.free_cache()
            )  # the host tier is re-sized for the extra layers
            self.controller = None
            try:
                self._adopt([*main, *made.tensors], made.per_layer, num_mtp_layers)
            except Exception:
                # Refused (e.g. the MTP tensors' dtype): the main cache gets its
                # controller and host tier back (no swap ran, so nothing is lost).
                self._adopt(main, made.per_layer, 0)
                raise
            self.cache_kvs_map.update(zip(made.names, made.tensors, strict=True))
            return list(made.tensors)

    def get_kv_caches(self) -> dict[str, Any]:
        """FastDeploy's name -> tensor dict of every cache tensor (the runner's
        `cache_kvs_map`); the same dict object, emptied by `free_gpu_cache`."""
        return self.cache_kvs_map

    def get_host_cache_kvs_map(self) -> dict[str, int]:
        """Cache tensor name -> address of its host-tier region; empty before the
        cache exists or without a host tier (as FastDeploy's)."""
        with self._lock:
            ctrl = self.controller
            if ctrl is None or not ctrl.shape.num_host_blocks:
                return {}
            return dict(zip(self.cache_kvs_map, ctrl.host_ptrs, strict=True))

    @property
    def transfer_manager(self) -> Any:
        """FastDeploy's name for what orders the copies: the controller's
        TransferManager (read-only)."""
        return self._require().transfers

    # -- per step ---------------------------------------------------------------

    def submit_swap_tasks(
        self,
        evict_metadata: Any | None,
        swap_in_metadata: Any | None,
        compute_stream: Any | None = None,
    ) -> StepLayerCounter | None:
        """Start the step's merged eviction and swap-in.

        Args:
            evict_metadata: the batch's device-to-host metadata, or None.
            swap_in_metadata: the batch's host-to-device metadata, or None.
            compute_stream: the model's stream this step (GPU; default Paddle's
                current stream on this device).

        Returns:
            The swap-in's counter (also `swap_layer_done_counter`), or None when the
            step loads nothing. A swap-in the controller refuses (ids out of range),
            or any step before the cache exists, is reported failed, and its counter
            raises at every wait (FastDeploy's controller does not raise there
            either).

        Raises:
            ValueError: metadata fastkv's scheduler did not make (wrong levels,
                lists of different lengths, untagged hashes, tags of two cache
                epochs); nothing is launched, and every transfer and lookup of
                fastkv's merged into the batch is reported failed (lookups with no
                hits; each in the epoch its tag names), so none stays reserved.

        Every result carries the cache epoch of the tags it answers (see
        `fd_transfers`): a scheduler of a later epoch drops it.
        """
        with self._lock:
            try:  # the whole batch is checked before any of it runs
                evict_metadata_rest, pd_work, pd_next = self._split_pd(evict_metadata, "batch")
                evict_rest, work = split_storage(evict_metadata_rest)
                evict = parse_merged(evict_rest, "device", "host")
                swap = parse_merged(swap_in_metadata, "host", "device")
                step_epoch(evict, swap, work)  # one epoch, stamped on every result
            except ValueError as e:
                self._refuse_batch((evict_metadata, swap_in_metadata), e)
                raise
            self._routes.settle_held()
            if pd_work:  # before the step's layers: a send starts before they are written
                self._pd_next["batch"] = pd_next
                self.pd.run_tasks(pd_work)
            if self.controller is None:
                fail_storage(self._routes, work, "the KV cache is not initialized")
                counter = self._launcher.refuse(evict, swap, "the KV cache is not initialized")
            else:
                self._report()
                submit_storage(self.controller, self._routes, work, self.rank)
                counter = self._launcher.launch(self.controller, evict, swap, compute_stream)
            self.swap_layer_done_counter = counter
            return counter

    def _refuse_batch(self, metas: tuple[Any, ...], error: ValueError) -> None:
        """A step's batch that cannot run: fail every fastkv id tagged in it (the
        valid transfers merged with a foreign entry included), none launched; each
        in the epoch its tag names."""
        copies: dict[tuple[int, int], None] = {}
        lookups: dict[tuple[int, int], None] = {}
        for meta in metas:
            copy_ids, storage_ids, lookup_ids = tagged_ids(meta)
            copies.update(dict.fromkeys(copy_ids + storage_ids))
            lookups.update(dict.fromkeys(lookup_ids))
        why = f"not launched: the step's batch was refused: {error}"
        log.error("fastkv rank %d: %s", self.rank, why)
        self._routes.send(
            [TransferResult(t, False, why, epoch=e) for t, e in copies]
            + [LookupResult(q, 0, epoch=e) for q, e in lookups]
        )

    def prefetch_from_storage(self, metadata: Any) -> None:
        """Start one storage task the scheduler's `drain_pending_prefetches` gave
        the engine (upstream's worker call, over the engine-worker queue; no step
        needed): a lookup (`direction="lookup"`) or loads into host blocks
        (`"load"`). Never waits: the answer and each block's result go to the
        scheduler over the results channel, combined there over ranks. Before the
        cache exists the task is reported failed.

        Args:
            metadata: a `StorageMetadata` of fastkv's scheduler (tagged
                `hash_values`, host `block_ids`, -1 for a lookup).

        Raises:
            ValueError: a direction other than load or lookup, lists of different
                lengths, or entries fastkv's scheduler did not tag (nothing starts).
        """
        direction = getattr(metadata, "direction", None)
        if direction == pd_tasks.PD_DIRECTION:
            with self._lock:
                rest, work, pd_next = self._split_pd(metadata, "drain")
                if rest is not None:
                    raise ValueError(
                        "metadata.hash_values: a PD task list with other entries; was "
                        "this task made by fastkv's cache manager?"
                    )
                if work:
                    self._pd_next["drain"] = pd_next
                    self.pd.run_tasks(work)
            return
        if direction == IDLE_EVICT:  # the copies no batch carried (engine idle)
            extra = getattr(metadata, "extra_params", None)
            evict = extra.get(EVICT) if isinstance(extra, dict) else None
            if evict is None or metadata.hash_values or metadata.block_ids:
                raise ValueError(
                    f"metadata: direction {IDLE_EVICT!r} carries its copies in "
                    f"extra_params[{EVICT!r}] only"
                )
            self.submit_swap_tasks(evict, None)
            return
        if direction not in ("load", "lookup"):
            raise ValueError(
                f"metadata.direction: {direction!r}; fastkv takes 'load' or 'lookup'"
            )
        hashes = list(metadata.hash_values or ())
        blocks = list(metadata.block_ids or ())
        shaped = SimpleNamespace(
            src_block_ids=[-1] * len(hashes), dst_block_ids=blocks, hash_values=hashes
        )
        rest, work = split_storage(shaped)
        if rest is not None or work.writes:
            raise ValueError(
                "metadata.hash_values: entries that are not fastkv storage loads or "
                "lookups; was this task made by fastkv's cache manager?"
            )
        with self._lock:
            if self.controller is None:
                fail_storage(self._routes, work, "the KV cache is not initialized")
                return
            self._report()
            submit_storage(self.controller, self._routes, work, self.rank)

    def wait_for_layer(self, layer: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """`swap_layer_done_counter.wait_for_layer`, when the step has a swap-in."""
        counter = self.swap_layer_done_counter
        if counter is not None:
            counter.wait_for_layer(layer, timeout)

    def finish_step(
        self, timeout: float = DEFAULT_TIMEOUT, *, wait_evictions: bool = False
    ) -> frozenset[int]:
        """End of the step: host-wait its swap-in, send every finished result.

        Args:
            timeout: bound on each wait.
            wait_evictions: also wait for every in-flight eviction (deterministic
                tests; evictions otherwise finish in the background).

        Returns:
            The device blocks of a failed swap-in (the runner must not emit tokens
            for requests reading them), or an empty set.

        Raises:
            TransferTimeoutError: a wait ran past `timeout`.
            ValueError: `timeout` is not None or a finite number of seconds >= 0
                (a bool is refused); nothing was waited for.
        """
        timeout = fdc.as_timeout("timeout", timeout)  # type: ignore[assignment]
        failed: frozenset[int] = frozenset()
        counter = self.swap_layer_done_counter
        if counter is not None:
            try:
                counter.wait_all(timeout)
            except SwapInFailedError as e:
                failed = e.device_block_ids
        with self._lock:
            ctrl = self._require()
            self._routes.forward(
                ctrl.wait_all(timeout) if wait_evictions else ctrl.poll_results()
            )
        return failed

    def report_results(self) -> int:
        """Send the results of the copies finished so far (never blocks).

        Returns:
            Results the scheduler has not acknowledged yet (see ResultsSender).
        """
        with self._lock:
            return self._report()

    # -- lifecycle --------------------------------------------------------------

    def reset_cache(self) -> bool:
        """Wait for in-flight copies (reporting them), then zero every block.
        Returns True, also before the cache exists (as FastDeploy's)."""
        with self._lock:
            if self.controller is not None:
                self._routes.forward(self.controller.reset_cache())
            self.swap_layer_done_counter = None
            return True

    def free_gpu_cache(self) -> None:
        """Let go of every KV tensor: stop reporting, wait for in-flight copies
        (reporting them), drop the controller (and its host tier) and every
        reference fastkv holds to the tensors (`cache_kvs_map` is emptied: it is
        the dict the runner got from `get_kv_caches`), and flush the results
        channel (at most `FREE_FLUSH_S`). FastDeploy's runner calls
        this after its profiling run, at `clear_parameters` and when the KV cache
        sleeps; `initialize_kv_cache` may run again afterwards. With PD attached,
        first `PDWorker.close` (P's writes settle, the transport lets go of the
        tensors; if a write is still inside it past its bound, this raises and
        frees nothing): PD serves again once `attach_pd` is called on the new cache. No-op
        without a cache."""
        self.stop()
        with self._lock:  # a batch or drained task holds it from its PD check to its use
            pd, self.pd = self.pd, None
        if pd is not None:  # before the tensors go: its writes read them
            try:
                # outside the lock: the reports it sends take it
                if not pd.close():
                    raise RuntimeError(
                        "free_gpu_cache: PD writes are still inside the transport past "
                        "its own timeout; no KV tensor was freed (call it again)"
                    )
            except BaseException:
                with self._lock:  # nothing was freed: attached and reporting as before
                    self.pd = pd
                self._start_reporter()
                raise
        with self._lock:
            ctrl, self.controller = self.controller, None
            if ctrl is not None:
                self._routes.forward(ctrl.free_cache())  # it drops the adopted tensors
            if self._storage_backend is not None:
                self._storage_backend.close()
                self._storage_backend = None
            self._routes.settle_held()
            self._routes.forget_recoveries()
            self.cache_kvs_map.clear()
            self._caches = []
            self.swap_layer_done_counter = None
        # The reporter is stopped: hand the scheduler what the free produced
        # (copies' results, PD reports) now rather than at the next cache.
        end = time.monotonic() + FREE_FLUSH_S
        while time.monotonic() < end:
            with self._lock:  # the sender is the adapter's: one caller at a time
                if not self.sender.flush():
                    break
            time.sleep(0.005)

    def free_cache(self, clear_storage: bool = False) -> bool:
        """`free_gpu_cache`, then close the results sender (shutdown). Returns True,
        as FastDeploy's."""
        del clear_storage  # blocks on disk stay: they serve after a restart
        self.free_gpu_cache()
        with self._lock:
            self.sender.close()
        return True

    def start(self) -> None:
        """The reporter thread starts with the cache; nothing else to start."""

    def stop(self) -> None:
        """Stop the reporter thread."""
        self._stop.set()
        if self._reporter is not None:
            self._reporter.join(timeout=10)
            self._reporter = None

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            stats: dict[str, Any] = {"rank": self.rank, "tp_size": self.tp_size}
            if self.controller is not None:
                s = self.controller.get_stats()
                stats.update({name: getattr(s, name) for name in s.__slots__})
            sent = self.sender.stats()
            stats.update(
                results_sent=sent.sent,
                results_pending=sent.pending,
                results_dropped=sent.dropped,
                transfers_without_result=self._routes.num_waiting,
                swap_in_retries=self._retry.attempts,
                swap_ins_recovered=self._retry.recoveries,
            )
            return stats

    # -- prefill/decode disaggregation (fd_pd_worker) ------------------------------

    def attach_pd(
        self,
        transport: Any,
        *,
        role: str,
        report_to: Any = None,
        checksums: bool = True,
    ) -> Any:
        """Serve this rank's half of FastDeploy's splitwise role over `transport`
        (every cache tensor is registered there once). Returns the `PDWorker`; its
        `handshake()` is what D's scheduler hands P (`fd_pd.PDSettings.handshakes`).
        The rank's RankReports go to `report_to`; None (a deployment): over the
        results channel, where the scheduler's result polling hands them to its PD
        half (`FastDeployCacheManager._poll`).

        Raises:
            RuntimeError: the cache does not exist yet.
            ValueError: a bad role.
        """
        from fastkv.integrations.fd_pd_worker import PDWorker
        from fastkv.pd.layout import KVLayout

        with self._lock:
            layout = KVLayout.of_controller(
                self._require(), tp_rank=self.rank, tp_size=self.tp_size
            )
            to = self._send_reports if report_to is None else report_to
            self.pd = PDWorker(layout, transport, role=role, report_to=to, checksums=checksums)
            return self.pd

    def send_to_node(self, metadata: Any) -> Any:
        """FastDeploy's name: P sends a request's blocks (`PDWorker.send_to_node`)."""
        return self._pd_worker().send_to_node(metadata)

    def wait_for_transfer_from_node(self, metadata: Any) -> Any:
        """FastDeploy's name: D expects a request's blocks from P."""
        return self._pd_worker().wait_for_transfer_from_node(metadata)

    def after_layer(self, layer: int, stream: int | None = None) -> None:
        """The one line PD adds to FastDeploy's runner: call it once layer `layer` of
        the step is written, or on a GPU right after launching that layer's kernel
        on `stream` (None: Paddle's current stream): the writes wait for a CUDA
        event recorded there (`PDSender.after_layer`)."""
        pd = self.pd
        if pd is not None:
            pd.after_layer(layer, stream)

    def _send_reports(self, reports: list[Any]) -> None:
        """This rank's PD RankReports over the results channel (acked, resent on
        trouble: see ResultsSender)."""
        with self._lock:
            self.sender.send(reports)

    def _split_pd(self, meta: Any, route: str) -> tuple[Any, list[Any], int]:
        """(`meta` without its PD entries, this rank's PD tasks, the route's count
        after them), all checked, nothing changed: PD tasks on a rank without PD
        attached, of the other role, for a rank this instance lacks, or out of
        the route's order (a payload twice, or one lost) raise ValueError."""
        rest, numbered = pd_tasks.split(meta, self.rank, self.tp_size)
        work = [task for _, task in numbered]
        after = pd_tasks.in_order(numbered, self._pd_next[route], route)
        if work:
            if self.pd is None:
                raise ValueError(
                    f"rank {self.rank}: PD tasks for a rank without PD (attach_pd first)"
                )
            self.pd.check_tasks(work)
        return rest, work, after

    def _pd_worker(self) -> Any:
        if self.pd is None:
            raise RuntimeError("PD is not attached to this rank (attach_pd first)")
        return self.pd

    # -- internals --------------------------------------------------------------

    def _require(self) -> Any:
        if self.controller is None:
            raise RuntimeError("the KV cache is not initialized (initialize_kv_cache first)")
        return self.controller

    def _make(
        self, attn_backend: Any, num_blocks: int, first_layer: int, num_layers: int
    ) -> LayerTensors:
        """Make the layers' tensors as FastDeploy's runner would (see fd_backend)."""
        return make_layers(
            attn_backend,
            num_blocks=num_blocks,
            first_layer=first_layer,
            num_layers=num_layers,
            model_dtype=fdc.model_dtype(self.fd_config),
            quant=fdc.kv_cache_quant_type(self.fd_config),
            tp_rank=self.rank,
            device_id=self.device_id,
        )

    def _adopt(self, caches: list[Any], per_layer: int, num_extra: int) -> None:
        from fastkv.worker.cache_controller import CacheController

        config = fdc.cache_config_from_fastdeploy(
            self.fd_config,
            num_device_blocks=self._num_gpu_blocks,
            kv_dtype=_kv_dtype_of_tensor(caches[0]),
        )
        backend, namespace = open_storage(
            self._storage_dir, caches, config, per_layer, num_extra
        )
        try:
            ctrl = CacheController.adopt(
                caches,
                config,
                tensors_per_layer=per_layer,
                num_extra_layers=num_extra,
                block_axis=self.block_axis,
                fail_rate=self.fail_rate,
                storage=backend,
                storage_namespace=namespace,
                tp_rank=self.rank,
            )
        except BaseException:
            if backend is not None:
                backend.close()
            raise
        register = getattr(backend, "register_host_memory", None)
        if register is not None:  # Mooncake moves blocks in and out of the host tier
            try:
                register(*ctrl.host_memory)
            except BaseException:
                ctrl.free_cache()
                backend.close()
                raise
        self.controller = ctrl
        self._storage_backend = backend
        self._caches = caches
        self._routes.reopen_sender()  # a cache made again after free_cache
        self._tensors_per_layer = per_layer
        self._start_reporter()

    def _start_reporter(self) -> None:
        if self.report_interval_s and self._reporter is None:
            self._stop.clear()
            self._reporter = threading.Thread(
                target=self._report_loop, name=f"fastkv-report-r{self.rank}", daemon=True
            )
            self._reporter.start()

    def _report(self) -> int:
        if self.controller is None:
            return self.sender.flush()
        return self._routes.forward(self.controller.poll_results())

    def _recover(self, counter: StepLayerCounter, timeout: float) -> bool:
        """A step's swap-in failed: retry it (see `SwapInRetry.recover`)."""
        with self._lock:
            return self._retry.recover(
                counter, self.controller, timeout, retries=self.swap_in_retries
            )

    def _report_loop(self) -> None:
        while not self._stop.wait(self.report_interval_s):
            try:
                self.report_results()
                if self.pd is not None:
                    self.pd.poll()
            except Exception:  # never let the reporter die silently mid-run
                log.exception("fastkv rank %d: reporting results failed", self.rank)


def _kv_dtype_of_tensor(tensor: Any) -> str:
    name = str(tensor.dtype).removeprefix("paddle.")
    return "fp8" if name == "uint8" else name


__all__ = ["FastDeployCacheController", "StepLayerCounter", "SwapInFailedError"]
