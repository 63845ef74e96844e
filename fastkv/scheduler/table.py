"""A request's block table as the manager hands it out: the only truth an engine reads.

Position p of a request holds tokens [p * block_size, (p + 1) * block_size). Its
entry says which device block holds that KV and what the engine does with it:

    position    0        1        2        3        4
    block      17        4       31        9       12
    slot     CACHED   CACHED  LOADING  COMPUTE  COMPUTE
             `------- num_cached_blocks = 3 -------'
              KV the cache provides    |  the engine computes from token 3 * bs on
                                       |
               a swap-in writes block 31: wait for its layer before reading it

The leading CACHED/LOADING positions are what the cache provides (device hits, host
hits being swapped in, blocks found in storage); the engine computes from
`num_cached_tokens` on. After a failed swap-in its positions turn COMPUTE again
(see `CacheManager.apply_results`'s rollbacks) and the cached prefix ends at the
first of them; positions past it keep their slot. A CACHED one there holds valid KV
that other requests may read: an engine that recomputes every position from
`num_cached_tokens` on writes the same KV into it again.

An engine never builds a table from hit counts and lists of new blocks: it asks the
manager (`CacheManager.block_table`), which knows every position, including device
blocks matched below a host hit and blocks another request loaded meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from fastkv.config import as_int
from fastkv.scheduler.radix_tree import SWAP_TO_DEVICE
from fastkv.scheduler.request import RequestState


class Slot(IntEnum):
    """What a table position's block holds, and what the engine does with it."""

    CACHED = 0
    """Valid KV now: read it."""
    LOADING = 1
    """A swap-in this step writes it: read it after the layer's wait
    (`LayerDoneCounter.wait_for_layer`)."""
    COMPUTE = 2
    """The engine writes its KV (new tokens, or a failed swap-in to recompute)."""


@dataclass(frozen=True, slots=True)
class BlockTable:
    """A snapshot of positions [start, start + len(block_ids)) of a request's table.

    Attributes:
        start: the position of `block_ids[0]` (0 for the whole table).
        block_ids: per position, its device block.
        slots: per position, its `Slot`.
        num_blocks: the whole table's length (positions beyond this window included).
        num_cached_blocks: the leading positions of the whole table whose KV the
            cache provides (CACHED or LOADING); the engine computes from there.
        block_size: tokens per block.
    """

    start: int
    block_ids: tuple[int, ...]
    slots: tuple[Slot, ...]
    num_blocks: int
    num_cached_blocks: int
    block_size: int

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV the cache provides: the engine's first position to compute."""
        return self.num_cached_blocks * self.block_size

    @property
    def num_tokens(self) -> int:
        """Tokens the whole table can hold."""
        return self.num_blocks * self.block_size

    @property
    def loading(self) -> tuple[int, ...]:
        """The positions in this window a swap-in is writing."""
        return tuple(self.start + i for i, s in enumerate(self.slots) if s is Slot.LOADING)

    def __len__(self) -> int:
        return len(self.block_ids)

    @classmethod
    def of(cls, req: RequestState, block_size: int, start: int = 0) -> BlockTable:
        """The table of request record `req` from position `start` on.

        Positions with a node hold cached KV, the rest are the engine's to compute;
        then the exceptions: blocks a swap-in is writing (LOADING), positions whose
        swap-in failed (COMPUTE again). O(positions returned).

        Raises:
            ValueError: `start` is not an int in [0, table length].
        """
        blocks, nodes = req.blocks, req.nodes
        end = len(blocks)
        start = as_int("start", start, 0, end)
        with_node = max(start, min(len(nodes), end))
        slots = [Slot.CACHED] * (with_node - start) + [Slot.COMPUTE] * (end - with_node)
        if req.loading:
            for pos in range(start, with_node):
                node = nodes[pos]
                if node.state is SWAP_TO_DEVICE and node.device_block == blocks[pos]:
                    slots[pos - start] = Slot.LOADING
        for pos in req.rolled_back:
            if start <= pos < end:
                slots[pos - start] = Slot.COMPUTE
        return cls(
            start, tuple(blocks[start:]), tuple(slots), end, req.num_cached_blocks, block_size
        )


__all__ = ["BlockTable", "Slot"]
