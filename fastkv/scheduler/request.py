"""The per-request record both the cache manager and its storage tier work on."""

from __future__ import annotations

from collections.abc import Hashable

from fastkv.hashing import BlockHasher
from fastkv.metadata import BlockHash
from fastkv.scheduler.radix_tree import TreeNode

RequestId = Hashable


class RequestState:
    """One active request as the scheduler tracks it.

    Owned by its `CacheManager`; the manager's `StorageTier` edits the storage
    fields (`lookup_id`, `storage_deadline`) and the tail of `nodes` its loads
    added or cut. Positions are block indices: `nodes[i]`, `blocks[i]` and
    `hashes[i]` describe block i of the request.
    """

    __slots__ = (
        "allocated",
        "blocks",
        "done",
        "hash_set",
        "hasher",
        "hashes",
        "loading",
        "lookup_id",
        "nodes",
        "num_matched",
        "owns_matched_positions",
        "request_id",
        "rolled_back",
        "storage_deadline",
        "wait_epoch",
        "waits",
    )

    def __init__(
        self, request_id: RequestId, hashes: list[BlockHash], nodes: list[TreeNode]
    ) -> None:
        self.request_id = request_id
        self.hashes = hashes  # block i's hash, as far as the request has full blocks
        self.hash_set: set[BlockHash] | None = None  # made at the first append_hashes
        self.hasher: BlockHasher | None = None  # the manager hashes its tokens (add_request)
        self.nodes = nodes  # locked path; position i holds block i's node
        self.blocks: list[int] = []  # device block table
        self.loading = 0  # blocks of its swap-in whose result has not arrived
        self.rolled_back: list[int] = []  # positions whose swap-in failed
        # Set once some position below len(nodes) holds a block its node does not
        # own (a duplicate of a concurrently cached block, or a failed swap-in).
        self.owns_matched_positions = False
        self.done = False
        self.num_matched = len(nodes)  # hits at match; storage hits come after
        self.allocated = False
        self.lookup_id = -1  # a storage lookup in flight
        self.storage_deadline = 0.0  # when it stops waiting for storage
        self.waits = 0  # WAIT_FOR_TRANSFERS answers in a row with nothing taken between
        self.wait_epoch = -1  # the manager's take count at the last of them


__all__ = ["RequestId", "RequestState"]
