"""The example engine with tensor parallelism: several worker ranks, each holding a
share of the KV heads and exchanging attention outputs every layer, fed the same
steps by one scheduler. Outputs equal the single rank's bit for bit, a copy failing
on one rank only is recomputed by every rank, a dead rank fails the run instead of
hanging, and the scheduler serves the whole engine's metrics over HTTP."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from examples.engine.config import MODEL_ID, EngineConfig
from examples.engine.demo import compare, main
from examples.engine.scheduler import EngineScheduler, RunResult
from examples.engine.workload import ConversationSpec, MultiTurnChat
from fastkv.metrics import CacheMetrics, serve_metrics
from tests.examples_engine.conftest import sample, scrape_metrics

SMALL = ConversationSpec(conversations=5, turns=3, new_tokens=6, system_prompts=2)
CONFIG = EngineConfig(num_device_blocks=64, num_host_blocks=512, device="cpu")


def run(config: EngineConfig, **kwargs) -> RunResult:
    return EngineScheduler(config, **kwargs).run(MultiTurnChat(SMALL))


@pytest.fixture(scope="module")
def one_rank() -> RunResult:
    return run(CONFIG)


@pytest.fixture(scope="module")
def failing_rank_with_metrics():
    """tp=2 with copy failures on rank 1 only, metrics served on a free port and
    scraped over HTTP during the run (after step 5) and after it."""
    registry = CollectorRegistry()
    server = serve_metrics(0, registry)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    during = []
    config = dataclasses.replace(CONFIG, tp_size=2, fail_rate=0.25, fail_rank=1)
    scheduler = EngineScheduler(
        config,
        on_step=lambda *_: during.append(scrape_metrics(url)) if len(during) < 1 else None,
        metrics=CacheMetrics(registry, model=MODEL_ID),
    )
    try:
        result = scheduler.run(MultiTurnChat(SMALL))
        yield result, scheduler, during, scrape_metrics(url)
    finally:
        server.shutdown()
        server.server_close()


def test_two_ranks_give_the_single_rank_outputs_and_savings(one_rank: RunResult) -> None:
    two = run(dataclasses.replace(CONFIG, tp_size=2))
    cmp = compare(two, one_rank)
    assert cmp.identical_outputs, cmp
    assert cmp.bitwise_logits == cmp.requests == SMALL.conversations * SMALL.turns
    assert not two.rank_mismatches and not two.checksum_mismatches
    # One scheduler decides once: the same hits, the same prefill saved.
    assert two.computed_prompt_tokens == one_rank.computed_prompt_tokens
    assert two.saved_frac == one_rank.saved_frac > 0
    assert (two.device_hit_tokens, two.host_hit_tokens) == (
        one_rank.device_hit_tokens,
        one_rank.host_hit_tokens,
    )
    assert two.host_hit_tokens > 0 and two.worker.host_to_device_blocks > 0
    # Every rank moves every block, each its half of the heads' bytes.
    assert len(two.workers) == 2
    for rank in two.workers:
        assert rank.device_to_host_blocks == one_rank.worker.device_to_host_blocks
        assert 2 * rank.device_to_host_bytes == one_rank.worker.device_to_host_bytes
        assert 2 * rank.device_cache_bytes == one_rank.worker.device_cache_bytes
        assert rank.checksums_verified == one_rank.worker.checksums_verified > 0
    assert two.worker.host_to_device_bytes == one_rank.worker.host_to_device_bytes


def test_a_copy_failing_on_one_rank_is_recomputed_by_every_rank(
    one_rank: RunResult, failing_rank_with_metrics
) -> None:
    result, *_ = failing_rank_with_metrics
    cmp = compare(result, one_rank)
    assert cmp.identical_outputs, cmp
    assert cmp.bitwise_logits == cmp.requests
    assert not result.rank_mismatches and not result.checksum_mismatches
    assert result.workers[0].failed_transfers == 0 < result.workers[1].failed_transfers
    # Combined with RankResults: a transfer failed when rank 1's copy did.
    assert result.cache.failed_transfers == result.workers[1].failed_transfers
    assert result.rollbacks > 0 and result.recomputed_tokens > 0
    assert result.cache.inflight_transfers == 0  # every rank reported every transfer
    assert result.cache.active_requests == 0


def test_the_scheduler_serves_the_whole_engines_metrics(failing_rank_with_metrics) -> None:
    result, scheduler, during, after = failing_rank_with_metrics
    model = MODEL_ID
    assert during, "no scrape during the run"
    for rank in ("0", "1"):  # worker families were there while it ran
        sample(during[0], "fastkv:worker_cache_bytes", model=model, tp_rank=rank, tier="device")
    assert sample(during[0], "fastkv:lookup_tokens_total", model=model) <= sample(
        after, "fastkv:lookup_tokens_total", model=model
    )

    stats = scheduler.mgr.get_stats()
    assert stats == result.cache
    for name, value in (
        ("fastkv:lookup_tokens_total", stats.lookup_tokens),
        ("fastkv:lookup_blocks_total", stats.lookup_blocks),
        ("fastkv:failed_transfers_total", stats.failed_transfers),
        ("fastkv:rollback_blocks_total", stats.rollbacks),
        ("fastkv:cached_blocks", stats.cached_nodes),
        ("fastkv:inflight_transfers", stats.inflight_transfers),
    ):
        assert sample(after, name, model=model) == value, name
    assert sample(after, "fastkv:cached_tokens_total", model=model, cache_source="device") == (
        stats.device_hit_tokens
    )
    assert sample(after, "fastkv:cached_tokens_total", model=model, cache_source="host") == (
        stats.host_hit_tokens
    )
    assert stats.device_hit_tokens == result.device_hit_tokens > 0
    for tier, pool in (("device", stats.device_pool), ("host", stats.host_pool)):
        for state in ("used", "free"):
            assert sample(
                after, "fastkv:pool_blocks", model=model, tier=tier, state=state
            ) == getattr(pool, state)

    for rank, w in enumerate(result.workers):
        labels = {"model": model, "tp_rank": str(rank)}
        for direction in ("device_to_host", "host_to_device"):
            for name, field in (
                ("fastkv:worker_transfers_total", "transfers"),
                ("fastkv:worker_transferred_blocks_total", "blocks"),
                ("fastkv:worker_transferred_bytes_total", "bytes"),
            ):
                expected = getattr(w, f"{direction}_{field}")
                assert sample(after, name, direction=direction, **labels) == expected, name
            # Each transfer the rank launched was timed and forwarded once.
            assert sample(
                after, "fastkv:transfer_duration_seconds_count", direction=direction, **labels
            ) == getattr(w, f"{direction}_transfers")
        assert sample(after, "fastkv:worker_failed_transfers_total", **labels) == (
            w.failed_transfers
        )
        assert sample(after, "fastkv:worker_cache_bytes", tier="host", **labels) == (
            w.host_cache_bytes
        )
    assert sample(after, "fastkv:worker_failed_transfers_total", model=model, tp_rank="1") > 0


def test_a_rank_that_dies_fails_the_run_with_its_error() -> None:
    scheduler: EngineScheduler

    def kill_rank_1(done: int, total: int) -> None:
        if scheduler.procs[1].is_alive():
            scheduler.procs[1].kill()

    scheduler = EngineScheduler(dataclasses.replace(CONFIG, tp_size=2), on_step=kill_rank_1)
    with pytest.raises(RuntimeError, match=r"rank 1: the worker process exited \(code -9\)"):
        scheduler.run(MultiTurnChat(SMALL))
    assert not any(p.is_alive() for p in scheduler.procs)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tp_size": 3}, r"tp_size: 3 does not divide .* allowed: 1, 2"),
        ({"tp_size": 0}, r"tp_size: must be an int >= 1"),
        ({"tp_size": True}, r"tp_size: must be an int >= 1"),
        ({"tp_size": 2, "fail_rank": 2}, r"fail_rank: must be an int in \[0, 2\)"),
        ({"fail_rank": -1}, r"fail_rank: must be an int in \[0, 1\)"),
        ({"fail_rate": 1.5}, r"fail_rate: must be a number in \[0, 1\]"),
    ],
)
def test_bad_tensor_parallel_settings_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **changes)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "3"], "--tp: 3 does not divide the model's 4 attention heads"),
        (["--tp", "0"], "--tp: must be an int >= 1, got 0"),
        (["--tp", "two"], "argument --tp: invalid int value"),
        (["--tp", "2", "--fail-rank", "2"], "--fail-rank: must be an int in [0, 2)"),
    ],
)
def test_the_demo_refuses_bad_tp_flags_with_a_clear_error(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--no-progress"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
