"""The Mooncake backend's circuit breaker and key quarantine on their own (the
real-Mooncake behaviour is in test_mooncake.py)."""

from __future__ import annotations

import time

from fastkv.storage.circuit_breaker import CircuitBreaker, KeyQuarantine


def test_opens_on_a_fatal_call_and_fails_fast() -> None:
    breaker = CircuitBreaker(cooldown_s=60)
    assert breaker.allow()
    breaker.record(None)
    assert not breaker.is_open
    assert breaker.allow()
    breaker.record("get answered -900")
    assert breaker.is_open and breaker.trips == 1 and breaker.reason == "get answered -900"
    assert not breaker.allow()  # fails fast for the whole cooldown


def test_one_probe_after_the_cooldown_closes_it_on_success() -> None:
    breaker = CircuitBreaker(cooldown_s=0.05)
    assert breaker.allow()
    breaker.record("put answered -800")
    time.sleep(0.06)
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one probe at a time
    breaker.record(None)
    assert not breaker.is_open
    assert breaker.allow() and breaker.allow()
    assert breaker.trips == 1


def test_recovery_is_prompt_however_long_the_outage() -> None:
    """Issue 15 item 5: after a long outage the breaker reopened for 30 s per failed
    probe; the cooldown now stops growing at max_cooldown_s."""
    breaker = CircuitBreaker(cooldown_s=0.02, max_cooldown_s=0.08)
    assert breaker.allow()
    breaker.record("get answered -901")
    for _ in range(8):  # a long outage: every probe fails
        time.sleep(breaker.cooldown_s + 0.005)
        assert breaker.allow()
        breaker.record("get answered -901")
    assert breaker.cooldown_s == 0.08
    # the master is back: the next probe is at most max_cooldown_s away
    t0 = time.monotonic()
    while not breaker.allow():
        time.sleep(0.002)
    assert time.monotonic() - t0 <= 0.08 + 0.02
    breaker.record(None)
    assert not breaker.is_open


def test_a_failed_probe_reopens_with_a_longer_cooldown() -> None:
    breaker = CircuitBreaker(cooldown_s=0.05)
    assert breaker.allow()
    breaker.record("put answered -900")
    time.sleep(0.06)
    assert breaker.allow()
    breaker.record("put answered -900")  # the probe failed
    assert breaker.is_open and breaker.trips == 1
    assert not breaker.allow()
    assert breaker.cooldown_s == 0.1
    time.sleep(0.11)
    assert breaker.allow()
    breaker.record(None)
    assert not breaker.is_open and breaker.cooldown_s == 0.05


def test_a_quarantine_holds_back_only_its_keys_for_a_while() -> None:
    quarantine = KeyQuarantine(0.05, "its node failed")
    quarantine.hold(["a", "b"])
    held = quarantine.reasons(["a", "c", "b"])
    assert held[1] is None and held[0] == held[2]
    assert held[0] is not None and held[0].startswith("its node failed; not asked again for ")
    time.sleep(0.06)
    assert quarantine.reasons(["a", "b"]) == [None, None]


def test_a_full_quarantine_ends_the_oldest_holds_first() -> None:
    quarantine = KeyQuarantine(60, "failed", max_keys=2)
    quarantine.hold(["a", "b"])
    quarantine.hold(["a"])  # held again: now the most recent
    quarantine.hold(["c"])
    assert [r is not None for r in quarantine.reasons(["a", "b", "c"])] == [True, False, True]
