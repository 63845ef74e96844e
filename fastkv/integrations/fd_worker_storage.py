"""The storage tier of a FastDeploy worker: its local disk backend, and the step's
storage work handed to fastkv's controller.

With FastDeploy's `kvcache_storage_backend="file"` each rank opens a
`LocalDiskBackend` in its own directory, with "mooncake" a `MooncakeBackend` on
the cluster FastDeploy's Mooncake settings name (`open_storage`). The scheduler's storage
writes ride in the step's eviction metadata, its lookups and loads come as the
prefetch tasks the engine drained (`prefetch_from_storage`); both are taken apart
by `fd_transfers.split_storage`, and `submit_storage` gives each a local id (see
`fd_routes`) and starts it on the controller, never waiting. A block's storage key
is the SHA-256 of the scheduler's hash text (`storage_key`), the same on every
rank (the rank is part of the backend's namespace).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from fastkv.config import CacheConfig
from fastkv.integrations import fd_config as fdc
from fastkv.integrations.fd_routes import Result, ResultRoutes
from fastkv.integrations.fd_transfers import StorageWork
from fastkv.metadata import (
    CacheLevel,
    CacheSwapMetadata,
    Epoch,
    LookupResult,
    StorageLookup,
    TransferResult,
)
from fastkv.storage.mooncake.options import MooncakeConnection

log = logging.getLogger(__name__)


def storage_key(text: str) -> bytes:
    """A block's storage key: SHA-256 of the scheduler's hash text (FastDeploy's
    block hashes are hex strings; every rank derives the same key, its rank is
    part of the storage key)."""
    return hashlib.sha256(text.encode("utf-8")).digest()


def open_storage(
    target: str | MooncakeConnection | None,
    caches: list[Any],
    config: CacheConfig,
    per_layer: int,
    num_extra: int,
) -> tuple[Any, bytes]:
    """The storage backend of this rank, or (None, b"") without a storage tier:
    fastkv's local disk backend in a directory, or its Mooncake backend (its key
    ring from `$FASTKV_STORAGE_KEY_FILE`: blocks are authenticated). Its layout
    is one segment per cache tensor (a host block's bytes); its namespace digest
    covers the model, dtype, block size, TP size, layers and the per-rank head
    shape, so a different cache never hits.

    Args:
        target: this rank's storage directory or Mooncake connection
            (`fd_config.storage_target`), None without a storage tier.
        caches: the cache tensors, layer-major (extra layers last).
        config: the cache's configuration (FastDeploy's, see `fd_config`).
        per_layer: tensors per layer.
        num_extra: extra (MTP) layers among them.
    """
    if target is None:
        return None, b""
    from fastkv.config import ModelKVShape
    from fastkv.storage import BlockLayout, StorageNamespace

    lengths = []
    for t in caches:
        shape = [int(d) for d in t.shape]
        per_block = 1
        for d in shape[1:]:
            per_block *= d
        lengths.append(per_block * int(t.element_size()))
    shape = [int(d) for d in caches[0].shape]
    # config.model_id is FastDeploy's model path (or "fastdeploy"), its tp_size
    # FastDeploy's: the digest stays the one this adapter always keyed under.
    model_kv = ModelKVShape(
        len(caches) // per_layer - num_extra, shape[1], shape[-1], num_extra
    )
    namespace = StorageNamespace.of(config, model_kv).digest()
    layout = BlockLayout(tuple(lengths))
    if isinstance(target, MooncakeConnection):
        from fastkv.storage.mooncake import MooncakeBackend, MooncakeOptions

        return MooncakeBackend(layout, MooncakeOptions(connection=target)), namespace
    from fastkv.storage.local_disk import LocalDiskBackend

    backend = LocalDiskBackend(
        target, layout, capacity_blocks=fdc.storage_capacity_blocks(config.num_host_blocks)
    )
    return backend, namespace


def submit_storage(ctrl: Any, routes: ResultRoutes, work: StorageWork, rank: int) -> None:
    """Start the step's storage lookups, loads and writes on `ctrl` (never waits);
    each keeps its scheduler id for its result. Refused work is reported failed.

    Args:
        ctrl: fastkv's CacheController of this rank.
        routes: the rank's result routes (local ids, the sender).
        work: the step's storage work.
        rank: this worker's tensor-parallel rank (for the log).
    """
    if not work:
        return
    batch = _StorageBatch()
    try:
        batch.build(work, routes)
        batch.submit(ctrl, routes)
    except (ValueError, TypeError) as e:  # refused: what did not start fails
        log.error("fastkv rank %d: storage work not started: %s", rank, e)
        routes.send(batch.not_started(f"not started: {type(e).__name__}: {e}"))


def fail_storage(routes: ResultRoutes, work: StorageWork, why: str) -> None:
    """Report the step's storage work failed without starting any (no cache)."""
    if work:
        epoch = work.epoch
        routes.send(
            [TransferResult(t, False, why, epoch=epoch) for t in (*work.loads, *work.writes)]
            + [LookupResult(q, 0, epoch=epoch) for q in work.lookups]
        )


class _StorageBatch:
    """One step's storage work in the controller's shape, and the scheduler ids of
    what has not started yet."""

    __slots__ = ("epoch", "ids", "loads", "lookup_ids", "lookups", "stores")

    def __init__(self) -> None:
        self.epoch = Epoch(0)  # the work's (its results carry it)
        self.lookups: list[StorageLookup] = []
        self.loads: list[CacheSwapMetadata] = []
        self.stores: list[CacheSwapMetadata] = []
        self.ids: dict[int, tuple[int, ...]] = {}  # local transfer -> scheduler ids
        self.lookup_ids: dict[int, int] = {}  # local lookup -> the scheduler's

    def build(self, work: StorageWork, routes: ResultRoutes) -> None:
        """Give every lookup, load and write a local id and its storage keys."""
        self.epoch = work.epoch
        for qid, texts in work.lookups.items():
            local = routes.new_id()
            self.lookups.append(StorageLookup(local, [storage_key(t) for t in texts]))
            self.lookup_ids[local] = qid
        for tid, pairs in (*work.loads.items(), *work.writes.items()):
            local = routes.new_id()
            hosts = [h for h, _ in pairs]
            keys = [storage_key(t) for _, t in pairs]
            if tid in work.loads:
                self.loads.append(
                    CacheSwapMetadata(
                        local, CacheLevel.STORAGE, CacheLevel.HOST, [], hosts, keys
                    )
                )
            else:
                self.stores.append(
                    CacheSwapMetadata(
                        local, CacheLevel.HOST, CacheLevel.STORAGE, hosts, [], keys
                    )
                )
            self.ids[local] = (tid,)

    def submit(self, ctrl: Any, routes: ResultRoutes) -> None:
        """Start it, one load and one write per call (the controller's shape), the
        lookups with the first; what started is expected by `routes`."""
        loads, stores = self.loads, self.stores
        for i in range(max(len(loads), len(stores), 1)):
            load = loads[i] if i < len(loads) else None
            store = stores[i] if i < len(stores) else None
            ctrl.submit_storage_tasks(load, store, self.lookups if i == 0 else ())
            for meta in (load, store):
                if meta is not None:
                    routes.expect(meta.transfer_id, self.ids.pop(meta.transfer_id), self.epoch)
            if i == 0:
                routes.expect_lookups(self.lookup_ids, self.epoch)
                self.lookup_ids = {}

    def not_started(self, error: str) -> list[Result]:
        """Failures for every transfer and lookup that did not start."""
        epoch = self.epoch
        return [
            TransferResult(t, False, error, epoch=epoch)
            for group in self.ids.values()
            for t in group
        ] + [LookupResult(q, 0, epoch=epoch) for q in self.lookup_ids.values()]


__all__ = ["fail_storage", "open_storage", "storage_key", "submit_storage"]
