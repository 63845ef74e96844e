"""The scheduler's side of the storage tier: lookups, prefetch, write policies.

Storage sits behind host memory: blocks move storage -> host -> device and back.
The scheduler does not know what storage holds (after a restart nobody does), so it
asks the workers and never waits for the answer:

    match      the request's blocks past its device/host hits are looked up
               (a StorageLookup, sent with the step's metadata)
    result     the workers answer in a later step (LookupResult, the minimum prefix
               over ranks); the prefix found is loaded into host blocks: nodes in
               LOADING_FROM_STORAGE, locked by the request (a STORAGE -> HOST
               transfer), subject to the prefetch policy
    landed     the load's result makes them HOST nodes: host hits the request's
               `allocate` swaps in like any other; a failed block (on any rank)
               drops it and what follows, and its key is not looked up again for
               `retry_after_s` (at most `MAX_RETRY_KEYS` such keys are remembered,
               none longer than `retry_after_s`: past the count the oldest is
               forgotten early and merely looked up again)
    allocate   waits for a lookup or load in flight (WAIT, PREDICTED) at most
               `wait_s` after the match, then lets go of what has not landed and
               computes it (BEST_EFFORT never waits); loads it let go of still
               land and serve later requests

Writes (HOST -> STORAGE) follow the storage write policy. A block's host copy is
pinned while a write reads it (never evicted from host before the result), a block
evicted from host under ON_HOST_EVICTION keeps its host block until its write ends,
and a block counts as stored only once its write succeeded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

from fastkv.config import StorageConfig
from fastkv.metadata import (
    BlockHash,
    CacheLevel,
    CacheSwapMetadata,
    Epoch,
    LookupResult,
    StorageLookup,
    TransferResult,
)
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.policies import (
    PrefetchPolicyBase,
    StorageWritePolicyBase,
    prefetch_policy,
    storage_write_policy,
)
from fastkv.scheduler.radix_tree import (
    BACKUP_TO_HOST,
    DEVICE,
    DROPPED,
    HOST,
    LOADING_FROM_STORAGE,
    NOT_STORED,
    STORED,
    STORING,
    RadixTree,
    TreeNode,
)
from fastkv.scheduler.request import RequestState
from fastkv.scheduler.stats import StorageTierStats
from fastkv.scheduler.transfers import LoadTransfer, StoreTransfer, Transfer


class QueuedNodes(NamedTuple):
    """What `StorageTier.check` reports of its queued (not yet taken) transfers."""

    storing: list[TreeNode]
    """Nodes whose host copy a queued write pins (state STORING)."""
    loading: list[TreeNode]
    """Nodes a queued load moves into host."""


MAX_RETRY_KEYS = 4096
"""The most keys of failed loads a StorageTier remembers (about 0.5 MB): each is
kept until `retry_after_s` has passed (dropped on the next failure after that, or
when looked up), and past this count the oldest goes first. Forgetting one early
costs one lookup more, never a wrong byte."""


class StorageTier:
    """Lookups, loads and writes of one CacheManager's storage tier.

    It works on the manager's tree, host pool and per-request records, given to it
    explicitly; it never sees the manager. Transfer ids come from the `emit`
    callable passed to `take`.

    Args:
        config: the storage settings.
        tree: the manager's radix tree (loads insert nodes into it).
        host_pool: the manager's host block pool (read for its fill level).
        take_host_blocks: `take_host_blocks(n)`: up to n host blocks, evicting
            least recently used host copies as the manager does.
        block_size: tokens per block (to price recomputing a block).
        clock: monotonic seconds (injectable for tests and replays).
    """

    def __init__(
        self,
        config: StorageConfig,
        *,
        tree: RadixTree,
        host_pool: BlockPool,
        take_host_blocks: Callable[[int], list[int]],
        block_size: int,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.tree = tree
        self.host_pool = host_pool
        self._take_host_blocks = take_host_blocks
        self.block_size = block_size
        self.clock = clock
        self.write_policy: StorageWritePolicyBase = storage_write_policy(config)
        self.prefetch_policy: PrefetchPolicyBase = prefetch_policy(config, block_size)
        self._lookups: list[StorageLookup] = []
        # id -> (request, first position looked up, how many blocks were asked about)
        self._lookup_owner: dict[int, tuple[RequestState, int, int]] = {}
        self._next_lookup_id = 0
        self.epoch = Epoch(0)  # stamped on every lookup and transfer (the manager's)
        self._loads = LoadTransfer()
        self._stores = StoreTransfer()
        # key -> when it may be looked up again; in insertion order, which is the
        # order of those times (one retry_after_s after a clock that only grows)
        self._retry_after: dict[BlockHash, float] = {}
        self.lookups = 0
        self.lookup_blocks = 0
        self.hit_blocks = 0
        self.load_failures = 0
        self.skipped_loads = 0  # PREDICTED: recomputing was cheaper
        self.writes = 0
        self.write_failures = 0
        self.abandoned_loads = 0  # blocks a request stopped waiting for

    # -- lookups --------------------------------------------------------------

    def plan_lookup(self, req: RequestState, start: int, limit: int) -> bool:
        """Ask the workers about the request's blocks [start, limit); True if asked."""
        now = self.clock()
        keys = req.hashes[start:limit]
        retry = self._retry_after
        if retry:  # keys whose load failed lately end the lookup
            for i, key in enumerate(keys):
                until = retry.get(key)
                if until is not None:
                    if until > now:
                        keys = keys[:i]
                        break
                    del retry[key]
        if not keys:
            return False
        lookup_id = self._next_lookup_id
        self._next_lookup_id += 1
        self._lookups.append(StorageLookup(lookup_id, keys, self.epoch))
        self._lookup_owner[lookup_id] = (req, start, len(keys))
        req.lookup_id = lookup_id
        req.storage_deadline = now + self.config.wait_s
        self.lookups += 1
        self.lookup_blocks += len(keys)
        return True

    def wants_answer(self, lookup_id: int) -> bool:
        return lookup_id in self._lookup_owner

    def check_answer(self, result: LookupResult) -> None:
        """Raise ValueError for an answer no lookup could have given: more hits than
        blocks asked about, or fewer than none. (An answer to a lookup given up
        is ignored by `apply_lookup`.)"""
        hits = result.num_hits
        if isinstance(hits, bool) or not isinstance(hits, int) or hits < 0:
            raise ValueError(f"num_hits: must be an int >= 0, got {hits!r}")
        owner = self._lookup_owner.get(result.lookup_id)
        if owner is not None and hits > owner[2]:
            raise ValueError(
                f"num_hits: lookup {result.lookup_id} asked about {owner[2]} blocks, "
                f"the answer says {hits}"
            )

    def apply_lookup(self, result: LookupResult) -> None:
        """A lookup's combined answer: load the prefix found, if still wanted."""
        owner = self._lookup_owner.pop(result.lookup_id, None)
        if owner is None:
            return
        req, start, _ = owner
        if req.done or req.lookup_id != result.lookup_id or req.allocated:
            return
        req.lookup_id = -1
        if len(req.nodes) != start or result.num_hits <= 0:
            return
        keys = req.hashes[start : start + result.num_hits]
        if not self.prefetch_policy.worth_loading(len(keys)):
            self.skipped_loads += len(keys)
            return
        tree = self.tree
        for i, key in enumerate(keys):  # another request may have cached some since
            if tree.contains(key):
                keys = keys[:i]
                break
        host = self._take_host_blocks(len(keys))
        if not host:
            return
        keys = keys[: len(host)]
        parent = req.nodes[-1] if req.nodes else tree.root
        nodes = tree.insert_loading(parent, keys, host)
        loads = self._loads
        for node in nodes:
            loads.nodes.append(node)
            loads.requests.append(req)
            loads.positions.append(len(req.nodes))
            req.nodes.append(node)

    # -- the request's wait -------------------------------------------------------

    def waits(self, req: RequestState) -> bool:
        """Does the request wait for storage (a lookup or its loads in flight)?"""
        return self.prefetch_policy.waits(req.storage_deadline, self.clock)

    def let_go(self, req: RequestState, first_loading: int) -> None:
        """The request stops waiting: drop its lookup and the blocks still loading
        (they land and serve later requests)."""
        if req.lookup_id >= 0:
            self._lookup_owner.pop(req.lookup_id, None)
            req.lookup_id = -1
        if first_loading < len(req.nodes):
            self.abandoned_loads += len(req.nodes) - first_loading
            self.tree.unlock(req.nodes[first_loading:])
            del req.nodes[first_loading:]

    def forget(self, req: RequestState) -> None:
        """The request finished or aborted: its lookup is not sent if it has not
        been yet, and its answer is ignored if it has."""
        if req.lookup_id >= 0:
            self._lookup_owner.pop(req.lookup_id, None)
            if self._lookups:
                lookup_id = req.lookup_id
                self._lookups = [q for q in self._lookups if q.lookup_id != lookup_id]

    # -- writes -----------------------------------------------------------------

    def on_host_copy(self, node: TreeNode) -> None:
        """The node's host copy just became valid (a copy to host, or a load)."""
        if node.storage != NOT_STORED:
            return
        if self.write_policy.write_on_host_copy(node):
            self._write(node, free_after=False)

    def on_hit(self, node: TreeNode) -> None:
        """The node was matched once more (its `hits` already counted)."""
        if (
            node.storage == NOT_STORED
            and self.write_policy.write_on_hit(node)
            and node.host_block >= 0
            and node.state in (HOST, DEVICE)
        ):
            self._write(node, free_after=False)

    def on_host_eviction(self, node: TreeNode) -> bool:
        """The node's host copy is being evicted. True when the write policy keeps
        its host block for a write (freed when the write ends): the caller then
        detaches the copy but does not free the block."""
        if not self.write_policy.writes_on_host_eviction:
            return False
        if node.storage != NOT_STORED:
            return False
        self._write(node, free_after=True)
        return True

    def flush_ahead(self) -> None:
        """When the write policy says so (ON_HOST_EVICTION: the host tier is nearly
        full), start writing the oldest host copies that are not stored yet, so
        that evicting them later frees their host blocks at once instead of after
        a write."""
        window = self.write_policy.flush_window(self.host_pool)
        if not window:
            return
        for node in itertools.islice(self.tree.host_lru, window):  # oldest first
            if node.storage == NOT_STORED:
                self._write(node, free_after=False)

    def _write(self, node: TreeNode, free_after: bool) -> None:
        stores = self._stores
        stores.nodes.append(None if free_after else node)
        stores.host_ids.append(node.host_block)
        stores.keys.append(node.key)
        stores.free_after.append(free_after)
        if not free_after:
            node.storage = STORING  # the host copy stays until the write ends

    def plan_request_writes(self, req: RequestState) -> tuple[int, list[TreeNode]]:
        """WRITE_THROUGH's writes of a request's cached blocks storage does not hold
        yet: those with a valid host copy are queued now. Returns how many, and the
        device-only blocks, which need a host copy first (written once it lands)."""
        planned = 0
        device_only = []
        for node in req.nodes:
            if node.storage != NOT_STORED:
                continue
            if node.host_block >= 0 and node.state in (HOST, DEVICE):
                self.on_host_copy(node)
                planned += 1
            elif node.state == DEVICE and node.host_block < 0:
                device_only.append(node)
        return planned, device_only

    # -- per step -----------------------------------------------------------------

    @property
    def num_queued_blocks(self) -> int:
        return len(self._loads.nodes) + len(self._stores.keys)

    @property
    def num_lookups_pending(self) -> int:
        """Lookups queued or sent whose answer has not been applied."""
        return len(self._lookup_owner)

    @property
    def has_queued(self) -> bool:
        # Flush-ahead writes are planned by `flush_ahead`, which runs before
        # this is read at take time: a full host tier alone is not queued work.
        return bool(self._lookups or self._loads.nodes or self._stores.keys)

    def take(
        self, emit: Callable[[Transfer], int]
    ) -> tuple[CacheSwapMetadata | None, CacheSwapMetadata | None, tuple[StorageLookup, ...]]:
        """The lookups, the load and the write planned since the last step."""
        load, lookups = self.take_reads(emit)
        store = None
        timeout = self.config.timeout_s
        if self._stores.keys:
            stores, self._stores = self._stores, StoreTransfer()
            tid = emit(stores)
            store = CacheSwapMetadata(
                tid,
                CacheLevel.HOST,
                CacheLevel.STORAGE,
                list(stores.host_ids),
                [],
                list(stores.keys),
                timeout,
                epoch=self.epoch,
            )
        return load, store, lookups

    def take_reads(
        self, emit: Callable[[Transfer], int]
    ) -> tuple[CacheSwapMetadata | None, tuple[StorageLookup, ...]]:
        """The lookups and the load planned so far (writes stay queued)."""
        load = None
        if self._loads.nodes:
            loads, self._loads = self._loads, LoadTransfer()
            tid = emit(loads)
            hosts = [n.host_block for n in loads.nodes]
            keys = [n.key for n in loads.nodes]
            load = CacheSwapMetadata(
                tid,
                CacheLevel.STORAGE,
                CacheLevel.HOST,
                [],
                hosts,
                keys,
                self.config.timeout_s,
                epoch=self.epoch,
            )
        lookups, self._lookups = tuple(self._lookups), []
        return load, lookups

    def finish_load(
        self, transfer: LoadTransfer, failed: set[int], all_failed: bool
    ) -> list[int]:
        """Apply a load's result; returns the host blocks to free.

        A block good on every rank becomes HOST. From a request's first bad block
        on, its loaded blocks leave the tree (a path past a hole is unreachable),
        the request's path is cut there (it computes those blocks) and their keys
        are not looked up again for `retry_after_s`. A block a request computed
        meanwhile (BACKUP_TO_HOST) keeps its device copy either way.
        """
        tree = self.tree
        first_bad: dict[int, int] = {}  # id(request) -> first failed position
        for i, (node, req, pos) in enumerate(
            zip(transfer.nodes, transfer.requests, transfer.positions, strict=True)
        ):
            if node.state == LOADING_FROM_STORAGE and (all_failed or i in failed):
                first_bad[id(req)] = min(pos, first_bad.get(id(req), pos))
        for req in {id(r): r for r in transfer.requests}.values():
            pos = first_bad.get(id(req))
            if pos is not None and not req.done and pos < len(req.nodes):
                tree.unlock(req.nodes[pos:])
                del req.nodes[pos:]
        now = self.clock()
        freed: list[int] = []
        # Deepest first, so every node dropped is a leaf by then.
        entries = list(zip(transfer.nodes, transfer.requests, transfer.positions, strict=True))
        for i in range(len(entries) - 1, -1, -1):
            node, req, pos = entries[i]
            good = not all_failed and i not in failed
            if node.state == LOADING_FROM_STORAGE:
                good = pos < first_bad.get(id(req), 1 << 62)
                if good:
                    self.hit_blocks += 1
                else:
                    self._remember_failed(node.key, now)
                    self.load_failures += 1
                    freed += tree.drop_subtree(node)
            elif node.state == BACKUP_TO_HOST:  # a request computed it meanwhile
                node.storage = STORED if good else NOT_STORED
            _, host = tree.finish_copy_to_host(node, good)
            if host >= 0:
                freed.append(host)
        return freed

    def _remember_failed(self, key: BlockHash, now: float) -> None:
        """Keep `key` from lookups for `retry_after_s`; forget keys whose time has
        passed and, past MAX_RETRY_KEYS, the oldest (the bound in the module
        docstring)."""
        retry = self._retry_after
        retry.pop(key, None)  # re-inserted last: the order stays that of the times
        retry[key] = now + self.config.retry_after_s
        while retry:
            oldest = next(iter(retry))
            if retry[oldest] > now and len(retry) <= MAX_RETRY_KEYS:
                return
            del retry[oldest]

    def finish_store(
        self, transfer: StoreTransfer, failed: set[int], all_failed: bool
    ) -> list[int]:
        """Apply a write's result. Returns the host blocks to free."""
        tree = self.tree
        freed = []
        for i, (node, host, free) in enumerate(
            zip(transfer.nodes, transfer.host_ids, transfer.free_after, strict=True)
        ):
            ok = not all_failed and i not in failed
            self.writes += ok
            self.write_failures += not ok
            if free:
                freed.append(host)
                continue
            assert node is not None
            if node.state == DROPPED:  # an ancestor lost its only copy meanwhile
                freed.append(host)
                continue
            assert node.host_block == host, node  # a pinned host copy stays put
            node.storage = STORED if ok else NOT_STORED
            tree.unpin_host(node)
        return freed

    def apply_result(
        self, transfer: LoadTransfer | StoreTransfer, result: TransferResult, now: float
    ) -> None:
        """A load's or a write's result, per block (`failed_blocks`; a failure that
        names no block fails them all): see `finish_load` and `finish_store`. Frees
        the host blocks they release."""
        failed = set(result.failed_blocks)
        everything = not result.success and not result.failed_blocks
        if type(transfer) is LoadTransfer:
            if result.success:
                self.note_load_time(transfer, now - transfer.emitted_at)
            freed = self.finish_load(transfer, failed, everything)
        else:
            freed = self.finish_store(transfer, failed, everything)
        self.host_pool.free(freed)

    def note_load_time(self, transfer: LoadTransfer, seconds: float) -> None:
        """Refine the read-bandwidth estimate PREDICTED uses (EWMA)."""
        self.prefetch_policy.note_load(len(transfer.nodes) * self.config.block_bytes, seconds)

    def stats(self) -> StorageTierStats:
        return StorageTierStats(
            self.lookups,
            self.lookup_blocks,
            self.hit_blocks,
            self.load_failures,
            self.skipped_loads,
            self.abandoned_loads,
            self.writes,
            self.write_failures,
        )

    def check(self, host_owner: dict[int, object]) -> QueuedNodes:
        """Assert the tier's queued state (part of CacheManager.check_invariants).

        Claims in `host_owner` the host blocks its queued writes free when they end
        (asserting no one else owns them), and returns the nodes its queued
        transfers pin or move, for the caller's check that every such node in the
        tree is accounted for.
        """
        for lookup_id, (req, _, _) in self._lookup_owner.items():
            assert req.lookup_id == lookup_id, f"lookup {lookup_id} owner moved on"
        for node in self._loads.nodes:  # adopted by a recomputed block, or dropped
            assert node.state in (LOADING_FROM_STORAGE, BACKUP_TO_HOST, DROPPED), node
        for node, host, free in zip(
            self._stores.nodes, self._stores.host_ids, self._stores.free_after, strict=True
        ):
            if free or (node is not None and node.state == DROPPED):
                # Its host block is the write's until the write ends (a dropped
                # block's too: it left the tree, the write still reads it).
                assert host not in host_owner, f"host block {host} owned twice"
                host_owner[host] = "a queued storage write"
            else:
                assert node is not None and node.storage == STORING, node
        return QueuedNodes(
            [n for n in self._stores.nodes if n is not None], list(self._loads.nodes)
        )


def has_pending_storage(req: RequestState) -> bool:
    """Whether the request's storage lookup is unanswered or blocks found for it
    are still loading into host."""
    if req.lookup_id >= 0:
        return True
    return any(n.state is LOADING_FROM_STORAGE for n in req.nodes[req.num_matched :])


def first_loading(req: RequestState) -> int:
    """The first position past the request's table whose block is still loading
    from storage (the path's length if none)."""
    nodes = req.nodes
    return next(
        (
            i
            for i in range(len(req.blocks), len(nodes))
            if nodes[i].state is LOADING_FROM_STORAGE
        ),
        len(nodes),
    )


def loaded_from_storage(req: RequestState) -> list[BlockHash]:
    """The hashes of the request's blocks past its match that sit in the cache now
    (loads that failed are gone from its path)."""
    return [n.key for n in req.nodes[req.num_matched :] if n.state is not LOADING_FROM_STORAGE]


__all__ = [
    "QueuedNodes",
    "StorageTier",
    "first_loading",
    "has_pending_storage",
    "loaded_from_storage",
]
