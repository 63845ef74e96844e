"""Random request lifecycles with random transfer completions, reorderings, failures,
decode growth and bad calls, checked after every step against the invariants of the
brief; a bad call at any point must raise and leave the manager exactly as it was."""

from __future__ import annotations

import hashlib
import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fastkv import (
    CacheConfig,
    CacheSwapMetadata,
    LookupResult,
    StorageConfig,
    StorageLookup,
    TransferResult,
)
from fastkv.metadata import CacheLevel
from fastkv.scheduler import AllocStatus, CacheManager, Slot

BS = 4


def H(name: str) -> bytes:
    """A block's 32-byte digest, named for readability."""
    return hashlib.sha256(name.encode()).digest()


# A few documents sharing prefixes, so requests hit, branch and evict.
DOCUMENTS = [
    ["sys", "a1", "a2", "a3", "a4", "a5"],
    ["sys", "a1", "b2", "b3", "b4"],
    ["sys", "c1", "c2", "c3", "c4", "c5", "c6"],
    ["d0", "d1", "d2", "d3"],
]


class CacheLifecycle(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["write_back", "write_through", "write_through_selective"]),
        device_blocks=st.integers(8, 11),
        host_blocks=st.sampled_from([0, 3, 8, 20]),
        reuse=st.booleans(),
        storage=st.sampled_from(
            [None, "write_through", "on_host_eviction", "after_hits", "none"]
        ),
        prefetch=st.sampled_from(["wait", "best_effort"]),
    )
    def setup(
        self,
        policy: str,
        device_blocks: int,
        host_blocks: int,
        reuse: bool,
        storage: str | None,
        prefetch: str,
    ) -> None:
        self.now = 0.0
        tier = None
        if storage is not None and host_blocks:
            tier = StorageConfig(
                write_policy=storage, prefetch_policy=prefetch, wait_s=1.0, retry_after_s=2.0
            )
        self.mgr = CacheManager(
            CacheConfig(
                block_size=BS,
                num_device_blocks=device_blocks,
                num_host_blocks=host_blocks,
                write_policy=policy,
                selective_threshold=2,
                reuse_evicted_blocks=reuse,
                storage=tier,
            ),
            clock=lambda: self.now,
        )
        self.lookups: list[StorageLookup] = []  # emitted, not answered yet
        self.hits: dict[int, int] = {}  # request -> blocks hit at match
        # With reuse, a device block an eviction still reads may go to a new owner
        # (the worker orders the copy first); a block being written never may.
        self.reuse = reuse
        self.next_id = 0
        self.requests: dict[int, list[bytes]] = {}  # active request -> its hashes
        self.allocated: set[int] = set()
        self.outstanding: list[CacheSwapMetadata] = []  # emitted, no result yet

    # -- requests -------------------------------------------------------------

    @rule(
        doc=st.integers(0, len(DOCUMENTS) - 1),
        length=st.integers(1, 7),
        tail=st.booleans(),
        partial=st.integers(0, BS - 1),
    )
    def arrive(self, doc: int, length: int, tail: bool, partial: int) -> None:
        rid = self.next_id
        self.next_id += 1
        hashes = [H(n) for n in DOCUMENTS[doc][:length] + ([f"u{rid}"] if tail else [])]
        num_tokens = len(hashes) * BS + partial  # partial == 0: a block-aligned prompt
        hit = self.mgr.match(rid, hashes, num_tokens)
        self.hits[rid] = hit.num_hits
        # The prompt's last token is always computed.
        assert 0 <= hit.num_hits <= (num_tokens - 1) // BS
        assert hit.num_cached_tokens == hit.num_hits * BS < num_tokens
        # The device hits are exactly the table the match made: cached, in order.
        table = self.mgr.block_table(rid)
        assert table.num_blocks == hit.num_device_hits == table.num_cached_blocks
        assert set(table.slots) <= {Slot.CACHED}
        if partial == 0 and hit.num_hits == len(hashes) - 1:
            event("full hit capped")
        self.requests[rid] = hashes

    @rule(
        doc=st.integers(0, len(DOCUMENTS) - 1),
        length=st.integers(1, 7),
        tail=st.booleans(),
        keep=st.sampled_from([False, False, False, True]),
    )
    def serve(self, doc: int, length: int, tail: bool, keep: bool) -> None:
        """Arrive and allocate at once; with `keep` the request stays active (so a
        swap-in it started can fail under it), else it also commits and finishes."""
        self.arrive(doc, length, tail, 1)
        rid = self.next_id - 1
        self.allocate_request(rid)
        if keep:
            return
        if rid in self.allocated:
            self.flush()  # the step ran: results come back before the commit
            self.mgr.commit(rid, num_computed_tokens=len(self.requests[rid]) * BS)
        self.release_request(rid, abort=False)

    @rule(
        doc=st.integers(0, len(DOCUMENTS) - 1),
        length=st.integers(1, 7),
        first_leaves=st.booleans(),
    )
    def compute_twice(self, doc: int, length: int, first_leaves: bool) -> None:
        """Two requests miss the same blocks and compute them side by side; both
        commit, one leaves. The one staying held the other's cached copy besides
        its own (issue 25 (a)): the invariants check it holds one block per
        position now, and `allocate` that alone it never gets NO_SPACE."""
        twins = []
        for _ in range(2):
            self.arrive(doc, length, False, 1)
            twins.append(self.next_id - 1)
            self.allocate_request(twins[-1])
        if any(rid not in self.allocated for rid in twins):
            return
        self.flush()
        for rid in twins:
            if not self.mgr.has_pending_swap_in(rid):
                self.mgr.commit(rid, num_computed_tokens=len(self.requests[rid]) * BS)
        self.release_request(twins[0] if first_leaves else twins[1], abort=False)
        event("computed twice, one left")

    def _pick(self, pool: list[int], i: int) -> int:
        return sorted(pool)[i % len(pool)]

    @precondition(lambda self: any(r not in self.allocated for r in self.requests))
    @rule(i=st.integers(0, 1000))
    def allocate(self, i: int) -> None:
        self.allocate_request(
            self._pick([r for r in self.requests if r not in self.allocated], i)
        )

    def allocate_request(self, rid: int) -> None:
        before = self.mgr.block_table(rid)
        pool = self.mgr.device_pool
        was_free = {b for b in range(pool.capacity) if not pool.is_allocated(b)}
        hashes = self.requests[rid]
        # The whole prompt; the manager brings in what it matched (storage hits that
        # landed since included) and adds fresh blocks for the rest.
        try:
            alloc = self.mgr.allocate(rid, num_tokens=len(hashes) * BS)
        except RuntimeError as e:  # asked again and again while nothing was taken
            assert "never taken" in str(e) and self.mgr.busy
            event("allocate refused: WAITs with nothing taken")
            return
        matched = self.hits[rid]
        if not alloc:
            event(f"allocate: {alloc.status.value}")
            assert alloc.num_new_blocks == 0
            assert self.mgr.block_table(rid) == before, "a failed allocate changed the table"
            busy = self.mgr.busy
            if alloc.status is AllocStatus.WAIT_FOR_TRANSFERS:
                assert busy, "told to wait with nothing in flight or queued"
            else:  # other requests hold the blocks: alone, it would always fit
                assert len(self.requests) > 1
            return
        table = self.mgr.block_table(rid)
        ids = table.block_ids
        cached = alloc.num_cached_tokens // BS  # device, host and storage hits
        assert cached == table.num_cached_blocks
        assert cached >= matched or self.mgr.request_state(rid).rolled_back
        assert alloc.num_new_blocks == len(ids) - before.num_blocks
        assert len(ids) == len(hashes) and ids[: before.num_blocks] == before.block_ids
        # The cached prefix is CACHED or LOADING, the rest is the engine's to compute;
        # a LOADING block is a destination of this step's swap-in.
        assert all(s is not Slot.COMPUTE for s in table.slots[:cached])
        assert all(s is Slot.COMPUTE for s in table.slots[cached:])
        queued = set(self.mgr.transfers.to_device.device_ids)
        assert all(ids[p] in queued for p in table.loading), "LOADING without a swap-in"
        assert len(set(ids)) == len(ids), "one block at two positions"
        fresh = set(ids) & was_free
        busy = self._outstanding_ids(CacheLevel.DEVICE)
        assert not fresh & busy, f"device blocks {fresh & busy} handed out while in flight"
        self.allocated.add(rid)

    @precondition(lambda self: self.allocated)
    @rule(i=st.integers(0, 1000), full=st.booleans(), extra=st.integers(0, BS - 1))
    def commit(self, i: int, full: bool, extra: int) -> None:
        rid = self._pick(list(self.allocated), i)
        hashes = self.requests[rid]
        blocks = len(hashes) if full else max(1, len(hashes) // 2)
        count = blocks * BS + (extra if blocks < len(hashes) else 0)
        try:
            self.mgr.commit(rid, num_computed_tokens=count)
        except ValueError as e:  # its swap-in has no result yet: the engine waits
            if "below" in str(e):  # fewer tokens than the cached prefix holds
                assert count < self.mgr.block_table(rid).num_cached_tokens
                event("commit below the cached prefix refused")
                return
            if "not taken yet" in str(e):  # its step has not run: nothing computed
                assert self.reuse
                event("commit before the step that hands its block over refused")
                return
            assert "swap-in" in str(e)
            event("commit refused until the swap-in result")

    @precondition(lambda self: self.allocated)
    @rule(i=st.integers(0, 1000))
    def grow(self, i: int) -> None:
        """Decode fills a block: its hash is appended and a block allocated for it."""
        rid = self._pick(list(self.allocated), i)
        hashes = self.requests[rid]
        if len(hashes) >= self.mgr.device_pool.capacity:
            return
        new = H(f"g{rid}.{len(hashes)}")
        self.mgr.append_hashes(rid, [new])
        hashes.append(new)
        if not self.mgr.allocate(rid, num_tokens=len(hashes) * BS):
            event("grow deferred")
            self.mgr.abort(rid)  # preempted: it gives its blocks back
            del self.requests[rid]
            self.allocated.discard(rid)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 1000), abort=st.booleans())
    def release(self, i: int, abort: bool) -> None:
        self.release_request(self._pick(list(self.requests), i), abort)

    def release_request(self, rid: int, abort: bool) -> None:
        (self.mgr.abort if abort else self.mgr.finish)(rid)
        del self.requests[rid]
        self.allocated.discard(rid)

    # -- bad calls ------------------------------------------------------------

    @rule(data=st.data())
    def bad_call(self, data: st.DataObject) -> None:
        """A call with bad input, at any point of any lifecycle: it raises, and the
        manager is exactly as it was (then `accounting_holds` checks it again)."""
        mgr = self.mgr
        active = sorted(self.requests)
        rid = data.draw(st.sampled_from(active)) if active else None
        outstanding = [m.transfer_id for m in self.outstanding]
        sys_, a1, z = H("sys"), H("a1"), H("z")
        calls = [
            ("match unhashable late", lambda: mgr.match(-1, [sys_, a1, ["x"]], 13)),
            ("match iterator", lambda: mgr.match(-1, iter([sys_, a1]), 9)),
            ("match repeated hash", lambda: mgr.match(-1, [sys_, a1, sys_], 13)),
            ("match str", lambda: mgr.match(-1, "sys", 13)),
            ("match str hashes", lambda: mgr.match(-1, ["sys", "a1"], 9)),
            ("match short digest", lambda: mgr.match(-1, [sys_[:16]], 5)),
            ("match int hashes", lambda: mgr.match(-1, [hash("sys")], 5)),
            ("match too few tokens", lambda: mgr.match(-1, [sys_, a1], 7)),
            ("match float tokens", lambda: mgr.match(-1, [sys_], 5.0)),
            ("match bool tokens", lambda: mgr.match(-1, [], True)),
            ("match negative tokens", lambda: mgr.match(-1, [], -1)),
            ("allocate unknown", lambda: mgr.allocate(-1, num_tokens=1)),
            ("finish unknown", lambda: mgr.finish(-1)),
            ("abort unknown", lambda: mgr.abort(-1)),
            ("commit unknown", lambda: mgr.commit(-1, num_computed_tokens=0)),
            ("append unknown", lambda: mgr.append_hashes(-1, [z])),
            ("apply unknown id", lambda: mgr.apply_results([TransferResult(10**9, True)])),
            ("apply non-result", lambda: mgr.apply_results(["done"])),
            (
                "apply one rank of two",
                lambda: mgr.apply_results([TransferResult(10**9, True, num_ranks=2)]),
            ),
        ]
        if outstanding:
            tid = data.draw(st.sampled_from(outstanding))
            calls += [
                ("apply twice", lambda: mgr.apply_results([TransferResult(tid, True)] * 2)),
                (
                    "apply with a non-result",
                    lambda: mgr.apply_results([TransferResult(tid, False), None]),
                ),
            ]
        if rid is not None:
            n = mgr.num_blocks(rid)
            held = self.requests[rid]
            too_many = (mgr.device_pool.capacity + 1) * BS
            calls += [
                ("match active", lambda: mgr.match(rid, [], 1)),
                ("allocate float", lambda: mgr.allocate(rid, num_tokens=1.5)),
                ("allocate bool", lambda: mgr.allocate(rid, num_tokens=True)),
                ("allocate negative", lambda: mgr.allocate(rid, num_tokens=-1)),
                ("allocate a block count", lambda: mgr.allocate(rid, 1)),
                ("allocate too many", lambda: mgr.allocate(rid, num_tokens=too_many)),
                ("commit float", lambda: mgr.commit(rid, num_computed_tokens=4.0)),
                ("commit negative", lambda: mgr.commit(rid, num_computed_tokens=-4)),
                ("commit a block count", lambda: mgr.commit(rid, n)),
                (
                    "commit past the table",
                    lambda: mgr.commit(rid, num_computed_tokens=(n + 1) * BS),
                ),
                ("append unhashable", lambda: mgr.append_hashes(rid, [H("ok"), {}])),
                ("append repeated", lambda: mgr.append_hashes(rid, [z, z])),
                ("append non-sequence", lambda: mgr.append_hashes(rid, 7)),
                ("append str", lambda: mgr.append_hashes(rid, ["z"])),
            ]
            if held:
                calls.append(("append the held list", lambda: mgr.append_hashes(rid, held)))
            pending = [q for q in self.lookups if mgr.storage_pending_lookup(q.lookup_id)]
            if pending:
                q = pending[0]
                too_long = len(q.block_hashes) + 1
                calls.append(
                    (
                        "lookup answer longer than its lookup",
                        lambda: mgr.apply_results([LookupResult(q.lookup_id, too_long)]),
                    )
                )
        name, call = data.draw(st.sampled_from(calls))
        before = snapshot(mgr)
        try:
            call()
        except (ValueError, TypeError, RuntimeError):
            event(f"bad call refused: {name}")
        else:
            raise AssertionError(f"bad call accepted: {name}")
        assert snapshot(mgr) == before, f"{name} changed the manager"

    # -- the worker -----------------------------------------------------------

    @rule()
    def step(self) -> None:
        tasks = self.mgr.take_swap_metadata()
        self.lookups += tasks.lookups
        for meta in (tasks.evict, tasks.swap_in, tasks.storage_load, tasks.storage_store):
            if meta is None:
                continue
            dst_busy = self._outstanding_ids(meta.dst_level)
            src_busy = self._outstanding_ids(meta.src_level, dst_only=True)
            if meta.dst_level != CacheLevel.STORAGE:
                assert len(set(meta.dst_block_ids)) == meta.num_blocks, "duplicate destination"
            assert not set(meta.dst_block_ids) & dst_busy, "destination used by another copy"
            assert not set(meta.src_block_ids) & src_busy, "source still being written"
            self.outstanding.append(meta)
            event(f"emitted {meta.src_level.name}->{meta.dst_level.name}")

    @rule()
    def flush(self) -> None:
        """The worker catches up: every planned copy runs and succeeds."""
        self.step()
        self.mgr.apply_results(TransferResult(m.transfer_id, True) for m in self.outstanding)
        self.outstanding.clear()
        self.mgr.apply_results(LookupResult(q.lookup_id, 0) for q in self.lookups)
        self.lookups.clear()

    @precondition(lambda self: self.lookups)
    @rule(i=st.integers(0, 1000), hits=st.integers(0, 8))
    def answer_lookup(self, i: int, hits: int) -> None:
        """A lookup's answer (a hint: a load of a block storage lacks fails)."""
        lookup = self.lookups.pop(i % len(self.lookups))
        self.mgr.apply_results(
            [LookupResult(lookup.lookup_id, min(hits, len(lookup.block_hashes)))]
        )
        event("storage lookup answered")

    @rule(seconds=st.sampled_from([0.1, 0.6, 3.0]))
    def tick(self, seconds: float) -> None:
        """Time passes: storage waits run out, failed keys may be retried."""
        self.now += seconds

    @precondition(lambda self: self.outstanding)
    @rule(i=st.integers(0, 1000), success=st.booleans(), bad=st.integers(0, 7))
    def complete(self, i: int, success: bool, bad: int) -> None:
        meta = self.outstanding.pop(i % len(self.outstanding))  # any order
        nodes = self.mgr.get_stats().cached_nodes
        failed: tuple[int, ...] = ()
        if CacheLevel.STORAGE in (meta.src_level, meta.dst_level) and not success:
            failed = (bad % meta.num_blocks,)  # one block failed, the others good
            event(f"storage {'load' if meta.dst_level == CacheLevel.HOST else 'write'} failed")
        rollbacks = self.mgr.apply_results(
            [TransferResult(meta.transfer_id, success, "" if success else "x", failed)]
        )
        if self.reuse and self.mgr.get_stats().cached_nodes < nodes:
            event("failed released eviction dropped its subtree")
        if success:
            assert not rollbacks
        if rollbacks:
            event("swap-in rolled back")
        for rb in rollbacks:
            assert rb.request_id in self.requests
            assert meta.dst_level == CacheLevel.DEVICE

    @precondition(lambda self: any(m.dst_level == CacheLevel.DEVICE for m in self.outstanding))
    @rule()
    def swap_in_fails(self) -> None:
        meta = next(m for m in self.outstanding if m.dst_level == CacheLevel.DEVICE)
        self.outstanding.remove(meta)
        rollbacks = self.mgr.apply_results([TransferResult(meta.transfer_id, False, "h2d")])
        if rollbacks:
            # The engine recomputes the rolled-back blocks in its next step, which
            # takes that step's copies first (an eviction queued under reuse may
            # hand one of its blocks over: committing before the step is refused).
            self.step()
        for rb in rollbacks:
            event("swap-in rolled back")
            assert rb.request_id in self.requests and rb.block_indices
            # ... then commits them.
            if rb.request_id in self.allocated and not self.mgr.has_pending_swap_in(
                rb.request_id
            ):
                self.mgr.commit(
                    rb.request_id, num_computed_tokens=len(self.requests[rb.request_id]) * BS
                )

    # -- checks ---------------------------------------------------------------

    def _outstanding_ids(self, level: CacheLevel, dst_only: bool = False) -> set[int]:
        """Blocks of `level` that in-flight copies write (and read, unless
        `dst_only`, or the block is a device block an eviction reads under reuse)."""
        ids: set[int] = set()
        for meta in self.outstanding:
            if meta.dst_level == level:
                ids.update(meta.dst_block_ids)
            reads_reusable = self.reuse and level == CacheLevel.DEVICE
            if meta.src_level == level and not dst_only and not reads_reusable:
                ids.update(meta.src_block_ids)
        return ids

    @invariant()
    def accounting_holds(self) -> None:
        self.mgr.check_invariants()
        for meta in self.outstanding:  # no block of an in-flight copy is free
            for level, ids in (
                (meta.src_level, meta.src_block_ids),
                (meta.dst_level, meta.dst_block_ids),
            ):
                if self.reuse and level == meta.src_level == CacheLevel.DEVICE:
                    continue  # handed on at once: the worker reads it before any write
                pool = (
                    self.mgr.device_pool if level == CacheLevel.DEVICE else self.mgr.host_pool
                )
                assert all(pool.is_allocated(b) for b in ids), (
                    f"{level.name} block freed in flight"
                )

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.requests):
            self.mgr.finish(rid)
        # Transfers planned by the last operations, then everything outstanding.
        for _ in range(4):  # storage writes follow copies to host
            self.flush()
        self.mgr.check_invariants()
        stats = self.mgr.get_stats()
        assert stats.inflight_transfers == 0 and stats.queued_blocks == 0
        nodes = list(self.mgr.tree)
        assert all(n.ref == 0 for n in nodes), "a lock outlived every holder"
        device_owned = sum(1 for n in nodes if n.device_block >= 0)
        host_owned = sum(1 for n in nodes if n.host_block >= 0)
        assert self.mgr.device_pool.num_used == device_owned, "device blocks leaked"
        assert self.mgr.host_pool.num_used == host_owned, "host blocks leaked"


def snapshot(mgr: CacheManager) -> tuple:
    """Everything a call could change, in comparable form: the tree (every node's
    fields, both LRU orders, the parked sets), both pools (free lists in order),
    requests, transfers in flight and queued, counters and stats."""
    tree = mgr.tree

    def key(node):
        return None if node is tree.root else node.key

    def pool(p):
        return list(p._free), bytes(p._allocated), p.stats()

    return (
        {
            n.key: (
                key(n.parent),
                n.state,
                n.device_block,
                n.host_block,
                n.ref,
                n.hits,
                n.num_children,
                n.num_device_children,
            )
            for n in tree
        },
        [n.key for n in tree.device_lru],
        [n.key for n in tree.host_lru],
        sorted(n.key for n in tree._device_parked),
        sorted(n.key for n in tree._host_parked),
        tree.num_evicting,
        pool(mgr.device_pool),
        pool(mgr.host_pool),
        {
            rid: (
                list(r.hashes),
                [n.key for n in r.nodes],
                list(r.blocks),
                r.loading,
                list(r.rolled_back),
                r.owns_matched_positions,
            )
            for rid, r in ((rid, mgr.request_state(rid)) for rid in mgr.active_request_ids())
        },
        {
            tid: (type(t).__name__, [n.key if n is not None else None for n in t.nodes])
            for tid, t in mgr.transfers.inflight()
        },
        [n.key for n in mgr.transfers.to_host.nodes],
        [n.key for n in mgr.transfers.to_device.nodes],
        mgr.transfers.next_transfer_id,
        mgr.get_stats(),
    )


TestCacheLifecycle = CacheLifecycle.TestCase
TestCacheLifecycle.settings = settings(
    max_examples=int(os.environ.get("FASTKV_STATEFUL_EXAMPLES", "500")),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
