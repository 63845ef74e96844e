"""A radix tree of chained block hashes with per-tier leaf-first LRU eviction.

One node per block. A block hash is chained: it commits to every block before it,
so it names a whole prefix, and a request's blocks form one root-to-node path. The
children of every node are therefore found by hash in one tree-wide index (a child of
`node` is `index[h]` when that entry's parent is `node`), and each node keeps counts
of its children. One dict per node cost twice the time per block at 100,000 cached
blocks, from memory traffic alone.

Eviction order. A lock (`ref`) counts the requests holding a node, and a request
always locks its whole path: the matched prefix at `match`, the blocks it caches at
`commit`. Unlocking walks a path deepest-first and appends each node whose count
drops to zero to the tail of its tier's LRU list. So, with no timestamps and no
search, every list is ordered by last use (release time), oldest first, and a
node's descendants come before it: the head of the device list is the least
recently used device leaf.

An in-flight copy takes no lock: a node in SWAP_TO_DEVICE, SWAP_TO_HOST or
BACKUP_TO_HOST is on no list, so nothing evicts it, and it is listed when its copy
ends (if no request holds it by then). A transfer therefore costs O(its blocks),
whatever the depth of the path above them.

Failed transfers and copies that outlive their requests can disturb that order (a
block whose eviction failed goes back to the head; one listed when its copy ends
comes after its ancestors). So victims are checked where they are taken: a node
that still has a child holding a copy in that tier is parked instead of evicted,
and goes back to the head of its list when that last child leaves. Only nodes
without any children are ever deleted.

Scale. With millions of cached blocks, per-block Python objects made cyclic garbage
collection stall the scheduler for up to a second. Nodes cannot form reference
cycles (a node refers only to its key and its parent), so the `fastkv.scheduler.
_tree_node` C extension gives them C fields and keeps them out of the collector,
and threads both eviction lists through the nodes instead of OrderedDicts: nothing
per block is left for a collection to traverse. Its index grows incrementally, a
few buckets per operation, where a dict of millions of keys stops its caller for
a whole resize. Without the extension (it is built
by `make install`) the pure-Python `TreeNode` and OrderedDicts below do the same.
"""

from __future__ import annotations

import gc
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum

from fastkv.metadata import BlockHash

_ABSENT = object()


class NodeState(IntEnum):
    """Where a node's KV block lives. `TreeNode.host_block >= 0` in the DEVICE state
    means the block also has a valid host copy (written through or written back)."""

    DEVICE = 0
    """The device copy is valid."""
    HOST = 1
    """Only the host copy is valid."""
    SWAP_TO_HOST = 2
    """Being evicted: the device block is read into the host block, then freed."""
    SWAP_TO_DEVICE = 3
    """Being loaded: the host block is read into the device block."""
    BACKUP_TO_HOST = 4
    """Being backed up (write-through): the device block is read into the host
    block and stays."""
    PENDING_HOST = 5
    """Evicted with its device block handed to a new owner at once (the worker orders
    the copy before the new owner's writes): only the copy in flight to the host
    block will hold the KV, so nothing may read it until that copy lands."""
    DROPPED = 6
    """Left the tree while a copy into or out of its host block was in flight (an
    ancestor lost its only copy); the host block is freed when that copy ends."""
    LOADING_FROM_STORAGE = 7
    """Being read from the storage tier into its host block; like PENDING_HOST,
    nothing may read it until the load lands (then it is HOST)."""


class StorageState(IntEnum):
    """Where a node's block stands with the storage tier (`TreeNode.storage`)."""

    NOT_STORED = 0
    """Storage does not hold it (or nobody knows: a failed write counts as this)."""
    STORING = 1
    """A write reads its host copy: the copy stays pinned until the write ends."""
    STORED = 2
    """A write succeeded, or it was loaded from storage."""


# Module-level names for the hot paths (a global read, not an attribute lookup).
DEVICE = NodeState.DEVICE
HOST = NodeState.HOST
SWAP_TO_HOST = NodeState.SWAP_TO_HOST
SWAP_TO_DEVICE = NodeState.SWAP_TO_DEVICE
BACKUP_TO_HOST = NodeState.BACKUP_TO_HOST
PENDING_HOST = NodeState.PENDING_HOST
DROPPED = NodeState.DROPPED
LOADING_FROM_STORAGE = NodeState.LOADING_FROM_STORAGE
HOST_LANDING = (PENDING_HOST, LOADING_FROM_STORAGE)  # host copy in flight, no device copy
NOT_STORED = StorageState.NOT_STORED
STORING = StorageState.STORING
STORED = StorageState.STORED


class _PyTreeNode:
    """One cached block. State changes go through `RadixTree` methods, which keep the
    counts and eviction lists consistent."""

    __slots__ = (
        "device_block",
        "hits",
        "host_block",
        "key",
        "num_children",
        "num_device_children",
        "parent",
        "ref",
        "state",
        "storage",
    )

    def __init__(
        self, key: BlockHash, parent: TreeNode | None, device_block: int, num_children: int = 0
    ) -> None:
        self.key = key
        self.parent = parent
        self.num_children = num_children
        # Children whose device block stays: any state but HOST and SWAP_TO_HOST.
        self.num_device_children = num_children
        self.state = DEVICE
        self.device_block = device_block
        self.host_block = -1
        self.ref = 1  # a new node starts locked by the request that computed it
        self.hits = 0  # matches so far (write_through_selective, storage after_hits)
        self.storage = NOT_STORED  # STORING pins the host copy while it is written

    def __repr__(self) -> str:
        return (
            f"TreeNode({self.key!r}, {self.state.name}, dev={self.device_block}, "
            f"host={self.host_block}, ref={self.ref})"
        )


class _PyLRUList(OrderedDict):  # type: ignore[type-arg]
    """An eviction list: nodes oldest first (the C `LRUList`'s pure-Python twin)."""

    def __init__(self, slot: int = 0) -> None:  # slot: the C list's; unused here
        super().__init__()

    def pop_oldest(self) -> TreeNode | None:
        """Take the oldest node off the list, or None when it is empty."""
        return self.popitem(last=False)[0] if self else None


class _PyNodeIndex(dict):  # type: ignore[type-arg]
    """Nodes by key (the C `NodeIndex`'s pure-Python twin)."""

    def isdisjoint(self, keys: Sequence[BlockHash] | set[BlockHash]) -> bool:
        """True when no key of `keys` is indexed."""
        return self.keys().isdisjoint(keys)


_new_index: Callable[[], _PyNodeIndex]
_new_lru: Callable[[int], _PyLRUList]
_unlock_path: Callable[[Sequence[TreeNode], _PyLRUList, _PyLRUList], None] | None
_discard_leaves: Callable[[_PyLRUList, set[TreeNode], dict, int], list[int]] | None
_make_path: (
    Callable[[TreeNode, Sequence[BlockHash], Sequence[int], dict], list[TreeNode]] | None
)
_match_path: Callable[..., tuple[list[TreeNode], array[int], int, bool]] | None
try:
    from fastkv.scheduler import _tree_node

    _tree_node.set_states(tuple(NodeState))
    _tree_node.set_storage_states(tuple(StorageState))
    TreeNode = _tree_node.TreeNode

    def _new_lru(slot: int) -> _PyLRUList:
        """A C eviction list. At most 255 exist at once (a node names its list in
        one byte); lists of trees dropped in reference cycles count until the
        collector runs, so when none is left it runs once before giving up."""
        try:
            return _tree_node.LRUList(slot)
        except RuntimeError:
            gc.collect()
            return _tree_node.LRUList(slot)

    _new_index = _tree_node.NodeIndex
    _unlock_path = _tree_node.unlock_path
    _discard_leaves = _tree_node.discard_leaves
    _make_path = _tree_node.make_path
    _match_path = _tree_node.match_path
except ImportError:  # built by `make install`; the pure-Python classes are equivalent
    TreeNode = _PyTreeNode  # type: ignore[misc]
    _new_lru = _PyLRUList
    _new_index = _PyNodeIndex
    _unlock_path = _discard_leaves = _make_path = _match_path = None


class RadixTree:
    """Nodes, their lock counts, their states and the two tiers' eviction lists.

    The tree does not own block ids: the cache manager allocates and frees them and
    hands them to the tree's state transitions.
    """

    __slots__ = (
        "_device_parked",
        "_host_parked",
        "_host_storing",
        "_index",
        "device_lru",
        "host_lru",
        "num_evicting",
        "root",
    )

    def __init__(self) -> None:
        self.root = TreeNode(None, None, -1)
        self._index = _new_index()  # every node but the root, by key
        # Unlocked nodes whose copy in that tier could be evicted, oldest first.
        self.device_lru = _new_lru(0)
        self.host_lru = _new_lru(1)
        # Taken off a list because a child still holds a copy in that tier.
        self._device_parked: set[TreeNode] = set()
        self._host_parked: set[TreeNode] = set()
        # Taken off the host list while a storage write reads their host copy.
        self._host_storing: set[TreeNode] = set()
        self.num_evicting = 0  # nodes in SWAP_TO_HOST: device blocks on their way out

    @property
    def num_nodes(self) -> int:
        return len(self._index)

    @property
    def num_unlocked_device(self) -> int:
        """Device nodes no request holds and no copy moves: all can be evicted,
        leaves first."""
        return len(self.device_lru) + len(self._device_parked)

    # -- lookup and locks -----------------------------------------------------

    def match_and_lock(
        self, hashes: list[BlockHash], limit: int, distinct_name: str | None = None
    ) -> tuple[list[TreeNode], array[int], int, bool]:
        """Lock the longest usable cached prefix of `hashes`, at most `limit` nodes.

        A node is usable when it holds a valid copy that can be read: DEVICE,
        SWAP_TO_HOST (the device copy is intact while it is read), BACKUP_TO_HOST
        or HOST. Every entry of `hashes` must be hashable (the caller checks).
        One call into the C extension when it is built (`_tree_node.match_path`).

        With `distinct_name`, `hashes` (32-byte digests: the caller checks) must be
        distinct: ValueError naming it otherwise, before anything is locked.
        Checked only when the walk stops short of the end of `hashes`: a path of
        the tree never repeats a key, so a full match needs no check of its own.

        Returns:
            The matched nodes (root side first); the device blocks of those before
            the first host-only one, as an int32 `array` (a request's table starts
            with them; no int object per block); how many
            are host-only; and whether the walk stopped at a block whose copy is in
            flight (SWAP_TO_DEVICE, PENDING_HOST, LOADING_FROM_STORAGE): matching
            after it lands finds more.
        """
        if _match_path is not None:
            return _match_path(
                self, self.root, hashes, limit, self._index, self.device_lru, distinct_name
            )
        nodes: list[TreeNode] = []
        blocks = array("i")
        num_host = 0
        index = self._index
        waiting = False
        parent = self.root
        for h in hashes if limit >= len(hashes) else hashes[:limit]:
            node = index.get(h)
            if node is None or node.parent is not parent:
                break
            state = node.state
            if state in (SWAP_TO_DEVICE, PENDING_HOST, LOADING_FROM_STORAGE):
                waiting = True
                break
            if state == HOST:
                num_host += 1
            elif not num_host:
                blocks.append(node.device_block)
            nodes.append(node)
            parent = node
        if (
            distinct_name is not None
            and len(nodes) < len(hashes)
            and len(set(hashes)) < len(hashes)
        ):
            raise ValueError(
                f"{distinct_name}: a hash appears twice (chained hashes never repeat)"
            )
        self.lock(nodes)
        return nodes, blocks, num_host, waiting

    def lock(self, nodes: Sequence[TreeNode]) -> None:
        """Add one reference to each node, taking newly locked ones off the lists."""
        for node in nodes:
            if not node.ref:
                self._unlist(node)
            node.ref += 1

    def _unlist(self, node: TreeNode) -> None:
        """An unlocked node is being locked: take it off every list and parking set.
        Locking a node that is being evicted keeps it: its device copy is intact
        while the eviction reads it, so the copy carries on as a backup."""
        if node.ref:
            return
        state = node.state
        if state == DEVICE:
            if self.device_lru.pop(node, _ABSENT) is _ABSENT:
                self._device_parked.discard(node)
        elif state == SWAP_TO_HOST:
            node.state = BACKUP_TO_HOST
            self.num_evicting -= 1
            self._gain_device_child(node.parent)  # type: ignore[arg-type]
        if node.host_block >= 0 and self.host_lru.pop(node, _ABSENT) is _ABSENT:
            self._host_parked.discard(node)
            self._host_storing.discard(node)

    def unlock(self, nodes: Sequence[TreeNode]) -> None:
        """Drop one reference from each node, deepest first, listing freed nodes."""
        device_lru, host_lru = self.device_lru, self.host_lru
        if _unlock_path is not None:
            _unlock_path(nodes, device_lru, host_lru)
            return
        for node in reversed(nodes):
            if node.ref == 1:
                node.ref = 0
                state = node.state
                if state == DEVICE:
                    device_lru[node] = None
                    if node.host_block >= 0:
                        host_lru[node] = None
                elif state == HOST:
                    host_lru[node] = None
            elif node.ref > 1:
                node.ref -= 1
            else:
                raise AssertionError(f"unlocking {node}, which is not locked")

    # -- insertion ------------------------------------------------------------

    def insert(
        self, parent: TreeNode, keys: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> tuple[list[TreeNode], list[int]]:
        """Extend the path below `parent` with one node per key, each locked once
        for the caller.

        A key without a node gets a new DEVICE node holding its device block. A key
        that already has a node under the same parent (cached meanwhile by another
        request) keeps it and is reported, so the caller can decide what its own
        block becomes.

        Returns:
            The path nodes, one per key, and the offsets of the pre-existing ones.

        Raises:
            ValueError: a key repeats, or is cached under another parent (keys that
                are not chained hashes, or a hash collision); the tree is unchanged.
        """
        index = self._index
        distinct = set(keys)
        if len(distinct) == len(keys) and index.isdisjoint(distinct):  # all new
            if _make_path is not None:
                path = _make_path(parent, keys, device_blocks, index)
                self._new_child(parent)
                return path, []
            path: list[TreeNode] = []
            self._new_child(parent)
            last = len(keys) - 1
            for i, key in enumerate(keys):
                parent = TreeNode(key, parent, device_blocks[i], 1 if i != last else 0)
                path.append(parent)
            index.update(zip(keys, path, strict=True))
            return path, []
        num_existing = self._check_insert(parent, keys, len(distinct))
        path = []
        for i, key in enumerate(keys):
            if i < num_existing:
                node = index[key]
                self.lock((node,))
            else:
                node = index[key] = TreeNode(key, parent, device_blocks[i])
                self._new_child(parent)
            path.append(node)
            parent = node
        return path, list(range(num_existing))

    def insert_loading(
        self, parent: TreeNode, keys: Sequence[BlockHash], host_blocks: Sequence[int]
    ) -> list[TreeNode]:
        """Extend the path below `parent` with nodes being read from storage into
        `host_blocks`, each locked once for the caller. No key may be cached."""
        path = []
        for key, host_block in zip(keys, host_blocks, strict=True):
            node = TreeNode(key, parent, -1)
            node.state = LOADING_FROM_STORAGE
            node.host_block = host_block
            node.storage = STORED
            self._index[key] = node
            parent.num_children += 1
            path.append(node)
            parent = node
        return path

    def contains(self, key: BlockHash) -> bool:
        return key in self._index

    def _check_insert(self, parent: TreeNode, keys: Sequence[BlockHash], distinct: int) -> int:
        """How many leading keys already sit on the path below `parent`; raises if a
        key repeats or sits anywhere else."""
        if distinct != len(keys):
            raise ValueError("block hashes: a hash appears twice in one request's chain")
        index = self._index
        num_existing = 0
        for i, key in enumerate(keys):
            node = index.get(key)
            if node is None:
                continue
            # Cached keys must be a leading run on the path: one after a new key,
            # or under another parent, was chained from a different prefix.
            if i != num_existing or node.parent is not parent:
                raise ValueError(
                    f"block hashes: position {i} of the new blocks is already cached under "
                    "another prefix; block hashes must be chained (each commits to every "
                    "block before it)"
                )
            num_existing += 1
            parent = node
        return num_existing

    # -- state transitions ----------------------------------------------------

    def attach_device(self, node: TreeNode, device_block: int, *, loading: bool) -> None:
        """A host-only node gets a device block: a swap-in starts (`loading`) or a
        request that recomputed the block hands its copy over. A PENDING_HOST node
        handed a recomputed copy keeps its copy to host going, as a backup."""
        node.device_block = device_block
        if node.state in HOST_LANDING:
            node.state = BACKUP_TO_HOST
        else:
            node.state = SWAP_TO_DEVICE if loading else DEVICE
        self._gain_device_child(node.parent)  # type: ignore[arg-type]

    def detach_device(self, node: TreeNode) -> int:
        """The node's device copy goes (evicted, or a swap-in into it failed); the
        host copy stays. Returns the device block, for the caller to free."""
        block = node.device_block
        node.device_block = -1
        node.state = HOST
        self._lose_device_child(node.parent)  # type: ignore[arg-type]
        self.relist(node)
        return block

    def start_eviction(self, node: TreeNode, host_block: int) -> None:
        """An unlocked device leaf starts moving to `host_block`."""
        node.host_block = host_block
        node.state = SWAP_TO_HOST
        self.num_evicting += 1
        self._lose_device_child(node.parent)  # type: ignore[arg-type]

    def release_to_host(self, node: TreeNode, host_block: int) -> int:
        """An unlocked device leaf starts moving to `host_block` and gives up its
        device block at once (returned, for the caller to hand to a new owner whose
        writes the worker orders after the copy). The node becomes PENDING_HOST."""
        block, node.device_block = node.device_block, -1
        node.host_block = host_block
        node.state = PENDING_HOST
        self._lose_device_child(node.parent)  # type: ignore[arg-type]
        return block

    def start_backup(self, node: TreeNode, host_block: int) -> None:
        """A locked device node starts being copied to `host_block`."""
        node.host_block = host_block
        node.state = BACKUP_TO_HOST

    def finish_copy_to_host(self, node: TreeNode, success: bool) -> tuple[int, int]:
        """A device-to-host copy ended.

        On success the host copy becomes valid, and an eviction frees the device
        block unless a child came back to the device meanwhile (a failed eviction
        of its own) and still needs this node as its path. On failure the host
        block is released and the device copy stays.

        A PENDING_HOST node (its device block already reused) becomes host-only on
        success; on failure it holds no copy at all, so it leaves the tree with its
        descendants (see `drop_subtree`), and its host block is freed. A DROPPED
        node's host block is freed either way.

        Returns:
            (device block to free, host block to free), -1 for none.
        """
        state = node.state
        if state in (PENDING_HOST, LOADING_FROM_STORAGE, DROPPED):
            if success and state != DROPPED:
                node.state = HOST
                self.relist(node)
                return -1, -1
            block, node.host_block = node.host_block, -1
            if state != DROPPED:
                node.state = DROPPED  # drop_subtree skips it: its host block goes here
                self.remove(node)
            return -1, block
        evicting = state == SWAP_TO_HOST
        if evicting:
            self.num_evicting -= 1
        if not success:
            block, node.host_block = node.host_block, -1
            self._settle_on_device(node, evicting)
            return -1, block
        if evicting and not node.num_device_children:
            block, node.device_block = node.device_block, -1
            node.state = HOST
            self.relist(node)
            return block, -1
        self._settle_on_device(node, evicting)
        return -1, -1

    def _settle_on_device(self, node: TreeNode, was_evicting: bool) -> None:
        node.state = DEVICE
        if was_evicting:  # back to where it was taken from: the head
            self._gain_device_child(node.parent)  # type: ignore[arg-type]
            self.relist(node, oldest=True)
        else:
            self.relist(node)

    def finish_swap_in(self, node: TreeNode, success: bool) -> int:
        """A host-to-device copy ended. Returns the device block to release on
        failure (garbage), else -1."""
        if success:
            node.state = DEVICE
            self.relist(node)
            return -1
        return self.detach_device(node)

    def drop_host_copy(self, node: TreeNode) -> int:
        """Evict a node's host copy (taken by `pop_host_victim`); a host-only node
        leaves the tree. Returns the host block, for the caller to free."""
        block, node.host_block = node.host_block, -1
        if node.state == HOST:
            self.remove(node)
        return block

    def remove(self, node: TreeNode) -> None:
        """Delete an unlocked node without children whose blocks the caller frees."""
        if node.num_children:
            raise AssertionError(f"removing {node} would orphan {node.num_children} children")
        del self._index[node.key]
        parent = node.parent
        assert parent is not None
        if node.device_block >= 0 and node.state != SWAP_TO_HOST:
            self._lose_device_child(parent)
        parent.num_children -= 1
        if not parent.num_children and parent in self._host_parked:
            self._unpark(parent, self._host_parked, self.host_lru)
        self._host_storing.discard(node)

    def drop_subtree(self, node: TreeNode) -> list[int]:
        """Take every descendant of `node` out of the tree: their prefix lost its
        only copy, so they can never be matched again. Returns the host blocks to
        free now; a descendant whose copy to host is still in flight becomes
        DROPPED and its host block is freed when that copy ends. O(1) for a leaf
        (callers drop deepest first, so that is the usual case), else O(cached
        nodes): only a failed copy that already gave its device block away comes
        here.

        Every descendant is host-only or PENDING_HOST and unlocked: a request
        holding one would hold `node` too, and a node with device children is
        never released.
        """
        if not node.num_children:
            return []
        children: dict[TreeNode, list[TreeNode]] = {}
        for other in self._index.values():
            children.setdefault(other.parent, []).append(other)  # type: ignore[arg-type]
        doomed: list[TreeNode] = []
        stack = list(children.get(node, ()))
        while stack:
            child = stack.pop()
            doomed.append(child)
            stack.extend(children.get(child, ()))
        freed = []
        for child in reversed(doomed):  # deepest first: each is a leaf when removed
            assert not child.ref and child.device_block < 0, child
            if child.state == HOST and child.storage != STORING:
                if self.host_lru.pop(child, _ABSENT) is _ABSENT:
                    self._host_parked.discard(child)
                freed.append(child.host_block)
                child.host_block = -1
            else:  # a copy still uses its host block: freed when that copy ends
                self._host_storing.discard(child)
                child.state = DROPPED
            self.remove(child)
        return freed

    def unpin_host(self, node: TreeNode) -> None:
        """A storage write of the node's host copy ended (the caller has set
        `node.storage`): its host copy may be evicted again."""
        if node in self._host_storing:
            self._unpark(node, self._host_storing, self.host_lru)

    # -- eviction lists -------------------------------------------------------

    def relist(self, node: TreeNode, *, oldest: bool = False) -> None:
        """Put an unlocked node on the lists its state belongs to; `oldest` puts it at
        the head of the device list (it was about to be evicted)."""
        if node.ref:
            return
        state = node.state
        if state == DEVICE:
            self.device_lru[node] = None
            if oldest:
                self.device_lru.move_to_end(node, last=False)
        elif state != HOST:
            return
        if node.host_block >= 0 and node not in self._host_storing:  # else: when written
            self.host_lru[node] = None

    def pop_device_victim(self) -> TreeNode | None:
        """Take the least recently used unlocked device leaf off the list, or None.

        The caller must move it off the device (`detach_device`, `start_eviction`,
        `remove`) or `restore_device_victim` it before taking the next one: its
        parent becomes a leaf, and a candidate, only once it has left.
        """
        lru = self.device_lru
        while (node := lru.pop_oldest()) is not None:
            if not node.num_device_children:
                return node
            self._device_parked.add(node)
        return None

    def discard_device_leaves(self, n: int) -> list[int]:
        """Delete up to `n` least recently used unlocked device leaves that have no
        host copy and no children (the path without a host tier). Returns their
        device blocks."""
        lru = self.device_lru
        if _discard_leaves is not None:
            return _discard_leaves(lru, self._device_parked, self._index, n)
        pop = lru.popitem
        index = self._index
        parked = self._device_parked
        freed: list[int] = []
        while n and lru:
            node = pop(last=False)[0]
            if node.num_children:  # only after a failure reordered the list
                parked.add(node)
                continue
            del index[node.key]
            parent = node.parent
            parent.num_children -= 1  # type: ignore[union-attr]
            parent.num_device_children -= 1  # type: ignore[union-attr]
            if not parent.num_device_children and parent in parked:  # type: ignore[union-attr]
                self._unpark(parent, parked, lru)  # type: ignore[arg-type]
            freed.append(node.device_block)
            n -= 1
        return freed

    def count_device_victims(self, limit: int) -> int:
        """How many nodes successive `pop_device_victim` calls would return now, at
        most `limit`, if each victim left the device (its parent then becoming a
        candidate once its last device child has left). Changes nothing.
        O(nodes visited)."""
        count = 0
        left: dict[TreeNode, int] = {}  # device children each would still have
        passed: set[TreeNode] = set()  # visited with device children: parked
        ready: list[TreeNode] = []  # unparked by the walk: taken next
        parked = self._device_parked
        listed = iter(self.device_lru)
        root = self.root
        while count < limit:
            if ready:
                node = ready.pop()
            else:
                node = next(listed, None)
                if node is None:
                    break
            if left.get(node, node.num_device_children):
                passed.add(node)
                continue
            count += 1
            parent = node.parent
            if parent is root or parent is None:
                continue
            remaining = left.get(parent, parent.num_device_children) - 1
            left[parent] = remaining
            if not remaining and (parent in passed or parent in parked):
                passed.discard(parent)
                ready.append(parent)
        return count

    def restore_device_victim(self, node: TreeNode) -> None:
        """Put back a node taken by `pop_device_victim` that was not evicted."""
        self.device_lru[node] = None
        self.device_lru.move_to_end(node, last=False)

    def pop_host_victim(self) -> TreeNode | None:
        """Take the least recently used unlocked node whose host copy can be dropped:
        one that keeps a device copy, or a host-only node without children."""
        host_lru = self.host_lru
        while (node := host_lru.pop_oldest()) is not None:
            if node.storage == STORING:  # a storage write reads it: not now
                self._host_storing.add(node)
                continue
            if node.state == HOST and node.num_children:
                self._host_parked.add(node)
                continue
            return node
        return None

    # -- counts ---------------------------------------------------------------

    @staticmethod
    def _new_child(parent: TreeNode) -> None:
        """A new node (always on the device) was created under `parent`."""
        parent.num_children += 1
        parent.num_device_children += 1

    @staticmethod
    def _gain_device_child(parent: TreeNode) -> None:
        parent.num_device_children += 1

    def _lose_device_child(self, parent: TreeNode) -> None:
        parent.num_device_children -= 1
        if not parent.num_device_children and parent in self._device_parked:
            self._unpark(parent, self._device_parked, self.device_lru)

    @staticmethod
    def _unpark(node: TreeNode, parked: set[TreeNode], lru: _PyLRUList) -> None:
        parked.discard(node)
        lru[node] = None
        lru.move_to_end(node, last=False)

    # -- inspection -----------------------------------------------------------

    def __iter__(self) -> Iterator[TreeNode]:
        """Every node except the root (a snapshot)."""
        return iter(list(self._index.values()))

    def check(self) -> None:
        """Assert structure, counts and list membership (O(nodes); for tests).

        Raises:
            AssertionError: a dangling node, a wrong child count, a node listed
                where its state and lock do not allow or missing from a list it
                belongs to, or a state whose block fields disagree.
        """
        children: dict[TreeNode, int] = {}
        device_children: dict[TreeNode, int] = {}
        evicting = 0
        for key, node in self._index.items():
            assert node.key == key, node
            parent = node.parent
            assert parent is self.root or self._index.get(parent.key) is parent, (
                f"{node} hangs under a node that left the tree"
            )
            children[parent] = children.get(parent, 0) + 1
            if node.device_block >= 0 and node.state != SWAP_TO_HOST:
                device_children[parent] = device_children.get(parent, 0) + 1
            evicting += node.state == SWAP_TO_HOST
            self._check_node(node)
        assert evicting == self.num_evicting, (evicting, self.num_evicting)
        for node in self._index.values():
            assert node.num_children == children.get(node, 0), f"child count of {node}"
            assert node.num_device_children == device_children.get(node, 0), (
                f"device child count of {node}"
            )
        for node in self._device_parked:
            assert node.num_device_children and node not in self.device_lru, node
        for node in self._host_parked:
            assert node.state == HOST and node.num_children, node
            assert node not in self.host_lru, node
        for node in self._host_storing:
            assert node.storage == STORING and node not in self.host_lru, node
            assert node not in self._host_parked, node

    def _check_node(self, node: TreeNode) -> None:
        """Assert one node's lists, lock and block fields agree with its state."""
        assert node.ref >= 0, node
        in_device = node in self.device_lru or node in self._device_parked
        in_host = (
            node in self.host_lru or node in self._host_parked or node in self._host_storing
        )
        listed = node.ref == 0
        state = node.state
        assert in_device == (listed and state == DEVICE), f"device list: {node}"
        assert in_host == (
            listed and (state == HOST or (state == DEVICE and node.host_block >= 0))
        ), f"host list: {node}"
        assert state != DROPPED, node
        if state in (HOST, *HOST_LANDING):
            assert node.device_block < 0 and node.host_block >= 0, node
        else:
            assert node.device_block >= 0, node
        if state == PENDING_HOST:
            assert node.ref == 0, f"{node} is locked but its copy has not landed"
        if state in (SWAP_TO_HOST, SWAP_TO_DEVICE, BACKUP_TO_HOST):
            assert node.host_block >= 0, node
        if state == SWAP_TO_HOST:
            assert node.ref == 0, f"{node} is locked but still being evicted"
