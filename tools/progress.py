"""A dependency-free progress bar for long runs, drawn on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    """Redraws at most every `interval` seconds, and only every `check_every`
    updates does it read the clock, so it stays off hot paths.

    The estimate of the time left comes from the rate since the first clock reading
    that saw units done, so start-up (spawning workers, importing paddle) does not
    count as work; until a later reading has seen more units done, the bar shows no
    estimate ("eta      -").

    Args:
        total: number of units expected.
        label: text before the bar.
        enabled: False turns every call into a no-op (e.g. for --json runs).
        stream: where to draw; stderr by default.
        interval: least seconds between redraws.
        check_every: updates between clock readings.
        clock: seconds, monotonic; time.monotonic by default.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.2,
        check_every: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self.check_every = check_every
        self.done = 0
        self.postfix = ""
        self._clock = clock
        self._start = clock()
        self._last_draw = 0.0
        self._since_check = 0
        self._rate_from: tuple[float, int] | None = None  # (time, units done) then

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self.done += n
        if postfix is not None:
            self.postfix = postfix
        if not self.enabled:
            return
        self._since_check += 1
        if self._since_check < self.check_every and self.done < self.total:
            return
        self._since_check = 0
        now = self._clock()
        if self._rate_from is None and self.done > 0:
            self._rate_from = (now, self.done)
        if now - self._last_draw >= self.interval or self.done >= self.total:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._draw(self._clock())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 30
        filled = int(frac * width)
        elapsed = now - self._start
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} "
            f"{elapsed:5.1f}s eta {self._eta(now)} {self.postfix}"
        )
        self.stream.flush()

    def _eta(self, now: float) -> str:
        """Seconds left at the rate measured since `_rate_from`, or "     -" while
        there is no such rate yet."""
        left = self.total - self.done
        if left <= 0:
            return f"{0.0:5.1f}s"
        if self._rate_from is None:
            return "     -"
        since, done_then = self._rate_from
        if self.done <= done_then or now <= since:
            return "     -"
        rate = (self.done - done_then) / (now - since)
        return f"{left / rate:5.1f}s"
