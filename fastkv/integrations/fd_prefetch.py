"""Storage prefetches of the FastDeploy cache manager (FastDeploy's newer v1 API:
`prefetch_storage`, `drain_pending_prefetches`, `update_storage_blocks_to_host`,
`abort_prefetch_blocks`).

A prefetch is held in fastkv's manager by a stand-in request (`_PrefetchKey`) that
matches the prompt with a storage lookup: the lookup and the loads it starts go to
the workers with the next step's metadata, their results come back over the
results channel, and once the prefetch ends its blocks sit in host, unlocked, until
the request's own match. Blocks a prefetch brought from storage are remembered
until a match hits them, so that hit counts as a storage hit (once).

This room holds the whole group, so a different prefetch API replaces this module
and the cache manager's four methods that call it. Not thread-safe: the cache
manager adapter calls it under its lock, after polling the workers' results.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from fastkv.integrations.fd_views import AdapterCounters, prompt_digests
from fastkv.scheduler import CacheManager

log = logging.getLogger(__name__)


class _PrefetchKey(tuple):
    """The id of the stand-in request that holds a storage prefetch in fastkv's
    manager: distinct from every FastDeploy request id."""

    def __new__(cls, request_id: Hashable) -> _PrefetchKey:
        return super().__new__(cls, ("fastkv-prefetch", request_id))


class StoragePrefetches:
    """The storage prefetches in flight, by FastDeploy request id, and the blocks
    they brought into host that no match has hit yet.

    Args:
        manager: fastkv's cache manager (with a storage tier when prefetches run).
        block_size: tokens per block.
        num_host_blocks: the host tier's size; at most twice as many landed blocks
            are remembered, oldest forgotten first.
        counters: where prefetches started and storage hits are counted.
    """

    __slots__ = ("_block_size", "_counters", "_keys", "_landed", "_manager", "_remember")

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
        # request id -> the key of the stand-in request holding its prefetch
        self._keys: dict[Hashable, _PrefetchKey] = {}
        # blocks a prefetch brought from storage, not hit since
        self._landed: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        """Prefetches in flight (each holds a stand-in request in the manager)."""
        return len(self._keys)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._keys

    def prefetch(self, request: Any, *, reset_owed: bool) -> bool:
        """`prefetch_storage` of a request: start a prefetch of what it does not
        find cached, unless one is in flight or the request matched already.

        Args:
            request: FastDeploy's request.
            reset_owed: the cache owes a reset (its blocks may be gone): nothing
                starts.

        Returns:
            Whether a prefetch of the request is in flight now.

        Raises:
            ValueError: the request's `prompt_hashes` are not SHA-256 digests.
        """
        rid = request.request_id
        if rid in self._keys:
            return True
        if self._manager.is_active(rid):
            return False
        tokens, hashes = prompt_digests(request, self._block_size)
        if reset_owed:
            return False
        return self.start(rid, hashes, tokens)

    def start(self, request_id: Hashable, hashes: Sequence[bytes], tokens: int) -> bool:
        """Look up in storage the blocks of `hashes` cached neither on the device
        nor in host, and load what is found (never waits; refused input is logged).

        Returns:
            Whether a prefetch started (False: nothing to look up, or refused).
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

    def drain(self) -> list[Hashable]:
        """End every prefetch whose lookup was answered and whose loads have all
        landed (or failed); returns their request ids in the order they started."""
        done = [
            rid for rid, key in self._keys.items() if not self._manager.storage_pending(key)
        ]
        for rid in done:
            self.end(rid)
        return done

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


__all__ = ["StoragePrefetches"]
