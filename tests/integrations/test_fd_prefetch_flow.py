"""FastDeploy's newer storage-prefetch flow (PR #7529), made in upstream's order by
a stand-in engine over the real adapters, real CPU workers, the real results
channel and each rank's local disk:

1. `add_request` runs `prefetch_storage(request)` on a preprocess thread (a pool
   of 4, as `apply_async_preprocess`); the request waits outside the scheduler;
2. the engine loop calls `drain_pending_prefetches()` every iteration and sends
   each task's `metadata` to every rank's worker (`prefetch_from_storage`, the
   engine-worker queue's stand-in): no step, empty or not, carries them;
3. once every rank reported a load, the engine calls
   `update_storage_blocks_to_host(task.host_block_ids)`, then hands the request to
   the scheduler, whose `match_prefix(request, True)` finds the blocks.

The engine's runner checks every KV position it reads (zero mismatches).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from fd_engine import BS, HEAD_DIM, KV_HEADS, LAYERS, Engine, Rank, prompt, slot_views
from fd_standins import (
    AttentionBackend,
    FDCacheConfig,
    FDConfig,
    ModelConfig,
    ParallelConfig,
    Request,
)

from fastkv.integrations import fd_config as fdc
from fastkv.integrations.fastdeploy import FastDeployCacheController, FastDeployCacheManager

pytest.importorskip("paddle", reason="the workers need paddle")

WAIT_S = 20.0


@dataclass
class StorageCacheConfig(FDCacheConfig):
    kvcache_storage_backend: str | None = "file"


class UpstreamEngine(Engine):
    """The engine loop of PR #7529 around the scheduler stand-in of fd_engine."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.preprocess = ThreadPoolExecutor(4)
        self.held: dict[str, tuple[Request, Future[bool]]] = {}
        self.loads: list[tuple[Any, float]] = []  # tasks sent, waiting for every rank
        self.calls: list[str] = []

    def arrive(self, request: Request) -> None:
        request.set_block_hasher(self._hasher)
        self.held[request.request_id] = (
            request,
            self.preprocess.submit(self._prefetch, request),
        )

    def _prefetch(self, request: Request) -> bool:
        found = self.cm.prefetch_storage(request)
        self.calls.append(f"prefetch_storage({request.request_id}) -> {found}")
        return found

    def loop_once(self) -> None:
        """One engine iteration: dispatch, settle loads, admit, schedule, run."""
        # A prefetch queues its loads before it answers: the drain below sees
        # those of every prefetch answered by now.
        answered = [rid for rid, (_, future) in self.held.items() if future.done()]
        for task in self.cm.drain_pending_prefetches():
            self.calls.append(f"drain -> {task.metadata.direction} {task.request_id}")
            for rank in self.ranks:
                rank.worker.prefetch_from_storage(task.metadata)
            if task.host_block_ids:
                self.loads.append((task, time.monotonic()))
        if self.loads and self._every_rank_reported():
            for task, _ in self.loads:
                self.cm.update_storage_blocks_to_host(task.host_block_ids)
                self.calls.append(f"update_storage_blocks_to_host({task.request_id})")
            self.loads = []
        if not self.loads:
            for rid in answered:
                request, future = self.held.pop(rid)
                future.result()
                self.add_request(request)
        batch = self.schedule()
        self.log.batches.append(batch)
        self.execute(batch)
        self.cm.manager.check_invariants()
        self.step += 1

    def _every_rank_reported(self) -> bool:
        return all(r.worker.get_stats()["transfers_without_result"] == 0 for r in self.ranks)

    def serve(self, requests: list[Request], max_steps: int = 2000) -> None:
        total = len(self.log.finished) + len(requests)
        for r in requests:
            self.arrive(r)
        deadline = time.monotonic() + 60
        while len(self.log.finished) < total:
            assert self.step < max_steps and time.monotonic() < deadline, (
                self.held,
                [r.request_id for r in self.waiting],
            )
            self.loop_once()
            time.sleep(0.001)

    def settle(self) -> None:
        """Writes and copies in flight land (empty iterations, as the loop idles)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            for rank in self.ranks:
                rank.worker.finish_step(WAIT_S, wait_evictions=True)
            self.cm.poll_results()
            s = self.cm.manager.get_stats()
            if not s.inflight_transfers and not s.queued_blocks:
                return
            assert time.monotonic() < deadline, s
            self.loop_once()
            # Writes still ride a step's eviction metadata (as the snapshot's
            # engine sends it): an idle engine sends what is pending on its own.
            meta = self.cm.issue_pending_backup_to_batch_request()
            if meta is not None:
                for rank in self.ranks:
                    rank.worker.submit_swap_tasks(meta, None)

    def close(self) -> None:
        self.preprocess.shutdown(wait=True)
        super().close()

    @property
    def _hasher(self) -> Any:
        from fd_standins import get_request_block_hasher

        return get_request_block_hasher(BS)


def make(
    channel: str, tmp_path: Any, monkeypatch: Any, *, host: int, tp: int
) -> UpstreamEngine:
    monkeypatch.setenv(fdc.STORAGE_DIR_ENV, str(tmp_path / "kv"))
    monkeypatch.setenv(fdc.STORAGE_CAPACITY_ENV, "256")
    fd_config = FDConfig(
        StorageCacheConfig(
            block_size=BS,
            total_block_num=16,
            num_cpu_blocks=host,
            write_policy="write_back",
        ),
        ModelConfig(num_hidden_layers=LAYERS),
        ParallelConfig(tensor_parallel_size=tp),
    )
    # The first lookup waits for the workers' first connection too: a deadline a
    # loaded CI machine cannot miss (the tests are about what comes back).
    cm = FastDeployCacheManager(
        fd_config, channel_name=channel, prefetch_lookup_timeout_s=WAIT_S
    )
    ranks = []
    for r in range(tp):
        worker = FastDeployCacheController(fd_config, r, r, channel_name=channel)
        caches = worker.initialize_kv_cache(AttentionBackend(KV_HEADS, HEAD_DIM, BS), 16)
        ranks.append(Rank(worker, slot_views(caches)))
    return UpstreamEngine(cm, ranks, max_num_batched_tokens=32)


def push_out(engine: UpstreamEngine, target: list[int]) -> None:
    """Other prompts push every block of `target` out of device and host."""
    engine.serve([Request(f"other{i}", prompt(10 + i, 7 * BS), 2) for i in range(6)])
    engine.settle()
    probe = Request("probe", list(target), 1)
    probe.set_block_hasher(engine._hasher)
    engine.cm.match_prefix(probe)  # upstream's default: a probe, nothing pinned
    assert probe.match_result.total_matched_blocks == 0, "still cached; the test needs disk"


@pytest.mark.parametrize("tp", [1, 2])
def test_upstream_order_brings_a_prompt_back_from_disk(
    channel: str, tmp_path: Any, monkeypatch: Any, tp: int
) -> None:
    engine = make(channel, tmp_path, monkeypatch, host=8, tp=tp)
    try:
        cm = engine.cm
        target = prompt(1, 6 * BS)
        engine.serve([Request("first", [*target, 5, 6, 7], 3)])
        engine.settle()  # write_through: its 6 blocks on every rank's disk
        assert cm.manager.get_stats().storage.writes >= 6
        push_out(engine, target)
        engine.calls.clear()
        again = Request("again", [*target, 8, 9], 3)
        engine.serve([again])
        assert engine.calls[0] == "drain -> lookup again"
        assert "prefetch_storage(again) -> True" in engine.calls
        assert engine.calls[-1] == "update_storage_blocks_to_host(again)"
        assert again.match_result.matched_storage_nums == 6
        assert cm.get_stats()["storage_hit_blocks"] == 6
        assert engine.log.reads_checked > 0  # every position read was the right KV
        engine.settle()
        engine.drain()
    finally:
        engine.close()


def test_a_host_tier_smaller_than_the_prefix_serves_what_fits(
    channel: str, tmp_path: Any, monkeypatch: Any
) -> None:
    """2 host blocks, a 6-block prefix on disk: the prefetch loads the first 2
    (host room), the request hits them as storage hits and computes the rest."""
    engine = make(channel, tmp_path, monkeypatch, host=2, tp=1)
    try:
        cm = engine.cm
        target = prompt(2, 6 * BS)
        engine.serve([Request("first", [*target, 5, 6, 7], 3)])
        engine.settle()
        push_out(engine, target)
        assert cm.manager.get_stats().storage.writes >= 6
        again = Request("again", [*target, 8, 9], 3)
        engine.serve([again])
        assert again.match_result.matched_storage_nums == 2
        assert cm.get_stats()["storage_hit_blocks"] == 2
        engine.settle()
        engine.drain()
    finally:
        engine.close()


def test_prefetch_tasks_after_a_cache_reset_carry_the_new_epoch(
    channel: str, tmp_path: Any, monkeypatch: Any
) -> None:
    """After `reset_cache` the manager is in epoch 1: a drained lookup or load
    tagged with epoch 0 would be answered in epoch 0 and dropped as stale, and the
    prefetch would never complete. The disk outlives the reset, so the prompt
    comes back from it."""
    engine = make(channel, tmp_path, monkeypatch, host=8, tp=1)
    try:
        cm = engine.cm
        target = prompt(3, 6 * BS)
        engine.serve([Request("first", [*target, 5, 6, 7], 3)])
        engine.settle()
        assert cm.manager.get_stats().storage.writes >= 6
        engine.drain()
        assert cm.reset_cache()
        assert cm.manager.epoch == 1
        again = Request("again", [*target, 8, 9], 3)
        engine.serve([again])
        assert "prefetch_storage(again) -> True" in engine.calls
        assert again.match_result.matched_storage_nums == 6
        assert cm.get_stats()["results_stale"] == 0
        assert engine.log.reads_checked > 0
        engine.settle()
        engine.drain()
    finally:
        engine.close()
