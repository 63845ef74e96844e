"""Device blocks reserved for bytes another instance writes (prefill/decode).

A receiving block is in no tree and no request's table and not free: nothing
matches, evicts, swaps, stores or frees it, and no request reads it, until the
manager hands it to a request (`CacheManager.commit_received`) or returns it to the
pool (`release`), only once no write into it can still land (the caller's fence,
see `fastkv.pd`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from fastkv.scheduler.api import AllocStatus
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.tiers import CacheTiers


class ReceivingBlocks:
    """The receiving set of one manager's device pool."""

    def __init__(self, pool: BlockPool, tiers: CacheTiers, reuse_evicted_blocks: bool) -> None:
        self._pool = pool
        self._tiers = tiers
        self._reuse_evicted = reuse_evicted_blocks
        self._ids: set[int] = set()

    def reserve(
        self, num_blocks: int, is_busy: Callable[[int], bool]
    ) -> list[int] | AllocStatus:
        """Take `num_blocks` device blocks (free ones first, then by eviction as
        `allocate` does); `num_blocks` is checked by the caller. With
        `reuse_evicted_blocks` and a host tier only free blocks are taken: an
        evicted block comes with its copy still to run, and only this instance's
        worker orders that copy before writes, not a remote writer's. Without a host
        tier an evicted block is discarded, no copy reads it: it is taken. Nothing
        is reserved when it answers an `AllocStatus`."""
        pool = self._pool
        if num_blocks <= pool.num_free:
            ids: list[int] | AllocStatus = pool.allocate(num_blocks)
        elif self._reuse_evicted and self._tiers.host_pool.capacity:
            return AllocStatus.NO_SPACE
        else:
            ids = self._tiers.take_device_blocks(num_blocks, is_busy)
        if type(ids) is AllocStatus:
            return ids
        self._ids.update(ids)
        return ids

    def checked(self, block_ids: Sequence[int]) -> list[int]:
        """`block_ids` as a list, each receiving and listed once.

        Raises:
            ValueError: an id is not receiving, or is listed twice."""
        ids = list(block_ids)
        for i, block in enumerate(ids):
            if block not in self._ids:
                raise ValueError(f"block_ids[{i}]: {block!r} is not a receiving block")
        if len(set(ids)) != len(ids):
            raise ValueError("block_ids: a block is listed twice")
        return ids

    def handed_over(self, ids: Sequence[int]) -> None:
        """`ids` (checked) now belong to a request's table."""
        self._ids.difference_update(ids)

    def release(self, ids: Sequence[int]) -> None:
        """Return `ids` (checked) to the device pool."""
        self._ids.difference_update(ids)
        self._pool.free(ids)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)
