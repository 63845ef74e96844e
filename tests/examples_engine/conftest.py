"""Helpers shared by the engine tests."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_metrics(url: str) -> Samples:
    """GET a /metrics endpoint over HTTP and parse it: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; KeyError naming it when the scrape lacks it."""
    key = (name, frozenset(labels.items()))
    if key not in samples:
        raise KeyError(f"{name}{labels} not in the scrape")
    return samples[key]


@pytest.fixture
def scrape() -> Callable[[str], Samples]:
    return scrape_metrics
