"""The contract between the scheduler and the worker; the only module both import.

Block ids travel as plain lists of ints. Measured on the development machine
(pickle protocol 5, dump + load): 256 ids cost 11 us as a list and 10 us as an
int64 array, but the scheduler builds lists and converting one to an array costs
another 6 us; at 16 ids the list is 10x cheaper. Only past a few thousand ids per
transfer do arrays win, and a step rarely moves that many blocks. The worker turns
them into int64 arrays once, which its copy ops need anyway.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import IntEnum


class CacheLevel(IntEnum):
    """A tier of the cache hierarchy, fastest first."""

    DEVICE = 0
    HOST = 1
    STORAGE = 2


@dataclass(frozen=True, slots=True)
class CacheSwapMetadata:
    """One transfer the worker must execute: copy `src_block_ids[i]` of `src_level`
    into `dst_block_ids[i]` of `dst_level`, for every i.

    The scheduler guarantees that no destination block is read or written by any
    other in-flight transfer, and that no block listed here returns to its pool
    before the matching `TransferResult` has been applied.

    Attributes:
        transfer_id: unique per CacheManager; echoed in the TransferResult.
        src_level, dst_level: the tiers copied from and to; they differ.
        src_block_ids, dst_block_ids: equal-length block id lists.
        block_hashes: the hash of each block (storage keys, debugging); may be empty.

    Raises:
        ValueError: the levels are equal, the id lists differ in length, or
            `block_hashes` is non-empty and of another length.
    """

    transfer_id: int
    src_level: CacheLevel
    dst_level: CacheLevel
    src_block_ids: Sequence[int]
    dst_block_ids: Sequence[int]
    block_hashes: Sequence[Hashable] = ()

    def __post_init__(self) -> None:
        if self.src_level == self.dst_level:
            raise ValueError(f"dst_level: equals src_level ({self.src_level.name})")
        n = len(self.src_block_ids)
        if len(self.dst_block_ids) != n:
            raise ValueError(
                f"dst_block_ids: length {len(self.dst_block_ids)} != src_block_ids length {n}"
            )
        if len(self.block_hashes) and len(self.block_hashes) != n:
            raise ValueError(
                f"block_hashes: length {len(self.block_hashes)} != block count {n}"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """The worker's report on one `CacheSwapMetadata`.

    A transfer succeeds or fails as a whole: on failure the scheduler treats every
    destination block as garbage and rolls the affected cache entries back.
    """

    transfer_id: int
    success: bool
    error: str = ""
