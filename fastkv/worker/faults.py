"""Fault injection for the worker's copies: a fraction of copy calls fail before they
touch memory, as a failed DMA would be reported. Engines and tests use it to prove
that a failed transfer is recomputed, never served."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class InjectedCopyError(RuntimeError):
    """A copy failed on purpose (fault injection)."""


class FaultInjector:
    """Fails a `rate` fraction of the calls it wraps, spread evenly: call n (from 1)
    fails when floor(n * rate) steps up, so runs are reproducible.

    Args:
        rate: fraction of calls to fail, in [0, 1].

    Raises:
        ValueError: `rate` out of range.
    """

    def __init__(self, rate: float) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"fail_rate: must be a number in [0, 1], got {rate!r}")
        self.rate = float(rate)
        self.calls = 0
        self.failures = 0
        self._lock = threading.Lock()  # copies run on several stream threads

    def wrap(self, fn: Callable[P, R]) -> Callable[P, R]:
        if not self.rate:
            return fn

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            with self._lock:
                self.calls += 1
                n = self.calls
                fail = int(n * self.rate) > int((n - 1) * self.rate)
                self.failures += fail
            if fail:
                raise InjectedCopyError(f"injected copy failure (call {n})")
            return fn(*args, **kwargs)

        return call
