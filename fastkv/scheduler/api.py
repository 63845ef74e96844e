"""What an engine reads back from the cache manager: small result types, no state.

Each result says what happened and, where the engine has something to do, what that
is: `Allocation.status` names the next step (`AllocStatus`), a `Rollback` names the
positions to recompute, a `StalledTransfer` names a copy whose result never came.
Blocks themselves are never listed here: an engine reads them from the request's
`BlockTable` (`CacheManager.block_table`), position by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fastkv.metadata import CacheSwapMetadata, StorageLookup
from fastkv.scheduler.request import RequestId


@dataclass(slots=True)
class MatchResult:
    """What `match` found for a request (counts for scheduling and metrics; the
    request's blocks themselves are read from `CacheManager.block_table`).

    Attributes:
        num_device_hits: matched blocks already in the request's table: the leading
            run of matched blocks that sit on the device.
        num_host_hits: the other matched blocks, which `allocate` brings into the
            table: host copies it swaps in, and device blocks matched below one.
        num_cached_tokens: tokens the engine skips: the hits times the block size
            (always fewer than the prompt: its last token is computed).
        waiting_on_transfer: the match stopped at a block whose copy is in flight;
            matching again after it lands finds more.
        storage_lookup: the blocks past the hits are being looked up in the
            storage tier; `allocate` reports what was found (and loaded).
    """

    num_device_hits: int
    num_host_hits: int
    num_cached_tokens: int
    waiting_on_transfer: bool
    storage_lookup: bool = False

    @property
    def num_hits(self) -> int:
        return self.num_device_hits + self.num_host_hits


class AllocStatus(StrEnum):
    """The outcome of `allocate`, and what the caller does next."""

    ALLOCATED = "allocated"
    """The table covers the tokens asked for: read it with `block_table`."""
    WAIT_FOR_TRANSFERS = "wait_for_transfers"
    """The request fits once transfers already planned complete: evictions that
    free device blocks, or a load of a block it matched. Send `take_swap_metadata()`
    to the worker, apply the results it reports, then call `allocate` again."""
    NO_SPACE = "no_space"
    """Other active requests hold the blocks it needs: finish or preempt (abort) one
    of them, or wait for one to finish, then call `allocate` again."""


# A module global: reading a member off the enum class costs a metaclass lookup,
# several times a global read, on every allocation an engine tests.
_ALLOCATED = AllocStatus.ALLOCATED


@dataclass(frozen=True, slots=True)
class Allocation:
    """What `allocate` did; true exactly when the table covers the tokens asked for.

    It names no blocks: the table (`CacheManager.block_table`) is the only place an
    engine reads them from, position by position.

    Attributes:
        status: see `AllocStatus`.
        num_new_blocks: how many blocks this call added to the table (host-hit
            destinations, matched device blocks brought in, fresh blocks).
        num_cached_tokens: when ALLOCATED, the tokens whose KV the cache provides
            (device, host and storage hits, the latter known only now): the engine
            computes from there.
    """

    status: AllocStatus
    num_new_blocks: int = 0
    num_cached_tokens: int = 0

    def __bool__(self) -> bool:
        return self.status is _ALLOCATED


@dataclass(frozen=True, slots=True)
class SwapTasks:
    """The transfers one step hands to the worker; either may be None."""

    evict: CacheSwapMetadata | None
    """Device to host: evictions (write_back) and backups (write-through policies)."""
    swap_in: CacheSwapMetadata | None
    """Host to device: host hits of the requests allocated since the last step."""
    storage_load: CacheSwapMetadata | None = None
    """Storage to host: blocks found in storage, prefetched into host blocks."""
    storage_store: CacheSwapMetadata | None = None
    """Host to storage: writes the storage write policy planned."""
    lookups: tuple[StorageLookup, ...] = ()
    """Storage lookups; answered with LookupResults in a later step."""


@dataclass(frozen=True, slots=True)
class Rollback:
    """A failed swap-in: these block positions of the request hold garbage and the
    engine must recompute their tokens before committing them."""

    request_id: RequestId
    block_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StalledTransfer:
    """A transfer taken but without a result for `CacheManager.stall_after_s`."""

    transfer_id: int
    direction: str
    """"device->host", "host->device", "storage->host" or "host->storage"."""
    num_blocks: int
    age_s: float
    """Seconds since `take_swap_metadata` handed it out."""


__all__ = [
    "AllocStatus",
    "Allocation",
    "MatchResult",
    "Rollback",
    "StalledTransfer",
    "SwapTasks",
]
