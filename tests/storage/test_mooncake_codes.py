"""MooncakeBackend's reading of return codes, against the in-process stand-in store
(exact codes on demand; the real store is in test_mooncake.py)."""

from __future__ import annotations

import time

import pytest
from fake_mooncake import FakeMooncakeStore
from storage_helpers import LAYOUTS, TEST_AUTH, HostMemory, make_keys, statuses

from fastkv.storage import deadline_after
from fastkv.storage.mooncake import RPC_FAIL, TRANSFER_FAIL, MooncakeBackend

LAYOUT = LAYOUTS["fp8"]
OBJECT_BYTES = 128 + LAYOUT.payload_bytes
SOON = 30.0


def open_backend(staged: bool = False) -> tuple[MooncakeBackend, FakeMooncakeStore, HostMemory]:
    store = FakeMooncakeStore()
    backend = MooncakeBackend(
        LAYOUT,
        store=store,
        staging_bytes=4 * 8 * OBJECT_BYTES if staged else 0,
        breaker_cooldown_s=0.05,
        auth=TEST_AUTH,
    )
    host = HostMemory(LAYOUT, 8)
    backend.register_host_memory(host.base, host.nbytes)
    host.fill(0, seed=0)
    return backend, store, host


def test_a_short_object_is_told_from_a_failing_store_by_its_size() -> None:
    backend, store, host = open_backend()
    keys = make_keys(4)
    assert all(
        r.ok for r in backend.put_from(keys, [host.segments(0)] * 4, deadline_after(SOON))
    )
    store.objects[keys[0].text()] = bytes(1000)  # short: a multi-buffer read answers -800
    for key in keys[1:]:  # whole objects whose transfers fail
        store.fail_get[key.text()] = TRANSFER_FAIL
    res = backend.get_into(keys, [host.segments(b) for b in range(4, 8)], deadline_after(SOON))
    assert statuses(res) == ["MISS", "FAILED", "FAILED", "FAILED"]
    assert "short object (1000 bytes)" in res[0].reason
    assert store.get_size_calls == [k.text() for k in keys]
    # -800 is the storage node holding the key, not the store: no breaker, the
    # failing keys rest for the cooldown (not asked), the others are served
    assert backend.stats().corrupt == 1 and not backend.breaker.is_open
    del store.objects[keys[0].text()]
    assert backend.put_from(keys[:1], [host.segments(0)], deadline_after(SOON))[0].ok
    res = backend.get_into(keys[:2], [host.segments(4), host.segments(5)], deadline_after(SOON))
    assert statuses(res) == ["OK", "FAILED"] and "not asked again" in res[1].reason
    assert len(store.get_size_calls) == 4
    time.sleep(0.06)  # the cooldown (0.05 s) ends: asked again
    res = backend.get_into(keys[1:2], [host.segments(5)], deadline_after(SOON))
    assert res[0].reason == "Mooncake get answered -800"


def test_no_size_is_asked_after_a_fatal_code() -> None:
    backend, store, host = open_backend()
    keys = make_keys(3)
    assert all(
        r.ok for r in backend.put_from(keys, [host.segments(0)] * 3, deadline_after(SOON))
    )
    store.fail_get[keys[0].text()] = RPC_FAIL
    store.fail_get[keys[1].text()] = TRANSFER_FAIL
    store.fail_get[keys[2].text()] = TRANSFER_FAIL
    res = backend.get_into(keys, [host.segments(b) for b in range(4, 7)], deadline_after(SOON))
    assert statuses(res) == ["FAILED"] * 3
    assert store.get_size_calls == []


def test_no_size_is_asked_past_the_deadline() -> None:
    backend, store, host = open_backend()
    keys = make_keys(2)
    assert all(
        r.ok for r in backend.put_from(keys, [host.segments(0)] * 2, deadline_after(SOON))
    )
    for key in keys:
        store.fail_get[key.text()] = TRANSFER_FAIL
    store.get_delay_s = 0.2
    res = backend.get_into(
        keys, [host.segments(b) for b in range(4, 6)], time.monotonic() + 0.1
    )
    assert statuses(res) == ["FAILED"] * 2
    assert store.get_size_calls == []


@pytest.mark.parametrize("code", [TRANSFER_FAIL, RPC_FAIL])
def test_staged_reads_never_ask_the_size(code: int) -> None:
    # a single-buffer read answers a short object's size itself: -800 is the store
    backend, store, host = open_backend(staged=True)
    keys = make_keys(2)
    assert all(
        r.ok for r in backend.put_from(keys, [host.segments(0)] * 2, deadline_after(SOON))
    )
    for key in keys:
        store.fail_get[key.text()] = code
    res = backend.get_into(keys, [host.segments(b) for b in range(4, 6)], deadline_after(SOON))
    assert statuses(res) == ["FAILED"] * 2
    assert store.get_size_calls == []
    store.objects[keys[0].text()] = bytes(1000)
    del store.fail_get[keys[0].text()]
    time.sleep(backend.breaker.cooldown_s + 0.05)
    res = backend.get_into(keys[:1], [host.segments(4)], deadline_after(SOON))
    assert statuses(res) == ["MISS"] and "short object (1000 bytes)" in res[0].reason


@pytest.mark.parametrize("call", ["put", "exists", "staged_get"])
def test_a_call_stuck_inside_mooncake_returns_by_its_deadline(call: str) -> None:
    """Issue 15 item 5: a Mooncake call blocked (4.3 s against a dead master); the
    backend answers by the deadline plus `deadline_margin_s` (TIMEOUT / not found),
    keeps the stuck call's arena until it returns, and serves the next call."""
    backend, store, host = open_backend(staged=call == "staged_get")
    keys = make_keys(2)
    assert all(
        r.ok for r in backend.put_from(keys[:1], [host.segments(0)], deadline_after(SOON))
    )
    store.put_delay_s = store.exist_delay_s = store.get_delay_s = 1.0
    t0 = time.monotonic()
    deadline = t0 + 0.2
    if call == "put":
        got = statuses(backend.put_from(keys[1:], [host.segments(0)], deadline))
        assert got == ["TIMEOUT"]
    elif call == "exists":
        assert backend.exists(keys, deadline) == [False, False]
    else:
        got = statuses(backend.get_into(keys[:1], [host.segments(1)], deadline))
        assert got == ["TIMEOUT"]
    took = time.monotonic() - t0
    assert took < 0.2 + backend.deadline_margin_s + 0.1, took
    assert backend.overruns == 1
    store.put_delay_s = store.exist_delay_s = store.get_delay_s = 0.0
    time.sleep(1.1)  # the stuck call returns and gives its arena back
    assert backend.exists(keys[:1], deadline_after(SOON)) == [True]
    assert statuses(backend.get_into(keys[:1], [host.segments(2)], deadline_after(SOON))) == [
        "OK"
    ]
    assert host.read(2) == host.read(0)
