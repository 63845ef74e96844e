"""Results of several tensor-parallel ranks, combined into one per transfer or lookup.

One scheduler serves every rank: each rank's worker runs the same metadata on its
own shard of the KV heads (and its own storage keys) and reports its own results.
A transfer is applied when every rank has reported, and succeeds only if every rank
succeeded: a block is valid only when all of its shards are (for storage transfers,
per block: a block failed on any rank failed). A storage lookup's usable prefix is
the minimum over ranks.

Memory is bounded: at most `max_pending` transfers and lookups wait for missing
ranks. Past that, the oldest is given up: it completes as failed (a lookup with no
hits), naming the ranks that never reported, and a late report of it is dropped.
A rank that leaves that many newer results unanswered has stopped (it died or
hangs); failing its oldest transfers is the conservative answer, holding them
forever grew the process by 185 MB per 300k.

Reports are combined per (epoch, id) (`fastkv.metadata.Epoch`): transfer and lookup
ids restart after a cache reset, so a stale or duplicated report from before it
never completes, or counts toward, a new transfer that reuses its id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from fastkv.metadata import LookupResult, TransferResult

Result = TransferResult | LookupResult


class _Partial:
    __slots__ = ("error", "failed", "hits", "ranks")

    def __init__(self) -> None:
        self.ranks: set[int] = set()
        self.error: str | None = None
        self.failed: set[int] = set()
        self.hits: int | None = None

    def add(self, rank: int, r: Result) -> None:
        """Fold one rank's result in: the fewest hits, every failed block, the
        first error."""
        self.ranks.add(rank)
        if isinstance(r, LookupResult):
            self.hits = r.num_hits if self.hits is None else min(self.hits, r.num_hits)
            return
        self.failed.update(r.failed_blocks)
        if not r.success and self.error is None:
            self.error = f"rank {rank}: {r.error}"


class RankResults:
    """Collects per-rank results until every rank has reported.

    Args:
        tp_size: number of ranks, >= 1.
        max_pending: the most transfers and lookups kept waiting for missing ranks
            (module docstring), >= 1.

    Raises:
        ValueError: `tp_size` or `max_pending` out of range.
    """

    def __init__(self, tp_size: int, max_pending: int = 16384) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size: must be an int >= 1, got {tp_size!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending: must be an int >= 1, got {max_pending!r}")
        self.tp_size = tp_size
        self.max_pending = max_pending
        # (kind, id, epoch) -> what the ranks that reported so far said; oldest first
        self._partial: OrderedDict[_Key, _Partial] = OrderedDict()
        # given up (oldest first, at most max_pending): late reports are dropped
        self._given_up: OrderedDict[_Key, None] = OrderedDict()
        self.given_up = 0  # transfers and lookups completed as failed for missing ranks
        self.late_dropped = 0  # reports that came after their transfer was given up

    def add(self, rank: int, results: Iterable[Result]) -> list[Result]:
        """Record one rank's results (TransferResults and LookupResults).

        Returns:
            The combined results of what every rank has now reported, in the order
            this call completed them.

        Raises:
            ValueError: `rank` out of range, or the rank reports a transfer or lookup
                twice (in this batch or before); nothing is recorded.
            TypeError: an entry is neither a TransferResult nor a LookupResult.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ValueError(f"rank: must be an int in [0, {self.tp_size}), got {rank!r}")
        results = list(results)
        self._check_batch(rank, results)
        done: list[Result] = []
        for r in results:
            key = _key(r)
            if key in self._given_up:
                self.late_dropped += 1
                continue
            partial = self._partial.get(key)
            if partial is None:
                partial = self._partial[key] = _Partial()
                if len(self._partial) > self.max_pending:
                    done.append(self._give_up_oldest())
            partial.add(rank, r)
            if len(partial.ranks) == self.tp_size:
                del self._partial[key]
                done.append(_combined(r, partial))
        return done

    def _check_batch(self, rank: int, results: list[Result]) -> None:
        """Raise unless every entry is a result this rank has not reported yet."""
        seen: set[_Key] = set()
        for r in results:
            if not isinstance(r, (TransferResult, LookupResult)):
                raise TypeError(
                    f"results: expected TransferResult or LookupResult, got {r!r:.80}"
                )
            key = _key(r)
            partial = self._partial.get(key)
            if key in seen or (partial is not None and rank in partial.ranks):
                what = "transfer" if isinstance(r, TransferResult) else "lookup"
                raise ValueError(f"transfer_id: rank {rank} reported {what} {key[1]} twice")
            seen.add(key)

    def _give_up_oldest(self) -> Result:
        key, partial = self._partial.popitem(last=False)
        kind, id_, epoch = key
        self._given_up[key] = None
        while len(self._given_up) > self.max_pending:
            self._given_up.popitem(last=False)
        self.given_up += 1
        if kind is LookupResult:
            return LookupResult(id_, 0, self.tp_size, epoch)
        absent = sorted(set(range(self.tp_size)) - partial.ranks)
        error = (
            f"ranks {absent} never reported it ({self.max_pending} newer transfers and "
            "lookups were waiting); given up"
        )
        return TransferResult(
            id_, False, error, tuple(sorted(partial.failed)), self.tp_size, epoch
        )

    def missing(self) -> dict[tuple[str, int], list[int]]:
        """Transfers and lookups some rank has reported and others not yet:
        ("transfer" or "lookup", id) -> missing ranks. (Transfer and lookup ids are
        separate counters, so an id alone would let one hide the other.) Where an
        id waits in several epochs, the newest epoch's entry is listed."""
        everyone = set(range(self.tp_size))
        return {
            ("lookup" if kind is LookupResult else "transfer", id_): sorted(everyone - p.ranks)
            for (kind, id_, _), p in self._partial.items()
        }


_Key = tuple[type, int, int]  # (TransferResult or LookupResult, id, epoch)


def _key(r: Result) -> _Key:
    if isinstance(r, LookupResult):
        return LookupResult, r.lookup_id, r.epoch
    return TransferResult, r.transfer_id, r.epoch


def _combined(r: Result, partial: _Partial) -> Result:
    ranks = len(partial.ranks)
    if isinstance(r, LookupResult):
        return LookupResult(r.lookup_id, partial.hits or 0, ranks, r.epoch)
    return TransferResult(
        r.transfer_id,
        partial.error is None,
        partial.error or "",
        tuple(sorted(partial.failed)),
        ranks,
        r.epoch,
    )


__all__ = ["RankResults", "Result"]
