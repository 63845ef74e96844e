"""A seeded model loop over a real CacheManager (reuse_evicted_blocks, as the
FastDeploy adapter runs it) and a CPU CacheController, that writes the blocks it
computes right after `submit_swap_tasks`, before waiting on any layer and without
`write_block_ids`, then checks every cached block it reads.

The eviction stream runs each layer's copy after a seeded delay (a GPU's busy
output stream), so a model write that nothing orders lands in a block before the
eviction has read it: the host copy then holds the new owner's bytes, and a later
request that hits that block reads them. Used by tests/worker/test_handover.py and
`python tools/handover_rate.py`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

import numpy as np

from fastkv import CacheConfig
from fastkv.hashing import BlockHasher, namespace_root
from fastkv.metadata import CacheSwapMetadata
from fastkv.scheduler import AllocStatus, CacheManager
from fastkv.worker import CacheController, KVCacheSpec
from fastkv.worker.streams import HostStream, InlineStream, Launch, OnError

BS = 4
LAYERS = 2
DEVICE_BLOCKS = 8
HOST_BLOCKS = 24
PREFIXES = 2  # shared prompts of two blocks each


class DelayedStream(HostStream):
    """A HostStream that runs each launched item after a seeded delay."""

    def __init__(self, name: str, seed: int, max_delay_s: float) -> None:
        super().__init__(name)
        self._rng = random.Random(seed)
        self._max_delay_s = max_delay_s

    def launch(self, fn: Launch, on_error: OnError) -> None:
        delay = self._rng.uniform(0.0, self._max_delay_s)

        def delayed(handle: int) -> None:
            time.sleep(delay)
            fn(handle)

        super().launch(delayed, on_error)


@dataclass
class RunResult:
    wrong_blocks: int  # cached blocks read with bytes other than those computed
    checked_blocks: int  # cached blocks read and checked
    reused_blocks: int  # evicted blocks handed to a new owner


def run(
    seed: int, *, hand_over: bool = True, requests: int = 24, max_delay_s: float = 0.002
) -> RunResult:
    """One seeded run. `hand_over=False` strips `reused_block_ids` from the
    evictions (what a scheduler that does not say which blocks it handed over
    would send): the measurement of the rate before the fix."""
    config = CacheConfig(
        block_size=BS,
        num_device_blocks=DEVICE_BLOCKS,
        num_host_blocks=HOST_BLOCKS,
        model_id="handover",
        kv_dtype="float32",
        write_policy="write_back",
        reuse_evicted_blocks=True,
    )
    spec = KVCacheSpec(
        num_layers=LAYERS,
        num_kv_heads=1,
        head_dim=8,
        block_size=BS,
        num_device_blocks=DEVICE_BLOCKS,
        num_host_blocks=HOST_BLOCKS,
        dtype="float32",
    )
    streams = (
        HostStream("handover-h2d"),
        DelayedStream("handover-d2h", seed, max_delay_s),
        InlineStream(),
    )
    mgr = CacheManager(config)
    ctrl = CacheController(spec, streams=streams, config=config)
    root = namespace_root(config.namespace_key())
    rng = np.random.default_rng(seed)
    result = RunResult(0, 0, 0)

    def expected(block_hash: bytes, tensor: int) -> np.ndarray:
        salt = int.from_bytes(block_hash[:8], "little") ^ tensor
        return np.random.default_rng(salt).integers(0, 256, ctrl.block_bytes[tensor], np.uint8)

    def step(rid: str | None, hashes: list[bytes], first_new: int) -> None:
        tasks = mgr.take_swap_metadata()
        evict: CacheSwapMetadata | None = tasks.evict
        if evict is not None:
            result.reused_blocks += len(evict.reused_block_ids)
            if not hand_over:
                evict = dataclasses.replace(evict, reused_block_ids=())
        ctrl.submit_swap_tasks(evict, tasks.swap_in)  # no write_block_ids
        if rid is not None:
            table = mgr.block_table(rid).block_ids
            # The model writes what it computes at once, before any layer's wait.
            for pos in range(first_new, len(table)):
                for t in range(len(ctrl.caches)):
                    view = ctrl.device_blocks(t)
                    if pos < len(hashes):
                        view[table[pos]] = expected(hashes[pos], t)
                    else:  # the partial last block: never cached
                        view[table[pos]] = rng.integers(0, 256, view.shape[1], np.uint8)
            for layer in range(LAYERS):
                ctrl.wait_for_layer(layer, timeout=10)
            for pos in range(first_new):  # cached KV, loaded or resident
                result.checked_blocks += 1
                result.wrong_blocks += any(
                    not np.array_equal(
                        ctrl.device_blocks(t)[table[pos]], expected(hashes[pos], t)
                    )
                    for t in range(len(ctrl.caches))
                )
        assert mgr.apply_results(ctrl.poll_results()) == []

    try:
        for i in range(requests):
            rid = f"r{i}"
            prefix = [1000 * (1 + int(rng.integers(PREFIXES))) + j for j in range(2 * BS)]
            suffix = rng.integers(0, 50, int(rng.integers(1, 3 * BS))).tolist()
            tokens = prefix + suffix
            hashes = BlockHasher(BS, root).append(tokens)
            hit = mgr.match(rid, hashes, len(tokens))
            while not (alloc := mgr.allocate(rid, num_tokens=len(tokens))):
                assert alloc.status is AllocStatus.WAIT_FOR_TRANSFERS, alloc.status
                step(None, [], 0)
                assert mgr.apply_results(ctrl.wait_all(timeout=10)) == []
            step(rid, hashes, hit.num_hits)
            mgr.commit(rid, num_computed_tokens=len(tokens))
            mgr.finish(rid)
        assert mgr.apply_results(ctrl.wait_all(timeout=10)) == []
        mgr.check_invariants()
    finally:
        ctrl.free_cache()
    return result


def rate(runs: int, *, hand_over: bool, first_seed: int = 0) -> tuple[int, int, int]:
    """(runs with a wrong read, wrong blocks in all, blocks handed over in all)."""
    bad = wrong = reused = 0
    for seed in range(first_seed, first_seed + runs):
        r = run(seed, hand_over=hand_over)
        bad += r.wrong_blocks > 0
        wrong += r.wrong_blocks
        reused += r.reused_blocks
    return bad, wrong, reused
