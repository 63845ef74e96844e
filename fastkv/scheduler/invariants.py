"""Whole-manager consistency checks (tests and debugging; O(cached blocks)).

`CacheManager.check_invariants()` calls `check_manager`. It reads the manager's
state (the tree, both pools, the per-request records, the transfers in flight and
queued) and asks the storage tier to check what it owns (`StorageTier.check`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from fastkv.config import CacheConfig
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.radix_tree import (
    BACKUP_TO_HOST,
    DROPPED,
    LOADING_FROM_STORAGE,
    PENDING_HOST,
    STORING,
    SWAP_TO_DEVICE,
    SWAP_TO_HOST,
    RadixTree,
    TreeNode,
)
from fastkv.scheduler.request import RequestId, RequestState
from fastkv.scheduler.storage_tier import StorageTier
from fastkv.scheduler.transfers import LoadTransfer, StoreTransfer, TransferBook

LOADING = LOADING_FROM_STORAGE


class DeviceTransferView(Protocol):
    """A device <-> host transfer record as the checker reads it."""

    to_host: bool
    nodes: list[TreeNode]
    device_ids: list[int]


class CheckedManager(Protocol):
    """What `check_manager` reads of a `CacheManager` (its own state, private to the
    package; the protocol keeps this module from importing cache_manager)."""

    config: CacheConfig
    tree: RadixTree
    device_pool: BlockPool
    host_pool: BlockPool
    _requests: Mapping[RequestId, RequestState]
    transfers: TransferBook
    _storage: StorageTier | None


def check_manager(manager: CheckedManager) -> None:
    """Assert block accounting and locking (O(cached blocks); for tests and
    debugging).

    Raises:
        AssertionError: free + used != capacity in a pool, a block id owned
            twice or leaked, a lock count that does not match the requests
            holding the node, a request whose nodes are not its hashes' path, a
            moving node in no transfer (or in two), an in-flight block back in
            its pool, or a tree list invariant broken.
    """
    manager.tree.check()
    expected_ref: dict[TreeNode, int] = {}
    owner: dict[int, object] = {}
    host_owner: dict[int, object] = {}

    def own(block: int, who: object) -> None:
        assert block not in owner, f"device block {block} owned by {owner[block]} and {who}"
        owner[block] = who

    for node in manager.tree:
        if node.device_block >= 0:
            own(node.device_block, node)
        if node.host_block >= 0:
            assert node.host_block not in host_owner, f"host block {node.host_block} twice"
            host_owner[node.host_block] = node
    for req in manager._requests.values():
        parent = manager.tree.root
        for pos, node in enumerate(req.nodes):
            expected_ref[node] = expected_ref.get(node, 0) + 1
            assert node.parent is parent and node.key == req.hashes[pos], (
                f"request {req.request_id!r}: node {pos} is not its hash path"
            )
            parent = node
        for pos, block in enumerate(req.blocks):
            if pos >= len(req.nodes) or req.nodes[pos].device_block != block:
                own(block, req.request_id)
    moving: set[TreeNode] = set()
    storing: set[TreeNode] = set()
    released = (PENDING_HOST, DROPPED)  # device block already handed on
    for transfer in [
        *(t for _, t in manager.transfers.inflight()),
        manager.transfers.to_host,
    ]:  # queued ones too
        if isinstance(transfer, StoreTransfer):
            for node, host, free in zip(
                transfer.nodes, transfer.host_ids, transfer.free_after, strict=True
            ):
                if free or node is None or node.state == DROPPED:
                    assert host not in host_owner, f"host block {host} owned twice"
                    host_owner[host] = "a storage write"
                else:
                    assert node.storage == STORING and node.host_block == host, node
                    storing.add(node)
            continue
        for node in transfer.nodes:
            if node.state == DROPPED:  # out of the tree; its host block is still its
                assert node.host_block not in host_owner, f"{node}: host block owned"
                host_owner[node.host_block] = node
    if manager._storage is not None:
        queued = manager._storage.check(host_owner)
        storing.update(queued.storing)
        loads = queued.loading
    else:
        loads = []
    for transfer in [
        *(t for _, t in manager.transfers.inflight()),
        manager.transfers.to_host,
        manager.transfers.to_device,
    ]:
        if isinstance(transfer, StoreTransfer):
            continue
        if isinstance(transfer, LoadTransfer):
            loads += transfer.nodes
            continue
        expected = (
            (SWAP_TO_HOST, BACKUP_TO_HOST, *released) if transfer.to_host else (SWAP_TO_DEVICE,)
        )
        assert len(transfer.device_ids) == len(transfer.nodes)
        for node, device_block in zip(transfer.nodes, transfer.device_ids, strict=True):
            assert node.state in expected, f"{node} in a transfer but not moving"
            assert node not in moving, f"{node} in two transfers"
            moving.add(node)
            assert manager.host_pool.is_allocated(node.host_block), node
            # A released eviction's block may be anyone's, or free, also after a
            # request that recomputed the block handed the node its own copy.
            if node.state in released or node.device_block != device_block:
                assert manager.config.reuse_evicted_blocks, node
                assert node.state in (*released, BACKUP_TO_HOST), node
                continue
            assert manager.device_pool.is_allocated(device_block), node
    for node in loads:
        assert node.state in (LOADING, BACKUP_TO_HOST, DROPPED), node
        assert node not in moving, f"{node} in two transfers"
        moving.add(node)
        assert manager.host_pool.is_allocated(node.host_block), node
    for node in manager.tree:
        if node.storage == STORING:
            assert node in storing, f"{node} is pinned by no storage write"
        if node.state in (
            SWAP_TO_HOST,
            BACKUP_TO_HOST,
            SWAP_TO_DEVICE,
            PENDING_HOST,
            LOADING,
        ):
            assert node in moving, f"{node} is moving in no transfer"
    for node in manager.tree:
        assert node.ref == expected_ref.get(node, 0), (
            f"{node}: ref {node.ref}, holders {expected_ref.get(node, 0)}"
        )
    for pool, owned in ((manager.device_pool, owner), (manager.host_pool, host_owner)):
        stats = pool.stats()
        assert stats.free + stats.used == stats.capacity, stats
        allocated = pool.allocated_ids()
        assert set(owned) == allocated, (
            f"{pool.name}: leaked {sorted(allocated - set(owned))[:8]}, "
            f"owned but free {sorted(set(owned) - allocated)[:8]}"
        )


__all__ = ["CheckedManager", "check_manager"]
