"""What a worker's CacheController reports (importable without paddle, so a
scheduler process can receive and export it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ControllerStats:
    """Counters since the controller was created, and its state now.

    Transfers, blocks and bytes count what was launched per direction;
    `ordering_waits` counts copies ordered after another copy touching the same
    blocks; the storage counts are blocks read from and written to the storage tier.
    """

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
    storage_blocks_read: int = 0
    storage_blocks_written: int = 0


@dataclass(slots=True)
class CopyCounters:
    """What the copies of one direction launched, counted as they launch."""

    transfers: int = 0
    blocks: int = 0
    nbytes: int = 0

    def add(self, num_blocks: int, block_bytes: int) -> None:
        """Count one transfer of `num_blocks` blocks of `block_bytes` bytes each."""
        self.transfers += 1
        self.blocks += num_blocks
        self.nbytes += num_blocks * block_bytes


@dataclass(slots=True)
class StorageCounters:
    """Blocks moved to and from the storage tier (counted as submitted), and the
    storage transfers reported failed."""

    blocks_written: int = 0
    blocks_read: int = 0
    failed_transfers: int = 0


__all__ = ["ControllerStats", "CopyCounters", "StorageCounters"]
