"""The scheduler's cache manager: prefix matching, allocation, eviction and swaps.

The manager keeps each request's block hashes (given at `match`, or made from its
tokens by `add_request`), so `commit` takes a count and cannot cache the wrong
blocks. Counts are tokens. One engine step (it may touch many requests):

    hit = mgr.add_request(rid, token_ids)    # or match(rid, hashes, num_tokens)
    alloc = mgr.allocate(rid, num_tokens=n)  # the table holds the first n tokens
    table = mgr.block_table(rid)             # per position: block, CACHED/LOADING/COMPUTE
    tasks = mgr.take_swap_metadata()         # D2H evictions/backups, H2D swap-ins
    ... the worker runs the swaps, then the model writes the COMPUTE positions ...
    rollbacks = mgr.apply_results(results)   # the TransferResults it reports, then
    mgr.commit(rid, num_computed_tokens=m)   # the computed full blocks become cached
    mgr.append_tokens(rid, new_tokens)       # or append_hashes(rid, new_hashes)
    mgr.finish(rid)  /  mgr.abort(rid)

`allocate` says what to do when it cannot give blocks now (see `AllocStatus`): wait
for the transfers it has planned (send `take_swap_metadata()` to the worker and
apply the results), or free blocks other requests hold. A request that could never
fit raises.

Block lifetime (Invariant 1): a block leaves its pool when it is allocated and goes
back only when nothing can read or write it any more. A device block being evicted
stays allocated until its copy's TransferResult arrives; the host block of a swap-in
stays with its node (the node keeps its host copy); a node whose copy is in flight
is on no eviction list, so nothing evicts it before the result.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence

from fastkv.config import CacheConfig, as_int
from fastkv.hashing import (
    BlockHasher,
    ExtraKey,
    Tokens,
    namespace_root,
    request_root,
)
from fastkv.metadata import (
    MAX_EPOCH,
    BlockHash,
    CacheSwapMetadata,
    Epoch,
    LookupResult,
    StorageLookup,
    TransferListener,
    TransferResult,
    check_epoch,
)
from fastkv.scheduler.api import (
    Allocation,
    AllocStatus,
    MatchResult,
    Rollback,
    StalledTransfer,
    SwapTasks,
)
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.invariants import check_manager
from fastkv.scheduler.radix_tree import (
    HOST,
    SWAP_TO_DEVICE,
    RadixTree,
    TreeNode,
)
from fastkv.scheduler.receiving import ReceivingBlocks
from fastkv.scheduler.request import (
    RequestId,
    RequestState,
    append_ids,
    check_count,
    checked_hashes,
)
from fastkv.scheduler.stats import CacheStats, ManagerCounters
from fastkv.scheduler.storage_tier import (
    first_loading,
    has_pending_storage,
    loaded_from_storage,
)
from fastkv.scheduler.table import BlockTable
from fastkv.scheduler.tiers import CacheTiers
from fastkv.scheduler.transfers import DeviceTransfer, TransferBook

_ALLOCATED = AllocStatus.ALLOCATED  # a global read, not an enum class lookup
_MAX_UNCHANGED = 4096  # cached-token counts whose unchanged Allocation is kept


def _count_matched(nodes: list[TreeNode], start: int, end: int) -> tuple[int, int, bool]:
    """Of the matched nodes [start, end) not in the table yet: how many are host
    copies to swap in, how many are on the device (below a host hit, or loaded by
    another request meanwhile), and whether one of those is still being loaded."""
    num_swap = num_below = 0
    loading = False
    for i in range(start, end):
        state = nodes[i].state
        if state == HOST:
            num_swap += 1
        else:
            num_below += 1
            loading |= state == SWAP_TO_DEVICE
    return num_swap, num_below, loading


def _stall_seconds(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"stall_after_s: must be a number of seconds > 0, got {value!r}")
    return float(value)


class CacheManager:
    """One cache as an engine's scheduler sees it: the request lifecycle, over the
    rooms that hold the state.

        CacheManager        validates each call, then delegates; a request's record
          │                 (RequestState) goes to the room that acts on it
          ├ tree            RadixTree: cached blocks, locks, eviction order
          ├ device_pool     BlockPool: device block ids
          ├ host_pool       BlockPool: host block ids
          ├ transfers       TransferBook: ids, queued and in-flight copies, stalls
          ├ _tiers          CacheTiers: eviction, backups, what a result frees
          └ _storage        StorageTier (the tiers' third, behind host memory):
                            lookups, loads, writes; the manager hands it requests

    `tree`, the pools and `transfers` are public for inspection (tests, tools,
    metrics); an engine reads tables and counts through the methods. Every method
    validates its whole input before it changes anything.

    Not thread-safe: call it from the scheduler loop only.

    Args:
        config: a validated `CacheConfig`. With `tp_size` > 1, `apply_results` takes
            only results combined over every rank (`fastkv.tp.RankResults`).
        clock: monotonic seconds, for transfer durations (metrics listeners, the
            storage read-bandwidth estimate), the storage tier's waits and retries,
            and stalled transfers (injectable for tests and replays).
        stall_after_s: a transfer taken by `take_swap_metadata` whose result has not
            been applied after this many seconds is stalled: logged once,
            counted in `CacheStats.stalled_transfers`, listed by
            `stalled_transfers()`.

        epoch: the cache epoch to start in (`fastkv.metadata.Epoch`): stamped on
            every metadata taken, and `apply_results` drops (and counts in
            `stale_results`) a result of another epoch. An engine that replaces its
            manager on a cache reset (instead of calling `reset_cache`) passes the
            old one's epoch + 1, so its workers' late reports stay apart.

    Raises:
        ValueError: `stall_after_s` is not a number > 0, or `epoch` not an int in
            [0, MAX_EPOCH].
    """

    def __init__(
        self,
        config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        stall_after_s: float = 60.0,
        epoch: int = 0,
    ) -> None:
        stall_s = _stall_seconds(stall_after_s)
        check_epoch(epoch)
        self.config = config
        self.block_size = config.block_size
        self._root = namespace_root(config.namespace_key())
        self._clock = clock
        self.stale_results = 0  # results of another epoch, dropped (kept across resets)
        self._build(Epoch(epoch), stall_s)

    def _build(self, epoch: Epoch, stall_s: float) -> None:
        """Empty rooms for `epoch` (construction and `reset_cache`)."""
        self.epoch = epoch
        config, clock = self.config, self._clock
        self._wait_on_untaken = False  # set by _allocate: its WAIT needs an untaken copy
        self._unchanged: dict[int, Allocation] = {}  # see _nothing_to_allocate
        self.device_pool = BlockPool(config.num_device_blocks, "device")
        self.host_pool = BlockPool(config.num_host_blocks, "host")
        self.tree = RadixTree()
        self._requests: dict[RequestId, RequestState] = {}
        self._counters = ManagerCounters()
        self.transfers = TransferBook(self._counters, clock, stall_s)
        self._tiers = CacheTiers(
            config,
            tree=self.tree,
            device_pool=self.device_pool,
            host_pool=self.host_pool,
            book=self.transfers,
            counters=self._counters,
            clock=clock,
        )
        self._storage = self._tiers.storage
        self._has_host_tier = config.num_host_blocks > 0
        self._counts_hits = self._tiers.counts_hits
        self._receiving = ReceivingBlocks(
            self.device_pool, self._tiers, config.reuse_evicted_blocks
        )
        self.transfers.epoch = epoch
        if self._storage is not None:
            self._storage.epoch = epoch

    def reset_cache(self) -> None:
        """Forget every cached block and start the next epoch (`fastkv.metadata.Epoch`):
        the pools are empty again, transfer and lookup ids restart, statistics
        restart (listeners stay), and every metadata taken from now on carries the
        new epoch. A result of an earlier epoch that still arrives (a stale or
        duplicated report) is dropped and counted (`stale_results`), never applied
        to a new transfer that reuses its id.

        Raises:
            ValueError: a request is active, a transfer or lookup is in flight or
                queued, or blocks are receiving a PD transfer (their blocks are still
                in use); nothing changes.
        """
        if self._requests or self.busy or self._receiving:
            raise ValueError(
                f"reset_cache: {len(self._requests)} requests active, "
                f"{self.transfers.num_inflight} transfers in flight, "
                f"{len(self._receiving)} blocks receiving; only an idle cache is reset"
            )
        if self.epoch >= MAX_EPOCH:
            raise ValueError(f"reset_cache: epoch {self.epoch} is the last (MAX_EPOCH)")
        listeners = self.transfers.listeners
        self._build(Epoch(self.epoch + 1), self.transfers.stall_after_s)
        for listener in listeners:
            self.transfers.add_listener(listener)

    # -- request lifecycle ----------------------------------------------------

    def add_request(
        self,
        request_id: RequestId,
        token_ids: Tokens,
        *,
        request_key: ExtraKey | None = None,
        extra_keys: Mapping[int, ExtraKey] | None = None,
        lookup_storage: bool = True,
    ) -> MatchResult:
        """Register a request by its prompt tokens: the manager hashes them (chained
        SHA-256 digests under this cache's namespace, see `fastkv.hashing`), keeps
        the hashes, and matches them as `match` does. Grow it with
        `append_tokens`.

        Args:
            request_id: any hashable id, unique among active requests.
            token_ids: the prompt (see `fastkv.hashing` for the accepted types).
            request_key: a request-wide key (LoRA adapter id, cache salt): requests
                with different keys share no block.
            extra_keys: per block index, a key folded into that block's hash
                (multimodal content hashes).
            lookup_storage: as for `match`.

        Raises:
            ValueError: `request_id` is already active, or a token or key is out of
                range. TypeError: tokens or keys of the wrong type. Nothing changes.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already active")
        hasher = BlockHasher(self.block_size, request_root(self._root, request_key))
        hashes = hasher.append(token_ids, extra_keys)
        hit = self.match(request_id, hashes, hasher.num_tokens, lookup_storage=lookup_storage)
        self._requests[request_id].hasher = hasher
        return hit

    def match(
        self,
        request_id: RequestId,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        *,
        lookup_storage: bool = True,
    ) -> MatchResult:
        """Register a new request by its block hashes and lock the longest cached
        prefix of its blocks (`add_request` does the hashing for an engine that
        does not hash itself).

        The manager keeps `block_hashes` for the request's later `commit`s. At most
        `(num_tokens - 1) // block_size` blocks hit: the prompt's last token is
        always computed, since its logits start decoding. Locked blocks cannot be
        evicted until the request finishes or aborts. The leading device hits enter
        the request's table now; `allocate` brings in the rest (host hits get
        device blocks and a planned swap-in).

        Args:
            request_id: any hashable id, unique among active requests.
            block_hashes: the chained 32-byte digests of the prompt's full blocks,
                in order (fewer is fine: only hashed blocks are matched and cached).
            num_tokens: the prompt's length in tokens.
            lookup_storage: False: no storage lookup for the blocks past the hits
                (the request computes them; an engine that looks storage up ahead
                of admission passes it).

        Raises:
            ValueError: `request_id` is already active, `num_tokens` is not an int
                >= 0, the hashes cover more than `num_tokens` tokens, or a hash
                appears twice.
            TypeError: `block_hashes` is not a sequence of 32-byte `bytes` digests.
            Nothing changes when it raises.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already active")
        hashes = checked_hashes(block_hashes, distinct=False)  # match_and_lock: distinct
        num_tokens = check_count("num_tokens", num_tokens)
        bs = self.block_size
        if len(hashes) * bs > num_tokens:
            raise ValueError(
                f"block_hashes: {len(hashes)} full blocks of {bs} tokens are more than "
                f"num_tokens={num_tokens}"
            )
        limit = (num_tokens - 1) // bs if num_tokens else 0
        nodes, blocks, num_host, waiting = self.tree.match_and_lock(
            hashes, limit, "block_hashes"
        )
        req = RequestState(request_id, hashes, nodes, blocks)
        self._requests[request_id] = req
        if self._counts_hits:
            self._tiers.note_hits(nodes)
        storage = self._storage
        looked_up = False
        if storage is not None and lookup_storage and not waiting and len(nodes) < limit:
            looked_up = storage.plan_lookup(req, len(nodes), limit)
        counters = self._counters
        counters.lookup_blocks += len(hashes)
        counters.lookup_tokens += num_tokens
        counters.device_hits += len(nodes) - num_host
        counters.host_hits += num_host
        in_table = len(req.blocks)
        return MatchResult(in_table, len(nodes) - in_table, len(nodes) * bs, waiting, looked_up)

    def storage_pending(self, request_id: RequestId) -> bool:
        """Whether the request's storage lookup is unanswered or blocks found for it
        are still loading into host.

        Raises:
            ValueError: unknown request.
        """
        req = self._get(request_id)
        return has_pending_storage(req)

    def storage_pending_lookup(self, lookup_id: int) -> bool:
        """Whether lookup `lookup_id` waits for its answer (its request still wants it)."""
        return self._storage is not None and self._storage.wants_answer(lookup_id)

    def storage_loaded(self, request_id: RequestId) -> list[BlockHash]:
        """The hashes of the request's blocks that came from storage past its match
        and sit in the cache now (loads that failed are gone from its path); meant
        for a request that has committed nothing since its match (a prefetch).

        Raises:
            ValueError: unknown request.
        """
        return loaded_from_storage(self._get(request_id))

    def write_to_storage(self, request_id: RequestId) -> int:
        """Under the storage write policy WRITE_THROUGH, plan the writes of the
        request's cached blocks that storage does not hold yet: a block with a valid
        host copy is written with the next `take_swap_metadata`; a device-only block
        is backed up to host first (if host room) and written once that copy lands.
        Other policies write at hits (AFTER_HITS) or at host eviction
        (ON_HOST_EVICTION): nothing is planned here.

        Returns:
            How many blocks were planned (writes and backups).

        Raises:
            ValueError: unknown request. Nothing changes.
        """
        req = self._get(request_id)
        storage = self._storage
        if storage is None or not storage.write_policy.writes_requests:
            return 0
        planned, device_only = storage.plan_request_writes(req)
        if device_only:
            before = self._counters.backups
            self._tiers.backup(device_only)
            planned += self._counters.backups - before
        return planned

    def append_tokens(
        self,
        request_id: RequestId,
        token_ids: Tokens,
        *,
        extra_keys: Mapping[int, ExtraKey] | None = None,
    ) -> int:
        """Add tokens the request generated (or a continuation of its prompt) to a
        request registered with `add_request`; the blocks they complete get their
        hashes, for later `commit`s.

        Returns:
            How many blocks the tokens completed.

        Raises:
            ValueError: unknown request, one registered by hashes (`match`: use
                `append_hashes`), or a token or key out of range. TypeError:
                tokens or keys of the wrong type. Nothing changes.
        """
        req = self._get(request_id)
        if req.hasher is None:
            raise ValueError(
                f"request_id: {request_id!r} was registered with its hashes (match); "
                "add its new blocks' hashes with append_hashes"
            )
        new = req.hasher.append(token_ids, extra_keys)
        req.hashes.extend(new)
        if req.hash_set is not None:
            req.hash_set.update(new)
        return len(new)

    def append_hashes(self, request_id: RequestId, block_hashes: Sequence[BlockHash]) -> None:
        """Add the hashes of the blocks the request completed since `match` or the
        last call (decoded tokens fill blocks too), so a later `commit` can cache
        them. Only the new ones: a hash the request already holds is refused.

        Raises:
            ValueError: unknown request; one registered by tokens (`add_request`:
                use `append_tokens`); a hash repeats, or the request holds it
                already (the whole list passed again instead of the new hashes).
            TypeError: not a sequence of 32-byte `bytes` digests. Nothing changes.
        """
        req = self._get(request_id)
        if req.hasher is not None:
            raise ValueError(
                f"request_id: {request_id!r} was registered with its tokens (add_request); "
                "the manager hashes it: add tokens with append_tokens"
            )
        new = checked_hashes(block_hashes)
        if not new:
            return
        held = req.hash_set
        if held is None:
            held = set(req.hashes)
        if not held.isdisjoint(new):
            first = next(i for i, h in enumerate(new) if h in held)
            raise ValueError(
                f"block_hashes[{first}]: request {request_id!r} holds this hash already "
                f"(it holds {len(req.hashes)}); pass only the hashes of blocks completed "
                "since the last call"
            )
        held.update(new)
        req.hash_set = held
        req.hashes.extend(new)

    def allocate(self, request_id: RequestId, *, num_tokens: int) -> Allocation:
        """Make the request's table hold its first `num_tokens` tokens: every block
        it matched (a host hit gets a device block and a swap-in planned for the
        next `take_swap_metadata`) and fresh blocks up to
        `ceil(num_tokens / block_size)` positions. Asking for no more than the table
        holds changes nothing, so a decode step passes the request's length each
        time and a block is added only when a boundary is crossed.

        All or nothing. When too few blocks are free, evictions start (queued for
        the next `take_swap_metadata`) and the result says what to do:
        WAIT_FOR_TRANSFERS when the request fits once planned transfers complete,
        NO_SPACE when other requests hold the blocks it needs (see `AllocStatus`).
        Then read the table with `block_table`.

        Args:
            request_id: an active request.
            num_tokens: the request's length in tokens that the table must hold:
                prompt, tokens generated so far and those this step adds.

        Raises:
            ValueError: unknown request; `num_tokens` not an int >= 0; a demand
                larger than the device pool could ever hold for this request alone
                (its table, the device blocks it has matched, its host hits and the
                new blocks).
            RuntimeError: the request was answered WAIT_FOR_TRANSFERS twice in a row
                while the only transfers it could wait for were never taken
                (`take_swap_metadata` was not called since, and nothing taken
                before is in flight): they can never complete. Nothing changes
                when it raises.
        """
        req = self._get(request_id)
        num_tokens = check_count("num_tokens", num_tokens)
        if req.waits >= 2 and req.wait_epoch == self.transfers.num_takes:
            raise RuntimeError(
                f"allocate({request_id!r}): answered WAIT_FOR_TRANSFERS {req.waits} times "
                "while the transfers it waits for were never taken; call "
                "take_swap_metadata(), run what it returns on the worker(s) and "
                "apply_results() their reports before allocating again"
            )
        num_positions = -(-num_tokens // self.block_size)
        held = len(req.blocks)
        if held >= num_positions and held >= len(req.nodes) and req.lookup_id < 0:
            # The table holds every position asked for and every block matched (a
            # full hit, a decode step within its last block): nothing to do.
            req.allocated = True
            req.waits = 0
            return self._nothing_to_allocate(req.num_cached_blocks * self.block_size)
        self._wait_on_untaken = False
        alloc = self._allocate(req, num_positions)
        if self._wait_on_untaken:  # a WAIT only untaken transfers can end
            req.waits = req.waits + 1 if req.wait_epoch == self.transfers.num_takes else 1
            req.wait_epoch = self.transfers.num_takes
        else:
            req.waits = 0
        return alloc

    def _allocate(self, req: RequestState, num_positions: int) -> Allocation:
        nodes, blocks = req.nodes, req.blocks
        storage = self._storage
        # Blocks still loading from storage for this request: it waits for them, or
        # lets go of them (and computes them) when it stops waiting.
        keep = len(nodes) if storage is None else first_loading(req)
        num_new = max(0, num_positions - max(keep, len(blocks)))
        num_swap = num_below = 0
        loading_elsewhere = False
        if keep > len(blocks):  # matched blocks not in the table yet
            num_swap, num_below, loading_elsewhere = _count_matched(nodes, len(blocks), keep)
        need = num_swap + num_new
        pool = self.device_pool
        if len(blocks) + num_below + need > pool.capacity:
            raise ValueError(
                f"num_tokens: request {req.request_id!r} would hold "
                f"{len(blocks) + num_below + need} device blocks "
                f"({len(blocks) + num_below} held, {num_swap} host hits to load, "
                f"{num_new} new), more than the {pool.capacity} device blocks"
            )
        if keep < len(nodes) or req.lookup_id >= 0:
            if storage.waits(req):  # type: ignore[union-attr]
                return Allocation(AllocStatus.WAIT_FOR_TRANSFERS)
            storage.let_go(req, keep)  # type: ignore[union-attr]
        if loading_elsewhere:  # a block it matched is still being loaded by another
            return self._wait_for_swap_in(nodes[len(blocks) : keep])
        if need <= pool.num_free:  # the common case inline
            ids = pool.allocate(need)
        else:
            ids = self._tiers.take_device_blocks(need, self._is_busy)
            if type(ids) is AllocStatus:
                return self._cannot_allocate(ids)
        before = len(blocks)
        if num_swap:
            self._tiers.plan_swap_in(req, nodes[before:], ids)
        elif keep > before:
            blocks.extend(n.device_block for n in nodes[before:])
        append_ids(blocks, ids[num_swap:])
        req.allocated = True
        return Allocation(
            _ALLOCATED, len(blocks) - before, req.num_cached_blocks * self.block_size
        )

    def _nothing_to_allocate(self, num_cached_tokens: int) -> Allocation:
        """ALLOCATED with no new block: one shared (frozen) object per count of
        cached tokens, as a full hit or a decode step within its block gets it
        every time (making an Allocation costs more than the rest of that path)."""
        alloc = self._unchanged.get(num_cached_tokens)
        if alloc is None:
            alloc = Allocation(_ALLOCATED, 0, num_cached_tokens)
            if len(self._unchanged) < _MAX_UNCHANGED:
                self._unchanged[num_cached_tokens] = alloc
        return alloc

    def _cannot_allocate(self, status: AllocStatus) -> Allocation:
        if status is AllocStatus.WAIT_FOR_TRANSFERS:
            # Only planned copies can free blocks when none taken is in flight.
            self._wait_on_untaken = not self.transfers.num_inflight
        return Allocation(status)

    def _wait_for_swap_in(self, matched: list[TreeNode]) -> Allocation:
        """A block the request matched is being swapped in by another request: it
        waits; only for an untaken copy if that swap-in is still queued."""
        queued = set(self.transfers.to_device.nodes)
        self._wait_on_untaken = any(n.state is SWAP_TO_DEVICE and n in queued for n in matched)
        return Allocation(AllocStatus.WAIT_FOR_TRANSFERS)

    def commit(self, request_id: RequestId, *, num_computed_tokens: int) -> None:
        """Record that the request's first `num_computed_tokens` token positions hold
        valid KV (cached, computed or recomputed): its full blocks among them become
        matchable by later requests, keyed by the hashes the manager holds.

        Committing again with the same or a larger count is how a request grows;
        blocks already committed stay. Apply the step's TransferResults first: a
        block computed on top of a swap-in that then failed would be garbage, so
        committing while the request's swap-in has no result yet is refused.

        Raises:
            ValueError: unknown request; `num_computed_tokens` not an int >= 0; it
                is below the tokens the table's cached prefix already holds (a
                block count passed for a token count), fills more blocks than are
                allocated, or more than the request's known hashes
                (`append_hashes`/`append_tokens` add blocks completed after the
                match); the request's swap-in has no result yet; or a hash is
                already cached under another prefix (not a chained hash). Nothing
                changes when it raises.
        """
        req = self._get(request_id)
        num_computed_tokens = check_count("num_computed_tokens", num_computed_tokens)
        if req.loading:
            raise ValueError(
                f"request_id: {request_id!r} has a swap-in without a result yet; "
                "apply its TransferResult before committing"
            )
        nodes, blocks = req.nodes, req.blocks
        bs = self.block_size
        cached = req.num_cached_blocks * bs
        if num_computed_tokens < cached:
            raise ValueError(
                f"num_computed_tokens: {num_computed_tokens} is below the {cached} tokens "
                f"request {request_id!r} already holds cached; counts are tokens, not blocks"
            )
        num_blocks = num_computed_tokens // bs
        if num_blocks > len(blocks):
            raise ValueError(
                f"num_computed_tokens: {num_computed_tokens} tokens fill {num_blocks} "
                f"blocks, but request {request_id!r} has {len(blocks)} blocks allocated"
            )
        if num_blocks > len(req.hashes):
            raise ValueError(
                f"num_computed_tokens: {num_computed_tokens} tokens fill {num_blocks} "
                f"blocks, but only {len(req.hashes)} block hashes of request "
                f"{request_id!r} are known; add the hashes of blocks completed after "
                "match with append_hashes"
            )
        start = len(nodes)
        reused = self.transfers.to_host.reused
        if (
            reused
            and num_blocks > start
            and not set(reused).isdisjoint(blocks[start:num_blocks])
        ):
            pos = next(p for p in range(start, num_blocks) if blocks[p] in set(reused))
            raise ValueError(
                f"num_computed_tokens: position {pos} of request {request_id!r} is block "
                f"{blocks[pos]}, handed over by an eviction not taken yet: its KV cannot "
                "have been computed; run the step (take_swap_metadata) before committing"
            )
        if num_blocks > start:
            parent = nodes[-1] if nodes else self.tree.root
            # Raises before changing anything when a hash is cached elsewhere.
            path, existing = self.tree.insert(
                parent, req.hashes[start:num_blocks], blocks[start:num_blocks]
            )
            nodes.extend(path)
            created = path
            if existing:  # a leading run of the path, cached meanwhile by others
                self._tiers.adopt_committed(req, path[: len(existing)], start)
                created = path[len(existing) :]
            if created and self._has_host_tier:
                self._tiers.back_up_new(created)
        if req.rolled_back:
            self._tiers.readopt(req, num_blocks)

    # -- blocks written by another instance (prefill/decode) ------------------

    def reserve_receiving(self, num_blocks: int) -> list[int] | AllocStatus:
        """Take `num_blocks` device blocks (evicting as `allocate` does) for bytes
        another instance will write into: they are in no tree and no request's table,
        so nothing matches, evicts, swaps, stores or frees them and no request reads
        them, until `commit_received` hands them to a request or `release_receiving`
        returns them (only once no write into them can still land: the caller's
        fence, see `fastkv.pd`).

        Returns:
            The block ids, or why there are none now (`AllocStatus` NO_SPACE or
            WAIT_FOR_TRANSFERS, as for `allocate`; nothing is reserved). With
            `reuse_evicted_blocks` and a host tier only free blocks are taken (an
            evicted block's copy is ordered before this instance's writes, not a
            remote writer's): NO_SPACE when too few are free. Without a host tier
            eviction copies nothing, and cached blocks are evicted for it.

        Raises:
            ValueError: `num_blocks` is not an int >= 0, or more than the device pool.
        """
        check_count("num_blocks", num_blocks)
        if num_blocks > self.device_pool.capacity:
            raise ValueError(
                f"num_blocks: {num_blocks} is more than the {self.device_pool.capacity} "
                "device blocks"
            )
        return self._receiving.reserve(num_blocks, self._is_busy)

    def release_receiving(self, block_ids: Sequence[int]) -> None:
        """Return reserved receiving blocks to the device pool (no write into them can
        land any more).

        Raises:
            ValueError: an id is not a receiving block, or is listed twice; nothing
                changes.
        """
        self._receiving.release(self._receiving.checked(block_ids))

    def commit_received(
        self, request_id: RequestId, block_ids: Sequence[int], *, num_computed_tokens: int
    ) -> None:
        """Append receiving blocks, whose bytes were written and verified, to the
        request's table after its matched prefix, and commit the request's first
        `num_computed_tokens` tokens exactly as after a local prefill (`commit`):
        their full blocks become matchable by later requests.

        Raises:
            ValueError: unknown request; a request whose table is not exactly its
                matched device prefix (it allocated, or a swap-in is pending); an id
                not receiving or listed twice; or what `commit` refuses. Nothing
                changes when it raises.
        """
        req = self._get(request_id)
        ids = self._receiving.checked(block_ids)
        if req.loading or req.allocated or len(req.blocks) != len(req.nodes):
            raise ValueError(
                f"request_id: {request_id!r} holds {len(req.blocks)} blocks in its table "
                f"for {len(req.nodes)} matched; received blocks follow a table that is "
                "exactly its matched device prefix (no allocate, no swap-in)"
            )
        before = len(req.blocks)
        req.blocks.extend(ids)
        try:
            self.commit(request_id, num_computed_tokens=num_computed_tokens)
        except ValueError:
            del req.blocks[before:]
            raise
        req.allocated = True
        self._receiving.handed_over(ids)

    @property
    def num_receiving_blocks(self) -> int:
        return len(self._receiving)

    def is_receiving(self, block_id: int) -> bool:
        return block_id in self._receiving

    def finish(self, request_id: RequestId) -> None:
        """Release a request, finished or not (`abort` is the same call): its
        committed blocks stay cached (evictable once no request or transfer holds
        them), the rest return to the pool. Swap-ins it started stay in flight and
        resolve when their results arrive; its storage lookup is dropped.

        Raises:
            ValueError: unknown request.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not an active request")
        req.done = True
        if self._storage is not None:
            self._storage.forget(req)
        self._tiers.release(req)

    def abort(self, request_id: RequestId) -> None:
        """Release a request that will not complete: the same call as `finish`.

        Raises:
            ValueError: unknown request.
        """
        self.finish(request_id)

    @property
    def stall_after_s(self) -> float:
        """Seconds without a result after which a taken transfer counts as stalled."""
        return self.transfers.stall_after_s

    @stall_after_s.setter
    def stall_after_s(self, seconds: float) -> None:
        self.transfers.stall_after_s = _stall_seconds(seconds)

    def block_table(self, request_id: RequestId, start: int = 0) -> BlockTable:
        """The request's table from position `start` on: per position its device
        block and its `Slot` (CACHED, LOADING, COMPUTE), with the length of the
        cached prefix (see `fastkv.scheduler.table`). O(positions returned): an
        engine that keeps the table it was given asks for the positions past it.

        Raises:
            ValueError: unknown request, or `start` not an int in [0, table length].
        """
        return BlockTable.of(self._get(request_id), self.block_size, start)

    def block_ids(self, request_id: RequestId, start: int = 0) -> array[int]:
        """The device blocks of `block_table(request_id, start)` as a new int32
        `array`: for an engine that copies them into an int32 table of its own
        (`numpy.frombuffer(..., dtype=numpy.int32)`) without an int object per
        block. The slots (and so where to compute from) come from `block_table`.
        O(positions returned).

        Raises:
            ValueError: unknown request, or `start` not an int in [0, table length].
        """
        blocks = self._get(request_id).blocks
        return blocks[as_int("start", start, 0, len(blocks)) :]

    def num_blocks(self, request_id: RequestId) -> int:
        """The length of the request's block table (O(1))."""
        return len(self._get(request_id).blocks)

    def is_active(self, request_id: RequestId) -> bool:
        return request_id in self._requests

    def active_request_ids(self) -> list[RequestId]:
        """The active requests, oldest first."""
        return list(self._requests)

    def request_state(self, request_id: RequestId) -> RequestState:
        """The manager's record of an active request, for inspection (tests,
        debugging): its hashes, locked path, table and in-flight counts. The
        manager's own object: read it, never change it.

        Raises:
            ValueError: unknown request.
        """
        return self._get(request_id)

    def num_hashes(self, request_id: RequestId) -> int:
        """How many of the request's block hashes the manager holds."""
        return len(self._get(request_id).hashes)

    def num_committed_blocks(self, request_id: RequestId) -> int:
        """Blocks of the request that are cached (matched or committed)."""
        return len(self._get(request_id).nodes)

    def has_pending_swap_in(self, request_id: RequestId) -> bool:
        """Whether a swap-in of the request has no result yet (commit waits)."""
        return self._get(request_id).loading > 0

    @property
    def num_free_device_blocks(self) -> int:
        return self.device_pool.num_free

    def free_device_block_ids(self) -> list[int]:
        """The free device block ids, the next to be allocated last (a copy,
        O(free blocks))."""
        return self.device_pool.free_ids()

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free

    def is_inflight(self, transfer_id: int) -> bool:
        """Whether transfer `transfer_id` was taken by `take_swap_metadata` and its
        result is not applied yet (its blocks are still reserved)."""
        return self.transfers.is_inflight(transfer_id)

    def num_obtainable_device_blocks(self, limit: int) -> int:
        """How many device blocks an allocation could get right now, at most
        `limit`: the free ones, then the cached blocks no request holds that
        evicting reaches now (leaves first; a block under which a copy to the device
        is still in flight stays until it lands).

        Exact with `reuse_evicted_blocks` (every evicted block goes to the
        allocating request at once, and a victim without host room is dropped with
        its host-only descendants rather than stopping the eviction): an allocation
        of at most this many blocks (its host hits' destinations included) succeeds
        now, one of more does not. Without it, blocks that must first be copied to
        host are counted though they free only when the copy lands.

        O(1) when the free blocks suffice, else O(cached blocks counted and passed
        over); at most `num_free_device_blocks + num_evictable_device_blocks` (O(1))
        rules out more.

        Raises:
            ValueError: `limit` is not an int >= 0.
        """
        limit = check_count("limit", limit)
        return self._tiers.num_obtainable_device_blocks(limit)

    @property
    def num_evictable_device_blocks(self) -> int:
        """Cached device blocks no request holds and no copy moves (O(1)): with the
        free ones, what an allocation can get by evicting, leaves first."""
        return self.tree.num_unlocked_device

    # -- per step -------------------------------------------------------------

    def take_swap_metadata(self) -> SwapTasks:
        """Package the transfers and lookups planned since the last call, each with
        a new id.

        Every block in them stays reserved until `apply_results` sees the result.
        """
        evict, swap_in = self.transfers.take()
        storage = self._storage
        if storage is None:
            return SwapTasks(evict, swap_in)
        storage.flush_ahead()
        if not storage.has_queued:
            return SwapTasks(evict, swap_in)
        load, store, lookups = storage.take(self.transfers.register)
        return SwapTasks(evict, swap_in, load, store, lookups)

    def take_storage_reads(self) -> tuple[CacheSwapMetadata | None, tuple[StorageLookup, ...]]:
        """Package only the storage lookups and the storage load planned so far
        (an engine that sends them to the workers on a route of their own, ahead
        of any step); device copies and writes stay for `take_swap_metadata`.

        Returns:
            (the load into host blocks, or None; the lookups). Every block in the
            load stays reserved until `apply_results` sees its result.
        """
        if self._storage is None:
            return None, ()
        return self._storage.take_reads(self.transfers.register)

    def stalled_transfers(self) -> list[StalledTransfer]:
        """Transfers taken by `take_swap_metadata` whose result has not been
        applied for `stall_after_s` or more, oldest first: a worker that lost them,
        results never delivered, or a batch never applied. Their blocks stay
        reserved (Invariant 1) until a result comes."""
        return self.transfers.stalled()

    def apply_results(self, results: Iterable[TransferResult | LookupResult]) -> list[Rollback]:
        """Apply the worker's transfer reports and storage lookup answers, in any
        order (with several ranks: combined first, see `fastkv.tp`).

        A successful eviction frees its device blocks; a successful swap-in or
        backup makes its blocks valid in the new tier. A failed device-to-host copy
        frees the host blocks it was writing and keeps the device copy; a failed
        swap-in returns its nodes to host-only, and each still-active request that
        was loading them gets a `Rollback` naming the positions to recompute. A
        storage load or write answers per block (see `fastkv.scheduler.storage_tier`);
        a lookup's answer starts the loads of what storage holds.

        Raises:
            TypeError: an entry is neither a TransferResult nor a LookupResult.
            ValueError: a transfer id that is unknown, already applied or listed
                twice, a malformed lookup answer, or a lookup answer to a manager
                without a storage tier. Nothing in the batch is applied when it raises.

        A result of another epoch than the manager's (a report from before
        `reset_cache`) is dropped and counted in `stale_results`, never applied.
        """
        results = list(results)
        epoch = self.epoch
        fresh = [r for r in results if getattr(r, "epoch", epoch) == epoch]
        if len(fresh) != len(results):  # reports from before a cache reset
            self.stale_results += len(results) - len(fresh)
            results = fresh
        self._check_results(results)
        rollbacks: dict[RequestId, list[int]] = {}
        now = self._clock()
        tiers, storage = self._tiers, self._storage
        for result in results:
            if isinstance(result, LookupResult):
                storage.apply_lookup(result)  # type: ignore[union-attr]
                continue
            transfer = self.transfers.pop(result.transfer_id, result.success, now)
            if type(transfer) is not DeviceTransfer:
                storage.apply_result(transfer, result, now)  # type: ignore[union-attr]
            elif transfer.to_host:
                tiers.finish_to_host(transfer, result.success)
            else:
                tiers.finish_to_device(transfer, result.success, rollbacks)
        if tiers.duplicates:  # copies landed, paths were cut: a node may give way now
            tiers.fold_duplicates()
        self._counters.rollbacks += sum(len(v) for v in rollbacks.values())
        return [Rollback(rid, tuple(sorted(pos))) for rid, pos in rollbacks.items()]

    def _check_results(self, results: list[TransferResult | LookupResult]) -> None:
        """Raise unless every result of the batch can be applied (all or nothing)."""
        seen: set[int] = set()
        ranks = self.config.tp_size
        for result in results:
            if not isinstance(result, (TransferResult, LookupResult)):
                raise TypeError(f"results: expected TransferResult, got {result!r:.80}")
            if result.num_ranks != ranks:
                raise ValueError(
                    f"num_ranks: a result for {result.num_ranks} of this cache's {ranks} "
                    "tensor-parallel ranks; combine every rank's results with "
                    "fastkv.tp.RankResults and apply what it returns"
                )
            if isinstance(result, LookupResult):
                if self._storage is None:
                    raise ValueError(
                        f"results: lookup {result.lookup_id} answered, but this manager "
                        "has no storage tier (CacheConfig.storage is None)"
                    )
                self._storage.check_answer(result)
                continue
            self.transfers.check_unapplied(result.transfer_id, seen)

    def add_transfer_listener(self, listener: TransferListener) -> None:
        """Call `listener` for every transfer result applied from now on (metrics)."""
        self.transfers.add_listener(listener)

    @property
    def num_inflight_transfers(self) -> int:
        return self.transfers.num_inflight

    @property
    def num_queued_blocks(self) -> int:
        """Blocks in transfers planned but not yet taken by `take_swap_metadata`."""
        book = self.transfers  # inline: an engine loop reads this every step
        queued = len(book.to_host.nodes) + len(book.to_device.nodes)
        return queued + (self._storage.num_queued_blocks if self._storage else 0)

    @property
    def hands_over_queued_blocks(self) -> bool:
        """Whether the eviction not yet taken hands device blocks to a new owner
        (`CacheSwapMetadata.reused_block_ids`): then it must go out with the step
        whose model writes those blocks, never on its own."""
        return bool(self.transfers.to_host.reused)

    def _is_busy(self) -> bool:
        return self.busy

    @property
    def busy(self) -> bool:
        """Transfers in flight or planned, or storage lookups not answered yet:
        WAIT_FOR_TRANSFERS is only ever returned while this holds."""
        storage = self._storage
        return self.transfers.busy or (
            storage is not None and (storage.has_queued or storage.num_lookups_pending > 0)
        )

    def get_stats(self) -> CacheStats:
        book = self.transfers
        return CacheStats(
            block_size=self.block_size,
            lookup_blocks=self._counters.lookup_blocks,
            lookup_tokens=self._counters.lookup_tokens,
            device_hit_blocks=self._counters.device_hits,
            host_hit_blocks=self._counters.host_hits,
            device_to_host_blocks=self._counters.d2h_blocks,
            host_to_device_blocks=self._counters.h2d_blocks,
            device_to_host_transfers=self._counters.d2h_transfers,
            host_to_device_transfers=self._counters.h2d_transfers,
            backups=self._counters.backups,
            backups_without_room=self._counters.backups_without_room,
            backup_retries=self._counters.backup_retries,
            device_evictions=self._counters.device_evictions,
            host_evictions=self._counters.host_evictions,
            failed_transfers=self._counters.failed_transfers,
            rollbacks=self._counters.rollbacks,
            inflight_transfers=book.num_inflight,
            stalled_transfers=len(book.stalled()) if book.num_inflight else 0,
            inflight_blocks=book.num_inflight_blocks(),
            queued_blocks=self.num_queued_blocks,
            active_requests=len(self._requests),
            cached_nodes=self.tree.num_nodes,
            device_pool=self.device_pool.stats(),
            host_pool=self.host_pool.stats(),
            storage=self._storage.stats() if self._storage is not None else None,
        )

    # -- internals ------------------------------------------------------------

    def _get(self, request_id: RequestId) -> RequestState:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not an active request")
        return req

    # -- checking -------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert block accounting and locking (O(cached blocks); for tests and
        debugging): `fastkv.scheduler.invariants.check_manager` lists the checks.

        Raises:
            AssertionError: an invariant broken.
        """
        check_manager(
            tree=self.tree,
            device_pool=self.device_pool,
            host_pool=self.host_pool,
            requests=self._requests.values(),
            transfers=self.transfers,
            storage=self._storage,
            reuse_evicted_blocks=self.config.reuse_evicted_blocks,
            receiving=self._receiving,
        )
