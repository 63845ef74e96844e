"""The per-request record the manager's rooms work on, and the checks of what an
engine passes in for a request (its hashes, its counts)."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from fastkv.config import as_int
from fastkv.hashing import BlockHasher
from fastkv.metadata import DIGEST_BYTES, BlockHash
from fastkv.scheduler.radix_tree import TreeNode

try:
    from fastkv.scheduler._tree_node import append_ids
    from fastkv.scheduler._tree_node import check_digests as _check_digests
except ImportError:  # built by `make install`; the checks below are the same
    _check_digests = None

    def append_ids(table: array[int], ids: list[int]) -> None:
        """Append the block ids `ids` to the int32 table `table`."""
        table.fromlist(ids)


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
        self,
        request_id: RequestId,
        hashes: list[BlockHash],
        nodes: list[TreeNode],
        blocks: array[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.hashes = hashes  # block i's hash, as far as the request has full blocks
        self.hash_set: set[BlockHash] | None = None  # made at the first append_hashes
        self.hasher: BlockHasher | None = None  # the manager hashes its tokens (add_request)
        self.nodes = nodes  # locked path; position i holds block i's node
        # The device block table (match starts it with the device run before the
        # first host copy): int32 ids, no int object per block (a full hit hands
        # out its table without making one; an engine reads it through
        # `BlockTable` or `CacheManager.block_ids`).
        self.blocks: array[int] = array("i") if blocks is None else blocks
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

    @property
    def num_cached_blocks(self) -> int:
        """The leading positions of the table whose KV the cache provides: those
        with a node, up to the first whose swap-in failed."""
        cached = min(len(self.nodes), len(self.blocks))
        if self.rolled_back:
            cached = min(cached, *self.rolled_back)
        return cached


def checked_hashes(
    block_hashes: Sequence[BlockHash], name: str = "block_hashes", *, distinct: bool = True
) -> list[BlockHash]:
    """A request's hashes as a new list, checked: distinct 32-byte digests (the
    chained SHA-256 digests `fastkv.hashing` makes; FastDeploy's hex digests become
    these with `bytes.fromhex`). `distinct=False` leaves distinctness to the caller
    (`RadixTree.match_and_lock` checks it, and only where its walk cannot vouch)."""
    kind = type(block_hashes)
    if (
        kind is not list
        and kind is not tuple
        and (
            issubclass(kind, (str, bytes, bytearray)) or not isinstance(block_hashes, Sequence)
        )
    ):
        raise TypeError(f"{name}: expected a sequence of block hashes, got {kind.__name__}")
    hashes = list(block_hashes)
    if _check_digests is not None:  # the same checks in one pass, in C
        _check_digests(hashes, name, DIGEST_BYTES, distinct)
        return hashes
    if hashes and (
        set(map(type, hashes)) != {bytes} or set(map(len, hashes)) != {DIGEST_BYTES}
    ):
        bad = next(
            i for i, h in enumerate(hashes) if type(h) is not bytes or len(h) != DIGEST_BYTES
        )
        what = (
            f"{len(hashes[bad])} bytes"
            if type(hashes[bad]) is bytes
            else type(hashes[bad]).__name__
        )
        raise TypeError(
            f"{name}[{bad}]: expected a {DIGEST_BYTES}-byte digest (bytes), got {what}"
        )
    if distinct and len(set(hashes)) != len(hashes):
        raise ValueError(f"{name}: a hash appears twice (chained hashes never repeat)")
    return hashes


def check_count(name: str, value: object) -> int:
    """`value` as an int >= 0 (a count of tokens or blocks): any integral type is
    taken (numpy's integers: FastDeploy passes them); a bool or a float raises
    ValueError naming `name`."""
    if type(value) is not int:
        value = as_int(name, value, -(1 << 63))
    if value < 0:
        raise ValueError(f"{name}: {value} is negative; must be >= 0")
    return value


__all__ = ["RequestId", "RequestState", "append_ids", "check_count", "checked_hashes"]
