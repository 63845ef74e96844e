"""A block's whole trip through the hierarchy with the real scheduler and worker:
computed on the device, copied to host, written to storage, dropped from device
and host, looked up, loaded back into host and swapped into the device, where its
bytes must be the bytes first computed. Shared by the local-disk test and the
Mooncake case (which runs in its own network namespace)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fastkv import CacheConfig, ModelKVShape, StorageConfig
from fastkv.hashing import BlockHasher, namespace_root
from fastkv.scheduler import CacheManager
from fastkv.storage import BlockLayout, StorageBackend, StorageNamespace
from fastkv.worker import CacheController, KVCacheSpec

BS = 4


def tiered_round_trip(
    make_backend: Callable[[BlockLayout], StorageBackend], dtype: str, extra_layers: int
) -> dict[str, object]:
    config = CacheConfig(
        block_size=BS,
        num_device_blocks=4,
        num_host_blocks=4,
        kv_dtype=dtype,
        model_id="tiered",
        write_policy="write_back",
        storage=StorageConfig(write_policy="write_through", timeout_s=30),
    )
    model_kv = ModelKVShape(
        num_layers=2, num_kv_heads=2, head_dim=16, num_extra_layers=extra_layers
    )
    spec = KVCacheSpec.from_config(config, model_kv)
    layout = BlockLayout(tuple(spec.block_bytes()))
    backend = make_backend(layout)
    namespace = StorageNamespace.of(config, model_kv).digest()
    ctrl = CacheController(spec, config=config, storage=backend, storage_namespace=namespace)
    register = getattr(backend, "register_host_memory", None)
    if register is not None:  # Mooncake: the whole host tier, once
        register(*ctrl.host_memory)
    mgr = CacheManager(config)
    root = namespace_root(config.namespace_key())
    rng = np.random.default_rng(7)
    written: dict[bytes, bytes] = {}

    def kv(block: int) -> bytes:
        return b"".join(ctrl.device_blocks(t)[block].tobytes() for t in range(len(ctrl.caches)))

    def step() -> None:
        tasks = mgr.take_swap_metadata()
        ctrl.submit_swap_tasks(tasks.evict, tasks.swap_in)
        ctrl.submit_storage_tasks(tasks.storage_load, tasks.storage_store, tasks.lookups)
        mgr.apply_results(ctrl.wait_all(timeout=60))
        mgr.check_invariants()

    def serve(rid: str, tokens: list[int]) -> tuple[int, int]:
        hashes = BlockHasher(BS, root).append(tokens)
        mgr.match(rid, hashes, len(tokens))
        while not mgr.allocate(rid, num_tokens=len(tokens)):
            step()
        step()  # swap-ins land before the model reads
        view = mgr.block_table(rid)
        table, cached = view.block_ids, view.num_cached_blocks
        for pos in range(cached):
            assert kv(table[pos]) == written[hashes[pos]], f"{rid}: block {pos} differs"
        for pos in range(cached, len(table)):
            for t in range(len(ctrl.caches)):
                view = ctrl.device_blocks(t)[table[pos]]
                view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
            if pos < len(hashes):
                written[hashes[pos]] = kv(table[pos])
        mgr.commit(rid, num_computed_tokens=len(tokens))
        mgr.finish(rid)
        while mgr.busy:  # backups, then their writes to storage
            step()
        return cached, len(hashes)

    first = serve("r1", list(range(3 * BS + 1)))
    for i in range(4):  # others push r1's blocks out of device and host
        serve(f"other{i}", [1000 * (i + 1) + t for t in range(3 * BS + 1)])
    stats = mgr.get_stats()
    again = serve("r1-again", list(range(3 * BS + 1)))
    final = mgr.get_stats()
    ctrl.free_cache()
    backend.close()
    return {
        "first": first,
        "again": again,
        "storage_writes": stats.storage.writes,
        "storage_hits": final.storage.hit_blocks - stats.storage.hit_blocks,
        "host_hits_before": stats.host_hit_blocks,
    }
