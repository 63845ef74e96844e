"""D's scheduler half: take a request P prefilled, receive its tail, commit it.

A transfer on D (one per accepted offer):

      accept(offer) ── no room / bad layout ──► Rejection (nothing held)
          │ match own prefix (locked by the request), reserve the tail RECEIVING
          ▼
      RECEIVING ── every rank ok ──► commit_received ──► COMMITTED (done; the
          │                                              request decodes on D)
          │ a rank failed / deadline / abort
          ▼
      FENCING   (outcome already reported: the request recomputes, or is gone)
          │ every rank's report fenced it (P's writes settled done) or
          │ fence_at = deadline + grace
          ▼
      released: the receiving blocks return to the device pool

The tail blocks stay receiving (`CacheManager.reserve_receiving`) from `accept`
until they are committed or released: in no tree and no table, so nothing matches,
evicts, swaps, stores, frees or reads them. A fenced rank report means no write of
that P rank for the transfer can land any more (`RankReport.fenced`: not so after a
failed write, whose bytes may still be on the wire); once every rank's report fenced
it, or `fence_grace_s` after the deadline (which must exceed the transport's longest
write, after which it guarantees no write lands: a P process that is dead writes
nothing, a live one's handles settle within the transport timeout), no write can
land and the blocks go back. Failure keeps the request on D with its prefix: the
engine allocates and recomputes the rest as for any prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from fastkv.metadata import BlockHash, Epoch
from fastkv.pd.messages import (
    Acceptance,
    Offer,
    RankReport,
    Rejection,
    check_digest,
    check_positive,
    check_rank_count,
    check_secret,
    checked_reports,
    new_secret,
    transfer_secret,
)
from fastkv.scheduler.api import AllocStatus
from fastkv.scheduler.cache_manager import CacheManager


class DState(Enum):
    RECEIVING = "receiving"
    FENCING = "fencing"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a transfer for its request: `success` (committed: decode on
    D) or not (`reason`; the request, if not aborted, recomputes its tail on D)."""

    request_id: Hashable
    transfer_id: int
    success: bool
    reason: str = ""


@dataclass(slots=True)
class _Transfer:
    request_id: Hashable
    transfer_id: int
    epoch: Epoch
    blocks: list[int]
    num_tokens: int
    deadline: float
    state: DState = DState.RECEIVING
    fence_at: float = 0.0
    reported: dict[int, bool] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeCounters:
    accepted: int = 0
    rejected: int = 0
    committed: int = 0
    failed: int = 0
    expired: int = 0
    aborted: int = 0
    released_blocks: int = 0
    stale_epoch: int = 0
    unknown: int = 0
    duplicate: int = 0
    late: int = 0


class DecodeTransfers:
    """D's transfers over one `CacheManager` (not thread-safe: the scheduler loop).

    Args:
        manager: D's cache manager; requests are registered by their block hashes.
        layout_digest: D's `KVLayout.digest()`; an offer of another layout is refused.
        num_ranks: D's tensor-parallel size (reports expected per transfer).
        timeout_s: how long a transfer may take from acceptance to the last report.
        fence_grace_s: after the deadline, how long until no write can land (more
            than the transport's write timeout).
        epoch: the cache epoch transfers belong to; default the manager's
            (`CacheManager.epoch`), the one epoch notion of fastkv. On a cache
            reset, call `advance_epoch(manager.epoch + 1)` first (it fails what is
            receiving), then `manager.reset_cache()` once those blocks are fenced
            and released (it refuses while any block is receiving).
        deployment_secret: if set, notice keys derive from it (never sent);
            else each acceptance carries a fresh random secret.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        manager: CacheManager,
        *,
        layout_digest: bytes,
        num_ranks: int = 1,
        timeout_s: float = 30.0,
        fence_grace_s: float = 5.0,
        epoch: Epoch | None = None,
        deployment_secret: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = check_positive("timeout_s", timeout_s)
        self.fence_grace_s = check_positive("fence_grace_s", fence_grace_s)
        self.num_ranks = check_rank_count("num_ranks", num_ranks)
        secret = check_secret("deployment_secret", deployment_secret)
        digest = check_digest("layout_digest", layout_digest)
        self.manager = manager
        self.layout_digest = digest
        self.epoch = Epoch(manager.epoch) if epoch is None else epoch
        self._secret = secret
        self._clock = clock
        self._next_id = 1
        self._by_id: dict[tuple[Epoch, int], _Transfer] = {}
        self._by_request: dict[Hashable, _Transfer] = {}
        self.counters = DecodeCounters()

    # -- offers -------------------------------------------------------------------

    def accept(self, offer: Offer, block_hashes: Sequence[BlockHash]) -> Acceptance | Rejection:
        """Take `offer`: register its request with the manager by `block_hashes`
        (D's own hashes of the prompt), keep the leading device hits, reserve the
        rest of `ceil(num_tokens / block_size)` blocks as receiving.

        Raises:
            ValueError/TypeError: a malformed offer or hashes (`CacheManager.match`),
                or a request already active; nothing changes.
        """
        mgr = self.manager
        if mgr.is_active(offer.request_id):
            raise ValueError(f"request_id: {offer.request_id!r} is already active")
        check_rank_count("num_p_ranks", offer.num_p_ranks)
        if offer.layout_digest != self.layout_digest:
            self.counters.rejected += 1
            return Rejection(offer.request_id, "layout digest differs from D's")
        if self.num_ranks % offer.num_p_ranks:
            self.counters.rejected += 1
            return Rejection(
                offer.request_id,
                f"tensor parallel sizes P={offer.num_p_ranks}, D={self.num_ranks}: "
                "D's must be a multiple of P's",
            )
        total = (
            -(-offer.num_tokens // mgr.block_size) if isinstance(offer.num_tokens, int) else 0
        )
        if total > mgr.device_pool.capacity:
            self.counters.rejected += 1
            return Rejection(
                offer.request_id,
                f"{total} blocks are more than D's {mgr.device_pool.capacity} device blocks",
            )
        hashes = list(block_hashes)
        hit = mgr.match(offer.request_id, hashes, offer.num_tokens, lookup_storage=False)
        if hit.num_host_hits:  # keep only the device run: the rest is received
            mgr.finish(offer.request_id)
            hit = mgr.match(
                offer.request_id,
                hashes[: hit.num_device_hits],
                offer.num_tokens,
                lookup_storage=False,
            )
            mgr.append_hashes(offer.request_id, hashes[hit.num_device_hits :])
        prefix = hit.num_device_hits
        got = mgr.reserve_receiving(total - prefix)
        if isinstance(got, AllocStatus):
            mgr.finish(offer.request_id)
            self.counters.rejected += 1
            return Rejection(offer.request_id, f"no room on D ({got.value})")
        tid = self._next_id
        self._next_id += 1
        deadline = self._clock() + self.timeout_s
        t = _Transfer(offer.request_id, tid, self.epoch, got, offer.num_tokens, deadline)
        self._by_id[(self.epoch, tid)] = t
        self._by_request[offer.request_id] = t
        self.counters.accepted += 1
        secret = (
            transfer_secret(self._secret, self.epoch, tid) if self._secret else new_secret()
        )
        return Acceptance(
            offer.request_id,
            tid,
            self.epoch,
            offer.num_tokens,
            prefix,
            tuple(got),
            secret,
            self.timeout_s,
            self.num_ranks,
        )

    # -- reports, aborts, deadlines --------------------------------------------------

    def on_reports(self, reports: Iterable[RankReport]) -> list[Outcome]:
        """Apply D ranks' reports (in any order): a transfer every rank reported ok
        is committed; one a rank failed ends in failure. Reports for another epoch,
        an unknown or finished transfer, or a rank twice are dropped and counted."""
        outcomes: list[Outcome] = []
        reports = checked_reports(reports)
        for report in reports:
            t = self._by_id.get((report.epoch, report.transfer_id))
            if t is None:
                if report.epoch != self.epoch:
                    self.counters.stale_epoch += 1
                else:
                    self.counters.unknown += 1
                continue
            if not 0 <= report.rank < self.num_ranks or report.rank in t.reported:
                self.counters.duplicate += 1
                continue
            t.reported[report.rank] = report.ok or report.fenced
            if t.state is DState.FENCING:
                self.counters.late += 1
                self._release_if_fenced(t, self._clock())
            elif not report.ok:
                outcomes.append(self._fail(t, report.reason or f"rank {report.rank} failed"))
            elif len(t.reported) == self.num_ranks:
                outcomes.append(self._commit(t))
        return outcomes

    def abort(self, request_id: Hashable) -> None:
        """The request goes now (its prefix unlocked); a receiving tail goes once
        fenced. A request with no live transfer is simply finished.

        Raises:
            ValueError: the request is not active on D's manager.
        """
        if not self.manager.is_active(request_id):
            raise ValueError(f"request_id: {request_id!r} is not an active request")
        t = self._by_request.get(request_id)
        if t is not None and t.state is DState.RECEIVING:
            self.counters.aborted += 1
            self._fail(t, "aborted")
        self.manager.finish(request_id)

    def tick(self) -> list[Outcome]:
        """Expire transfers past their deadline (failure) and release fenced blocks."""
        now = self._clock()
        outcomes = []
        for t in list(self._by_id.values()):
            if t.state is DState.RECEIVING and now >= t.deadline:
                self.counters.expired += 1
                outcomes.append(self._fail(t, "deadline passed without every rank's notice"))
            elif t.state is DState.FENCING:
                self._release_if_fenced(t, now)
        return outcomes

    def advance_epoch(self, epoch: Epoch) -> list[Outcome]:
        """A new cache epoch: every receiving transfer fails (fenced as usual) and
        transfer ids restart.

        Raises:
            ValueError: `epoch` is not above the current one."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch <= self.epoch:
            raise ValueError(f"epoch: must be an int > {self.epoch}, got {epoch!r}")
        outcomes = [
            self._fail(t, "cache epoch advanced")
            for t in list(self._by_id.values())
            if t.state is DState.RECEIVING
        ]
        self.epoch = epoch
        self._next_id = 1
        return outcomes

    # -- queries ------------------------------------------------------------------

    def is_receiving(self, request_id: Hashable) -> bool:
        """Whether the request waits for its KV (the engine must not schedule it)."""
        t = self._by_request.get(request_id)
        return t is not None and t.state is DState.RECEIVING

    def is_live(self, epoch: Epoch, transfer_id: int) -> bool:
        """Whether the transfer still holds blocks (receiving or fencing): its
        notices still matter to D's workers (`PDReceiver.forget` once not)."""
        return (epoch, transfer_id) in self._by_id

    def num_transfers(self, state: DState) -> int:
        return sum(1 for t in self._by_id.values() if t.state is state)

    def oldest_age_s(self) -> float:
        """Age of the oldest live transfer (0 when none)."""
        if not self._by_id:
            return 0.0
        start = min(t.deadline - self.timeout_s for t in self._by_id.values())
        return max(0.0, self._clock() - start)

    # -- internals ----------------------------------------------------------------

    def _commit(self, t: _Transfer) -> Outcome:
        try:
            self.manager.commit_received(
                t.request_id, t.blocks, num_computed_tokens=t.num_tokens
            )
        except ValueError as exc:  # the engine touched the request's table meanwhile
            return self._fail(t, f"commit refused: {exc}")
        self._forget(t)
        self.counters.committed += 1
        return Outcome(t.request_id, t.transfer_id, True)

    def _fail(self, t: _Transfer, reason: str) -> Outcome:
        self.counters.failed += 1
        t.state = DState.FENCING
        t.fence_at = t.deadline + self.fence_grace_s
        if self._by_request.get(t.request_id) is t:
            del self._by_request[t.request_id]
        self._release_if_fenced(t, self._clock())
        return Outcome(t.request_id, t.transfer_id, False, reason)

    def _release_if_fenced(self, t: _Transfer, now: float) -> None:
        """Release a failed transfer's blocks once no write can land: every rank's
        report fenced it (`RankReport.fenced`), or its deadline plus grace passed."""
        fenced = len(t.reported) == self.num_ranks and all(t.reported.values())
        if fenced or now >= t.fence_at:
            self.manager.release_receiving(t.blocks)
            self.counters.released_blocks += len(t.blocks)
            del self._by_id[(t.epoch, t.transfer_id)]

    def _forget(self, t: _Transfer) -> None:
        del self._by_id[(t.epoch, t.transfer_id)]
        del self._by_request[t.request_id]

    def check_invariants(self) -> None:
        """The manager's invariants, and: every receiving block belongs to exactly one
        live transfer with a deadline; a receiving transfer's request is active and
        its table is its prefix only (no request reads the tail).

        Raises:
            AssertionError: one broken."""
        mgr = self.manager
        mgr.check_invariants()
        owned: set[int] = set()
        for t in self._by_id.values():
            assert t.deadline > 0 and (t.state is DState.RECEIVING or t.fence_at > 0), t
            for b in t.blocks:
                assert b not in owned, f"receiving block {b} in two transfers"
                assert mgr.is_receiving(b), f"block {b} of {t.transfer_id} is not receiving"
                owned.add(b)
            if t.state is DState.RECEIVING:
                assert self._by_request[t.request_id] is t
                assert mgr.is_active(t.request_id), t
                table = mgr.block_table(t.request_id)
                assert not owned.intersection(table.block_ids), t
        assert len(owned) == mgr.num_receiving_blocks, (
            f"{mgr.num_receiving_blocks} receiving blocks, {len(owned)} owned by transfers"
        )


__all__ = ["DState", "DecodeCounters", "DecodeTransfers", "Outcome"]
