"""Prometheus families of prefill/decode transfers, for either role.

    watch_pd(registry, role="decode", model="m", scheduler=decode_transfers,
             workers=lambda: receivers)            # D: DecodeTransfers, PDReceivers
    watch_pd(registry, role="prefill", model="m", scheduler=prefill_transfers,
             workers=lambda: senders)              # P: PrefillTransfers, PDSenders

Read when Prometheus scrapes (nothing on the transfer path). Every family carries
`model` and `role` ("prefill" or "decode"):

    fastkv:pd_transfers{state}                 gauge: live transfers by state
                                               (P: offered, sending; D: receiving, fencing)
    fastkv:pd_oldest_transfer_age_seconds      gauge
    fastkv:pd_transfer_events_total{event}     P: offered, rejected, settled, send_failed,
                                               expired; D: accepted, rejected, committed,
                                               failed, expired, aborted
    fastkv:pd_notices_dropped_total{reason}    P: stale, duplicate reports; D: the
                                               scheduler's stale_epoch, unknown, duplicate,
                                               late reports and the workers' forged,
                                               duplicate, stale, unknown, late notices
                                               (final or progress), bad_checksum and
                                               checksum_mismatch (P's and D's checksum
                                               settings differ)
    fastkv:pd_layers_verified_early_total      D: layers verified on a progress notice
    fastkv:pd_bytes_total{direction}           P: sent (handed to the transport);
                                               D: received (verified)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fastkv.pd.decode import DecodeTransfers, DState
from fastkv.pd.prefill import PrefillTransfers, PState
from fastkv.pd.receiver import NOT_DROPS, PDReceiver


def watch_pd(
    registry: CollectorRegistry,
    *,
    role: str,
    scheduler: DecodeTransfers | PrefillTransfers,
    workers: Callable[[], Iterable[Any]] = tuple,
    model: str = "default",
) -> None:
    """Export one role's PD families from its scheduler half and its ranks' worker
    halves (`PDSender`s on P, `PDReceiver`s on D; those of this process).

    Raises:
        ValueError: `role` is not "prefill" or "decode", or does not match
            `scheduler`; a family of the same name is already in `registry`."""
    want = {"decode": DecodeTransfers, "prefill": PrefillTransfers}.get(role)
    if want is None or not isinstance(scheduler, want):
        raise ValueError(f"role: {role!r} must be 'prefill' or 'decode', matching scheduler")
    registry.register(_PDCollector(role, model, scheduler, workers))


class _PDCollector(Collector):
    def __init__(
        self,
        role: str,
        model: str,
        scheduler: DecodeTransfers | PrefillTransfers,
        workers: Callable[[], Iterable[Any]],
    ) -> None:
        self._role = role
        self._model = model
        self._scheduler = scheduler
        self._workers = workers

    def _family(self, kind: type, name: str, doc: str, label: str | None) -> Any:
        labels = ["model", "role"] + ([label] if label else [])
        return kind(name, doc, labels=labels)

    def collect(self) -> Iterator[Any]:
        sched, base = self._scheduler, [self._model, self._role]
        workers = list(self._workers())
        states = self._family(
            GaugeMetricFamily, "fastkv:pd_transfers", "Live transfers", "state"
        )
        for state in DState if isinstance(sched, DecodeTransfers) else PState:
            states.add_metric(
                [*base, state.value],
                sched.num_transfers(state)
                if isinstance(sched, DecodeTransfers)
                else sched.num_sends(state),
            )
        yield states
        age = self._family(
            GaugeMetricFamily,
            "fastkv:pd_oldest_transfer_age_seconds",
            "Oldest live transfer",
            None,
        )
        age.add_metric(base, sched.oldest_age_s())
        yield age
        counters = asdict(sched.counters)
        dropped_names = ("stale_epoch", "unknown", "duplicate", "late", "stale")
        events = self._family(
            CounterMetricFamily, "fastkv:pd_transfer_events", "Transfer events", "event"
        )
        for name, value in counters.items():
            if name not in dropped_names and name != "released_blocks":
                events.add_metric([*base, name], value)
        yield events
        dropped: dict[str, int] = {n: v for n, v in counters.items() if n in dropped_names}
        receivers = [w for w in workers if isinstance(w, PDReceiver)]  # senders drop none
        for w in receivers:
            for name, value in asdict(w.counters).items():
                if name not in NOT_DROPS:
                    dropped[name] = dropped.get(name, 0) + value
        drops = self._family(
            CounterMetricFamily,
            "fastkv:pd_notices_dropped",
            "Reports and notices dropped",
            "reason",
        )
        for name, value in dropped.items():
            drops.add_metric([*base, name], value)
        yield drops
        if self._role == "decode":
            early = self._family(
                CounterMetricFamily,
                "fastkv:pd_layers_verified_early",
                "Layers verified on a progress notice, before the final notice",
                None,
            )
            early.add_metric(base, sum(w.counters.layers_early for w in receivers))
            yield early
        nbytes = self._family(
            CounterMetricFamily, "fastkv:pd_bytes", "KV bytes moved", "direction"
        )
        if self._role == "prefill":
            nbytes.add_metric([*base, "sent"], sum(w.bytes_sent for w in workers))
        else:
            nbytes.add_metric([*base, "received"], sum(w.bytes_received for w in workers))
        yield nbytes


__all__ = ["watch_pd"]
