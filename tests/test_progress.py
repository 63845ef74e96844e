"""The tools' progress bar: no time-left estimate until there is a rate to base it
on, then one from the rate since the first units were done (start-up excluded)."""

from __future__ import annotations

import io

from tools.progress import Progress


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def last_draw(stream: io.StringIO) -> str:
    return stream.getvalue().rsplit("\r", 1)[-1]


def test_no_estimate_until_a_rate_then_the_rate_since_the_first_units() -> None:
    clock, out = Clock(), io.StringIO()
    bar = Progress(10, "run", stream=out, interval=0.0, check_every=1, clock=clock)
    clock.now += 5.0  # start-up: nothing done for 5 s
    bar.update(0)
    assert "eta      -" in last_draw(out)
    bar.update(1)  # the first unit: a starting point, no rate yet
    assert "1/10" in last_draw(out) and "eta      -" in last_draw(out)
    clock.now += 1.0
    bar.update(2)  # 2 units in the 1 s since: 7 left at 2/s
    assert "3/10" in last_draw(out) and "eta   3.5s" in last_draw(out)
    clock.now += 1.0
    bar.update(7)
    assert "10/10" in last_draw(out) and "eta   0.0s" in last_draw(out)
    bar.close()
    assert out.getvalue().endswith("\n")


def test_no_estimate_while_the_clock_has_not_moved_since_the_first_units() -> None:
    clock, out = Clock(), io.StringIO()
    bar = Progress(4, stream=out, interval=0.0, check_every=1, clock=clock)
    bar.update(1)
    bar.update(1)  # more units, but no time has passed: no rate
    assert "2/4" in last_draw(out) and "eta      -" in last_draw(out)


def test_a_disabled_bar_draws_nothing() -> None:
    out = io.StringIO()
    bar = Progress(3, stream=out, enabled=False, interval=0.0, check_every=1)
    bar.update(3)
    bar.close()
    assert out.getvalue() == ""
