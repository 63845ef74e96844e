"""FastDeploy's cache metric names, kept current from fastkv's cache manager.

FastDeploy's dashboards read `fastdeploy:*` families from its own metrics object
(`fastdeploy.metrics.metrics.main_process_metrics`). Its v1 cache path leaves the hit
rates and `free_gpu_block_num` stale (only the legacy PrefixCacheManager set them).
With fastkv in its place:

- when that object is importable, `FastDeployMetrics.update()` sets its gauges and
  adds to its counters (the engine calls it through the scheduler adapter, at the
  end of every schedule and at every finish);
- otherwise the same names are exposed by a prometheus_client collector in a
  registry the caller gives, read when Prometheus scrapes.

Gauges: `gpu_cache_usage_perc` (1 - free / total, tree-held blocks count as used,
as in FastDeploy v1), `hit_token_rate`, `gpu_hit_token_rate`, `cpu_hit_token_rate`
(hit tokens per looked-up prompt token since start; FastDeploy's legacy windows
reset every 10,000 requests), `available_gpu_block_num` (free plus evictable cached
blocks), `free_gpu_block_num`. Counters: `prefix_{gpu,cpu,ssd}_cache_token_num`.
FastDeploy's ResourceManagerV1 already adds matched tokens to the gpu and cpu
counters at every admission, so in its metrics object fastkv adds only to the
ones the engine does not count (`engine_counted`), never twice.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

FASTDEPLOY_METRICS_MODULE = "fastdeploy.metrics.metrics"
PREFIX = "fastdeploy:"
GAUGES = {
    "gpu_cache_usage_perc": "GPU KV-cache usage. 1 means 100 percent usage",
    "hit_token_rate": "Token-level prefix cache hit rate",
    "gpu_hit_token_rate": "Token-level GPU prefix cache hit rate",
    "cpu_hit_token_rate": "Token-level CPU prefix cache hit rate",
    "available_gpu_block_num": "Number of available gpu blocks in cache, including "
    "blocks in LRU list",
    "free_gpu_block_num": "Number of free blocks in cache",
}
COUNTERS = {
    "prefix_gpu_cache_token_num": "Total number of cached tokens on GPU",
    "prefix_cpu_cache_token_num": "Total number of cached tokens on CPU",
    "prefix_ssd_cache_token_num": "Total number of cached tokens on SSD",
}
ENGINE_COUNTED = frozenset({"prefix_gpu_cache_token_num", "prefix_cpu_cache_token_num"})
"""Counters FastDeploy's ResourceManagerV1 increments itself (get_prefix_cached_blocks)."""

Figures = Callable[[], Mapping[str, float]]
"""Returns every name of GAUGES and COUNTERS (without the prefix) -> its value now;
counters as totals since start."""


def fastdeploy_metrics_object() -> Any | None:
    """`fastdeploy.metrics.metrics.main_process_metrics`, or None if not importable."""
    try:
        module = importlib.import_module(FASTDEPLOY_METRICS_MODULE)
        return module.main_process_metrics
    except (ImportError, AttributeError):
        return None


class FastDeployMetrics:
    """Publishes fastkv's figures under FastDeploy's metric names.

    Args:
        figures: see `Figures`.
        registry: where to register the collector when FastDeploy's metrics object
            is not importable (None: export nothing then).
        fastdeploy_metrics: FastDeploy's metrics object to use; by default the one
            importable from fastdeploy, if any.
        engine_counted: counters the engine increments itself (left alone in its
            metrics object).
    """

    def __init__(
        self,
        figures: Figures,
        registry: CollectorRegistry | None = None,
        *,
        fastdeploy_metrics: Any | None = None,
        engine_counted: frozenset[str] = ENGINE_COUNTED,
    ) -> None:
        self._figures = figures
        self.target = (
            fastdeploy_metrics
            if fastdeploy_metrics is not None
            else fastdeploy_metrics_object()
        )
        self._engine_counted = engine_counted
        self._reported: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self._reported_missing: set[str] = set()
        self.collector: _Collector | None = None
        if self.target is None and registry is not None:
            self.collector = _Collector(figures)
            registry.register(self.collector)

    @property
    def mode(self) -> str:
        """'fastdeploy' (its metrics object), 'prometheus' (our collector) or 'off'."""
        if self.target is not None:
            return "fastdeploy"
        return "prometheus" if self.collector is not None else "off"

    def rebase(self) -> None:
        """The figures' counters restarted from zero (a new cache manager): count
        from there."""
        self._reported = dict.fromkeys(COUNTERS, 0.0)

    def update(self) -> None:
        """Push the figures into FastDeploy's metrics object (no-op otherwise).
        A metric missing from that object is logged once and skipped."""
        target = self.target
        if target is None:
            return
        values = self._figures()
        for name in GAUGES:
            metric = self._metric(target, name)
            if metric is not None:
                metric.set(values[name])
        for name in COUNTERS:
            if name in self._engine_counted:
                continue
            delta = values[name] - self._reported[name]
            metric = self._metric(target, name)
            if metric is not None and delta > 0:
                metric.inc(delta)
                self._reported[name] = values[name]

    def _metric(self, target: Any, name: str) -> Any | None:
        metric = getattr(target, name, None)
        if metric is None and name not in self._reported_missing:
            self._reported_missing.add(name)
            log.warning("FastDeploy's metrics object has no %r; not updated", name)
        return metric


class _Collector(Collector):
    def __init__(self, figures: Figures) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Any]:
        values = self._figures()
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=values[name])
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=values[name])


__all__ = [
    "COUNTERS",
    "ENGINE_COUNTED",
    "GAUGES",
    "FastDeployMetrics",
    "fastdeploy_metrics_object",
]
