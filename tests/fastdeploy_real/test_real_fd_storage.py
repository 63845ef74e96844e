"""Storage behind FastDeploy, on its real scheduler, batches and token processor,
with fastkv's local disk backend on every rank (`kvcache_storage_backend="file"`,
`$FASTKV_STORAGE_DIR`).

A prompt is computed, written to disk (FastDeploy's `write_cache_to_storage` at
finish, write_through), pushed out of device and host by other prompts, then
prefetched back as FastDeploy's newer v1 engine does (`prefetch_storage`, steps
until `drain_pending_prefetches` names it, then admission): its blocks come
storage -> host -> device, the runner reads every one of them and finds the KV its
prefix determines (zero mismatches), FastDeploy's ssd-hit metric counts them, and
nothing leaks.
"""

from __future__ import annotations

import pickle
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from real_fd_config import BLOCK_SIZE, build_fd_config
from real_fd_engine import AllocationSpy, Engine
from real_fd_model import prompt

from fastkv.integrations import fd_config as fdc

BS = BLOCK_SIZE
DRAIN_S = 20.0


class StorageEngine(Engine):
    """The engine loop with FastDeploy's newer storage-prefetch calls in PR
    #7529's order: `prefetch_storage` on a preprocess pool (the request is held
    meanwhile), `drain_pending_prefetches` every iteration with each task's
    metadata pickled to every runner (the engine-worker queue), and
    `update_storage_blocks_to_host` once every rank reported. Steps are
    ResourceManagerV1's as shipped (an empty batch sends nothing); only `flush`
    sends pending writes on an idle engine's empty steps."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.preprocess = ThreadPoolExecutor(4)
        self.loads: list[Any] = []  # tasks sent, not every rank reported yet

    def dispatch(self) -> None:
        """The prefetch part of one engine-loop iteration."""
        cm = self.cache_manager
        for task in cm.drain_pending_prefetches():
            blob = pickle.dumps(task.metadata)
            for runner in self.runners:
                runner.receive_storage(blob)
            if task.host_block_ids:
                self.loads.append(task)
        if self.loads and self._every_rank_reported():
            for task in self.loads:
                cm.update_storage_blocks_to_host(task.host_block_ids)
            self.loads = []

    def _every_rank_reported(self) -> bool:
        return all(
            r.cache_controller.get_stats()["transfers_without_result"] == 0
            for r in self.runners
        )

    def loop(self) -> None:
        self.dispatch()
        self.step()

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.rm.requests and not self.rm.waiting:
                return
            self.loop()
        raise AssertionError(f"not finished after {max_steps} steps")

    def flush(self, timeout: float = DRAIN_S) -> None:
        """Idle iterations until no copy, write or lookup is queued or in flight
        (an idle engine sends pending writes on its empty steps)."""
        cm = self.cache_manager
        deadline = time.monotonic() + timeout
        while True:
            self.loop()
            meta = cm.issue_pending_backup_to_batch_request()
            if meta is not None:
                from fastdeploy.engine.request import BatchRequest

                only = BatchRequest()
                only.append_evict_metadata([meta])
                blob = pickle.dumps([(only, self.rm.real_bsz)])
                for runner in self.runners:
                    runner.receive(blob)
            time.sleep(0.002)
            s = cm.get_stats()
            workers = sum(
                r.cache_controller.get_stats()["transfers_without_result"] for r in self.runners
            )
            busy = s["inflight_transfers"] or s["queued_blocks"] or s["pending_prefetches"]
            if not busy and not workers and not self.loads:
                return
            assert time.monotonic() < deadline, f"storage work still pending: {s}"

    def prefetch(self, request: Any) -> Future[bool]:
        """`prefetch_storage` on the preprocess pool (as `apply_async_preprocess`)."""
        return self.preprocess.submit(self.cache_manager.prefetch_storage, request)

    def add_prefetched(self, request_id: str, tokens: list[int], max_tokens: int) -> Any:
        """Prefetch on the preprocess pool while the loop runs; hand the request
        to ResourceManagerV1 once its prefetch answered and its loads reported."""
        request = self.held_request(request_id, tokens, max_tokens)
        future = self.prefetch(request)
        deadline = time.monotonic() + DRAIN_S
        while True:
            answered = future.done()  # its loads were queued before it answered
            self.loop()  # ... so this drains them
            if answered and not self.loads:
                break
            assert time.monotonic() < deadline, f"{request_id}: prefetch never settled"
            time.sleep(0.002)
        future.result()
        self.rm.add_request(request)
        return request

    def held_request(self, request_id: str, tokens: list[int], max_tokens: int) -> Any:
        """The Request `add_request` makes, not handed to ResourceManagerV1 yet."""
        captured: list[Any] = []
        real_add = self.rm.add_request
        self.rm.add_request = captured.append  # type: ignore[method-assign]
        try:
            self.add_request(request_id, tokens, max_tokens)
        finally:
            self.rm.add_request = real_add  # type: ignore[method-assign]
        (request,) = captured
        return request

    def close(self) -> None:
        self.preprocess.shutdown(wait=True)
        super().close()


def make_storage_engine(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **config: Any
) -> StorageEngine:
    monkeypatch.setenv(fdc.STORAGE_DIR_ENV, str(tmp_path / "kv"))
    monkeypatch.setenv(fdc.STORAGE_CAPACITY_ENV, "256")  # every block written stays
    fd_config = build_fd_config(model_dir, **config)
    # What `--kvcache-storage-backend file` sets (EngineArgs checks it needs prefix
    # caching and the v1 scheduler; both are on here).
    fd_config.cache_config.kvcache_storage_backend = "file"
    engine = StorageEngine(fd_config)
    # A fresh engine's first lookup also waits for each worker's first connection
    # to the results channel; on a loaded 2-core machine that passed the 2 s
    # default once in ~10 runs (the prefetch then answers False: a miss, not wrong
    # KV). These tests are about what the prefetch brings back, not its deadline.
    engine.cache_manager.prefetch_lookup_timeout_s = 20.0
    return engine


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_evicted_from_device_and_host_comes_back_from_disk(
    installed: list[str],
    model_dir: Path,
    channel: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tp: int,
) -> None:
    engine = make_storage_engine(
        model_dir,
        tmp_path,
        monkeypatch,
        num_gpu_blocks=16,
        num_cpu_blocks=4,
        tensor_parallel_size=tp,
    )
    try:
        cm = engine.cache_manager
        assert cm.enable_storage
        target = prompt(1, 4 * BS)
        engine.add_request("first", target + prompt(2, 3), max_tokens=3)
        engine.run()
        engine.flush()  # its blocks: device -> host -> disk (write_through)
        assert cm.manager.get_stats().storage.writes >= 4, cm.manager.get_stats().storage
        # Other prompts push every block of `target` out of device and host.
        for i in range(6):
            engine.add_request(f"other{i}", prompt(10 + i, 5 * BS), max_tokens=2)
            engine.run()
        engine.flush()
        probe = _hashes(engine, target)
        assert not any(cm.manager.tree.contains(h) for h in probe), (
            "the target prompt is still cached; the test needs it on disk only"
        )
        ssd_before = _ssd_tokens()
        request = engine.add_prefetched("again", target + prompt(3, 5), max_tokens=3)
        engine.run()
        assert request.match_result.matched_storage_nums == 4, request.match_result
        assert engine.log.cached_tokens["again"] == 4 * BS
        # ResourceManagerV1's own per-request field for storage hits
        assert request.metrics.storage_cache_token_num == 4 * BS
        assert (request.metrics.gpu_cache_token_num, request.metrics.cpu_cache_token_num) == (
            0,
            0,
        )
        assert _ssd_tokens() - ssd_before == 4 * BS  # FastDeploy's own counter
        assert cm.get_stats()["storage_hit_blocks"] == 4
        engine.check_clean()  # zero mismatches: the runner read all 4 blocks back
    finally:
        engine.close()


def test_a_host_tier_smaller_than_the_prefix_serves_what_fits(
    installed: list[str],
    model_dir: Path,
    channel: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 6-block prompt on disk (written by an engine with room), read back after
    a restart by an engine whose host tier holds 2 blocks: the prefetch loads
    the first 2, the request hits them from storage and computes the rest, and
    every KV position read is right."""
    target = prompt(4, 6 * BS)
    writer = make_storage_engine(
        model_dir, tmp_path, monkeypatch, num_gpu_blocks=16, num_cpu_blocks=8
    )
    try:
        writer.add_request("first", target + prompt(5, 3), max_tokens=3)
        writer.run()
        writer.flush()
        assert writer.cache_manager.manager.get_stats().storage.writes >= 6
    finally:
        writer.close()
    engine = make_storage_engine(
        model_dir, tmp_path, monkeypatch, num_gpu_blocks=16, num_cpu_blocks=2
    )
    try:
        request = engine.add_prefetched("again", target + prompt(6, 5), max_tokens=3)
        engine.run()
        assert request.match_result.matched_storage_nums == 2, request.match_result
        assert request.metrics.storage_cache_token_num == 2 * BS
        assert engine.cache_manager.get_stats()["storage_hit_blocks"] == 2
        engine.flush()
        engine.check_clean()
    finally:
        engine.close()


def test_match_prefix_by_default_is_a_probe_that_pins_nothing(
    installed: list[str],
    model_dir: Path,
    channel: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Upstream's newer default (`skip_storage=False`): what is cached now, nothing
    locked, nothing registered, nothing looked up; ResourceManagerV1's own call
    (`True`) still locks, so its allocation stays exact."""
    engine = make_storage_engine(
        model_dir, tmp_path, monkeypatch, num_gpu_blocks=16, num_cpu_blocks=4
    )
    try:
        cm = engine.cache_manager
        body = prompt(7, 3 * BS + 1)
        engine.add_request("first", body, max_tokens=1)
        engine.run()
        request = engine.held_request("probe", body, max_tokens=1)
        free = cm.num_free_device_blocks
        cm.match_prefix(request)
        assert request.match_result.matched_device_nums == 3
        assert cm.num_free_device_blocks == free
        assert cm.manager.get_stats().active_requests == 0
        assert cm.drain_pending_prefetches() == []
        engine.rm.add_request(request)
        engine.run()
        assert engine.log.cached_tokens["probe"] == 3 * BS
        engine.flush()
        engine.check_no_leaks()
    finally:
        engine.close()


@pytest.mark.parametrize("storage_policy", ["write_through", "on_host_eviction", "after_hits"])
def test_random_load_with_storage_on_crowded_tiers(
    installed: list[str],
    model_dir: Path,
    channel: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    storage_policy: str,
) -> None:
    """Seeded arrivals sharing a few prefixes, on device and host tiers small
    enough that blocks leave both; most requests are prefetched from storage first
    (held until drained), the others go straight in. Zero KV mismatches, every
    request finished, no leak, blocks loaded back from disk, and no yes from
    `can_allocate_gpu_blocks` followed by a short allocation."""
    monkeypatch.setenv(fdc.STORAGE_WRITE_POLICY_ENV, storage_policy)
    engine = make_storage_engine(
        model_dir,
        tmp_path,
        monkeypatch,
        num_gpu_blocks=12,
        num_cpu_blocks=3,
        write_policy="write_back",
        max_model_len=80,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    try:
        spy = AllocationSpy()
        spy.install(engine.cache_manager)
        cm, rm = engine.cache_manager, engine.rm
        rng = random.Random(5)
        heads = [prompt(500 + i, rng.randrange(2, 5) * BS) for i in range(4)]
        pending = []
        for i in range(36):
            tail = prompt(5000 + i, rng.randrange(1, 2 * BS))
            body = (rng.choice(heads) + tail)[: 6 * BS]
            pending.append((f"st-{i}", body, rng.randrange(1, 2 * BS), rng.random() < 0.75))
        held: dict[str, tuple[Any, Future[bool]]] = {}
        steps = 0

        def drain() -> None:
            # The engine idles until the copies and writes it sent have landed, so
            # what a prefetch looks up is on disk however slow the machine is
            # (draining only every 20 steps left it to timing: under load, no
            # lookup found anything in two CI runs).
            # Copies no batch took leave with the drained tasks (the engine loop's
            # dispatch), so what is queued goes too.
            deadline = time.monotonic() + DRAIN_S
            while time.monotonic() < deadline:
                stats = cm.get_stats()
                if not (stats["inflight_transfers"] or stats["queued_blocks"]):
                    break
                engine.dispatch()
                engine.idle(0.01)

        while pending or held or rm.requests or rm.waiting:
            if pending and rng.random() < 0.3:
                rid, body, max_tokens, prefetch = pending.pop(0)
                request = engine.held_request(rid, body, max_tokens)
                if prefetch:
                    drain()
                    held[rid] = (request, engine.prefetch(request))
                else:
                    rm.add_request(request)
            answered = [rid for rid, (_, future) in held.items() if future.done()]
            engine.dispatch()  # drains what the answered prefetches queued
            if not engine.loads:
                for rid in answered:
                    request, future = held.pop(rid)
                    future.result()
                    rm.add_request(request)
            engine.step()
            steps += 1
            if steps % 20 == 0:
                drain()
            assert steps < 4000, f"not done: held {list(held)}, {cm.get_stats()}"
        engine.flush()
        assert spy.asked and spy.allocations
        assert not spy.yes_then_short, spy.yes_then_short[:10]
        # Blocks came back from disk (whether a request still finds them in host
        # at its match depends on how long it waits behind others: the
        # deterministic count is in the tests above).
        tier = cm.manager.get_stats().storage
        assert cm.get_stats()["prefetches"] and tier.writes and tier.hit_blocks, tier
        engine.check_clean()
    finally:
        engine.close()


def _ssd_tokens() -> float:
    """FastDeploy's `prefix_ssd_cache_token_num` counter, read as Prometheus does."""
    from fastdeploy.metrics.metrics import main_process_metrics

    (family,) = main_process_metrics.prefix_ssd_cache_token_num.collect()
    return next(s.value for s in family.samples if s.name.endswith("_total"))


def _hashes(engine: Engine, tokens: list[int]) -> list[str]:
    from fastdeploy.engine.request import Request
    from fastdeploy.engine.sampling_params import SamplingParams

    r = Request(
        request_id="hash-probe",
        prompt_token_ids=list(tokens),
        prompt_token_ids_len=len(tokens),
        sampling_params=SamplingParams(max_tokens=1),
    )
    r.set_block_hasher(engine.block_hasher)
    return list(r.prompt_hashes)
