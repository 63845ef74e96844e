"""The transfer book: every copy the scheduler planned, from planning to its result.

    plan            the tiers queue device<->host copies in `to_host` / `to_device`;
                    the storage tier queues its own loads and writes
    take            `take()` turns the queued device copies into CacheSwapMetadata,
                    each with a new id (`register` gives the storage tier's theirs);
                    from then on the transfer is in flight
    result          `pop(id)` hands the record back when its TransferResult is
                    applied, tells the listeners, and forgets it

Every block named in a record stays reserved until the record is popped
(Invariant 1): a record in flight is the proof. Ids are handed out in order, so the
dict of transfers in flight is oldest first, and a transfer without a result for
`stall_after_s` is reported once (logged, counted, listed by `stalled()`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from fastkv.metadata import (
    BlockHash,
    CacheLevel,
    CacheSwapMetadata,
    Epoch,
    TransferListener,
)
from fastkv.scheduler.api import StalledTransfer
from fastkv.scheduler.block_pool import BlockPool
from fastkv.scheduler.radix_tree import (
    BACKUP_TO_HOST,
    DROPPED,
    LOADING_FROM_STORAGE,
    PENDING_HOST,
    STORING,
    SWAP_TO_DEVICE,
    SWAP_TO_HOST,
    TreeNode,
)
from fastkv.scheduler.request import RequestState
from fastkv.scheduler.stats import ManagerCounters

log = logging.getLogger(__name__)

_DEVICE, _HOST, _STORAGE = CacheLevel.DEVICE, CacheLevel.HOST, CacheLevel.STORAGE


class DeviceTransfer:
    """One device <-> host copy: per node, its device block when planned (an
    eviction whose block was handed on no longer holds it); for a swap-in, per node,
    the request loading it and the node's position in that request."""

    __slots__ = (
        "device_ids",
        "emitted_at",
        "nodes",
        "positions",
        "requests",
        "reused",
        "to_host",
    )

    def __init__(self, to_host: bool) -> None:
        self.to_host = to_host
        self.emitted_at = 0.0
        self.nodes: list[TreeNode] = []
        self.device_ids: list[int] = []
        self.requests: list[RequestState] = []  # to the device only
        self.positions: list[int] = []  # to the device only
        self.reused: list[int] = []  # to host only: device blocks handed on while copied

    @property
    def levels(self) -> tuple[CacheLevel, CacheLevel]:
        return (_DEVICE, _HOST) if self.to_host else (_HOST, _DEVICE)

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)


class LoadTransfer:
    """A STORAGE -> HOST transfer: per node, the request that prefetched it and the
    node's position in that request."""

    __slots__ = ("emitted_at", "nodes", "positions", "requests")
    levels = (_STORAGE, _HOST)

    def __init__(self) -> None:
        self.emitted_at = 0.0
        self.nodes: list[TreeNode] = []
        self.requests: list[RequestState] = []
        self.positions: list[int] = []

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)


class StoreTransfer:
    """A HOST -> STORAGE transfer: per block, its node (None once it left the tree),
    host block, key, and whether the host block is freed when the write ends."""

    __slots__ = ("emitted_at", "free_after", "host_ids", "keys", "nodes")
    levels = (_HOST, _STORAGE)

    def __init__(self) -> None:
        self.emitted_at = 0.0
        self.nodes: list[TreeNode | None] = []
        self.host_ids: list[int] = []
        self.keys: list[BlockHash] = []
        self.free_after: list[bool] = []

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


Transfer = DeviceTransfer | LoadTransfer | StoreTransfer

_DIRECTIONS = {
    (_DEVICE, _HOST): "device->host",
    (_HOST, _DEVICE): "host->device",
    (_STORAGE, _HOST): "storage->host",
    (_HOST, _STORAGE): "host->storage",
}


class TransferBook:
    """Transfer ids, the device copies queued for the next step, the transfers in
    flight, their stalls and the listeners told of each result.

    Args:
        counters: the manager's counters (transfers and blocks taken, failures).
        clock: monotonic seconds (durations for the listeners, stall ages).
        stall_after_s: the age at which a transfer in flight counts as stalled.
    """

    __slots__ = (
        "_clock",
        "_counters",
        "_inflight",
        "_listeners",
        "_next_id",
        "_stalled",
        "epoch",
        "num_takes",
        "stall_after_s",
        "to_device",
        "to_host",
    )

    def __init__(
        self,
        counters: ManagerCounters,
        clock: Callable[[], float],
        stall_after_s: float,
    ) -> None:
        self._counters = counters
        self._clock = clock
        self.stall_after_s = stall_after_s
        self.to_host = DeviceTransfer(True)  # queued for the next take()
        self.to_device = DeviceTransfer(False)
        self._inflight: dict[int, Transfer] = {}
        self._next_id = 0
        self.epoch = Epoch(0)  # stamped on every metadata taken (the manager's)
        self._stalled: set[int] = set()  # ids already reported stalled
        self._listeners: list[TransferListener] = []
        self.num_takes = 0  # take() calls so far

    # -- ids and the step ---------------------------------------------------------

    def register(self, transfer: Transfer) -> int:
        """A new transfer id for `transfer`, in flight from now on."""
        transfer_id = self._next_id
        self._next_id += 1
        self._inflight[transfer_id] = transfer
        transfer.emitted_at = self._clock()
        return transfer_id

    def take(self) -> tuple[CacheSwapMetadata | None, CacheSwapMetadata | None]:
        """The queued device copies as (device->host, host->device) metadata, each
        with a new id, or None where nothing is queued; logs new stalls first."""
        self.num_takes += 1
        if self._inflight:
            self._note_stalls()
        evict = swap_in = None
        counters = self._counters
        if self.to_host.nodes:
            d2h, self.to_host = self.to_host, DeviceTransfer(True)
            evict = self._emit(d2h)
            counters.d2h_transfers += 1
            counters.d2h_blocks += len(d2h.nodes)
        if self.to_device.nodes:
            h2d, self.to_device = self.to_device, DeviceTransfer(False)
            swap_in = self._emit(h2d)
            counters.h2d_transfers += 1
            counters.h2d_blocks += len(h2d.nodes)
        return evict, swap_in

    def _emit(self, transfer: DeviceTransfer) -> CacheSwapMetadata:
        transfer_id = self.register(transfer)
        device_ids = transfer.device_ids
        host_ids = [n.host_block for n in transfer.nodes]
        keys = [n.key for n in transfer.nodes]
        if transfer.to_host:
            return CacheSwapMetadata(
                transfer_id,
                _DEVICE,
                _HOST,
                device_ids,
                host_ids,
                keys,
                reused_block_ids=transfer.reused,
                epoch=self.epoch,
            )
        return CacheSwapMetadata(
            transfer_id, _HOST, _DEVICE, host_ids, device_ids, keys, epoch=self.epoch
        )

    # -- results ------------------------------------------------------------------

    def check_unapplied(self, transfer_id: int, seen: set[int]) -> None:
        """Raise ValueError unless `transfer_id` is in flight and not in `seen` (the
        ids of the batch checked so far, which this adds it to)."""
        if transfer_id not in self._inflight or transfer_id in seen:
            raise ValueError(f"transfer_id: {transfer_id} is unknown or already applied")
        seen.add(transfer_id)

    def pop(self, transfer_id: int, success: bool, now: float) -> Transfer:
        """The record of a transfer whose result is being applied (it is no longer
        in flight); the listeners hear of it. The id must be in flight."""
        transfer = self._inflight.pop(transfer_id)
        if self._stalled:
            self._stalled.discard(transfer_id)
        if self._listeners:
            seconds = now - transfer.emitted_at
            for listener in self._listeners:
                listener(*transfer.levels, transfer.num_blocks, seconds, success)
        if not success:
            self._counters.failed_transfers += 1
        return transfer

    def add_listener(self, listener: TransferListener) -> None:
        """Call `listener` for every transfer result popped from now on."""
        self._listeners.append(listener)

    @property
    def listeners(self) -> list[TransferListener]:
        """The listeners added, in order (a copy)."""
        return list(self._listeners)

    # -- queries ------------------------------------------------------------------

    def is_inflight(self, transfer_id: int) -> bool:
        """Whether `transfer_id` was taken and its result not yet applied."""
        return transfer_id in self._inflight

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def next_transfer_id(self) -> int:
        """The id the next transfer gets."""
        return self._next_id

    def num_inflight_blocks(self) -> int:
        """Blocks of every transfer in flight (a snapshot: a metrics thread may read
        while the scheduler loop runs)."""
        return sum(t.num_blocks for t in list(self._inflight.values()))

    @property
    def busy(self) -> bool:
        """Transfers in flight or device copies queued."""
        return bool(self._inflight or self.to_host.nodes or self.to_device.nodes)

    def inflight(self) -> list[tuple[int, Transfer]]:
        """(id, record) of every transfer in flight, oldest first (a snapshot)."""
        return list(self._inflight.items())

    def device_copies(self) -> Iterator[DeviceTransfer]:
        """Every device <-> host copy in flight or queued."""
        for transfer in self._inflight.values():
            if type(transfer) is DeviceTransfer:
                yield transfer
        yield self.to_host
        yield self.to_device

    def stalled(self) -> list[StalledTransfer]:
        """Transfers in flight for `stall_after_s` or more, oldest first: a worker
        that lost them, results never delivered, or a batch never applied."""
        now = self._clock()
        out = []
        for tid, transfer in list(self._inflight.items()):  # id order: oldest first
            age = now - transfer.emitted_at
            if age < self.stall_after_s:
                break
            direction = _DIRECTIONS[transfer.levels]
            out.append(StalledTransfer(tid, direction, transfer.num_blocks, age))
        return out

    def check(
        self,
        host_owner: dict[int, object],
        device_pool: BlockPool,
        host_pool: BlockPool,
        reuse_evicted_blocks: bool,
    ) -> tuple[set[TreeNode], set[TreeNode]]:
        """Assert the records in flight and queued (part of
        `CacheManager.check_invariants`): every node a copy moves is in a moving
        state, in one transfer only, with its blocks still allocated; claims in
        `host_owner` the host blocks only a write or a copy still holds.

        Returns:
            The nodes a copy or load moves, and those whose host copy a write pins.
        """
        moving: set[TreeNode] = set()
        storing: set[TreeNode] = set()
        for transfer in [*self._inflight.values(), self.to_host, self.to_device]:
            if type(transfer) is StoreTransfer:
                storing.update(_check_store(transfer, host_owner))
                continue
            for node in transfer.nodes:
                assert node not in moving, f"{node} in two transfers"
                moving.add(node)
                assert host_pool.is_allocated(node.host_block), node
                if node.state == DROPPED:  # out of the tree; its host block is still its
                    assert node.host_block not in host_owner, f"{node}: host block owned"
                    host_owner[node.host_block] = node
            if type(transfer) is LoadTransfer:
                for node in transfer.nodes:
                    assert node.state in (LOADING_FROM_STORAGE, BACKUP_TO_HOST, DROPPED), node
            else:
                _check_device_copy(transfer, device_pool, reuse_evicted_blocks)
        return moving, storing

    def _note_stalls(self) -> None:
        """Log each newly stalled transfer once (O(stalled + 1): ids are handed out
        in order, so the first young one ends the scan)."""
        for stalled in self.stalled():
            if stalled.transfer_id not in self._stalled:
                self._stalled.add(stalled.transfer_id)
                log.warning(
                    "fastkv: transfer %d (%s, %d blocks) taken %.1f s ago has no result "
                    "yet; its blocks stay reserved until apply_results() gets one",
                    stalled.transfer_id,
                    stalled.direction,
                    stalled.num_blocks,
                    stalled.age_s,
                )


_RELEASED = (PENDING_HOST, DROPPED)  # an eviction whose device block was handed on


def _check_store(transfer: StoreTransfer, host_owner: dict[int, object]) -> list[TreeNode]:
    """A write's host blocks: its own when it frees them (or its node left the
    tree), else pinned on a STORING node. Returns the pinned nodes."""
    pinned = []
    for node, host, free in zip(
        transfer.nodes, transfer.host_ids, transfer.free_after, strict=True
    ):
        if free or node is None or node.state == DROPPED:
            assert host not in host_owner, f"host block {host} owned twice"
            host_owner[host] = "a storage write"
        else:
            assert node.storage == STORING and node.host_block == host, node
            pinned.append(node)
    return pinned


def _check_device_copy(
    transfer: DeviceTransfer, device_pool: BlockPool, reuse_evicted_blocks: bool
) -> None:
    expected = (
        (SWAP_TO_HOST, BACKUP_TO_HOST, *_RELEASED) if transfer.to_host else (SWAP_TO_DEVICE,)
    )
    assert len(transfer.device_ids) == len(transfer.nodes)
    for node, device_block in zip(transfer.nodes, transfer.device_ids, strict=True):
        assert node.state in expected, f"{node} in a transfer but not moving"
        # A released eviction's block may be anyone's, or free, also after a
        # request that recomputed the block handed the node its own copy.
        if node.state in _RELEASED or node.device_block != device_block:
            assert reuse_evicted_blocks, node
            assert node.state in (*_RELEASED, BACKUP_TO_HOST), node
            continue
        assert device_pool.is_allocated(device_block), node


__all__ = [
    "DeviceTransfer",
    "LoadTransfer",
    "StoreTransfer",
    "Transfer",
    "TransferBook",
]
