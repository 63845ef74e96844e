"""P's scheduler half: offer a request to D, pin what it sends until the send settles.

A send on P (one per offered request):

      offer() ──► OFFERED ── Rejection / answer deadline ──► unpinned
                     │ Acceptance
                     ▼
                  SENDING ── every P rank reported (writes settled) ──► unpinned
                     └────── send deadline ─────────────────────────► unpinned

Pinned means the request stays active in P's manager (its path locked, its private
blocks held), so nothing evicts, reuses or frees a block a write may still read.
The engine calls `release` instead of `CacheManager.finish` for an offered request:
the finish happens when the send is unpinned (at once if it is). The send deadline
must exceed the transport's write timeout (a handle settles within it), so no write
reads a block after its unpin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from fastkv.metadata import Epoch
from fastkv.pd.messages import (
    Acceptance,
    Offer,
    RankReport,
    Rejection,
    SendPlan,
    check_digest,
    check_positive,
    check_rank_count,
    check_secret,
    checked_reports,
    transfer_secret,
)
from fastkv.scheduler.cache_manager import CacheManager


class PState(Enum):
    OFFERED = "offered"
    SENDING = "sending"


@dataclass(slots=True)
class _Send:
    request_id: Hashable
    num_tokens: int
    deadline: float
    started: float
    state: PState = PState.OFFERED
    acceptance: Acceptance | None = None
    reported: dict[int, bool] = field(default_factory=dict)
    released: bool = False


@dataclass(slots=True)
class PrefillCounters:
    offered: int = 0
    rejected: int = 0
    settled: int = 0
    send_failed: int = 0
    expired: int = 0
    stale: int = 0
    duplicate: int = 0


class PrefillTransfers:
    """P's sends over one `CacheManager` (not thread-safe: the scheduler loop).

    Args:
        manager: P's cache manager.
        layout_digest: P's `KVLayout.digest()`, sent with each offer.
        num_ranks: P's tensor-parallel size.
        answer_timeout_s: how long D may take to answer an offer.
        send_timeout_s: the longest P keeps a send pinned after acceptance (more
            than the transport's write timeout).
        deployment_secret: the secret D's `DecodeTransfers` was given, if any: an
            acceptance without a key (`Acceptance.public`) then gets its notice key
            from it (`transfer_secret`).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        manager: CacheManager,
        *,
        layout_digest: bytes,
        num_ranks: int = 1,
        answer_timeout_s: float = 30.0,
        send_timeout_s: float = 60.0,
        deployment_secret: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        secret = check_secret("deployment_secret", deployment_secret)
        digest = check_digest("layout_digest", layout_digest)
        self._secret = secret
        self.answer_timeout_s = check_positive("answer_timeout_s", answer_timeout_s)
        self.send_timeout_s = check_positive("send_timeout_s", send_timeout_s)
        self.num_ranks = check_rank_count("num_ranks", num_ranks)
        self.manager = manager
        self.layout_digest = digest
        self._clock = clock
        self._sends: dict[Hashable, _Send] = {}
        self._by_id: dict[tuple[Epoch, int], _Send] = {}
        self.counters = PrefillCounters()

    def offer(self, request_id: Hashable, num_tokens: int) -> Offer:
        """Pin an active request and make the offer to send to D.

        Raises:
            ValueError: the request is not active, already offered, or
                `num_tokens` is not an int >= 1."""
        if not self.manager.is_active(request_id):
            raise ValueError(f"request_id: {request_id!r} is not an active request")
        if request_id in self._sends:
            raise ValueError(f"request_id: {request_id!r} is already offered")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens: must be an int >= 1, got {num_tokens!r}")
        now = self._clock()
        self._sends[request_id] = _Send(
            request_id, num_tokens, now + self.answer_timeout_s, now
        )
        self.counters.offered += 1
        return Offer(request_id, num_tokens, self.layout_digest, self.num_ranks)

    def on_answer(self, answer: Acceptance | Rejection) -> bool:
        """Apply D's answer; True when the request is to be sent (`plan`). An
        acceptance for another token count or a D size not a multiple of P's, or
        without a key where P has no deployment secret, is treated as a rejection. An
        answer to no offered request (late, after its deadline) is counted and
        ignored (D's own deadline frees what it reserved)."""
        if not isinstance(answer, (Acceptance, Rejection)):
            raise TypeError(f"answer: expected Acceptance or Rejection, got {answer!r:.80}")
        send = self._sends.get(answer.request_id)
        if send is None or send.state is not PState.OFFERED:
            self.counters.stale += 1
            return False
        if isinstance(answer, Rejection):
            self.counters.rejected += 1
            self._unpin(send)
            return False
        if (
            answer.num_tokens != send.num_tokens
            or answer.num_d_ranks % self.num_ranks
            or not (answer.secret or self._secret)
        ):
            self.counters.rejected += 1
            self._unpin(send)
            return False
        send.state = PState.SENDING
        send.acceptance = answer
        send.deadline = self._clock() + min(self.send_timeout_s, answer.timeout_s)
        self._by_id[(answer.epoch, answer.transfer_id)] = send
        return True

    def plan(self, request_id: Hashable) -> SendPlan:
        """The send of an accepted request, from its table now: call it when the
        table covers the prompt (before the prefill step that writes it).

        Raises:
            ValueError: not an accepted send, or the table is too short."""
        send = self._sends.get(request_id)
        if send is None or send.acceptance is None:
            raise ValueError(f"request_id: {request_id!r} has no accepted send")
        acc = send.acceptance
        total = acc.num_prefix_blocks + len(acc.block_ids)
        table = self.manager.block_table(request_id)
        if table.num_blocks < total:
            raise ValueError(
                f"request_id: {request_id!r} holds {table.num_blocks} blocks, the send "
                f"needs {total}; allocate its prompt first"
            )
        key = acc.secret or transfer_secret(self._secret or b"", acc.epoch, acc.transfer_id)
        return SendPlan(
            acc.transfer_id,
            acc.epoch,
            key,
            tuple(table.block_ids[acc.num_prefix_blocks : total]),
            acc.block_ids,
            acc.num_d_ranks,
            send.deadline - self._clock(),
        )

    def on_reports(self, reports: Iterable[RankReport]) -> None:
        """P ranks' reports that their writes settled; when every rank has, the send
        is unpinned. Unknown, stale and repeated reports are counted and dropped."""
        reports = checked_reports(reports)
        for report in reports:
            send = self._by_id.get((report.epoch, report.transfer_id))
            if send is None:
                self.counters.stale += 1
            elif report.rank in send.reported or not 0 <= report.rank < self.num_ranks:
                self.counters.duplicate += 1
            else:
                send.reported[report.rank] = report.ok
                if len(send.reported) == self.num_ranks:
                    self.counters.settled += 1
                    if not all(send.reported.values()):
                        self.counters.send_failed += 1
                    self._unpin(send)

    def release(self, request_id: Hashable) -> None:
        """The engine is done with the request on P: finish it now, or when its send
        is unpinned.

        Raises:
            ValueError: the request is not active."""
        if not self.manager.is_active(request_id):
            raise ValueError(f"request_id: {request_id!r} is not an active request")
        send = self._sends.get(request_id)
        if send is None:
            self.manager.finish(request_id)
        else:
            send.released = True

    def withdraw(self, request_id: Hashable) -> bool:
        """Unpin an offer D has not accepted (the engine gave the request up before
        an answer: nothing was sent, nothing can be read). True when withdrawn;
        False (nothing changes) for a request not offered or already sending."""
        send = self._sends.get(request_id)
        if send is None or send.state is not PState.OFFERED:
            return False
        del self._sends[request_id]
        return True

    def tick(self) -> None:
        """Unpin sends past their deadline."""
        now = self._clock()
        for send in [s for s in self._sends.values() if now >= s.deadline]:
            self.counters.expired += 1
            self._unpin(send)

    def is_pinned(self, request_id: Hashable) -> bool:
        return request_id in self._sends

    def num_sends(self, state: PState) -> int:
        return sum(1 for s in self._sends.values() if s.state is state)

    def oldest_age_s(self) -> float:
        """Age of the oldest pinned send, from its offer (0 when none)."""
        if not self._sends:
            return 0.0
        return max(0.0, self._clock() - min(s.started for s in self._sends.values()))

    def _unpin(self, send: _Send) -> None:
        del self._sends[send.request_id]
        if send.acceptance is not None:
            self._by_id.pop((send.acceptance.epoch, send.acceptance.transfer_id), None)
        if send.released:
            self.manager.finish(send.request_id)

    def check_invariants(self) -> None:
        """The manager's invariants, and: every pinned request is active, has a
        deadline, and none of its blocks is in the free pool.

        Raises:
            AssertionError: one broken."""
        mgr = self.manager
        mgr.check_invariants()
        for rid, send in self._sends.items():
            assert send.deadline > 0, send
            assert mgr.is_active(rid), f"pinned request {rid!r} is not active"
            for b in mgr.block_table(rid).block_ids:
                assert mgr.device_pool.is_allocated(b), f"pinned block {b} is free"
        for key, send in self._by_id.items():
            assert self._sends.get(send.request_id) is send, key


__all__ = ["PState", "PrefillCounters", "PrefillTransfers"]
