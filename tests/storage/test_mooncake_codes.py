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
    # the first -800 get_size confirms is the store failing: the rest are not asked
    assert store.get_size_calls == [keys[0].text(), keys[1].text()]
    assert backend.stats().corrupt == 1 and backend.breaker.is_open


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
