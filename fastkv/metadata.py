"""The contract between the scheduler and the worker; the only module both import.

Block ids travel as plain lists of ints. Measured on the development machine
(pickle protocol 5, dump + load): 256 ids cost 11 us as a list and 10 us as an
int64 array, but the scheduler builds lists and converting one to an array costs
another 6 us; at 16 ids the list is 10x cheaper. Only past a few thousand ids per
transfer do arrays win, and a step rarely moves that many blocks. The worker turns
them into int64 arrays once, which its copy ops need anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NewType

DIGEST_BYTES = 32
"""Bytes of a block hash and of a storage namespace digest (SHA-256)."""

BlockHash = NewType("BlockHash", bytes)
"""A block's chained hash (a 32-byte digest, see `fastkv.hashing`): the key of its
radix-tree node and of its storage object. Defined here, the one module both halves
import, and imported from here everywhere else. A NewType costs nothing at run
time; code that builds hashes in bulk returns the digests as they are."""


Epoch = NewType("Epoch", int)
"""A generation of a cache's contents: a counter that starts at 0 and grows by one
each time the cache is reset (`CacheManager.reset_cache`). Transfer ids restart with
a new epoch, so every message that names a transfer also names the epoch it belongs
to, and a message of another epoch is dropped (and counted), never applied. The one
epoch notion of fastkv: cache resets and prefill/decode transfers (`fastkv.pd`) use
this type, no other. At most `MAX_EPOCH`."""


class CacheLevel(IntEnum):
    """A tier of the cache hierarchy, fastest first."""

    DEVICE = 0
    HOST = 1
    STORAGE = 2


TransferListener = Callable[[CacheLevel, CacheLevel, int, float, bool], None]
"""`listener(src_level, dst_level, num_blocks, seconds, success)`: one transfer
result, on either half: the scheduler calls it as it applies a result (`seconds`
from `take_swap_metadata` to `apply_results`), the worker as it collects one
(`seconds` from launch to collection). Metrics hang off it."""


@dataclass(frozen=True, slots=True)
class CacheSwapMetadata:
    """One transfer the worker must execute: copy `src_block_ids[i]` of `src_level`
    into `dst_block_ids[i]` of `dst_level`, for every i.

    A storage transfer (either level STORAGE) names no storage block ids: that side's
    list is empty and `block_hashes[i]` is the storage key of block i (with the
    worker's rank and namespace).

    The scheduler guarantees that no destination block is read or written by any
    other in-flight transfer, and that no block listed here returns to its pool
    before the matching `TransferResult` has been applied.

    Attributes:
        transfer_id: unique per CacheManager; echoed in the TransferResult.
        src_level, dst_level: the tiers copied from and to; they differ.
        src_block_ids, dst_block_ids: equal-length block id lists (one of them
            empty for a storage transfer).
        block_hashes: the hash of each block (storage keys, debugging); may be
            empty, except for a storage transfer.
        timeout_s: a bound on a storage transfer, seconds; 0 is the worker's default.
        epoch: the cache epoch the scheduler made it in (`Epoch`); the worker echoes
            it in the TransferResult.
        reused_block_ids: DEVICE -> HOST only: the source blocks the scheduler has
            already handed to a new owner (`reuse_evicted_blocks`), which the model
            may write in the step that carries this copy. The worker orders those
            writes after the copy's reads itself; no caller has to. Blocks not
            listed (backups, evictions whose block is not reused yet) never hold
            the model up.

    Raises:
        ValueError: the levels are equal, the id lists differ in length, a storage
            side lists ids, `block_hashes` has another length than the blocks (or
            is empty for a storage transfer), `reused_block_ids` is given for
            another direction, repeats a block or names one that is not a source,
            or `epoch` is not an int >= 0.
    """

    transfer_id: int
    src_level: CacheLevel
    dst_level: CacheLevel
    src_block_ids: Sequence[int]
    dst_block_ids: Sequence[int]
    block_hashes: Sequence[BlockHash] = ()
    timeout_s: float = 0.0
    reused_block_ids: Sequence[int] = ()
    epoch: Epoch = Epoch(0)

    def __post_init__(self) -> None:
        if self.src_level == self.dst_level:
            raise ValueError(f"dst_level: equals src_level ({self.src_level.name})")
        if CacheLevel.STORAGE in (self.src_level, self.dst_level):
            from_storage = self.src_level == CacheLevel.STORAGE
            keyed, name = (
                (self.src_block_ids, "src_block_ids")
                if from_storage
                else (self.dst_block_ids, "dst_block_ids")
            )
            if len(keyed):
                raise ValueError(
                    f"{name}: the storage side takes no block ids (block_hashes are its keys)"
                )
            n = self.num_blocks
            if len(self.block_hashes) != n:
                raise ValueError(
                    f"block_hashes: length {len(self.block_hashes)} != block count {n} "
                    "(a storage transfer needs a key per block)"
                )
        else:
            n = len(self.src_block_ids)
            if len(self.dst_block_ids) != n:
                raise ValueError(
                    f"dst_block_ids: length {len(self.dst_block_ids)} != src_block_ids "
                    f"length {n}"
                )
            if len(self.block_hashes) and len(self.block_hashes) != n:
                raise ValueError(
                    f"block_hashes: length {len(self.block_hashes)} != block count {n}"
                )
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e6:
            raise ValueError(
                f"timeout_s: must be a number of seconds >= 0, got {self.timeout_s!r}"
            )
        if self.epoch:
            check_epoch(self.epoch)
        if len(self.reused_block_ids):
            self._check_reused()

    def _check_reused(self) -> None:
        reused = self.reused_block_ids
        if (self.src_level, self.dst_level) != (CacheLevel.DEVICE, CacheLevel.HOST):
            raise ValueError(
                f"reused_block_ids: only a DEVICE->HOST copy hands blocks over, this is "
                f"{self.src_level.name}->{self.dst_level.name}"
            )
        sources = set(self.src_block_ids)
        seen: set[int] = set()
        for i, block in enumerate(reused):
            if block not in sources:
                raise ValueError(
                    f"reused_block_ids[{i}]: {block!r} is not one of the src_block_ids"
                )
            if block in seen:
                raise ValueError(f"reused_block_ids[{i}]: {block!r} is listed twice")
            seen.add(block)

    @property
    def num_blocks(self) -> int:
        return max(len(self.src_block_ids), len(self.dst_block_ids))


@dataclass(frozen=True, slots=True)
class TransferResult:
    """The worker's report on one `CacheSwapMetadata`.

    A device/host copy succeeds or fails as a whole: on failure the scheduler treats
    every destination block as garbage and rolls the affected cache entries back. A
    storage transfer answers per block: `failed_blocks` lists the positions that
    failed (then `success` is False); the others are good.

    `num_ranks` is how many tensor-parallel ranks the result speaks for: 1 from a
    worker, every rank once `fastkv.tp.RankResults` has combined them. A scheduler
    with several ranks applies only combined results. `epoch` is the metadata's,
    echoed: a scheduler drops (and counts) a result of another epoch than its own.
    """

    transfer_id: int
    success: bool
    error: str = ""
    failed_blocks: tuple[int, ...] = ()
    num_ranks: int = 1
    epoch: Epoch = Epoch(0)


@dataclass(frozen=True, slots=True)
class StorageLookup:
    """Ask the workers how many leading blocks of `block_hashes` storage holds.

    The scheduler never waits for the answer: it comes back as a `LookupResult` in
    a later step, from every rank (each with its own keys), and the usable prefix is
    the minimum over ranks. `epoch` as for `CacheSwapMetadata`.
    """

    lookup_id: int
    block_hashes: Sequence[BlockHash]
    epoch: Epoch = Epoch(0)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """One rank's answer to a `StorageLookup`: the leading blocks storage holds
    (at most the lookup's length). `num_ranks` and `epoch` (the lookup's, echoed)
    as for `TransferResult`."""

    lookup_id: int
    num_hits: int
    num_ranks: int = 1
    epoch: Epoch = Epoch(0)


MAX_EPOCH = (1 << 32) - 1
"""The largest epoch (a results row carries it in 4 bytes)."""


def check_epoch(epoch: object) -> None:
    """Raise ValueError unless `epoch` is an int in [0, MAX_EPOCH] (a bool is not)."""
    if type(epoch) is not int or not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch: must be an int in [0, {MAX_EPOCH}], got {epoch!r}")
