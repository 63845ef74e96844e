"""The PD scheduler halves against random interleavings of offers, answers, rank
reports (ok, failed, late, duplicate, stale epoch, unknown), aborts, deadlines and
local requests competing for D's blocks; after every step both halves' invariants
hold, and a receiving block never returns to the pool while a write may land."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from fastkv import CacheConfig
from fastkv.metadata import Epoch
from fastkv.pd.decode import DecodeTransfers
from fastkv.pd.messages import Acceptance, RankReport, Rejection
from fastkv.pd.prefill import PrefillTransfers
from fastkv.scheduler import CacheManager

BS = 4
DIGEST = b"L" * 32
TIMEOUT = 10.0
GRACE = 3.0
DOCS = [
    ["s", "a1", "a2", "a3", "a4", "a5", "a6", "a7"],
    ["s", "b1", "b2"],
    ["c0", "c1", "c2", "c3", "c4"],
]


def H(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


class PDLifecycle(RuleBasedStateMachine):
    @initialize(
        d_blocks=st.integers(6, 14),
        host=st.sampled_from([0, 4]),
        d_ranks=st.sampled_from([1, 2]),
        reuse=st.booleans(),
    )
    def setup(self, d_blocks: int, host: int, d_ranks: int, reuse: bool) -> None:
        self.now = 0.0
        clock = lambda: self.now  # noqa: E731
        self.d_mgr = CacheManager(
            CacheConfig(
                block_size=BS,
                num_device_blocks=d_blocks,
                num_host_blocks=host,
                reuse_evicted_blocks=reuse,
            ),
            clock=clock,
        )
        self.p_mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=64), clock=clock)
        self.d = DecodeTransfers(
            self.d_mgr,
            layout_digest=DIGEST,
            num_ranks=d_ranks,
            timeout_s=TIMEOUT,
            fence_grace_s=GRACE,
            clock=clock,
        )
        self.p = PrefillTransfers(
            self.p_mgr,
            layout_digest=DIGEST,
            answer_timeout_s=5.0,
            send_timeout_s=TIMEOUT,
            clock=clock,
        )
        self.d_ranks = d_ranks
        self.next_id = 0
        self.live: dict[int, Acceptance] = {}  # D transfers not yet resolved
        # (epoch, transfer id) -> D ranks that reported; its deadline
        self.reported: dict[tuple[int, int], set[int]] = {}
        self.deadline: dict[tuple[int, int], float] = {}
        self.committed: dict[int, list[bytes]] = {}  # request -> its hashes, decoding on D
        self.recompute: set[int] = set()  # requests failed on D, still active
        self.local: list[int] = []  # D's own requests holding blocks
        self.hashes: dict[int, list[bytes]] = {}
        self.p_sends: dict[int, Acceptance] = {}  # accepted on P, maybe still pinned

    # -- offers ---------------------------------------------------------------

    @rule(doc=st.integers(0, len(DOCS) - 1), n=st.integers(1, 7), partial=st.integers(0, 3))
    def offer(self, doc: int, n: int, partial: int) -> None:
        rid = self.next_id
        self.next_id += 1
        hashes = [H(x) for x in DOCS[doc][:n]] + [H(f"u{rid}")]
        num_tokens = len(hashes) * BS + partial
        self.p_mgr.match(rid, hashes, num_tokens)
        assert self.p_mgr.allocate(rid, num_tokens=num_tokens)
        offer = self.p.offer(rid, num_tokens)
        self.p.release(rid)  # prefill done on P: finishes when unpinned
        answer = self.d.accept(offer, hashes)
        self.hashes[rid] = hashes
        if isinstance(answer, Rejection):
            assert not self.d_mgr.is_active(rid)
        else:
            table = self.d_mgr.block_table(rid)
            assert table.num_blocks == answer.num_prefix_blocks
            assert answer.num_prefix_blocks + len(answer.block_ids) == -(-num_tokens // BS)
            self.live[answer.transfer_id] = answer
            key = (answer.epoch, answer.transfer_id)
            self.reported[key] = set()
            self.deadline[key] = self.now + TIMEOUT
        if self.p.on_answer(answer):
            plan = self.p.plan(rid)
            assert len(plan.src_block_ids) == len(plan.dst_block_ids)
            table = self.p_mgr.block_table(rid).block_ids
            assert tuple(table[answer.num_prefix_blocks :]) == plan.src_block_ids
            self.p_sends[rid] = answer
        else:
            assert not self.p.is_pinned(rid) and not self.p_mgr.is_active(rid)

    @rule(i=st.integers(0, 10), ok=st.booleans(), again=st.booleans())
    def p_report(self, i: int, ok: bool, again: bool) -> None:
        """P's rank settles a send: it is unpinned and P's request finishes."""
        live = [r for r in sorted(self.p_sends) if self.p.is_pinned(r)]
        if not live:
            return
        rid = live[i % len(live)]
        acc = self.p_sends.pop(rid)
        report = RankReport(acc.transfer_id, acc.epoch, 0, ok)
        self.p.on_reports([report])
        assert not self.p.is_pinned(rid) and not self.p_mgr.is_active(rid)
        if again:
            before = self.p.counters.stale
            self.p.on_reports([report])
            assert self.p.counters.stale == before + 1

    @rule(doc=st.integers(0, len(DOCS) - 1), n=st.integers(1, 5))
    def local_request(self, doc: int, n: int) -> None:
        """A request D computes itself, competing for blocks and committing."""
        rid = self.next_id
        self.next_id += 1
        hashes = [H(x) for x in DOCS[doc][:n]]
        self.d_mgr.match(rid, hashes, len(hashes) * BS, lookup_storage=False)
        alloc = self.d_mgr.allocate(rid, num_tokens=len(hashes) * BS)
        if alloc:
            self.d_mgr.take_swap_metadata()  # never completed: copies stay in flight
            if not self.d_mgr.has_pending_swap_in(rid):
                self.d_mgr.commit(rid, num_computed_tokens=len(hashes) * BS)
        self.local.append(rid)

    @rule(i=st.integers(0, 10))
    def finish_local(self, i: int) -> None:
        if self.local:
            self.d_mgr.finish(self.local.pop(i % len(self.local)))

    # -- reports --------------------------------------------------------------

    def _pick(self, i: int) -> Acceptance | None:
        if not self.live:
            return None
        return self.live[sorted(self.live)[i % len(self.live)]]

    @rule(i=st.integers(0, 10), rank=st.integers(0, 1), ok=st.booleans())
    def report(self, i: int, rank: int, ok: bool) -> None:
        acc = self._pick(i)
        if acc is None:
            return
        rank %= self.d_ranks
        outcomes = self.d.on_reports([RankReport(acc.transfer_id, acc.epoch, rank, ok)])
        self.reported[(acc.epoch, acc.transfer_id)].add(rank)
        for out in outcomes:
            self._resolve(out.request_id, out.transfer_id, out.success)

    @rule(i=st.integers(0, 10), kind=st.sampled_from(["stale", "unknown", "dup"]))
    def bad_report(self, i: int, kind: str) -> None:
        acc = self._pick(i)
        c = self.d.counters
        before = (c.stale_epoch, c.unknown, c.duplicate, c.late)
        if kind == "stale":
            self.d.on_reports([RankReport(1, Epoch(self.d.epoch + 7), 0, True)])
            assert c.stale_epoch == before[0] + 1
        elif kind == "unknown":
            assert self.d.on_reports([RankReport(10**9, self.d.epoch, 0, True)]) == []
            assert c.unknown == before[1] + 1
        elif acc is not None and self.reported[(acc.epoch, acc.transfer_id)]:
            rank = next(iter(self.reported[(acc.epoch, acc.transfer_id)]))
            assert self.d.on_reports([RankReport(acc.transfer_id, acc.epoch, rank, True)]) == []
            assert c.duplicate == before[2] + 1

    @rule(i=st.integers(0, 10))
    def abort(self, i: int) -> None:
        acc = self._pick(i)
        if acc is None or not self.d.is_receiving(acc.request_id):
            return
        self.d.abort(acc.request_id)
        assert not self.d_mgr.is_active(acc.request_id)  # the request goes at once
        self._resolve(acc.request_id, acc.transfer_id, False, aborted=True)

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0, 11.0]))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        for out in self.d.tick():
            self._resolve(out.request_id, out.transfer_id, out.success)
        self.p.tick()
        for rid in self.p_sends:  # pinned exactly while its deadline has not passed
            assert self.p.is_pinned(rid) == self.p_mgr.is_active(rid)

    @rule()
    def advance_epoch(self) -> None:
        for out in self.d.advance_epoch(Epoch(self.d.epoch + 1)):
            self._resolve(out.request_id, out.transfer_id, out.success)

    @rule(i=st.integers(0, 10))
    def finish_decoding(self, i: int) -> None:
        """A committed request finishes; its blocks are cached: the same prompt hits."""
        if not self.committed:
            return
        rid = sorted(self.committed)[i % len(self.committed)]
        hashes = self.committed.pop(rid)
        self.d_mgr.finish(rid)
        probe = self.next_id
        self.next_id += 1
        hit = self.d_mgr.match(probe, hashes, len(hashes) * BS + 1, lookup_storage=False)
        assert hit.num_hits == len(hashes), "committed blocks must be hit by the next request"
        self.d_mgr.finish(probe)

    @rule(i=st.integers(0, 10))
    def recompute_done(self, i: int) -> None:
        if self.recompute:
            rid = sorted(self.recompute)[i % len(self.recompute)]
            self.recompute.discard(rid)
            self.d_mgr.finish(rid)

    def _resolve(self, rid: int, tid: int, success: bool, aborted: bool = False) -> None:
        acc = self.live.pop(tid, None)  # live transfers are all of the current epoch
        assert acc is not None and acc.request_id == rid
        key = (acc.epoch, tid)
        if success:
            assert self.reported[key] == set(range(self.d_ranks))
            table = self.d_mgr.block_table(rid)
            assert list(table.block_ids[acc.num_prefix_blocks :]) == list(acc.block_ids)
            self.committed[rid] = self.hashes[rid][: acc.num_tokens // BS]
        elif not aborted:
            assert self.d_mgr.is_active(rid)
            assert self.d_mgr.block_table(rid).num_blocks == acc.num_prefix_blocks
            self.recompute.add(rid)
        self.fencing = getattr(self, "fencing", {})
        if not success:
            self.fencing[key] = acc

    # -- checks ---------------------------------------------------------------

    @invariant()
    def halves_hold(self) -> None:
        if not hasattr(self, "d"):
            return
        self.d.check_invariants()
        self.p.check_invariants()
        for key, acc in list(getattr(self, "fencing", {}).items()):
            still = [self.d_mgr.is_receiving(b) for b in acc.block_ids]
            if not any(still):
                # Released: only once every rank reported or the fence passed.
                fenced = len(self.reported[key]) == self.d_ranks or (
                    self.now >= self.deadline[key] + GRACE
                )
                assert fenced, f"transfer {key}'s blocks freed while a write may land"
                del self.fencing[key]
            else:
                assert all(still)
        for acc in self.live.values():
            assert all(self.d_mgr.is_receiving(b) for b in acc.block_ids)

    def teardown(self) -> None:
        if not hasattr(self, "d"):
            return
        self.now += TIMEOUT + GRACE + 100
        for out in self.d.tick():
            self._resolve(out.request_id, out.transfer_id, out.success)
        self.d.tick()
        self.p.tick()
        for rid in list(self.committed) + list(self.recompute) + self.local:
            self.d_mgr.finish(rid)
        self.d.check_invariants()
        self.p.check_invariants()
        assert self.d_mgr.num_receiving_blocks == 0, "receiving blocks leaked"
        assert not self.p_mgr.active_request_ids(), "P kept a request pinned"
        assert self.p_mgr.device_pool.num_used == sum(
            1 for n in self.p_mgr.tree if n.device_block >= 0
        )


PDLifecycle.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPDLifecycle = PDLifecycle.TestCase
