"""The scheduler's side of every fastkv transfer's round trip through FastDeploy.

- **Out.** The copies fastkv's manager plans leave on FastDeploy's requests: an
  allocation's swap-ins and evictions in the request's `cache_swap_metadata` /
  `cache_evict_metadata`, the backups and storage work as the batch's eviction
  metadata (`fd_transfers` tells how their ids survive BatchRequest's merge).
- **Back.** Each rank's worker reports results over the results channel; the cache
  manager binds one receiver per channel name in this process (`bind_channel`)
  and hands what it polls to `TransferRelay.apply`, one result at a time. A failed
  swap-in rewinds its requests' `num_computed_tokens` to the first failed block.
- **Never sent.** Metadata still on a request when it ends, and copies planned but
  never sent when the cache resets, are failed here: no worker saw them.

Not thread-safe: the cache manager adapter calls `TransferRelay` under its lock.
"""

from __future__ import annotations

import atexit
import errno
import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from fastkv.channel import ResultsReceiver
from fastkv.integrations.fd_transfers import (
    storage_to_fastdeploy,
    tagged_ids,
    to_fastdeploy,
    transfer_ids,
)
from fastkv.integrations.fd_views import AdapterCounters
from fastkv.metadata import CacheSwapMetadata, LookupResult, StorageLookup, TransferResult
from fastkv.scheduler import CacheManager, Rollback, SwapTasks

log = logging.getLogger(__name__)

_LISTS = ("cache_swap_metadata", "cache_evict_metadata")

RequestOf = Callable[[Hashable], Any | None]
"""The FastDeploy request the adapter tracks under an id, or None."""

DivertReads = Callable[[CacheSwapMetadata | None, Sequence[StorageLookup]], None]
"""Where a step's storage load and lookups go instead of its metadata."""


class TransferRelay:
    """Carries fastkv's planned copies to FastDeploy's metadata and the workers'
    results back into fastkv's manager.

    Args:
        manager: fastkv's cache manager.
        swap_cls, levels: FastDeploy's `CacheSwapMetadata` and `CacheLevel` (or
            their stand-ins, see `fd_transfers.fastdeploy_metadata_types`).
        block_size: tokens per block.
        counters: where results applied, unknown and rolled back, and
            transfers never dispatched, are counted.
        request_of: the tracked FastDeploy request of an id (rewound when its
            swap-in failed).
        divert_reads: where storage loads and lookups go (the prefetch queue);
            None: they ride the step's eviction metadata.
    """

    __slots__ = (
        "_block_size",
        "_counters",
        "_divert_reads",
        "_levels",
        "_manager",
        "_request_of",
        "_swap_cls",
    )

    def __init__(
        self,
        manager: CacheManager,
        *,
        swap_cls: type,
        levels: Any,
        block_size: int,
        counters: AdapterCounters,
        request_of: RequestOf,
        divert_reads: DivertReads | None = None,
    ) -> None:
        self._manager = manager
        self._swap_cls = swap_cls
        self._levels = levels
        self._block_size = block_size
        self._counters = counters
        self._request_of = request_of
        self._divert_reads = divert_reads

    # -- out ------------------------------------------------------------------

    def attach(self, request: Any) -> None:
        """Append the copies planned so far (an allocation's) to the request's
        `cache_evict_metadata` and `cache_swap_metadata`, for BatchRequest to
        carry to the workers."""
        tasks = self._manager.take_swap_metadata()
        swap_in = (
            None
            if tasks.swap_in is None
            else to_fastdeploy(tasks.swap_in, self._swap_cls, self._levels)
        )
        for attr, meta in (
            ("cache_evict_metadata", self._evict_with_storage(tasks)),
            ("cache_swap_metadata", swap_in),
        ):
            if meta is None:
                continue
            lst = getattr(request, attr, None)
            if lst is None:
                lst = []
                setattr(request, attr, lst)
            lst.append(meta)

    def take_backups(self) -> Any | None:
        """The backups and storage work planned so far, as one FastDeploy eviction
        metadata for the batch being sent, or None. A swap-in planned outside an
        allocation (never expected) is failed here; the evictions are kept."""
        tasks = self._manager.take_swap_metadata()
        if tasks.swap_in is not None:  # allocations take their own swap-ins: never here
            # Taken with the evictions: fail it (its blocks return), keep those.
            log.error("fastkv: a swap-in was planned outside allocate_device_blocks")
            error = "planned outside allocate_device_blocks: never dispatched"
            tid = tasks.swap_in.transfer_id
            self.apply([TransferResult(tid, False, error, epoch=self._manager.epoch)])
        return self._evict_with_storage(tasks)

    def _evict_with_storage(self, tasks: SwapTasks) -> Any | None:
        evict = (
            None
            if tasks.evict is None
            else to_fastdeploy(tasks.evict, self._swap_cls, self._levels)
        )
        load, lookups = tasks.storage_load, tasks.lookups
        if self._divert_reads is not None:  # they go to the workers on their own route
            if load is not None or lookups:
                self._divert_reads(load, lookups)
            load, lookups = None, ()
        return storage_to_fastdeploy(
            load,
            tasks.storage_store,
            lookups,
            self._swap_cls,
            self._levels,
            evict,
        )

    # -- back -----------------------------------------------------------------

    def apply(self, results: Sequence[TransferResult | LookupResult]) -> None:
        """Apply the results one at a time (one the manager refuses is dropped,
        logged and counted, and spoils no other; one of an earlier cache epoch is
        dropped and counted), then rewind the requests whose
        swap-in failed to the first failed block."""
        rollbacks: list[Rollback] = []
        manager = self._manager
        for result in results:  # one at a time: an unknown id spoils no other
            stale = manager.stale_results
            try:
                rollbacks += manager.apply_results([result])
            except ValueError as e:
                self._counters.results_unknown += 1
                log.error("fastkv: dropped a worker result: %s", e)
                continue
            if manager.stale_results != stale:  # of an earlier epoch: dropped
                self._counters.results_stale += 1
                continue
            self._counters.results_applied += 1
            if isinstance(result, TransferResult) and not result.success:
                log.warning("fastkv transfer %d failed: %s", result.transfer_id, result.error)
        for rollback in rollbacks:
            self._rewind(rollback)

    def _rewind(self, rollback: Rollback) -> None:
        self._counters.rollback_blocks += len(rollback.block_indices)
        request = self._request_of(rollback.request_id)
        if request is None:
            return
        first = min(rollback.block_indices) * self._block_size
        if request.num_computed_tokens > first:
            self._counters.rewound_tokens += request.num_computed_tokens - first
            request.num_computed_tokens = first
        log.warning(
            "fastkv: request %r recomputes from token %d (its swap-in failed)",
            rollback.request_id,
            first,
        )

    # -- never sent -------------------------------------------------------------

    def fail_undispatched(self, request: Any) -> None:
        """Fail the transfers and lookups whose metadata is still on the request
        (it ended before any worker got them) and clear those lists. Every fastkv
        tag counts, each in the epoch it names (one of an earlier epoch is dropped
        by the manager); an entry without one (not fastkv's) is skipped and
        logged, and hides none after it."""
        ids: list[tuple[int, int]] = []
        lookups: list[tuple[int, int]] = []
        for attr in _LISTS:
            for meta in getattr(request, attr, None) or ():
                copies, stored, looked = tagged_ids(meta)
                ids += copies + stored
                lookups += looked
                try:
                    transfer_ids(meta)  # strict: says which entry is not fastkv's
                except ValueError as e:  # logged; the ids found around it still fail
                    log.error("fastkv: request %r: %s", request.request_id, e)
            if getattr(request, attr, None):
                setattr(request, attr, [])
        if ids or lookups:
            self._counters.undispatched_transfers += len(ids) + len(lookups)
            error = "never dispatched: the request ended first"
            self.apply(
                [TransferResult(t, False, error, epoch=e) for t, e in ids]
                + [LookupResult(q, 0, epoch=e) for q, e in lookups]
            )

    def fail_never_sent(self) -> None:
        """Fail the transfers planned but never sent to a worker (no request is left
        to carry them)."""
        tasks = self._manager.take_swap_metadata()
        ids = [
            m.transfer_id
            for m in (tasks.evict, tasks.swap_in, tasks.storage_load, tasks.storage_store)
            if m is not None
        ]
        if ids or tasks.lookups:
            self._counters.undispatched_transfers += len(ids) + len(tasks.lookups)
            epoch = self._manager.epoch
            self.apply(
                [TransferResult(t, False, "never dispatched: reset", epoch=epoch) for t in ids]
                + [LookupResult(q.lookup_id, 0, epoch=epoch) for q in tasks.lookups]
            )


# The receiver each channel name of this process is bound by, and the manager
# holding it (weakly: a manager dropped without close() is gone once collected).
_CHANNELS: dict[str, tuple[ResultsReceiver, weakref.ref[object]]] = {}
_CHANNELS_LOCK = threading.Lock()


def bind_channel(name: str, tp_size: int, owner: object) -> ResultsReceiver:
    """Bind the results channel `name` for the cache manager `owner`.

    A name an earlier manager of this process bound is taken over only from a
    manager that is gone: closed, or dropped and collected (FastDeploy builds a new
    ResourceManagerV1 without closing the old one; a reference cycle may keep the
    dropped one until a collection, so one is run before refusing). A live one
    keeps the name and its results: this start is refused.

    Raises:
        OSError(EADDRINUSE): a live manager of this process, or another process,
            holds the name; the message names the channel and the holder.
    """
    with _CHANNELS_LOCK:
        earlier = _CHANNELS.get(name)
        if earlier is not None and not earlier[0].closed and earlier[1]() is not None:
            gc.collect()  # a dropped manager in a reference cycle is gone after this
        if earlier is not None and not earlier[0].closed:
            holder = earlier[1]()
            if holder is not None:
                raise OSError(
                    errno.EADDRINUSE,
                    f"results channel {name!r}: held by a live cache manager of this "
                    f"process (pid {os.getpid()}, {type(holder).__name__} at "
                    f"{id(holder):#x}); close() it first, or give each engine its own "
                    "FASTKV_RESULTS_CHANNEL",
                )
            log.info("fastkv: results channel %r: taken over from a dropped manager", name)
            earlier[0].close()
        receiver = ResultsReceiver(name, tp_size)
        _CHANNELS[name] = (receiver, weakref.ref(owner))
        return receiver


def release_channel(receiver: ResultsReceiver) -> None:
    """Close `receiver` and free its name for the next manager (idempotent)."""
    with _CHANNELS_LOCK:
        held = _CHANNELS.get(receiver.name)
        if held is not None and held[0] is receiver:
            del _CHANNELS[receiver.name]
        receiver.close()


@atexit.register
def _close_channels() -> None:
    with _CHANNELS_LOCK:
        for receiver, _ in _CHANNELS.values():
            receiver.close()
        _CHANNELS.clear()


__all__ = ["TransferRelay", "bind_channel", "release_channel"]
