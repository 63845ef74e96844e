"""The scheduler's counters and the snapshots it reports.

`ManagerCounters` is the one mutable record of what a `CacheManager` has done since
it was created (each field is bumped where the event happens); `get_stats()` copies
it, with the state of the pools, tree and transfers, into an immutable `CacheStats`.
`StorageTierStats` is the storage tier's share.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastkv.scheduler.block_pool import PoolStats


@dataclass(slots=True)
class ManagerCounters:
    """Event counts since the manager was created (see `CacheStats` for each
    meaning); mutable, bumped in place on the manager's paths."""

    lookup_blocks: int = 0
    lookup_tokens: int = 0
    device_hits: int = 0
    host_hits: int = 0
    d2h_blocks: int = 0
    h2d_blocks: int = 0
    d2h_transfers: int = 0
    h2d_transfers: int = 0
    backups: int = 0
    backups_without_room: int = 0
    backup_retries: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    failed_transfers: int = 0
    rollbacks: int = 0


@dataclass(frozen=True, slots=True)
class StorageTierStats:
    """The storage tier as the scheduler saw it.

    Attributes:
        lookups, lookup_blocks: requests (and blocks) looked up in storage.
        hit_blocks: blocks loaded from storage into host for a request.
        load_failures: blocks whose load failed (on some rank); retried later.
        skipped_loads: blocks found but not loaded (PREDICTED: recomputing was
            cheaper).
        abandoned_loads: blocks a request stopped waiting for (they still land).
        writes, write_failures: blocks written to storage, and writes that failed
            (a failed write never counts as stored).
    """

    lookups: int
    lookup_blocks: int
    hit_blocks: int
    load_failures: int
    skipped_loads: int
    abandoned_loads: int
    writes: int
    write_failures: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since the manager was created, and the state now.

    `lookup_tokens` counts the prompt tokens given to `match`; the hit counts are
    blocks found (after the rule that a prompt's last token is computed).
    `backups_without_room` counts blocks a write-through policy owed a host copy
    when no host block was free; `backup_retries` counts owed copies made when
    such a block (or one whose backup failed) was evicted instead.
    """

    block_size: int
    lookup_blocks: int
    lookup_tokens: int
    device_hit_blocks: int
    host_hit_blocks: int
    device_to_host_blocks: int
    host_to_device_blocks: int
    device_to_host_transfers: int
    host_to_device_transfers: int
    backups: int
    backups_without_room: int
    backup_retries: int
    device_evictions: int
    host_evictions: int
    failed_transfers: int
    rollbacks: int
    inflight_transfers: int
    stalled_transfers: int
    inflight_blocks: int
    queued_blocks: int
    active_requests: int
    cached_nodes: int
    device_pool: PoolStats
    host_pool: PoolStats
    storage: StorageTierStats | None = None

    @property
    def storage_hit_blocks(self) -> int:
        return self.storage.hit_blocks if self.storage is not None else 0

    @property
    def storage_hit_tokens(self) -> int:
        return self.storage_hit_blocks * self.block_size

    @property
    def device_hit_tokens(self) -> int:
        return self.device_hit_blocks * self.block_size

    @property
    def host_hit_tokens(self) -> int:
        return self.host_hit_blocks * self.block_size

    @property
    def hit_rate(self) -> float:
        """Hit blocks (every tier) per looked-up block."""
        hits = self.device_hit_blocks + self.host_hit_blocks + self.storage_hit_blocks
        return hits / self.lookup_blocks if self.lookup_blocks else 0.0

    @property
    def hit_token_rate(self) -> float:
        """Prompt tokens served from the cache (every tier) per prompt token."""
        hits = self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens
        return hits / self.lookup_tokens if self.lookup_tokens else 0.0


__all__ = ["CacheStats", "ManagerCounters", "StorageTierStats"]
