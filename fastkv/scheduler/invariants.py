"""Whole-manager consistency checks (tests and debugging; O(cached blocks)).

`CacheManager.check_invariants()` hands `check_manager` its rooms; each room checks
its own records (`RadixTree.check`, `TransferBook.check`, `StorageTier.check`), and
this module checks what only the whole can: that every allocated block has exactly
one owner (a node, a request's private position, a copy or write still using it),
that every lock is held by a request whose path it is, that no request holds two
device blocks at one position when the node's copy could give way to its own (the
node is on the device, still, and no one else holds it), and that every node in a
moving state is moved by exactly one transfer (queued storage loads included).
"""

from __future__ import annotations

from collections.abc import Iterable

from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.radix_tree import (
    BACKUP_TO_HOST,
    DEVICE,
    DROPPED,
    LOADING_FROM_STORAGE,
    PENDING_HOST,
    STORING,
    SWAP_TO_DEVICE,
    SWAP_TO_HOST,
    RadixTree,
    TreeNode,
)
from fastkv.scheduler.request import RequestState
from fastkv.scheduler.storage_tier import StorageTier
from fastkv.scheduler.transfers import TransferBook

_MOVING = (SWAP_TO_HOST, BACKUP_TO_HOST, SWAP_TO_DEVICE, PENDING_HOST, LOADING_FROM_STORAGE)


def check_manager(
    *,
    tree: RadixTree,
    device_pool: BlockPool,
    host_pool: BlockPool,
    requests: Iterable[RequestState],
    transfers: TransferBook,
    storage: StorageTier | None,
    reuse_evicted_blocks: bool,
    receiving: Iterable[int] = (),
) -> None:
    """Assert block accounting and locking over a manager's rooms.

    Raises:
        AssertionError: free + used != capacity in a pool, a block id owned
            twice or leaked, a lock count that does not match the requests
            holding the node, a request whose nodes are not its hashes' path, a
            moving node in no transfer (or in two), an in-flight block back in
            its pool, a receiving block (`CacheManager.reserve_receiving`) that
            a node or request also holds or that is free, a request alone on a
            node holding its own valid copy of it besides the node's, or a tree
            list invariant broken.
    """
    tree.check()
    owner: dict[int, object] = {}
    host_owner: dict[int, object] = {}
    for node in tree:
        if node.device_block >= 0:
            _own(owner, node.device_block, node)
        if node.host_block >= 0:
            assert node.host_block not in host_owner, f"host block {node.host_block} twice"
            host_owner[node.host_block] = node
    for block in receiving:
        _own(owner, block, "receiving")
    holders = _check_requests(tree, requests, owner)
    moving, storing = transfers.check(host_owner, device_pool, host_pool, reuse_evicted_blocks)
    if storage is not None:
        queued = storage.check(host_owner)
        storing.update(queued.storing)
        for node in queued.loading:
            assert node.state in (LOADING_FROM_STORAGE, BACKUP_TO_HOST, DROPPED), node
            assert node not in moving, f"{node} in two transfers"
            moving.add(node)
            assert host_pool.is_allocated(node.host_block), node
    for node in tree:
        if node.storage == STORING:
            assert node in storing, f"{node} is pinned by no storage write"
        if node.state in _MOVING:
            assert node in moving, f"{node} is moving in no transfer"
        assert node.ref == holders.get(node, 0), (
            f"{node}: ref {node.ref}, holders {holders.get(node, 0)}"
        )
    _check_pool(device_pool, owner)
    _check_pool(host_pool, host_owner)


def _own(owner: dict[int, object], block: int, who: object) -> None:
    assert block not in owner, f"device block {block} owned by {owner[block]} and {who}"
    owner[block] = who


def _check_requests(
    tree: RadixTree, requests: Iterable[RequestState], owner: dict[int, object]
) -> dict[TreeNode, int]:
    """Each request's nodes are its hashes' path from the root; the blocks of its
    table no node holds are its own. Returns how many requests hold each node."""
    requests = list(requests)
    holders: dict[TreeNode, int] = {}
    for req in requests:
        parent = tree.root
        for pos, node in enumerate(req.nodes):
            holders[node] = holders.get(node, 0) + 1
            assert node.parent is parent and node.key == req.hashes[pos], (
                f"request {req.request_id!r}: node {pos} is not its hash path"
            )
            parent = node
        for pos, block in enumerate(req.blocks):
            if pos >= len(req.nodes) or req.nodes[pos].device_block != block:
                _own(owner, block, req.request_id)
    for req in requests:
        _check_one_block_per_position(req, holders)
    return holders


def _check_one_block_per_position(req: RequestState, holders: dict[TreeNode, int]) -> None:
    """A position where the request holds its own valid block and the node's device
    copy too: allowed only while that copy cannot give way (another request holds
    the node, or its copy moves). Otherwise the request pins two blocks for one
    position, and alone could find the pool full forever."""
    rolled_back = set(req.rolled_back)  # its own copy is garbage until recomputed
    for pos, (node, block) in enumerate(zip(req.nodes, req.blocks, strict=False)):
        if node.device_block >= 0 and node.device_block != block and pos not in rolled_back:
            assert holders[node] > 1 or node.state != DEVICE, (
                f"request {req.request_id!r}: position {pos} holds device blocks {block} "
                f"and {node.device_block} (its node's, which no one else holds)"
            )


def _check_pool(pool: BlockPool, owned: dict[int, object]) -> None:
    stats = pool.stats()
    assert stats.free + stats.used == stats.capacity, stats
    allocated = pool.allocated_ids()
    assert set(owned) == allocated, (
        f"{pool.name}: leaked {sorted(allocated - set(owned))[:8]}, "
        f"owned but free {sorted(set(owned) - allocated)[:8]}"
    )


__all__ = ["check_manager"]
