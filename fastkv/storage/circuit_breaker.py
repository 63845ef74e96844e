"""A circuit breaker for a backend whose calls all depend on one remote service
(Mooncake's master): once a call sees that service fail, further calls fail fast
instead of each waiting out its deadline, and a single probe call now and then
finds out when the service is back.

States: closed (calls go through), open (they fail fast until the cooldown has
passed), half-open (one probe goes through; every other call still fails fast).
The probe's success closes the breaker and resets the cooldown; its failure
reopens it with the cooldown doubled, up to `max_cooldown_s`. The breaker learns
only from the outcomes its owner records: it never calls anything itself.

A failure of one part of the service (a Mooncake storage node, holding some of
the keys) must not stop the calls the rest still answers: `KeyQuarantine` holds
back just the keys that met it, for a while, and the breaker stays closed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence


class CircuitBreaker:
    """Closed: calls go through. Open: they fail fast. After the cooldown one probe
    call goes through; its success closes the breaker, its failure reopens it with
    twice the cooldown (at most `max_cooldown_s`, so recovery is never later than
    that after the failure ends, plus the probe)."""

    def __init__(self, cooldown_s: float, max_cooldown_s: float = 4.0) -> None:
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max(cooldown_s, max_cooldown_s)
        self._cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._open_until: float | None = None
        self._probing = False
        self.reason = ""
        self.trips = 0

    @property
    def cooldown_s(self) -> float:
        """The current cooldown (doubles while probes fail)."""
        with self._lock:
            return self._cooldown_s

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None

    def allow(self) -> bool:
        """May a call go to Mooncake now? (True for the one probe when half-open.)"""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or time.monotonic() < self._open_until:
                return False
            self._probing = True
            return True

    def record(self, fatal: str | None) -> None:
        """The outcome of an allowed call: None if it saw no fatal code."""
        with self._lock:
            was_probe = self._probing
            self._probing = False
            if fatal is None:
                if was_probe or self._open_until is None:
                    self._open_until = None
                    self._cooldown_s = self.base_cooldown_s
                return
            if self._open_until is not None and was_probe:
                self._cooldown_s = min(self._cooldown_s * 2, self.max_cooldown_s)
            if self._open_until is None:
                self.trips += 1
            self._open_until = time.monotonic() + self._cooldown_s
            self.reason = fatal


class KeyQuarantine:
    """Keys not to ask for `hold_s` after a call for them met a failing part of the
    service. At most `max_keys` are held; past that the oldest holds end early.

    Args:
        hold_s: how long a key is held back.
        why: what happened to a held key, the start of the reason `reasons` gives.
        max_keys: the most keys held at once.
    """

    def __init__(self, hold_s: float, why: str, max_keys: int = 65536) -> None:
        self.hold_s = hold_s
        self.why = why
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._until: OrderedDict[str, float] = OrderedDict()  # name -> held until

    def reasons(self, names: Sequence[str]) -> list[str | None]:
        """Per name: why it is not to be asked now, or None (a hold that has
        ended is forgotten)."""
        if not self._until:  # nothing held (the usual case): no lock, no lookups
            return [None] * len(names)
        now = time.monotonic()
        out: list[str | None] = []
        with self._lock:
            for name in names:
                until = self._until.get(name)
                if until is not None and until <= now:
                    del self._until[name]
                    until = None
                out.append(
                    None
                    if until is None
                    else f"{self.why}; not asked again for {until - now:.1f} s"
                )
        return out

    def hold(self, names: Sequence[str]) -> None:
        """Holds these names back for `hold_s` from now."""
        until = time.monotonic() + self.hold_s
        with self._lock:
            for name in names:
                self._until[name] = until
                self._until.move_to_end(name)
            while len(self._until) > self.max_keys:
                self._until.popitem(last=False)


__all__ = ["CircuitBreaker", "KeyQuarantine"]
