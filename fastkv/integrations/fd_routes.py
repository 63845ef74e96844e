"""Where each result of a FastDeploy worker's fastkv controller goes.

The worker runs the scheduler's transfers under ids of its own: a step's merged
metadata of each direction becomes one local transfer that carries many scheduler
transfers (regrouped by their `hash_values` tags, see `fd_transfers`), and each
storage lookup, load and write gets a local id too. `ResultRoutes` maps those local
ids back, so every scheduler transfer gets the result of the copy that carried it,
stamped with the cache epoch its tags carried, and sends the results over the
results channel.

A failed swap-in's result is held back until the runner's wait has retried it
(`hold`, `resolve`): a retry that loads every layer turns it into a success, so the
scheduler never rewinds requests whose blocks are fine.

Not thread-safe: the cache controller adapter calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fastkv.channel import ResultsSender
from fastkv.integrations.fd_transfers import EPOCH_0, MergedTransfer
from fastkv.metadata import (
    CacheLevel,
    CacheSwapMetadata,
    Epoch,
    LookupResult,
    TransferResult,
)

Result = TransferResult | LookupResult


class ResultRoutes:
    """Local transfer and lookup ids, the scheduler ids each stands for, and the
    swap-in failures held back for a retry.

    Args:
        sender: this rank's results sender (`sender` may be replaced by a new one,
            see `reopen_sender`).
    """

    __slots__ = ("_groups", "_held", "_lookups", "_next_id", "_recovered", "sender")

    def __init__(self, sender: ResultsSender) -> None:
        self.sender = sender
        self._next_id = 0
        # local transfer -> (scheduler ids, their epoch)
        self._groups: dict[int, tuple[tuple[int, ...], Epoch]] = {}
        self._lookups: dict[int, tuple[int, Epoch]] = {}  # local lookup -> the scheduler's
        # Swap-ins whose failure waits for the runner's wait to retry them: local
        # transfer id -> the failure, once reported.
        self._held: dict[int, TransferResult | None] = {}
        self._recovered: set[int] = set()  # retried fine before their result came

    @property
    def num_waiting(self) -> int:
        """Local transfers and lookups whose result has not been sent yet."""
        return len(self._groups) + len(self._lookups)

    def reopen_sender(self) -> None:
        """A sender closed by `free_cache` is replaced by a new one (same channel,
        same rank) when a cache is made again."""
        if self.sender.closed:
            self.sender = ResultsSender(self.sender.name, self.sender.rank)

    def new_id(self) -> int:
        """A local id no earlier transfer or lookup of this worker had."""
        local = self._next_id
        self._next_id += 1
        return local

    def local(
        self, merged: MergedTransfer | None, src: CacheLevel, dst: CacheLevel
    ) -> CacheSwapMetadata | None:
        """The merged transfer as one fastkv transfer with a new local id (None
        for None); its scheduler ids are not expected until `expect`."""
        if merged is None:
            return None
        return CacheSwapMetadata(
            self.new_id(), src, dst, merged.src_block_ids, merged.dst_block_ids
        )

    def expect(
        self, local_id: int, transfer_ids: tuple[int, ...], epoch: Epoch = EPOCH_0
    ) -> None:
        """The result of local transfer `local_id` is the result of `transfer_ids`
        (of cache epoch `epoch`, stamped on their results)."""
        self._groups[local_id] = (transfer_ids, epoch)

    def expect_lookups(self, lookup_ids: Mapping[int, int], epoch: Epoch = EPOCH_0) -> None:
        """Local lookup id -> the scheduler's lookup id (of cache epoch `epoch`),
        for lookups submitted."""
        self._lookups.update((local, (qid, epoch)) for local, qid in lookup_ids.items())

    def hold(self, local_id: int) -> None:
        """Hold back a failure of swap-in `local_id` until `resolve`."""
        self._held[local_id] = None

    def resolve(self, local_id: int, recovered: bool) -> None:
        """Let a held-back swap-in result go: as a success if a retry loaded it."""
        if local_id not in self._held:
            return
        held = self._held[local_id]
        if held is None:  # its result has not come yet: convert it when it does
            if recovered:
                self._recovered.add(local_id)
            else:
                del self._held[local_id]
            return
        del self._held[local_id]
        self.forward([TransferResult(local_id, True) if recovered else held])

    def settle_held(self) -> None:
        """The step of a held-back swap-in is over and nothing retried it (the
        runner never waited on it): its failure goes on to the scheduler."""
        for local_id in list(self._held):
            if local_id not in self._recovered:
                self.resolve(local_id, False)

    def forget_recoveries(self) -> None:
        """Forget the swap-ins retried fine whose result has not come (the cache
        is gone)."""
        self._recovered.clear()

    def forward(self, results: Sequence[Result]) -> int:
        """Send the controller's results as the scheduler's, each with its
        scheduler id's epoch (held-back failures stay until resolved).

        Returns:
            Results the scheduler has not acknowledged yet (see ResultsSender).
        """
        out: list[Result] = []
        for r in results:
            if isinstance(r, LookupResult):
                looked = self._lookups.pop(r.lookup_id, None)
                if looked is not None:
                    out.append(LookupResult(looked[0], r.num_hits, epoch=looked[1]))
                continue
            released = self._unless_held(r)
            if released is None:
                continue
            ids, epoch = self._groups.pop(released.transfer_id, ((), EPOCH_0))
            out += [
                TransferResult(
                    t, released.success, released.error, released.failed_blocks, epoch=epoch
                )
                for t in ids
            ]
        return self.sender.send(out)

    def send(self, results: Iterable[Result]) -> int:
        """Send results already in the scheduler's ids and epochs (failures of
        work that never started)."""
        return self.sender.send(results)

    def _unless_held(self, r: TransferResult) -> TransferResult | None:
        """The result to send for `r`, or None while its failure is held back."""
        tid = r.transfer_id
        if tid not in self._held:
            return r
        if tid in self._recovered:  # a retry loaded every layer after all
            self._recovered.discard(tid)
            r = TransferResult(tid, True)
        elif not r.success:  # kept until the runner's wait retries it
            self._held[tid] = r
            return None
        del self._held[tid]
        return r


__all__ = ["ResultRoutes"]
