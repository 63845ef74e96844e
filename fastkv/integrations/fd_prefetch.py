"""Storage prefetches of the FastDeploy cache manager (FastDeploy's newer v1 API,
PR #7529: `prefetch_storage`, `drain_pending_prefetches`,
`update_storage_blocks_to_host`, `abort_prefetch_blocks`).

A prefetch is held in fastkv's manager by a stand-in request (`_PrefetchKey`) that
matches the prompt with a storage lookup. The lookup and the loads its answer
plans never ride a step: they wait here as `PendingPrefetch` tasks
(`StorageMetadata(hash_values, block_ids, direction)`) until the engine drains
them and sends them to every worker over its own engine-worker queue; each rank
answers over the results channel. Blocks a prefetch brought from storage are
remembered until a match hits them, so that hit counts as a storage hit (once).

A task's `hash_values` are fastkv's tagged entries (`"Q<lookup>:<hash>"` for a
lookup, `"L<transfer>:<hash>"` for a load into host block `block_ids[i]`, see
`fd_transfers`), so a worker needs no other table to report each one.

This room holds the whole group, so a different prefetch API replaces this module
and the cache manager's methods that call it. Not thread-safe: the cache manager
adapter calls it under its lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastkv.integrations.fd_transfers import (
    FASTDEPLOY_METADATA_MODULE,
    STORAGE_LOAD,
    STORAGE_LOOKUP,
    storage_tag_of,
    tag,
)
from fastkv.integrations.fd_views import AdapterCounters, prompt_digests
from fastkv.metadata import CacheSwapMetadata, LookupResult, StorageLookup, TransferResult
from fastkv.scheduler import CacheManager

log = logging.getLogger(__name__)

LOOKUP = "lookup"  # fastkv's direction for a task that only asks (no host blocks)


@dataclass
class FDStorageMetadata:
    """Stand-in for FastDeploy's `StorageMetadata` (same fields) when FastDeploy is
    not importable."""

    hash_values: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    direction: str = "load"
    storage_type: str = "file"
    endpoint: str | None = None
    timeout: float = 30.0
    layer_num: int = 0
    extra_params: dict[str, Any] = field(default_factory=dict)


@dataclass
class PendingPrefetch:
    """One storage task for every worker (upstream's `PendingPrefetch`).

    Attributes:
        request_id: the FastDeploy request the work is for (a load that serves
            several prefetches names the first).
        metadata: what the workers do: `direction="load"` loads `hash_values[i]`
            into host block `block_ids[i]`; `direction="lookup"` (fastkv's) asks
            how long a prefix of `hash_values` storage holds (`block_ids` all -1).
        host_block_ids: the host blocks the task fills (empty for a lookup): what
            the engine passes to `update_storage_blocks_to_host` or
            `abort_prefetch_blocks` once every rank reported.
    """

    request_id: Hashable
    metadata: Any
    host_block_ids: list[int] = field(default_factory=list)


def storage_metadata_type() -> type:
    """FastDeploy's `StorageMetadata` when importable, else `FDStorageMetadata`."""
    try:
        import importlib

        return importlib.import_module(FASTDEPLOY_METADATA_MODULE).StorageMetadata
    except (ImportError, AttributeError):
        return FDStorageMetadata


class _PrefetchKey(tuple):
    """The id of the stand-in request that holds a storage prefetch in fastkv's
    manager: distinct from every FastDeploy request id."""

    def __new__(cls, request_id: Hashable) -> _PrefetchKey:
        return super().__new__(cls, ("fastkv-prefetch", request_id))


class StoragePrefetches:
    """The storage prefetches in flight, by FastDeploy request id, the tasks not
    yet drained for the workers, and the blocks prefetches brought into host that
    no match has hit yet.

    Args:
        manager: fastkv's cache manager (with a storage tier when prefetches run).
        block_size: tokens per block.
        num_host_blocks: the host tier's size; at most twice as many landed blocks
            are remembered, oldest forgotten first.
        counters: where prefetches started and storage hits are counted.
    """

    __slots__ = (
        "_block_size",
        "_counters",
        "_keys",
        "_landed",
        "_loads",
        "_manager",
        "_meta_cls",
        "_queue",
        "_remember",
    )

    def __init__(
        self,
        manager: CacheManager,
        *,
        block_size: int,
        num_host_blocks: int,
        counters: AdapterCounters,
    ) -> None:
        self._manager = manager
        self._block_size = block_size
        self._remember = 2 * num_host_blocks
        self._counters = counters
        self._meta_cls = storage_metadata_type()
        # request id -> the key of the stand-in request holding its prefetch
        self._keys: dict[Hashable, _PrefetchKey] = {}
        # blocks a prefetch brought from storage, not hit since
        self._landed: OrderedDict[Hashable, None] = OrderedDict()
        self._queue: list[PendingPrefetch] = []  # not drained yet
        self._loads: dict[int, list[int]] = {}  # load transfer id -> its host blocks

    def __len__(self) -> int:
        """Prefetches in flight (each holds a stand-in request in the manager)."""
        return len(self._keys)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._keys

    def begin(self, request: Any) -> bool:
        """Start the prefetch of what `request` does not find cached (its lookup
        is queued for the workers; nothing waits here), unless one is in flight
        or the request is active.

        Returns:
            Whether a lookup was queued.

        Raises:
            ValueError: the request's `prompt_hashes` are not SHA-256 digests.
        """
        rid = request.request_id
        if rid in self._keys or self._manager.is_active(rid):
            return False
        tokens, hashes = prompt_digests(request, self._block_size)
        if not self.start(rid, hashes, tokens):
            return False
        self.take_work()
        return True

    def start(self, request_id: Hashable, hashes: Sequence[bytes], tokens: int) -> bool:
        """Plan a storage lookup of the blocks of `hashes` cached neither on the
        device nor in host (never waits; refused input is logged).

        Returns:
            Whether a lookup was planned (False: nothing to look up, or refused).
        """
        key = _PrefetchKey(request_id)
        try:
            hit = self._manager.match(key, hashes, tokens)
        except (ValueError, TypeError) as e:
            log.error("fastkv prefetch_storage(%r) failed: %s", request_id, e)
            return False
        if not hit.storage_lookup:
            self._manager.finish(key)
            return False
        self._counters.prefetches += 1
        self._keys[request_id] = key
        return True

    def lookup_pending(self, request_id: Hashable) -> bool:
        """Whether the request's prefetch still waits for its lookup's answer."""
        key = self._keys.get(request_id)
        return key is not None and self._manager.request_state(key).lookup_id >= 0

    def found(self, request_id: Hashable) -> bool:
        """Whether the request's prefetch has blocks loading or loaded from storage."""
        key = self._keys.get(request_id)
        if key is None:
            return False
        mgr = self._manager
        return mgr.storage_pending(key) or bool(mgr.storage_loaded(key))

    def take_work(self) -> None:
        """Move the lookups and the load the manager planned into the queue of
        tasks for the workers (never into a step's metadata)."""
        load, lookups = self._manager.take_storage_reads()
        self.queue(load, lookups)

    def queue(self, load: CacheSwapMetadata | None, lookups: Sequence[StorageLookup]) -> None:
        """Queue `load` and `lookups` as `PendingPrefetch` tasks."""
        owner = {self._manager.request_state(k).lookup_id: rid for rid, k in self._keys.items()}
        for q in lookups:
            texts = [STORAGE_LOOKUP + tag(q.lookup_id, h, q.epoch) for h in q.block_hashes]
            meta = self._meta_cls(
                hash_values=texts, block_ids=[-1] * len(texts), direction=LOOKUP
            )
            self._queue.append(PendingPrefetch(owner.get(q.lookup_id, "fastkv"), meta))
        if load is not None:
            hosts = list(load.dst_block_ids)
            tid, epoch = load.transfer_id, load.epoch
            texts = [STORAGE_LOAD + tag(tid, h, epoch) for h in load.block_hashes]
            meta = self._meta_cls(hash_values=texts, block_ids=hosts, direction="load")
            self._loads[load.transfer_id] = hosts
            rids = self.owners(hosts)
            self._queue.append(PendingPrefetch(rids[0] if rids else "fastkv", meta, hosts))

    def take_queue(self) -> list[PendingPrefetch]:
        """The tasks queued since the last call, in order, for every worker."""
        tasks, self._queue = self._queue, []
        return tasks

    def loads_in_flight(self, host_block_ids: Sequence[int]) -> list[int]:
        """The load transfers still in flight that fill any of `host_block_ids`
        (loads whose results are in are forgotten here)."""
        wanted = set(host_block_ids)
        busy = []
        for tid, hosts in list(self._loads.items()):
            if not self._manager.is_inflight(tid):
                del self._loads[tid]
            elif wanted.intersection(hosts):
                busy.append(tid)
        return busy

    def owners(self, host_block_ids: Sequence[int]) -> list[Hashable]:
        """The prefetches whose path holds any of `host_block_ids`, in start order."""
        wanted = set(host_block_ids)
        mgr = self._manager
        return [
            rid
            for rid, key in self._keys.items()
            if any(n.host_block in wanted for n in mgr.request_state(key).nodes)
        ]

    def never_sent(self) -> list[TransferResult | LookupResult]:
        """Take every task never drained, as the failures to apply for them (no
        worker saw them)."""
        out: list[TransferResult | LookupResult] = []
        epoch = self._manager.epoch  # every queued task is of the manager's epoch
        for task in self.take_queue():
            found = [storage_tag_of(h) for h in task.metadata.hash_values]
            ids = {f[1] for f in found if f is not None}
            if task.metadata.direction == LOOKUP:
                out += [LookupResult(q, 0, epoch=epoch) for q in sorted(ids)]
            else:
                why = "never dispatched"
                out += [TransferResult(t, False, why, epoch=epoch) for t in sorted(ids)]
        return out

    def end(self, request_id: Hashable) -> bool:
        """Stop waiting for the request's prefetch: remember what it landed, let its
        stand-in go (blocks still loading land and serve later matches).

        Returns:
            Whether a prefetch of the request was in flight.
        """
        key = self._keys.pop(request_id, None)
        if key is None:
            return False
        landed = self._landed
        for h in self._manager.storage_loaded(key):
            landed[h] = None
            landed.move_to_end(h)
        while len(landed) > self._remember:
            landed.popitem(last=False)
        self._manager.finish(key)
        return True

    def give_up_all(self) -> None:
        """End every prefetch and forget every landed block (a reset)."""
        for rid in list(self._keys):
            self.end(rid)
        self._landed.clear()

    def take_storage_hits(self, hashes: Sequence[Hashable]) -> int:
        """How many of a match's host hits `hashes` a prefetch landed; each counts
        as a storage hit once (here and in the counters), then is forgotten."""
        from_storage = 0
        if self._landed:
            for h in hashes:
                if self._landed.pop(h, 1) is None:
                    from_storage += 1
        self._counters.storage_hit_blocks += from_storage
        return from_storage


__all__ = ["FDStorageMetadata", "PendingPrefetch", "StoragePrefetches", "storage_metadata_type"]
