"""Transfer results of several tensor-parallel ranks, combined into one per transfer.

One scheduler serves every rank: each rank's worker runs the same
`CacheSwapMetadata` on its own shard of the KV heads and reports its own
`TransferResult`. A transfer is applied when every rank has reported, and succeeds
only if every rank succeeded: a block is valid only when all of its shards are.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastkv.metadata import TransferResult


class RankResults:
    """Collects per-rank results until every rank has reported a transfer.

    Args:
        tp_size: number of ranks, >= 1.

    Raises:
        ValueError: `tp_size` out of range.
    """

    def __init__(self, tp_size: int) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size: must be an int >= 1, got {tp_size!r}")
        self.tp_size = tp_size
        # transfer id -> (ranks reported, the first failure's error or None)
        self._partial: dict[int, tuple[set[int], str | None]] = {}

    def add(self, rank: int, results: Iterable[TransferResult]) -> list[TransferResult]:
        """Record one rank's results.

        Returns:
            The combined results of the transfers every rank has now reported, in
            the order this call completed them.

        Raises:
            ValueError: `rank` out of range, or the rank reports a transfer twice
                (in this batch or before); nothing is recorded.
            TypeError: an entry is not a TransferResult.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ValueError(f"rank: must be an int in [0, {self.tp_size}), got {rank!r}")
        results = list(results)
        seen: set[int] = set()
        for r in results:
            if not isinstance(r, TransferResult):
                raise TypeError(f"results: expected TransferResult, got {r!r:.80}")
            reported = self._partial.get(r.transfer_id)
            if r.transfer_id in seen or (reported is not None and rank in reported[0]):
                raise ValueError(
                    f"transfer_id: rank {rank} reported transfer {r.transfer_id} twice"
                )
            seen.add(r.transfer_id)
        done = []
        for r in results:
            ranks, error = self._partial.get(r.transfer_id, (set(), None))
            ranks.add(rank)
            if not r.success and error is None:
                error = f"rank {rank}: {r.error}"
            if len(ranks) == self.tp_size:
                self._partial.pop(r.transfer_id, None)
                done.append(TransferResult(r.transfer_id, error is None, error or ""))
            else:
                self._partial[r.transfer_id] = (ranks, error)
        return done

    def missing(self) -> dict[int, list[int]]:
        """Transfers some rank has reported and others not yet: id -> missing ranks."""
        return {
            tid: sorted(set(range(self.tp_size)) - ranks)
            for tid, (ranks, _) in self._partial.items()
        }


__all__ = ["RankResults"]
