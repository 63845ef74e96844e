"""A dependency-free progress bar for long runs, drawn on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Redraws at most every `interval` seconds, and only every `check_every`
    updates does it read the clock, so it stays off hot paths.

    Args:
        total: number of units expected.
        label: text before the bar.
        enabled: False turns every call into a no-op (e.g. for --json runs).
        stream: where to draw; stderr by default.
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
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self.check_every = check_every
        self.done = 0
        self.postfix = ""
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._since_check = 0

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
        now = time.monotonic()
        if now - self._last_draw >= self.interval or self.done >= self.total:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 30
        filled = int(frac * width)
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} "
            f"{elapsed:5.1f}s eta {eta:5.1f}s {self.postfix}"
        )
        self.stream.flush()
