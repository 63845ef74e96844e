"""The device and host tiers of one cache: who holds which block, which blocks go
when a tier needs room, and what a finished copy frees.

    device pool ──evict──► host pool ──evict──► (storage tier, or gone)
         ▲                     │
         └────── swap-in ──────┘

A device block leaves its pool when it is allocated and goes back only when nothing
can read or write it any more (Invariant 1): a block being evicted stays allocated
until its copy's result arrives (or, with `reuse_evicted_blocks`, goes to the
allocating request at once and the worker orders the copy first); the host block of
a swap-in stays with its node; a node whose copy is in flight is on no eviction list.

Eviction takes the least recently used unlocked leaf of a tier in O(1): a request
locks its whole path and unlocking appends nodes deepest first, so each tier's list
is in release order with descendants before their ancestors (the argument is in
`fastkv.scheduler.radix_tree`). The device write policy decides which device
blocks get a host copy, and when (`fastkv.scheduler.policies`).
"""

from __future__ import annotations

from collections.abc import Callable

from fastkv.config import CacheConfig
from fastkv.scheduler.api import AllocStatus
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.policies import DeviceWritePolicyBase, device_write_policy
from fastkv.scheduler.radix_tree import (
    BACKUP_TO_HOST,
    DEVICE,
    HOST,
    HOST_LANDING,
    PENDING_HOST,
    SWAP_TO_DEVICE,
    RadixTree,
    TreeNode,
)
from fastkv.scheduler.request import RequestId, RequestState
from fastkv.scheduler.stats import ManagerCounters
from fastkv.scheduler.storage_tier import StorageTier
from fastkv.scheduler.transfers import DeviceTransfer, TransferBook


class CacheTiers:
    """Blocks of the device and host tiers, and the copies between them.

    The tiers plan copies into the transfer book's queues and apply the results the
    manager hands back; they own the storage tier behind host memory (None without
    one), which takes host blocks through `take_host_blocks`.

    Args:
        config: the cache's configuration (write policy, block reuse, storage).
        tree: the radix tree of cached blocks.
        device_pool, host_pool: the tiers' block pools.
        book: where planned copies queue.
        counters: the manager's counters (backups, evictions).
        clock: monotonic seconds (the storage tier's waits and retries).
    """

    __slots__ = (
        "_book",
        "_counters",
        "_write_on_host_copy",
        "_write_on_host_eviction",
        "device_pool",
        "duplicates",
        "host_pool",
        "reuse_evicted_blocks",
        "storage",
        "tree",
        "write_policy",
    )

    def __init__(
        self,
        config: CacheConfig,
        *,
        tree: RadixTree,
        device_pool: BlockPool,
        host_pool: BlockPool,
        book: TransferBook,
        counters: ManagerCounters,
        clock: Callable[[], float],
    ) -> None:
        self.tree = tree
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._book = book
        self._counters = counters
        self.reuse_evicted_blocks = config.reuse_evicted_blocks
        # (node, request, position): the request holds its own valid copy of the
        # node's block at that position, which the node could not take yet (see
        # `fold_duplicates`); rare, so empty on the hot paths
        self.duplicates: list[tuple[TreeNode, RequestState, int]] = []
        self.write_policy: DeviceWritePolicyBase = device_write_policy(config)
        self.storage = (
            StorageTier(
                config.storage,
                tree=tree,
                host_pool=host_pool,
                take_host_blocks=self.take_host_blocks,
                block_size=config.block_size,
                clock=clock,
            )
            if config.storage is not None
            else None
        )
        # The storage write policy's per-block hooks, only where they can act.
        writes = self.storage.write_policy if self.storage is not None else None
        self._write_on_host_copy = writes is not None and writes.writes_on_host_copy
        self._write_on_host_eviction = writes is not None and writes.writes_on_host_eviction

    # -- a request's blocks -------------------------------------------------------

    @property
    def counts_hits(self) -> bool:
        """Whether a policy reads hit counts: `note_hits` has work to do."""
        storage = self.storage
        return (self.write_policy.counts_hits and self.host_pool.capacity > 0) or (
            storage is not None and storage.write_policy.counts_hits
        )

    def note_hits(self, nodes: list[TreeNode]) -> None:
        """A match locked `nodes` (and `counts_hits`): count the hit,
        back up the blocks that just became hot (write_through_selective), and let
        the storage write policy see them (AFTER_HITS)."""
        storage = self.storage
        selective = self.write_policy.counts_hits and self.host_pool.capacity > 0
        after_hits = storage is not None and storage.write_policy.counts_hits
        for node in nodes:  # one count per match, whichever policies read it
            node.hits += 1
        if selective and (hot := self.write_policy.matched_to_back_up(nodes)):
            self.backup(hot)
        if after_hits:
            for node in nodes:
                storage.on_hit(node)  # type: ignore[union-attr]

    def plan_swap_in(self, req: RequestState, pending: list[TreeNode], ids: list[int]) -> None:
        """Append the request's `pending` matched nodes to its table: a host-only one
        gets the next of `ids` and a swap-in queued; the others are on the device."""
        h2d = self._book.to_device
        blocks = req.blocks
        i = 0
        for node in pending:
            if node.state == HOST:
                self.tree.attach_device(node, ids[i], loading=True)
                i += 1
                h2d.nodes.append(node)
                h2d.device_ids.append(node.device_block)
                h2d.requests.append(req)
                h2d.positions.append(len(blocks))
                req.loading += 1
            blocks.append(node.device_block)

    def adopt_committed(self, req: RequestState, path: list[TreeNode], start: int) -> None:
        """`commit` found the nodes `path` (positions `start`... of the request)
        cached already by others: the request's own block at each gives way or is
        kept as `_give_way` decides; one kept is folded later (`fold_duplicates`)."""
        blocks = req.blocks
        freed: list[int] = []
        for i, node in enumerate(path):
            if not self._give_way(node, blocks[start + i], freed):
                req.owns_matched_positions = True
                self.duplicates.append((node, req, start + i))
        self.device_pool.free(freed)

    def _give_way(self, node: TreeNode, block: int, freed: list[int]) -> bool:
        """The one request holding `node` has its own valid copy `block` of it: the
        node takes it if it can now, True then. A host-only node (or one whose host
        copy is landing) adopts it; a device node no one else holds gives its block
        up for it (added to `freed`), so one position never holds two device blocks.
        A node others hold, or whose copy moves, keeps its copy (False)."""
        state = node.state
        if state == HOST or state in HOST_LANDING:
            self.tree.attach_device(node, block, loading=False)
            return True
        if state == DEVICE and node.ref == 1:
            freed.append(node.device_block)
            node.device_block = block
            return True
        return False

    def fold_duplicates(self) -> None:
        """Let the nodes of `duplicates` take their request's copy where they can
        now (`_give_way`): the other holders left, a copy landed. Called after
        anything that unlocks nodes or ends a copy, while `duplicates` is not
        empty. O(duplicates)."""
        keep = []
        freed: list[int] = []
        for entry in self.duplicates:
            node, req, pos = entry
            if req.done or pos >= len(req.nodes) or req.nodes[pos] is not node:
                continue  # released, or its path was cut there
            block = req.blocks[pos]
            if node.device_block == block:
                continue
            if pos in req.rolled_back or not self._give_way(node, block, freed):
                keep.append(entry)
        self.duplicates = keep
        self.device_pool.free(freed)

    def back_up_new(self, created: list[TreeNode]) -> None:
        """`commit` cached `created`: back up those the write policy copies now."""
        if self.host_pool.capacity and (
            to_back_up := self.write_policy.new_blocks_to_back_up(created)
        ):
            self.backup(to_back_up)

    def readopt(self, req: RequestState, num_valid: int) -> None:
        """The engine recomputed blocks whose swap-in failed: their nodes take the
        request's device blocks back as at commit (`_give_way`); a node that
        cannot yet (another request cached it meanwhile and holds it) is folded
        later."""
        keep = []
        freed: list[int] = []
        for pos in req.rolled_back:
            if pos >= num_valid:
                keep.append(pos)
                continue
            node = req.nodes[pos]
            if not self._give_way(node, req.blocks[pos], freed):
                self.duplicates.append((node, req, pos))
        req.rolled_back = keep
        self.device_pool.free(freed)

    def release(self, req: RequestState) -> None:
        """The request is done: unlock its path and free the blocks no node holds."""
        nodes, blocks = req.nodes, req.blocks
        private = blocks[len(nodes) :]
        if req.owns_matched_positions:
            own = zip(nodes, blocks, strict=False)
            private.extend(b for n, b in own if n.device_block != b)
        self.tree.unlock(nodes)
        if private:
            self.device_pool.free(private)
        if self.duplicates:  # a node it held may be held by one other alone now
            self.fold_duplicates()

    # -- room on the device -------------------------------------------------------

    def take_device_blocks(
        self, need: int, busy: Callable[[], bool]
    ) -> list[int] | AllocStatus:
        """`need` device blocks, evicting least recently used unlocked leaves for
        them; or, when they cannot be had now, why: NO_SPACE (active requests hold
        them, or nothing planned can free them: `busy()` is False) or
        WAIT_FOR_TRANSFERS (copies planned or in flight free them)."""
        pool = self.device_pool
        if need <= pool.num_free:
            return pool.allocate(need) if need else []
        if not self.reclaimable(need):  # others hold the blocks: evict nothing
            return AllocStatus.NO_SPACE
        # Evicted blocks go straight to the caller, not through the free list.
        freed = self.evict_device(need - pool.num_free)
        if need > pool.num_free + len(freed):
            pool.free(freed)
            return AllocStatus.WAIT_FOR_TRANSFERS if busy() else AllocStatus.NO_SPACE
        pool.recycled(len(freed))
        return pool.allocate(need - len(freed)) + freed

    def reclaimable(self, need: int) -> bool:
        """Will `need` device blocks be free once the transfers in flight or queued
        complete (and evictions run), if no request releases any?

        Every device block no active request holds counts: free ones, those being
        evicted, unlocked cached ones (leaves first), and those whose copy outlived
        its request.
        """
        tree = self.tree
        count = self.device_pool.num_free + tree.num_evicting + tree.num_unlocked_device
        if count >= need:
            return True
        for transfer in self._book.device_copies():
            for node in transfer.nodes:
                count += not node.ref and node.state in (BACKUP_TO_HOST, SWAP_TO_DEVICE)
        return count >= need

    def num_obtainable_device_blocks(self, limit: int) -> int:
        """See `CacheManager.num_obtainable_device_blocks` (`limit` checked there)."""
        free = self.device_pool.num_free
        if free >= limit:
            return limit
        return free + self.tree.count_device_victims(limit - free)

    def evict_device(self, num_blocks: int) -> list[int]:
        """Start freeing `num_blocks` device blocks, least recently used leaves first;
        return the blocks freed at once (the caller owns them: they are still marked
        allocated in the pool). Blocks whose copy to host starts now are freed when
        its result arrives.

        A block with a host copy is dropped at once; one that must be kept is copied
        to host and freed when the copy completes; any other is discarded. A block
        must be kept when the policy owes it a host copy (every block under
        write_back and write_through, a hot one under write_through_selective: a
        write-through backup that found no room or failed is retried here, once)
        or when its children live on host.
        """
        deficit = num_blocks - self.tree.num_evicting
        if deficit <= 0:
            return []
        tree = self.tree
        if not self.host_pool.capacity:  # every victim is a leaf to discard
            freed = tree.discard_device_leaves(deficit)
            self._counters.device_evictions += len(freed)
            return freed
        policy = self.write_policy
        threshold = policy.evicted_copy_threshold
        copy_all = threshold <= 0  # every block is owed a copy
        retry = policy.backs_up_ahead  # an owed copy made now is a missed backup
        reuse = self.reuse_evicted_blocks
        d2h = self._book.to_host
        counters = self._counters
        freed = []
        while len(freed) < deficit:
            node = tree.pop_device_victim()
            if node is None:
                break
            if node.host_block >= 0:  # backed up already: just drop the device copy
                freed.append(tree.detach_device(node))
            elif (owed := copy_all or node.hits >= threshold) or node.num_children:
                host = self.take_host_blocks(1)
                if host:
                    d2h.nodes.append(node)
                    d2h.device_ids.append(node.device_block)
                    counters.backup_retries += owed and retry
                    if reuse:  # the block goes to the caller now; the worker copies first
                        d2h.reused.append(node.device_block)
                        freed.append(tree.release_to_host(node, host[0]))
                    else:  # freed when the copy's result arrives
                        tree.start_eviction(node, host[0])
                        counters.device_evictions += 1
                        deficit -= 1
                elif node.num_children and not reuse:  # no host room; children need it
                    tree.restore_device_victim(node)
                    break
                else:
                    freed.append(self._drop_device_victim(node))
            else:
                freed.append(node.device_block)
                tree.remove(node)
        counters.device_evictions += len(freed)
        return freed

    def _drop_device_victim(self, node: TreeNode) -> int:
        """A victim owed a host copy found no host room: it leaves the tree and its
        device block is returned. Its descendants live only on host (or are on their
        way there): they lose their path and leave too (their host blocks free now
        or when their copies land). Evicting stops at nothing here, which keeps
        `num_obtainable_device_blocks` exact with `reuse_evicted_blocks`."""
        if node.num_children:
            self.host_pool.free(self.tree.drop_subtree(node))
        block = node.device_block
        self.tree.remove(node)
        return block

    # -- room on the host ---------------------------------------------------------

    def backup(self, nodes: list[TreeNode]) -> None:
        """Queue device-to-host copies of `nodes` (root side first). Blocks that find
        no host room stay device-only; they get their copy if they are evicted."""
        host_ids = self.take_host_blocks(len(nodes))
        self._counters.backups_without_room += len(nodes) - len(host_ids)
        if not host_ids:
            return
        d2h = self._book.to_host
        for node, host_block in zip(nodes, host_ids, strict=False):
            self.tree.start_backup(node, host_block)
            d2h.nodes.append(node)
            d2h.device_ids.append(node.device_block)
        self._counters.backups += len(host_ids)

    def take_host_blocks(self, n: int) -> list[int]:
        """Up to `n` host blocks, evicting least recently used host copies."""
        pool = self.host_pool
        deficit = n - pool.num_free
        if deficit > 0:
            storage = self.storage
            freed = []
            written = 0  # evicted, their host block freed once written to storage
            while len(freed) + written < deficit:
                node = self.tree.pop_host_victim()
                if node is None:
                    break
                keep = self._write_on_host_eviction and storage.on_host_eviction(node)  # type: ignore[union-attr]
                block = self.tree.drop_host_copy(node)
                if keep:
                    written += 1
                else:
                    freed.append(block)
            self._counters.host_evictions += len(freed) + written
            pool.free(freed)
        return pool.allocate(min(n, pool.num_free))

    # -- results ------------------------------------------------------------------

    def finish_to_host(self, transfer: DeviceTransfer, success: bool) -> None:
        """A device-to-host copy's result: free what it releases (evicted device
        blocks on success, the host blocks on failure); a new host copy may be
        written on to storage."""
        nodes = transfer.nodes
        if not success:
            # Failed evictions go back to the head of the device list; in reverse,
            # so they keep their least-recently-used-first order there.
            nodes = nodes[::-1]
        freed_device: list[int] = []
        freed_host: list[int] = []
        storage = self.storage
        write_on_copy = self._write_on_host_copy
        for node in nodes:
            if not success and node.state == PENDING_HOST:  # its block was reused: lost
                freed_host += self.tree.drop_subtree(node)
            device_block, host_block = self.tree.finish_copy_to_host(node, success)
            if device_block >= 0:
                freed_device.append(device_block)
            if host_block >= 0:
                freed_host.append(host_block)
            elif success and write_on_copy and node.state in (HOST, DEVICE):
                storage.on_host_copy(node)  # type: ignore[union-attr]  # maybe write it on
        self.device_pool.free(freed_device)
        self.host_pool.free(freed_host)

    def finish_to_device(
        self, transfer: DeviceTransfer, success: bool, rollbacks: dict[RequestId, list[int]]
    ) -> None:
        """A swap-in's result. On failure each still-active request that was loading
        a block keeps the block in its table and recomputes it: its position is added
        to `rollbacks`; a finished request's block is freed."""
        freed: list[int] = []
        for node, req, pos in zip(
            transfer.nodes, transfer.requests, transfer.positions, strict=True
        ):
            req.loading -= 1
            block = self.tree.finish_swap_in(node, success)
            if block < 0:
                continue
            if req.done:
                freed.append(block)
            else:  # the request keeps the block in its table and recomputes it
                req.owns_matched_positions = True
                req.rolled_back.append(pos)
                rollbacks.setdefault(req.request_id, []).append(pos)
        self.device_pool.free(freed)


__all__ = ["CacheTiers"]
