"""Prometheus metrics for both halves of fastkv (`prometheus_client`).

Counters and gauges are read from `get_stats()` when Prometheus scrapes, by custom
collectors, so the cache's hot paths pay nothing for them; transfer durations are
histograms observed once per transfer. Every family is named `fastkv:*` and labelled
with the model; worker families also carry the tensor-parallel rank.

    registry = CollectorRegistry()
    metrics = CacheMetrics(registry, model="llama-8b")
    metrics.watch_scheduler(manager)                     # the scheduler process
    metrics.watch_workers(lambda: {0: ctrl.get_stats()}) # stats of each rank
    serve_metrics(9400, registry)                        # GET /metrics

Scheduler families (from `CacheStats`):
    fastkv:lookup_tokens_total, fastkv:lookup_blocks_total
    fastkv:cached_tokens_total{cache_source="device"|"host"}  tokens served per tier
    fastkv:hit_token_rate                                   served / looked-up tokens
    fastkv:transfers_total{direction}, fastkv:transferred_blocks_total{direction}
    fastkv:evictions_total{tier}, fastkv:backups_total,
    fastkv:backups_without_room_total, fastkv:backup_retries_total
    fastkv:failed_transfers_total, fastkv:rollback_blocks_total
    fastkv:inflight_transfers, fastkv:inflight_blocks, fastkv:stalled_transfers,
    fastkv:queued_blocks
    fastkv:active_requests, fastkv:cached_blocks
    fastkv:pool_blocks{tier, state="used"|"free"}, fastkv:pool_usage_ratio{tier}
    fastkv:transfer_roundtrip_seconds{direction}  histogram: planned -> result applied
Worker families (from `ControllerStats`, per rank):
    fastkv:worker_transfers_total{direction}, fastkv:worker_transferred_blocks_total,
    fastkv:worker_transferred_bytes_total{direction}, fastkv:worker_failed_transfers_total,
    fastkv:worker_inflight_transfers, fastkv:worker_ordering_waits_total,
    fastkv:worker_cache_bytes{tier}
    fastkv:transfer_duration_seconds{direction}   histogram: launched -> finished
`direction` is "device_to_host" or "host_to_device"; `tier` is "device" or "host".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fastkv.metadata import CacheLevel

D2H, H2D = "device_to_host", "host_to_device"
# Transfers take from tens of microseconds (a few blocks over PCIe) to seconds
# (thousands of blocks, or storage).
DURATION_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def direction(src: CacheLevel, dst: CacheLevel) -> str:
    return f"{src.name.lower()}_to_{dst.name.lower()}"


class CacheMetrics:
    """The fastkv metric families of one process, in `registry`.

    Args:
        registry: where the families are registered (a private CollectorRegistry,
            or prometheus_client.REGISTRY to share the process default).
        model: value of the `model` label.

    Raises:
        ValueError: a family of the same name is already in `registry`.
    """

    def __init__(self, registry: CollectorRegistry, model: str = "default") -> None:
        self.registry = registry
        self.model = model
        self._roundtrip: Histogram | None = None
        self._duration: Histogram | None = None

    def watch_scheduler(self, manager: Any) -> None:
        """Export a `CacheManager`'s stats, and time its transfers (planned to
        applied)."""
        self.registry.register(_SchedulerCollector(manager, self.model))
        self._roundtrip = Histogram(
            "fastkv:transfer_roundtrip_seconds",
            "Time from a transfer being planned (take_swap_metadata) to its result "
            "being applied",
            ["model", "direction"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        roundtrip = self._roundtrip

        def observe(src: CacheLevel, dst: CacheLevel, _: int, seconds: float, __: bool) -> None:
            roundtrip.labels(self.model, direction(src, dst)).observe(seconds)

        manager.add_transfer_listener(observe)

    def watch_workers(self, stats: Callable[[], Mapping[int, Any]]) -> None:
        """Export worker stats: `stats()` returns the latest `ControllerStats` per
        tensor-parallel rank (one entry in a worker process; every rank's where the
        workers report to the scheduler)."""
        self.registry.register(_WorkerCollector(stats, self.model))

    def observe_transfer(
        self, tp_rank: int, src: CacheLevel, dst: CacheLevel, seconds: float
    ) -> None:
        """Record one worker transfer's duration, launch to completion."""
        if self._duration is None:
            self._duration = Histogram(
                "fastkv:transfer_duration_seconds",
                "Worker-side duration of one transfer, launched to finished",
                ["model", "tp_rank", "direction"],
                buckets=DURATION_BUCKETS,
                registry=self.registry,
            )
        self._duration.labels(self.model, str(tp_rank), direction(src, dst)).observe(seconds)


def serve_metrics(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1") -> Any:
    """Serve `registry` at http://addr:port/metrics from a daemon thread.

    Returns:
        The server (its `.server_address` gives the port when `port` is 0).

    Raises:
        ValueError: `port` outside [0, 65535].
        OSError: the port cannot be bound.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: must be an int in [0, 65535], got {port!r}")
    server, _ = start_http_server(port, addr=addr, registry=registry)
    return server


class _SchedulerCollector(Collector):
    def __init__(self, manager: Any, model: str) -> None:
        self._manager = manager
        self._model = model

    def collect(self) -> Iterator[Any]:
        s = self._manager.get_stats()
        model = self._model

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], value)
            return family

        yield counter("fastkv:lookup_tokens", "Prompt tokens looked up", s.lookup_tokens)
        yield counter("fastkv:lookup_blocks", "Prompt blocks looked up", s.lookup_blocks)
        cached = CounterMetricFamily(
            "fastkv:cached_tokens",
            "Prompt tokens served from the cache, by the tier they were found in",
            labels=["model", "cache_source"],
        )
        cached.add_metric([model, "device"], s.device_hit_tokens)
        cached.add_metric([model, "host"], s.host_hit_tokens)
        yield cached
        yield gauge(
            "fastkv:hit_token_rate", "Prompt tokens served / looked up", s.hit_token_rate
        )
        transfers = CounterMetricFamily(
            "fastkv:transfers", "Transfers planned", labels=["model", "direction"]
        )
        transfers.add_metric([model, D2H], s.device_to_host_transfers)
        transfers.add_metric([model, H2D], s.host_to_device_transfers)
        yield transfers
        blocks = CounterMetricFamily(
            "fastkv:transferred_blocks",
            "Blocks in planned transfers",
            labels=["model", "direction"],
        )
        blocks.add_metric([model, D2H], s.device_to_host_blocks)
        blocks.add_metric([model, H2D], s.host_to_device_blocks)
        yield blocks
        evictions = CounterMetricFamily(
            "fastkv:evictions", "Blocks evicted from a tier", labels=["model", "tier"]
        )
        evictions.add_metric([model, "device"], s.device_evictions)
        evictions.add_metric([model, "host"], s.host_evictions)
        yield evictions
        yield counter("fastkv:backups", "Blocks backed up to host", s.backups)
        yield counter(
            "fastkv:backups_without_room",
            "Blocks a write-through policy owed a host copy when no host block was free",
            s.backups_without_room,
        )
        yield counter(
            "fastkv:backup_retries",
            "Owed host copies made when the block was evicted instead",
            s.backup_retries,
        )
        yield counter("fastkv:failed_transfers", "Transfers that failed", s.failed_transfers)
        yield counter(
            "fastkv:rollback_blocks", "Blocks to recompute after failed loads", s.rollbacks
        )
        yield gauge(
            "fastkv:inflight_transfers", "Transfers without a result", s.inflight_transfers
        )
        yield gauge("fastkv:inflight_blocks", "Blocks in those transfers", s.inflight_blocks)
        yield gauge(
            "fastkv:stalled_transfers",
            "Transfers taken but without a result for the manager's stall_after_s",
            s.stalled_transfers,
        )
        yield gauge("fastkv:queued_blocks", "Blocks in planned, untaken swaps", s.queued_blocks)
        yield gauge("fastkv:active_requests", "Requests holding blocks", s.active_requests)
        yield gauge("fastkv:cached_blocks", "Blocks in the prefix tree", s.cached_nodes)
        pool = GaugeMetricFamily(
            "fastkv:pool_blocks", "Blocks per pool and state", labels=["model", "tier", "state"]
        )
        usage = GaugeMetricFamily(
            "fastkv:pool_usage_ratio", "Used / capacity per pool", labels=["model", "tier"]
        )
        for tier, p in (("device", s.device_pool), ("host", s.host_pool)):
            pool.add_metric([model, tier, "used"], p.used)
            pool.add_metric([model, tier, "free"], p.free)
            usage.add_metric([model, tier], p.usage)
        yield pool
        yield usage


class _WorkerCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[int, Any]], model: str) -> None:
        self._stats = stats
        self._model = model

    def collect(self) -> Iterator[Any]:
        per_rank = self._stats()
        labels = ["model", "tp_rank"]
        families = {
            "transfers": CounterMetricFamily(
                "fastkv:worker_transfers", "Transfers launched", labels=[*labels, "direction"]
            ),
            "blocks": CounterMetricFamily(
                "fastkv:worker_transferred_blocks",
                "Blocks in launched transfers",
                labels=[*labels, "direction"],
            ),
            "bytes": CounterMetricFamily(
                "fastkv:worker_transferred_bytes",
                "Bytes in launched transfers",
                labels=[*labels, "direction"],
            ),
            "failed": CounterMetricFamily(
                "fastkv:worker_failed_transfers", "Transfers that failed", labels=labels
            ),
            "inflight": GaugeMetricFamily(
                "fastkv:worker_inflight_transfers", "Transfers still running", labels=labels
            ),
            "waits": CounterMetricFamily(
                "fastkv:worker_ordering_waits",
                "Copies ordered after another copy touching the same blocks",
                labels=labels,
            ),
            "cache": GaugeMetricFamily(
                "fastkv:worker_cache_bytes", "KV cache bytes per tier", labels=[*labels, "tier"]
            ),
        }
        for rank, s in sorted(per_rank.items()):
            key = [self._model, str(rank)]
            for d, transfers, blocks, nbytes in (
                (
                    D2H,
                    s.device_to_host_transfers,
                    s.device_to_host_blocks,
                    s.device_to_host_bytes,
                ),
                (
                    H2D,
                    s.host_to_device_transfers,
                    s.host_to_device_blocks,
                    s.host_to_device_bytes,
                ),
            ):
                families["transfers"].add_metric([*key, d], transfers)
                families["blocks"].add_metric([*key, d], blocks)
                families["bytes"].add_metric([*key, d], nbytes)
            families["failed"].add_metric(key, s.failed_transfers)
            families["inflight"].add_metric(key, s.inflight_transfers)
            families["waits"].add_metric(key, s.ordering_waits)
            families["cache"].add_metric([*key, "device"], s.device_cache_bytes)
            families["cache"].add_metric([*key, "host"], s.host_cache_bytes)
        yield from families.values()


__all__ = ["CacheMetrics", "direction", "serve_metrics"]
