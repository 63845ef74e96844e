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


__all__ = ["ControllerStats"]
