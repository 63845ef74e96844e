"""fastkv in one process: the scheduler's CacheManager and a CPU CacheController
serve three requests that share a system prompt, then the first one again. The
device pool is small, so blocks are evicted to host and loaded back, and every
cached block read is checked against the bytes written when it was computed.

    python examples/minimal_loop.py
"""

import numpy as np

from fastkv import CacheConfig, ModelKVShape
from fastkv.hashing import BlockHasher, namespace_root
from fastkv.scheduler import AllocStatus, CacheManager, Slot
from fastkv.worker import CacheController, KVCacheSpec

BS = 4  # tokens per block
config = CacheConfig(
    block_size=BS, num_device_blocks=6, num_host_blocks=16, model_id="demo", kv_dtype="float32"
)
model_kv = ModelKVShape(num_layers=2, num_kv_heads=1, head_dim=8)  # one rank's KV per layer
mgr = CacheManager(config)
ctrl = CacheController(KVCacheSpec.from_config(config, model_kv), config=config)
root = namespace_root(config.namespace_key())
rng = np.random.default_rng(0)
written: dict[bytes, bytes] = {}  # block hash -> the KV bytes computed for it


def kv_bytes(block: int) -> bytes:
    """Every layer's K and V bytes of one device block."""
    return b"".join(ctrl.device_blocks(t)[block].tobytes() for t in range(len(ctrl.caches)))


def run_step() -> None:
    """The worker runs the swaps planned so far; the scheduler applies the results."""
    tasks = mgr.take_swap_metadata()
    ctrl.submit_swap_tasks(tasks.evict, tasks.swap_in)
    assert mgr.apply_results(ctrl.wait_all(timeout=10)) == []  # no failed swap-in


def serve(rid: str, tokens: list[int]) -> None:
    hit = mgr.add_request(rid, tokens)  # the manager hashes the tokens, locks its prefix
    while not (alloc := mgr.allocate(rid, num_tokens=len(tokens))):  # "not yet"
        assert alloc.status is AllocStatus.WAIT_FOR_TRANSFERS  # evictions must land
        run_step()
    run_step()  # this step's swap-ins (host hits) land before the model reads them
    table = mgr.block_table(rid)  # per position: the block, and CACHED/LOADING/COMPUTE
    hashes = BlockHasher(BS, root).append(tokens)  # the same digests, to check bytes
    for pos, (block, slot) in enumerate(zip(table.block_ids, table.slots, strict=True)):
        if slot is not Slot.COMPUTE:  # cached KV: exactly the bytes once written
            assert kv_bytes(block) == written[hashes[pos]], (rid, pos)
            continue
        for t in range(len(ctrl.caches)):  # "the model" computes the rest
            ctrl.device_blocks(t)[block] = rng.integers(0, 256, ctrl.block_bytes[t])
        if pos < len(hashes):
            written[hashes[pos]] = kv_bytes(block)
    mgr.commit(rid, num_computed_tokens=len(tokens))  # its full blocks become matchable
    mgr.finish(rid)
    print(
        f"{rid}: {hit.num_device_hits} device hits, {hit.num_host_hits} host hits, "
        f"{len(table) - table.num_cached_blocks} blocks computed"
    )


system = list(range(100, 108))  # two blocks every request shares
for i, rid in enumerate(["r1", "r2", "r3", "r1-again"]):
    user = [(i % 3) * 10 + j for j in range(9)]  # two more full blocks and one token
    serve(rid, system + user)
stats = mgr.get_stats()
print(
    f"evicted to host: {stats.device_to_host_blocks} blocks, loaded back: "
    f"{stats.host_to_device_blocks}; every cached block read back intact"
)
mgr.check_invariants()
ctrl.free_cache()
