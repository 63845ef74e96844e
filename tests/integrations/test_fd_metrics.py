"""FastDeploy's cache metric names kept current by the scheduler adapter: in
FastDeploy's own metrics object when it is importable (never double-counting what
ResourceManagerV1 counts itself), else in a prometheus_client registry."""

from __future__ import annotations

import pytest
from fd_standins import Request, install_fake_fastdeploy
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fastkv.integrations.fd_metrics import COUNTERS, GAUGES, FastDeployMetrics

pytest.importorskip("paddle", reason="the workers' CacheController needs paddle")

from fd_engine import BS, make_engine, prompt

SYSTEM = prompt(0, 8)


class Gauge:
    def __init__(self) -> None:
        self.value: float | None = None
        self.sets = 0

    def set(self, value: float) -> None:
        self.value = value
        self.sets += 1


class Counter:
    def __init__(self) -> None:
        self.total = 0.0

    def inc(self, amount: float = 1.0) -> None:
        assert amount >= 0, "a counter only goes up"
        self.total += amount


class MainProcessMetrics:
    """The attributes of FastDeploy's MetricsManager that the cache path touches."""

    def __init__(self) -> None:
        for name in GAUGES:
            setattr(self, name, Gauge())
        for name in (*COUNTERS, "prefix_cache_token_num"):
            setattr(self, name, Counter())


def workload() -> dict[int, list[Request]]:
    """Device and host hits (see test_fd_flows.host_hit_workload)."""
    return {
        0: [Request("a", SYSTEM + prompt(1, 8), 2)],
        4: [Request("b", prompt(2, 24), 2)],
        8: [Request("c", SYSTEM + prompt(1, 8) + prompt(3, 3), 2)],
    }


def expected(engine) -> dict[str, float]:
    mgr = engine.cm.manager
    s = mgr.get_stats()
    free = s.device_pool.free
    return {
        "gpu_cache_usage_perc": 1 - free / engine.cm.num_gpu_blocks,
        "hit_token_rate": s.hit_token_rate,
        "gpu_hit_token_rate": s.device_hit_tokens / s.lookup_tokens,
        "cpu_hit_token_rate": s.host_hit_tokens / s.lookup_tokens,
        "available_gpu_block_num": free + mgr.num_evictable_device_blocks,
        "free_gpu_block_num": free,
        "prefix_gpu_cache_token_num": s.device_hit_tokens,
        "prefix_cpu_cache_token_num": s.host_hit_tokens,
        "prefix_ssd_cache_token_num": 0,
    }


def test_fastdeploys_metrics_object_gets_the_gauges_and_no_double_counts(
    channel: str, monkeypatch
) -> None:
    metrics = MainProcessMetrics()
    install_fake_fastdeploy(monkeypatch, metrics=metrics)
    engine = make_engine(channel, device_blocks=10, host_blocks=16, fd_metrics=metrics)
    try:
        assert engine.cm.metrics.mode == "fastdeploy"
        engine.run(workload())
        engine.drain()
        want = expected(engine)
    finally:
        engine.close()
    for name in GAUGES:
        assert getattr(metrics, name).value == pytest.approx(want[name]), name
        assert getattr(metrics, name).sets >= engine.step  # every schedule
    assert want["cpu_hit_token_rate"] > 0 and want["gpu_hit_token_rate"] > 0
    # ResourceManagerV1 added the matched tokens itself; fastkv added nothing to them
    matched = engine.log.matches
    assert metrics.prefix_gpu_cache_token_num.total == sum(d * BS for d, _ in matched["c"])
    assert metrics.prefix_gpu_cache_token_num.total == want["prefix_gpu_cache_token_num"]
    assert metrics.prefix_cpu_cache_token_num.total == want["prefix_cpu_cache_token_num"]
    assert metrics.prefix_ssd_cache_token_num.total == 0


def test_without_fastdeploy_the_names_are_served_from_a_registry(channel: str) -> None:
    registry = CollectorRegistry()
    engine = make_engine(channel, device_blocks=10, host_blocks=16, registry=registry)
    try:
        assert engine.cm.metrics.mode == "prometheus"
        engine.run(workload())
        engine.drain()
        want = expected(engine)
        text = generate_latest(registry).decode()
    finally:
        engine.close()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    for name in GAUGES:
        assert samples[f"fastdeploy:{name}"] == pytest.approx(want[name]), name
    for name in COUNTERS:
        assert samples[f"fastdeploy:{name}_total"] == want[name], name
    assert want["prefix_cpu_cache_token_num"] > 0


def test_counters_fastdeploy_does_not_count_are_added_by_delta() -> None:
    figures = {name: 0.0 for name in (*GAUGES, *COUNTERS)}
    target = MainProcessMetrics()
    del target.free_gpu_block_num  # an older FastDeploy without it: skipped, logged
    metrics = FastDeployMetrics(
        lambda: figures, fastdeploy_metrics=target, engine_counted=frozenset()
    )
    figures["prefix_gpu_cache_token_num"] = 40
    metrics.update()
    figures["prefix_gpu_cache_token_num"] = 64
    figures["hit_token_rate"] = 0.5
    metrics.update()
    assert target.prefix_gpu_cache_token_num.total == 64
    assert target.hit_token_rate.value == 0.5
    metrics.rebase()  # a new cache manager counts from zero again
    figures["prefix_gpu_cache_token_num"] = 8
    metrics.update()
    assert target.prefix_gpu_cache_token_num.total == 72
    assert FastDeployMetrics(lambda: figures).mode == "off"  # nothing importable, no registry
