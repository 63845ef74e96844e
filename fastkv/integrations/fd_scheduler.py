"""FastDeploy's scheduler-side cache manager v1, on fastkv's CacheManager.

`FastDeployCacheManager(fd_config)` has the method names and return values that
FastDeploy's ResourceManagerV1 uses (see docs/fastdeploy.md for the
table). What it does differently, on purpose:

- **Commits only KV that exists.** FastDeploy v1 inserts blocks into its tree when
  it allocates them, before any KV is computed, so a request admitted meanwhile
  can hit blocks that hold nothing yet. Here a request's blocks become matchable
  only once a token sampled after its admission proves them computed: with k
  outputs (k above the count it was admitted with), every token before the last
  sampled one has KV (prompt + k - 1 tokens). This is checked at the end of every
  schedule (`check_and_add_pending_backup`) and at `request_finish`, with the
  request's `prompt_hashes` synced into the manager first.
- **Knows what the worker did.** Every transfer is a fastkv transfer with an id,
  carried through BatchRequest's merge in `hash_values` (see `fd_transfers`); each
  rank's worker reports results over the results channel, polled without blocking
  at every hook. A transfer is applied when every rank has reported it; a failed
  swap-in rewinds its requests' `num_computed_tokens` to the first block that
  failed, so the next schedule recomputes it (the runner must not emit the step's
  tokens for those requests: `FastDeployCacheController` raises at
  `wait_for_layer`).
- **Allocates synchronously, safely.** Blocks being evicted go to the allocating
  request at once (`reuse_evicted_blocks`); the step's evictions travel in that
  request's `cache_evict_metadata`, and the worker orders the model's writes after
  their reads. Metadata still on a request when it finishes was never dispatched:
  its transfers are failed here (nothing ran on any worker) and the lists cleared.

Thread-safe: one lock around every public method (ResourceManagerV1 finishes
requests from another thread). No method needs ResourceManagerV1's lock held or a
particular caller thread: ResourceManagerV2's model (every call from its scheduler
thread, V1's lock a no-op) works as V1's does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from fastkv.config import CacheConfig, as_int
from fastkv.integrations import fd_config as fdc
from fastkv.integrations import fd_pd_tasks as pd_tasks
from fastkv.integrations.fd_commits import CommitBook
from fastkv.integrations.fd_extend import ExtendTables
from fastkv.integrations.fd_metrics import FastDeployMetrics
from fastkv.integrations.fd_pd import FastDeployPD, PDSettings
from fastkv.integrations.fd_prefetch import (
    PendingPrefetch,
    StoragePrefetches,
    storage_metadata_type,
)
from fastkv.integrations.fd_results import TransferRelay, bind_channel, release_channel
from fastkv.integrations.fd_transfers import EVICT, IDLE_EVICT, fastdeploy_metadata_types
from fastkv.integrations.fd_views import (
    AdapterCounters,
    FastDeployMatchResult,
    FreeBlockList,
    prompt_digests,
)
from fastkv.pd.messages import RankReport
from fastkv.scheduler import CacheManager

log = logging.getLogger(__name__)

_POLL_S = 0.002  # between polls of a bounded wait (the lock is free meanwhile)


class FastDeployCacheManager:
    """Drop-in for `fastdeploy.cache_manager.v1.CacheManager`: FastDeploy's calls,
    each validated, polled and locked here, then handed to the room that acts.

        FastDeployCacheManager
          ├ manager       fastkv's CacheManager (rebuilt with the rooms below by
          │               update_cache_config and an owed reset)
          ├ _book         CommitBook (fd_commits): tracked requests, proven commits
          ├ _relay        TransferRelay (fd_results): copies out on FastDeploy's
          │               metadata, worker results in, never-sent copies failed
          ├ _prefetches   StoragePrefetches (fd_prefetch): the storage-prefetch API
          ├ results       the results channel's receiver (fd_results.bind_channel)
          └ metrics       FastDeployMetrics (fd_metrics)

    What ResourceManagerV1 reads back (`FastDeployMatchResult`, the free-block
    list) is in `fd_views`.

    Args:
        fd_config: FastDeploy's FDConfig (see `fd_config` for the fields read).
        channel_name: the results channel's name; default
            `fd_config.results_channel_name(fd_config)`. Workers must use the same.
        registry: where FastDeploy's metric names are exposed when FastDeploy's
            metrics object is not importable.
        fastdeploy_metrics: FastDeploy's metrics object (default: imported if
            importable).
        reset_timeout_s: how long `reset_cache` waits for copies in flight (a
            finite number of seconds >= 0; a bool is refused).
        prefetch_lookup_timeout_s: how long `prefetch_storage` waits for the
            workers' lookup answer, and `update_storage_blocks_to_host` /
            `abort_prefetch_blocks` for the ranks' load results (seconds, as
            `reset_timeout_s`).

    Raises:
        ValueError: a FastDeploy setting out of range (the message names it).
        OSError: another process, or a live manager of this process, holds the
            results channel's name (the message names both; a dropped manager's
            name is taken over, see `close`).
    """

    def __init__(
        self,
        fd_config: Any,
        *,
        channel_name: str | None = None,
        registry: CollectorRegistry | None = None,
        fastdeploy_metrics: Any | None = None,
        reset_timeout_s: float = 30.0,
        prefetch_lookup_timeout_s: float = 2.0,
    ) -> None:
        self.reset_timeout_s = fdc.as_seconds("reset_timeout_s", reset_timeout_s)
        self.prefetch_lookup_timeout_s = fdc.as_seconds(
            "prefetch_lookup_timeout_s", prefetch_lookup_timeout_s
        )
        # A reset_cache whose copies outlasted the wait: nothing hits until they
        # land and no request is active, then the cache is forgotten (see reset_cache).
        self._reset_pending = False
        self.fd_config = fd_config
        self.config: CacheConfig = fdc.cache_config_from_fastdeploy(fd_config)
        self.enable_prefix_caching = fdc.prefix_caching_enabled(fd_config)
        self.tp_size = fdc.tensor_parallel_size(fd_config)
        self._lock = threading.RLock()
        self._metadata_types = fastdeploy_metadata_types()
        self._counters = AdapterCounters()
        self.pd: FastDeployPD | None = None  # attach_pd: the splitwise roles
        self._pd_args: dict[str, Any] | None = None
        self._issued = False  # a batch took the queued copies since the last drain
        self._promised = False  # can_allocate said yes; its allocation has not come
        self._build_rooms(self.config)
        name = channel_name if channel_name is not None else fdc.results_channel_name(fd_config)
        self.results = bind_channel(name, self.tp_size, self)
        self.metrics = FastDeployMetrics(
            self._figures, registry, fastdeploy_metrics=fastdeploy_metrics
        )

    # -- FastDeploy attributes ------------------------------------------------

    @property
    def num_gpu_blocks(self) -> int:
        return self.config.num_device_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.config.num_host_blocks

    @property
    def enable_host_cache(self) -> bool:
        return self.config.num_host_blocks > 0

    @property
    def gpu_free_block_list(self) -> Sequence[int]:
        """The free device block ids (tree-held blocks count as used, as in v1)."""
        return FreeBlockList(self.manager)

    @property
    def available_gpu_resource(self) -> float:
        """Free device blocks / all device blocks."""
        return self.manager.num_free_device_blocks / self.num_gpu_blocks

    @property
    def num_free_device_blocks(self) -> int:
        return self.manager.num_free_device_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self.manager.num_free_host_blocks

    @property
    def storage_scheduler(self) -> None:
        """None: fastkv's storage tier is asked through the workers (see
        `prefetch_storage`), there is no FastDeploy StorageScheduler object."""
        return None

    @property
    def enable_storage(self) -> bool:
        """Whether a storage tier is configured (`kvcache_storage_backend="file"`)."""
        return self.config.storage is not None

    # -- admission and allocation ----------------------------------------------

    def can_allocate_device_blocks(self, num_blocks: int) -> bool:
        """Whether `allocate_device_blocks(request, num_blocks)` succeeds now (until
        another allocation or release): the free blocks and the cached ones eviction
        reaches now, counted exactly (`CacheManager.num_obtainable_device_blocks`),
        whatever the write policy, with the host tier full and copies in flight.
        ResourceManagerV1 does not check what `allocate` returns after a yes."""
        num_blocks = _check_blocks(num_blocks)
        with self._lock:
            self._poll()
            mgr = self.manager
            if num_blocks > mgr.num_free_device_blocks + mgr.num_evictable_device_blocks:
                return False  # O(1): more than every unheld block
            yes = mgr.num_obtainable_device_blocks(max(0, num_blocks)) >= num_blocks
            # A yes holds until the allocation it promises (or the schedule's end):
            # a storage prefetch, on another thread, waits rather than lock them.
            self._promised = yes and num_blocks > 0
            return yes

    can_allocate_gpu_blocks = can_allocate_device_blocks

    def match_prefix(self, request: Any, skip_storage: bool = False) -> None:
        """Lock the request's cached prefix and leave a `FastDeployMatchResult` on
        `request._match_result` (device hits first; at most (tokens - 1) // block
        size blocks hit, so the last token is always computed).

        With a storage tier: blocks a `prefetch_storage` of this request brought
        from storage into host are host hits swapped in by `allocate` like any
        other, counted as `matched_storage_nums` (and FastDeploy's ssd hit
        metric); a prefetch still in flight is let go of first (its blocks land
        and serve later matches). The match itself never waits for storage, so
        `can_allocate_gpu_blocks` stays exact.

        `skip_storage` follows upstream's newer contract: the default False is a
        probe that pins nothing and registers nothing (the result's counts are
        what is cached now; storage is looked up by `prefetch_storage`, never
        here); ResourceManagerV1's scheduling call passes True and gets the
        locked match above.

        With prefix caching off it leaves an empty result (as v1). A request already known
        with no blocks in its table (a stale registration) is released first.
        On a request that holds blocks, or bad input, the error is logged and an
        empty result left (FastDeploy then allocates every block).
        """
        if not self.enable_prefix_caching:  # as v1: an empty result, nothing locked
            request._match_result = FastDeployMatchResult()
            return
        with self._lock:
            self._poll()
            if self._reset_pending:  # the cache may hold blocks that are gone
                request._match_result = FastDeployMatchResult()
                return
            if not skip_storage:
                request._match_result = self._probe(request)
                return
            rid = request.request_id
            try:
                if self.manager.is_active(rid):
                    if list(request.block_tables or ()):
                        raise ValueError(
                            f"request {rid!r}: match_prefix on a request holding "
                            f"{len(request.block_tables)} blocks; request_finish first"
                        )
                    self._release(request, finished=False)
                tokens, hashes = prompt_digests(request, self.config.block_size)
                self._prefetches.end(rid)  # its blocks landed, or land later
                hit = self.manager.match(rid, hashes, tokens, lookup_storage=False)
            except (ValueError, TypeError) as e:
                self._counters.match_failures += 1
                log.error("fastkv match_prefix(%r) failed: %s", rid, e)
                request._match_result = FastDeployMatchResult()
                return
            self._book.track(request)
            # The table the match made: its device hits. Every other matched block
            # (host copies, device blocks below one) comes with allocate.
            table = self.manager.block_table(rid).block_ids
            from_storage = self._prefetches.take_storage_hits(hashes[len(table) : hit.num_hits])
            request._match_result = FastDeployMatchResult(
                table, hit.num_host_hits - from_storage, from_storage
            )

    def _probe(self, request: Any) -> FastDeployMatchResult:
        """What `request` finds cached now, nothing pinned or registered (logged
        and empty on bad input)."""
        key = ("fastkv-probe", request.request_id)
        try:
            tokens, hashes = prompt_digests(request, self.config.block_size)
            hit = self.manager.match(key, hashes, tokens, lookup_storage=False)
        except (ValueError, TypeError) as e:
            log.error("fastkv match_prefix(%r, skip_storage=False) failed: %s", key[1], e)
            return FastDeployMatchResult()
        table = list(self.manager.block_table(key).block_ids)
        self.manager.finish(key)
        return FastDeployMatchResult(table, hit.num_host_hits, 0)

    def allocate_device_blocks(self, request: Any, num_blocks: int) -> list[int]:
        """Add `num_blocks` device blocks to the request (FastDeploy counts its host
        hits among them); return the ids to extend `request.block_tables` with,
        host-hit swap-in destinations first, or `[]` when they cannot be had now.

        The swaps this allocation needs (swap-ins of its host hits, evictions of
        blocks handed to it) are appended to `request.cache_swap_metadata` /
        `cache_evict_metadata`, for BatchRequest to carry to the workers.

        Raises:
            ValueError: `num_blocks` is not an int, or the request has no
                `request_id`.
        """
        num_blocks = _check_blocks(num_blocks)
        rid = request.request_id
        with self._lock:
            self._promised = False
            self._poll()
            mgr = self.manager
            if self.pd is not None and self.pd.is_pd_request(request):
                return self.pd.accept(request)  # D: own prefix + receiving tail
            if not mgr.is_active(rid):  # prefix caching off: never matched
                mgr.match(rid, [], 0)
                self._book.track(request)
            elif rid not in self._book:
                self._book.track(request)
            if num_blocks <= 0:
                return []
            if self._extends.is_extend(request):
                return self._allocate_extend(request, num_blocks)
            self._extends.note(request)
            table = list(mgr.block_table(rid).block_ids)
            theirs = list(request.block_tables or ())
            if theirs != table:
                self._counters.table_mismatches += 1
                log.error(
                    "fastkv allocate(%r): request.block_tables (%d blocks) is not the table "
                    "fastkv gave it (%d blocks); refusing",
                    rid,
                    len(theirs),
                    len(table),
                )
                return []
            # FastDeploy counts blocks past its table, matched ones among them.
            try:
                allocation = mgr.allocate(
                    rid, num_tokens=(len(table) + num_blocks) * self.config.block_size
                )
            except (ValueError, RuntimeError) as e:  # can never fit / never taken
                self._counters.allocation_failures += 1
                log.error("fastkv allocate(%r, %d) refused: %s", rid, num_blocks, e)
                return []
            if not allocation:
                self._counters.allocation_failures += 1
                log.warning(
                    "fastkv allocate(%r, %d): %s (free %d, evictable %d)",
                    rid,
                    num_blocks,
                    allocation.status.value,
                    mgr.num_free_device_blocks,
                    mgr.num_evictable_device_blocks,
                )
                return []
            self._relay.attach(request)
            # What FastDeploy appends to its table: the manager's positions past it.
            return list(mgr.block_table(rid, len(table)).block_ids)

    allocate_gpu_blocks = allocate_device_blocks

    def _allocate_extend(self, request: Any, num_blocks: int) -> list[int]:
        """The blocks of FastDeploy's extend table (see `fd_extend`), or []."""
        try:
            blocks = self._extends.allocate(request, num_blocks)
        except (ValueError, RuntimeError) as e:  # can never fit
            blocks = None
            log.error("fastkv extend(%r, %d) refused: %s", request.request_id, num_blocks, e)
        if blocks is None:
            self._counters.allocation_failures += 1
            return []
        self._relay.attach(request)
        return blocks

    # -- storage prefetch (FastDeploy's newer v1 API) -----------------------------

    def prefetch_storage(self, request: Any) -> bool:
        """Upstream's preprocess-thread call: look up in storage the request's
        blocks cached neither on the device nor in host, and plan their loads into
        host blocks (loading nodes in the tree, held by a stand-in request until
        the request's own `match_prefix`). Clears `request.match_result`.

        fastkv's storage is read by the workers (each rank its own backend), so
        the answer is theirs: the lookup is queued as a `PendingPrefetch` that
        the engine's loop drains (`drain_pending_prefetches`) and sends to every
        worker over its engine-worker queue, and this call waits for the combined
        answer (the minimum over ranks, over the results channel) for at most
        `prefetch_lookup_timeout_s`, polling, without holding the lock `schedule()`
        takes between polls. The loads the answer plans are queued the same way.
        Called on the thread that drains (nobody drains meanwhile), it gives up
        after the timeout and returns False; a lookup given up is answered into
        nothing. Its match waits (within the same bound) while a yes of
        `can_allocate_gpu_blocks` waits for its allocation, so it never locks the
        cached blocks that yes counted on.

        Returns:
            True only when storage holds some of the request's blocks (their loads
            are planned); False without a storage tier, with prefix caching off,
            with nothing to look up, or when no answer came in time.
        """
        _clear_match_result(request)
        if not self.enable_prefix_caching or self.config.storage is None:
            return False
        deadline = time.monotonic() + self.prefetch_lookup_timeout_s
        rid = request.request_id
        while (started := self._begin_prefetch(request)) is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        if not started:
            return False
        while True:
            with self._lock:
                self._poll()
                if rid not in self._prefetches:  # finished or reset meanwhile
                    return False
                if not self._prefetches.lookup_pending(rid):
                    self._prefetches.take_work()
                    if self._prefetches.found(rid):
                        return True
                    self._prefetches.end(rid)
                    return False
                if time.monotonic() >= deadline:
                    log.warning(
                        "fastkv prefetch_storage(%r): no lookup answer in %.2f s "
                        "(is drain_pending_prefetches called meanwhile?)",
                        rid,
                        self.prefetch_lookup_timeout_s,
                    )
                    self._prefetches.end(rid)
                    return False
            time.sleep(_POLL_S)

    def _begin_prefetch(self, request: Any) -> bool | None:
        """Start the request's prefetch (True) or not (False: refused, nothing to
        look up, a reset pending); None while a yes of `can_allocate_device_blocks`
        waits for its allocation: the prefetch's match would lock cached blocks
        that yes counted on (ResourceManagerV1 asks and allocates under its own
        lock; this runs on its preprocess thread)."""
        with self._lock:
            if self._promised:
                return None
            self._poll()
            if self._reset_pending:
                return False
            try:
                return self._prefetches.begin(request)
            except (ValueError, TypeError) as e:
                log.error("fastkv prefetch_storage(%r) failed: %s", request.request_id, e)
                return False

    def drain_pending_prefetches(self) -> list[PendingPrefetch]:
        """The storage tasks to send to every worker now (lookups and loads), each
        a `PendingPrefetch(request_id, metadata=StorageMetadata(hash_values,
        block_ids, direction), host_block_ids)`, in the order they were planned;
        the copies no batch took since the last call (`direction="evict"`, see
        `_idle_copies`); with PD attached also one with `direction="pd"` carrying
        the ranks' PD tasks that need no step (`fd_pd_tasks`). A worker takes one with
        `FastDeployCacheController.prefetch_from_storage`. Never waits."""
        with self._lock:
            self._poll()
            self._prefetches.take_work()
            tasks = self._prefetches.take_queue()
            idle = self._idle_copies()
            if idle is not None:
                tasks.append(idle)
            if self.pd is not None:
                entries = self.pd.take_entries(step=False)
                if entries:
                    meta = storage_metadata_type()(
                        hash_values=entries,
                        block_ids=[-1] * len(entries),
                        direction=pd_tasks.PD_DIRECTION,
                    )
                    tasks.append(PendingPrefetch("fastkv-pd", meta))
            return tasks

    def _idle_copies(self) -> PendingPrefetch | None:
        """When no batch took the queued copies since the last drain (FastDeploy
        sends no batch while no request is scheduled, and issues backups only into
        one), those copies and storage writes as one drained task
        (`direction="evict"`, the metadata a batch would carry, in
        `extra_params["fastkv_evict"]`): a request that waits for the room they free
        (WAIT_FOR_TRANSFERS) is otherwise never scheduled again. While batches go
        out they carry them. Never an eviction that hands blocks over (that goes
        with the step that writes them); what is queued is safe to run outside a
        step: backups of KV the scheduler has seen computed, and host blocks, all
        held until their copies report."""
        issued, self._issued = self._issued, False
        if issued or self.manager.hands_over_queued_blocks:
            return None
        meta = self._relay.take_backups()
        if meta is None:
            return None
        storage = storage_metadata_type()(
            hash_values=[], block_ids=[], direction=IDLE_EVICT, extra_params={EVICT: meta}
        )
        return PendingPrefetch("fastkv-idle", storage)

    def update_storage_blocks_to_host(self, host_block_ids: Sequence[int]) -> None:
        """Every rank reported the load of `host_block_ids` (upstream's call). fastkv
        applies each load from the ranks' own results (over the results channel:
        a block is a host block only when every rank loaded it, a failed one is
        dropped and freed), so this waits, polling, at most
        `prefetch_lookup_timeout_s` for those results and never holding the lock
        between polls; a result still missing after that is applied when it comes.

        Raises:
            ValueError: an id that is not a host block id (nothing is waited for).
        """
        self._await_loads("update_storage_blocks_to_host", host_block_ids)

    def abort_prefetch_blocks(self, host_block_ids: Sequence[int]) -> None:
        """A load of `host_block_ids` failed (upstream's call): the prefetches
        holding them stop waiting. Host blocks are freed and loading nodes dropped
        by the ranks' own results (a block whose load failed on any rank never
        hits; one every rank loaded stays a correct host copy): this waits for
        them like `update_storage_blocks_to_host`, and a block a worker may still
        write stays reserved until its result comes.

        Raises:
            ValueError: an id that is not a host block id (nothing changes).
        """
        self._await_loads("abort_prefetch_blocks", host_block_ids)
        with self._lock:
            self._poll()
            for rid in self._prefetches.owners(host_block_ids):
                self._prefetches.end(rid)

    def _await_loads(self, what: str, host_block_ids: Sequence[int]) -> None:
        top = max(0, self.num_cpu_blocks - 1)
        ids = [as_int(f"host_block_ids[{i}]", b, 0, top) for i, b in enumerate(host_block_ids)]
        deadline = time.monotonic() + self.prefetch_lookup_timeout_s
        while True:
            with self._lock:
                self._poll()
                busy = self._prefetches.loads_in_flight(ids)
            if not busy:
                return
            if time.monotonic() >= deadline:
                log.warning("fastkv %s: loads %s still without every rank's result", what, busy)
                return
            time.sleep(_POLL_S)

    # -- lifecycle --------------------------------------------------------------

    def request_finish(self, request: Any) -> None:
        """Release the request (finished, preempted, aborted or refused): its
        computed full blocks stay cached, the rest return to the pool. Swap metadata
        still on it was never dispatched: those transfers fail here."""
        with self._lock:
            self._poll()
            self._release(request, finished=True)
            self._prefetches.end(request.request_id)
            self.metrics.update()

    def recycle_gpu_blocks(self, block_ids: Sequence[int], request_id: Any = None) -> None:
        """FastDeploy frees extend-table blocks with this after `request_finish`;
        fastkv frees every block of a request, its extend blocks included (see
        `fd_extend`), at `request_finish`, so there is nothing left to do.

        Raises:
            ValueError: an id outside the device pool, or the request still active
                (call request_finish first).
        """
        ids = list(block_ids or ())
        for i, block in enumerate(ids):
            as_int(f"block_ids[{i}]", block, 0, self.num_gpu_blocks - 1)
        with self._lock:
            if request_id is not None and self.manager.is_active(request_id):
                raise ValueError(
                    f"request_id: {request_id!r} still holds its blocks; request_finish first"
                )

    def write_cache_to_storage(self, request: Any) -> None:
        """Commit the request's computed blocks now (FastDeploy calls this before
        freeing a finished request, and for a preempted one). With a storage tier
        under the write policy write_through, its cached blocks storage does not
        hold yet are written: those with a host copy at the next step, device-only
        ones backed up to host first (if host room) and written once that copy
        lands. Other write policies write at hits or at host eviction."""
        with self._lock:
            self._poll()
            rid = request.request_id
            self._book.commit(rid)
            if self.config.storage is not None and self.manager.is_active(rid):
                self.manager.write_to_storage(rid)

    write_cache_to_storage_decode = write_cache_to_storage

    def update_cache_blocks(self, task: Any, block_size: int, num_computed_tokens: int) -> None:
        """FastDeploy's prefill role (`preallocate_resource_in_p`) calls this right
        after allocating a request's blocks, with the tokens it is about to compute;
        FastDeploy's legacy manager put those blocks in its tree there, before their
        KV existed. fastkv caches only KV a sampled token proves: this commits what
        is proven already (usually nothing yet) and leaves the rest to
        `check_and_add_pending_backup` and `request_finish`. Sets
        `task.num_cached_blocks` to the blocks committed.

        Raises:
            ValueError: `block_size` is not the cache's, or `num_computed_tokens`
                is not an int >= 0.
        """
        if block_size != self.config.block_size:
            raise ValueError(
                f"block_size: {block_size}, the cache's block size is {self.config.block_size}"
            )
        as_int("num_computed_tokens", num_computed_tokens, 0)
        with self._lock:
            self._poll()
            rid = task.request_id
            self._book.commit(rid)
            if self.manager.is_active(rid):
                task.num_cached_blocks = self.manager.num_committed_blocks(rid)
            if self.pd is not None and self.pd.role == "prefill":
                self.pd.offer(task)  # pinned until its send settles

    def cache_output_blocks(self, request: Any, block_size: int | None = None) -> None:
        """Commit the request's output blocks whose KV exists (FastDeploy's output
        caching).

        Raises:
            ValueError: `block_size` is not the cache's block size.
        """
        if block_size is not None and block_size != self.config.block_size:
            raise ValueError(
                f"block_size: {block_size}, the cache's block size is {self.config.block_size}"
            )
        self.write_cache_to_storage(request)

    def check_and_add_pending_backup(self) -> None:
        """End of every schedule: apply reported results, commit the KV running
        requests have proven computed (write-through backups are planned by those
        commits and leave with the next step), update the metrics."""
        with self._lock:
            self._promised = False  # the schedule is over: a yes it did not use lapses
            self._poll()
            self._book.commit_proven()
            self.metrics.update()

    def issue_pending_backup_to_batch_request(self) -> Any | None:
        """The backups planned so far, as one FastDeploy eviction metadata for the
        batch being sent, or None. Storage writes ride in it too (see
        `fd_transfers.storage_to_fastdeploy`); storage lookups and loads never do
        (`drain_pending_prefetches` hands them out)."""
        with self._lock:
            self._poll()
            self._issued = True
            return self._relay.take_backups()

    def get_pending_backup_count(self) -> int:
        return self.manager.num_queued_blocks

    def poll_results(self) -> int:
        """Apply the results the workers have reported (every hook does this too).

        Returns:
            How many transfers were applied.
        """
        with self._lock:
            return self._poll()

    # -- prefill/decode disaggregation (fd_pd) -----------------------------------

    def attach_pd(self, *, role: str, settings: PDSettings, finished_queue: Any = None) -> None:
        """Serve FastDeploy's splitwise role `role` ("prefill" or "decode") with
        fastkv's PD path (see `fd_pd`). `settings.layout_digest` is the workers'
        `KVLayout.digest()`; D's `settings.handshakes` its ranks' handshakes; P's
        `finished_queue` where its token processor reads finished sends
        (`put_finished_req`). Idle only.

        Raises:
            ValueError: a bad role or setting, or requests active (nothing changes).
        """
        with self._lock:
            self._poll()
            self._require_idle("attach_pd")
            args = {"role": role, "settings": settings, "finished_queue": finished_queue}
            self.pd = FastDeployPD(self, **args)
            self._pd_args = args

    def pd_offer(self, request: Any) -> bool:
        """P: pin an allocated request for its send (`FastDeployPD.offer`)."""
        with self._lock:
            return self.pd is not None and self.pd.role == "prefill" and self.pd.offer(request)

    def pd_cache_info(self, infos: Any) -> None:
        """P: the cache infos FastDeploy puts for its messager (`put_cache_info`):
        D's cache_sync answers start the sends."""
        with self._lock:
            self._poll()
            if self.pd is not None and self.pd.role == "prefill":
                self.pd.cache_info(infos if isinstance(infos, list) else [infos])

    def pd_reports(self, reports: Any) -> None:
        """The ranks' RankReports (fd_pd_worker), applied at once."""
        with self._lock:
            if self.pd is not None:
                self.pd.on_reports(reports)

    def pd_batch(self, batch: Any) -> None:
        """P: the step `batch` (a `BatchRequest`) carries its PD tasks to the ranks:
        each send's start and the chunk this step writes (`FastDeployPD.on_batch`),
        as entries of the batch's device-to-host metadata (`fd_pd_tasks`). Called
        by fastkv's `schedule` wrapper; a batch with no requests carries nothing."""
        with self._lock:
            if self.pd is None or self.pd.role != "prefill" or not len(batch):
                return
            self._poll()
            self.pd.on_batch(batch, self.config.block_size)
            entries = self.pd.take_entries(step=True)
            if entries:
                swap_cls, levels = fastdeploy_metadata_types()
                batch.append_evict_metadata(
                    [pd_tasks.as_swap_metadata(entries, swap_cls, levels)]
                )

    def pd_rejection(self, request_id: Any) -> str | None:
        with self._lock:
            return (
                None
                if self.pd is None or self.pd.d is None
                else self.pd.take_rejection(request_id)
            )

    def pd_dest_block_ids(self, request_id: Any) -> Any:
        with self._lock:
            return None if self.pd is None else self.pd.dest_block_ids(request_id)

    def pd_hold(self, request_output: Any) -> bool:
        """D: whether P's first token waits for the transfer's outcome."""
        with self._lock:
            self._poll()
            return (
                self.pd is not None and self.pd.d is not None and self.pd.hold(request_output)
            )

    def pd_ready(self) -> list[Any]:
        with self._lock:
            self._poll()
            return [] if self.pd is None or self.pd.d is None else self.pd.ready()

    def pd_table(self, request_id: Any) -> list[int]:
        with self._lock:
            assert self.pd is not None
            return self.pd.table(request_id)

    # -- configuration and state -----------------------------------------------

    def update_cache_config(self, cache_config: Any) -> None:
        """Take new block counts (FastDeploy updates them once the workers have
        sized their caches). Idle only: nothing active, nothing in flight.

        Raises:
            ValueError: a setting out of range, or requests or transfers still
                active (nothing changes then).
        """
        config = fdc.cache_config_from_fastdeploy(self.fd_config, cache_config=cache_config)
        with self._lock:
            self._poll()
            if config == self.config:
                return
            self._require_idle("update_cache_config")
            self.fd_config.cache_config = cache_config
            self._rebuild(config)

    def reset_cache(self) -> bool:
        """Forget every cached block.

        FastDeploy calls this when it pauses (and again when it puts the KV cache
        to sleep, after pausing): it has aborted every request and waited until
        ResourceManagerV1 holds none, but copies may still be in flight, and
        write-through backups planned after the last schedule were never sent. The
        backups never sent are failed here (no worker saw them); copies in flight
        are waited for, polling the results channel for at most `reset_timeout_s`,
        so no block is handed out again while a copy still uses it; so are D's PD
        blocks still receiving (a failed transfer's, held until its fence: P's
        bytes may still land in them). Storage
        prefetches still pending are given up with them (FastDeploy aborted their
        requests; loads in flight are waited for like any copy).

        FastDeploy ignores the answer: when a copy outlasts the wait, the reset is
        owed. Blocks stay reserved for the copies in flight (Invariant 1), no
        request hits the cache from then on (its blocks may be gone: sleep frees
        and re-creates the workers' tensors), and the cache is forgotten as soon
        as those copies' results are in, the PD blocks fenced, and no request is
        active.

        Returns:
            True once reset; False while a request is active (nothing changes) or a
            copy outlasts the wait (the reset is owed, as above; both logged).
        """
        deadline = time.monotonic() + self.reset_timeout_s
        with self._lock:
            self._poll()
            active = self.manager.get_stats().active_requests - len(self._prefetches)
            if active:
                log.warning("reset_cache: %d requests active; nothing reset", active)
                return False
            # Owed from here on: nothing hits, and `_poll` forgets the cache once
            # nothing is in flight and no request is active (now, or later).
            self._reset_pending = True
            self._prefetches.give_up_all()  # FastDeploy aborted their requests
            self._relay.apply(self._prefetches.never_sent())
            self._relay.fail_never_sent()
            self._poll()
        while True:
            with self._lock:
                self._poll()
                if not self._reset_pending:
                    return True
                inflight = self.manager.num_inflight_transfers
                receiving = self.manager.num_receiving_blocks
            if time.monotonic() >= deadline:
                log.error(
                    "reset_cache: %d copies in flight and %d PD blocks receiving after "
                    "%.1f s; no block hits until they land or are fenced and no request "
                    "is active, then the cache is reset",
                    inflight,
                    receiving,
                    self.reset_timeout_s,
                )
                return False
            time.sleep(0.005)

    def get_stats(self) -> dict[str, Any]:
        """fastkv's CacheStats fields, FastDeploy's block counts, and the adapter's
        counters (results applied or unknown, rollbacks, failures)."""
        with self._lock:
            s = self.manager.get_stats()
            stats: dict[str, Any] = {
                name: getattr(s, name) for name in s.__slots__ if not name.endswith("_pool")
            }
            stats.update(
                num_gpu_blocks=self.num_gpu_blocks,
                num_cpu_blocks=self.num_cpu_blocks,
                num_free_device_blocks=s.device_pool.free,
                num_free_host_blocks=s.host_pool.free,
                num_evictable_device_blocks=self.manager.num_evictable_device_blocks,
                hit_token_rate=s.hit_token_rate,
                tracked_requests=len(self._book),
                results_channel=self.results.name,
                results_waiting_for_ranks=len(self.results.missing()),
                pending_prefetches=len(self._prefetches),
                **self._counters.as_dict(),
            )
            return stats

    def close(self) -> None:
        """Release the results channel's name now (idempotent). FastDeploy's
        teardown calls nothing on a v1 cache manager, so a manager that is dropped
        without this keeps the name until the next manager of this process takes
        it over (only from a dropped one: see `fd_results.bind_channel`) or the
        process exits."""
        release_channel(self.results)

    def __enter__(self) -> FastDeployCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------

    def _poll(self) -> int:
        combined = self.results.poll()
        reports = [r for r in combined if isinstance(r, RankReport)]
        if reports:  # the ranks' PD reports: to the PD half, which counts per rank
            combined = [r for r in combined if not isinstance(r, RankReport)]
            self._route_reports(reports)
        if combined:
            self._relay.apply(combined)
        if self.pd is not None:
            self.pd.tick()
        if self._reset_pending:
            self._finish_owed_reset()
        return len(combined)

    def _route_reports(self, reports: list[RankReport]) -> None:
        """The PD RankReports polled from the results channel, to the PD half (it
        drops and counts unknown, stale and repeated ones); with no PD attached
        they are dropped and counted."""
        if self.pd is None:
            self._counters.pd_reports_unrouted += len(reports)
            log.error("fastkv: dropped %d PD reports: no PD role is attached", len(reports))
            return
        self.pd.on_reports(reports)

    def _finish_owed_reset(self) -> None:
        """The reset `reset_cache` owes, once nothing is in flight and no request
        (other than prefetch stand-ins, given up with it) is active."""
        mgr = self.manager
        if mgr.num_inflight_transfers or mgr.num_receiving_blocks:
            return  # receiving: PD bytes may still land until D's fence releases them
        if mgr.get_stats().active_requests > len(self._prefetches):
            return
        self._reset_pending = False
        self._prefetches.give_up_all()
        self._rebuild(self.config)
        log.info("reset_cache: the cache is reset")

    def _release(self, request: Any, *, finished: bool) -> None:
        self._relay.fail_undispatched(request)
        rid = request.request_id
        if self.pd is not None and (self.pd.abort(rid) or self.pd.defer_finish(rid)):
            self._book.forget(rid)  # D: finished by abort; P: once its send settled
        else:
            self._book.release(rid, finished=finished)
        self._extends.release(request.request_id)

    def _require_idle(self, what: str) -> None:
        s = self.manager.get_stats()
        receiving = self.manager.num_receiving_blocks  # D's PD blocks, fenced or not
        if s.active_requests or s.inflight_transfers or s.queued_blocks or receiving:
            raise ValueError(
                f"{what}: {s.active_requests} requests and {s.inflight_transfers} transfers "
                f"active, {s.queued_blocks} blocks queued, {receiving} receiving; only an "
                "idle cache can change"
            )

    def _build_rooms(self, config: CacheConfig) -> None:
        """A new manager for `config`, and the rooms that work on it (empty). A
        manager that replaces one (reset, new config) starts the next cache epoch:
        transfer ids restart, and the workers' late reports of the old one's
        transfers carry its epoch, so the new manager drops them."""
        old = getattr(self, "manager", None)
        manager = CacheManager(config, epoch=0 if old is None else old.epoch + 1)
        self.config = config
        self.manager = manager
        self._book = CommitBook(
            self.manager,
            block_size=config.block_size,
            prefix_caching=self.enable_prefix_caching,
            counters=self._counters,
        )
        self._extends = ExtendTables(self.manager, block_size=config.block_size)
        self._prefetches = StoragePrefetches(
            self.manager,
            block_size=config.block_size,
            num_host_blocks=config.num_host_blocks,
            counters=self._counters,
        )
        swap_cls, levels = self._metadata_types
        self._relay = TransferRelay(
            self.manager,
            swap_cls=swap_cls,
            levels=levels,
            block_size=config.block_size,
            counters=self._counters,
            request_of=self._book.request_of,
            divert_reads=self._prefetches.queue,
        )
        if self._pd_args is not None:  # a new manager: PD over it (counts kept)
            old = self.pd
            self.pd = FastDeployPD(self, **self._pd_args)
            if old is not None:
                self.pd.carry_counts(old)

    def _rebuild(self, config: CacheConfig) -> None:
        self._build_rooms(config)
        self.metrics.rebase()

    def _figures(self) -> dict[str, float]:
        with self._lock:
            mgr = self.manager
            s = mgr.get_stats()
            free = s.device_pool.free
            lookup = s.lookup_tokens or 1
            return {
                "gpu_cache_usage_perc": s.device_pool.usage,
                "hit_token_rate": s.hit_token_rate,
                "gpu_hit_token_rate": s.device_hit_tokens / lookup,
                "cpu_hit_token_rate": s.host_hit_tokens / lookup,
                "available_gpu_block_num": free + mgr.num_evictable_device_blocks,
                "free_gpu_block_num": free,
                "prefix_gpu_cache_token_num": s.device_hit_tokens,
                "prefix_cpu_cache_token_num": s.host_hit_tokens,
                "prefix_ssd_cache_token_num": self._counters.storage_hit_blocks
                * self.config.block_size,
            }


def _clear_match_result(request: Any) -> None:
    """Upstream's prefetch leaves no match on the request (the scheduler matches
    afresh)."""
    if hasattr(request, "_match_result"):
        request._match_result = None


def _check_blocks(num_blocks: object) -> int:
    """`num_blocks` as an int: any integral type (ResourceManagerV1 passes numpy's
    int32 on its extend-table path), never a bool or a float."""
    if type(num_blocks) is int:
        return num_blocks
    return as_int("num_blocks", num_blocks, -(1 << 63))


__all__ = ["FastDeployCacheManager", "FastDeployMatchResult"]
