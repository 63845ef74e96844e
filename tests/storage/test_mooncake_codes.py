"""MooncakeBackend's reading of return codes, against the in-process stand-in store
(exact codes on demand; the real store is in test_mooncake.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fake_mooncake import FakeMooncakeStore
from storage_helpers import LAYOUTS, TEST_AUTH, HostMemory, make_keys, statuses

from fastkv.storage import _disk_io, deadline_after
from fastkv.storage.auth import ring_of
from fastkv.storage.base import BlockLayout
from fastkv.storage.block_header import HEADER_BYTES, expected_header
from fastkv.storage.mooncake import MooncakeBackend
from fastkv.storage.mooncake import backend as backend_module
from fastkv.storage.mooncake.codes import RPC_FAIL, TRANSFER_FAIL
from fastkv.storage.mooncake.options import MooncakeOptions

LAYOUT = LAYOUTS["fp8"]
OBJECT_BYTES = 128 + LAYOUT.payload_bytes
SOON = 30.0


def open_backend(staged: bool = False) -> tuple[MooncakeBackend, FakeMooncakeStore, HostMemory]:
    store = FakeMooncakeStore()
    options = MooncakeOptions(
        staging_bytes=4 * 8 * OBJECT_BYTES if staged else 0,
        breaker_cooldown_s=0.05,
        auth=TEST_AUTH,
    )
    backend = MooncakeBackend(LAYOUT, options, store=store)
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
    blocks = [host.segments(b) for b in range(4, 6)]
    res = backend.get_into(keys, blocks, time.monotonic() + 0.1)
    assert statuses(res) == ["TIMEOUT"] * 2  # answered at the deadline plus the margin
    assert backend.wait_host_quiet(blocks, 5.0)  # the call left behind has ended: -800s
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


@pytest.mark.parametrize("call", ["put", "exists", "staged_get", "zero_copy_get"])
def test_a_call_stuck_inside_mooncake_returns_by_its_deadline(call: str) -> None:
    """Issue 15 item 5: a Mooncake call blocked (4.3 s against a dead master); the
    backend answers by the deadline plus `deadline_margin_s` (TIMEOUT / not found),
    keeps the stuck call's arena until it returns, and serves the next call. A
    zero-copy read too, though Mooncake writes the caller's memory until it ends."""
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


def test_memory_a_read_left_behind_still_writes_is_fenced_until_it_ends() -> None:
    """A zero-copy get that outlived its deadline still writes its destination: the
    backend lists that memory, refuses new calls on it (FAILED, Mooncake not asked)
    while serving the rest, and frees it when Mooncake returns."""
    backend, store, host = open_backend()
    keys = make_keys(2)
    assert all(
        r.ok for r in backend.put_from(keys, [host.segments(0)] * 2, deadline_after(SOON))
    )
    store.get_delay_s = 0.6
    res = backend.get_into(keys[:1], [host.segments(1)], time.monotonic() + 0.1)
    assert statuses(res) == ["TIMEOUT"] and "writes these blocks' host memory" in res[0].reason
    assert backend.busy_host_ranges() == sorted((p, p + n) for p, n in host.segments(1))
    store.get_delay_s = 0.0
    res = backend.get_into(keys, [host.segments(1), host.segments(2)], deadline_after(SOON))
    assert statuses(res) == ["FAILED", "OK"] and "outlived its deadline" in res[0].reason
    (other,) = make_keys(1, 5)
    res = backend.put_from([other], [host.segments(1)], deadline_after(SOON))
    assert statuses(res) == ["FAILED"]
    assert other.text() not in store.objects  # nothing reached Mooncake for it
    assert not backend.wait_host_quiet([host.segments(1)], 0.01)
    assert backend.wait_host_quiet([host.segments(2)], 0.0)  # untouched memory: at once
    assert backend.wait_host_quiet([host.segments(1)], 5.0)
    assert backend.busy_host_ranges() == []
    res = backend.get_into(keys[:1], [host.segments(1)], deadline_after(SOON))
    assert statuses(res) == ["OK"] and host.read(1) == host.read(0)


@pytest.mark.parametrize("staged", [False, True])
def test_the_io_engine_keeps_a_late_reads_host_block_busy_until_it_returns(
    staged: bool,
) -> None:
    """Through the I/O engine the request completes at its deadline; the engine's
    thread owns the deadline, so the backend runs the get on it to its end (nothing
    left behind: no busy ranges of its own) and the engine holds the host block
    until the get has returned, past the backend's own answer (deadline + margin).
    The late get still lands the block and counts as an overrun."""
    from fastkv.storage.io_engine import StorageIOEngine

    backend, store, host = open_backend(staged)
    keys = make_keys(1)
    assert backend.put_from(keys, [host.segments(0)], deadline_after(SOON))[0].ok
    engine = StorageIOEngine(backend, num_threads=1)
    try:
        store.get_delay_s = 0.8
        t0 = time.monotonic()
        engine.submit_load(1, keys, [host.segments(4)], [4], t0 + 0.1)
        (done,) = engine.wait_all(SOON)
        assert time.monotonic() - t0 < 0.5
        assert statuses(done.results) == ["TIMEOUT"]
        assert engine.busy_host_blocks() == {4}
        time.sleep(max(0.0, t0 + 0.35 - time.monotonic()))
        assert backend.busy_host_ranges() == []  # the call is not left behind...
        assert engine.busy_host_blocks() == {4}  # ...it still runs, on the engine's thread
        assert backend.overruns == 0
        end = time.monotonic() + SOON
        while engine.busy_host_blocks() and time.monotonic() < end:
            time.sleep(0.01)
        assert engine.busy_host_blocks() == frozenset() and backend.busy_host_ranges() == []
        assert backend.overruns == 1 and host.read(4) == host.read(0)
    finally:
        engine.close()


class ThreadLog:
    """Which threads the backend's Mooncake calls ran on, by the calls' names."""

    def __init__(self, store: FakeMooncakeStore) -> None:
        self.seen: dict[str, set[str]] = {}
        for name in ("batch_is_exist", "batch_upsert_from", "batch_get_into"):
            self._wrap(store, name)

    def _wrap(self, store: FakeMooncakeStore, name: str) -> None:
        inner = getattr(store, name)

        def logged(*args, **kwargs):
            self.seen.setdefault(name, set()).add(threading.current_thread().name)
            return inner(*args, **kwargs)

        setattr(store, name, logged)


def test_calls_through_the_io_engine_run_on_its_threads_and_direct_ones_on_the_pool() -> None:
    """The engine owns its deadlines, so the staged backend (the default) runs its
    calls on the engine's I/O threads, without the hop to a pool thread; a direct
    caller's calls still go to the pool, which answers them by their deadline.
    Both ways store and serve the same bytes and count the same."""
    from fastkv.storage.io_engine import StorageIOEngine

    backend, store, host = open_backend(staged=True)
    log = ThreadLog(store)
    keys = make_keys(4)
    want = [host.read(0), host.fill(1, seed=1)]
    engine = StorageIOEngine(backend, num_threads=2)
    try:
        two = [host.segments(0), host.segments(1)]
        engine.submit_store(1, keys[:2], two, [0, 1], deadline_after(SOON))
        assert engine.wait_all(SOON)[0].success
        engine.submit_lookup(2, keys, deadline_after(SOON))
        assert engine.wait_all(SOON)[0].hits == (True, True, False, False)
        engine.submit_load(3, keys[:2], [host.segments(4), host.segments(5)], [4, 5],
                           deadline_after(SOON))  # fmt: skip
        assert engine.wait_all(SOON)[0].success
        assert [host.read(4), host.read(5)] == want
        via_engine = {name: set(threads) for name, threads in log.seen.items()}
        log.seen.clear()
        direct = backend.put_from(keys[2:], two, deadline_after(SOON))
        assert statuses(direct) == ["OK", "OK"]
        assert backend.exists(keys, deadline_after(SOON)) == [True] * 4
        res = backend.get_into(
            keys[2:], [host.segments(6), host.segments(7)], deadline_after(SOON)
        )
        assert statuses(res) == ["OK", "OK"] and [host.read(6), host.read(7)] == want
    finally:
        engine.close()
    assert set(via_engine) == {"batch_is_exist", "batch_upsert_from", "batch_get_into"}
    for threads in via_engine.values():
        assert all(t.startswith("fastkv-storage-io-") for t in threads), via_engine
    assert set(log.seen) == set(via_engine)
    for threads in log.seen.values():
        assert all(t.startswith("fastkv-mooncake") for t in threads), log.seen
    stats = backend.stats()
    assert (stats.puts, stats.gets, stats.misses, stats.corrupt) == (4, 4, 0, 0), stats
    assert backend.overruns == 0


def test_close_waits_for_a_call_running_on_an_io_thread() -> None:
    """A call run on the engine's thread counts as in flight: close does not close
    the store under it, and closes it once it has returned."""
    from fastkv.storage.io_engine import StorageIOEngine

    backend, store, host = open_backend(staged=True)
    keys = make_keys(1)
    assert backend.put_from(keys, [host.segments(0)], deadline_after(SOON))[0].ok
    closed: list[float] = []
    returned: list[float] = []
    store.close = lambda: closed.append(time.monotonic())
    entered = threading.Event()
    get = store.batch_get_into

    def slow_get(*args):
        entered.set()
        time.sleep(0.6)
        try:
            return get(*args)
        finally:
            returned.append(time.monotonic())

    store.batch_get_into = slow_get
    engine = StorageIOEngine(backend, num_threads=1)
    try:
        engine.submit_load(1, keys, [host.segments(4)], [4], time.monotonic() + 0.05)
        assert entered.wait(SOON)
        assert backend.close(SOON)
        assert len(closed) == 1 and len(returned) == 1 and closed[0] >= returned[0]
    finally:
        engine.close(SOON)


@pytest.mark.parametrize("verify_puts", [True, False])
def test_an_object_planted_between_the_existence_check_and_the_put(verify_puts: bool) -> None:
    """Issue 15 item 2: another client stores its object under the key after the
    put's is_exist and before its put; this Mooncake answers 0 and keeps that
    object. With verify_puts the put reads it back: not stored, and removed."""
    store = FakeMooncakeStore()
    store.reput_code = 0  # as the Mooncake in the venv answers
    options = MooncakeOptions(auth=TEST_AUTH, verify_puts=verify_puts)
    backend = MooncakeBackend(LAYOUT, options, store=store)
    host = HostMemory(LAYOUT, 4)
    backend.register_host_memory(host.base, host.nbytes)
    host.fill(0, seed=3)
    (key,) = make_keys(1)
    forged = bytes(OBJECT_BYTES)
    honest_put = store._put

    def racing_put(name: str, ptrs: list[int], sizes: list[int]) -> int:
        store.objects.setdefault(name, forged)  # the other client wins the race
        return honest_put(name, ptrs, sizes)

    store._put = racing_put  # type: ignore[method-assign]
    res = backend.put_from([key], [host.segments(0)], deadline_after(SOON))
    store._put = honest_put  # type: ignore[method-assign]
    if not verify_puts:  # the documented window: counted stored, its reads refused
        assert statuses(res) == ["OK"]
        got = backend.get_into([key], [host.segments(1)], deadline_after(SOON))
        assert statuses(got) == ["MISS"] and "rejected" in got[0].reason
        return
    assert statuses(res) == ["FAILED"] and "not this block" in res[0].reason
    assert key.text() not in store.objects and backend.forged_puts == 1
    assert backend.put_from([key], [host.segments(0)], deadline_after(SOON))[0].ok
    got = backend.get_into([key], [host.segments(1)], deadline_after(SOON))
    assert statuses(got) == ["OK"] and host.read(1) == host.read(0)


def test_a_put_replaces_an_object_that_is_not_its_block_under_a_held_lease() -> None:
    """Issue 25 item 11: the key is in use (looked up and read, so Mooncake's read
    lease never ends); an object that is not the block (here: zeros, as a forger
    or another deployment left it) was answered FAILED and its remove refused for
    as long as the key stayed hot. Now the put removes it (forced) and stores the
    block in the same call."""
    backend, store, host = open_backend()
    keys = make_keys(3)
    assert backend.put_from(keys[2:], [host.segments(0)], deadline_after(SOON))[0].ok
    store.objects[keys[0].text()] = bytes(OBJECT_BYTES)
    store.objects[keys[1].text()] = bytes(100)
    got = backend.get_into(keys, [host.segments(b) for b in (1, 2, 3)], deadline_after(SOON))
    assert statuses(got) == ["MISS", "MISS", "OK"]  # every key now under a read lease
    res = backend.put_from(keys, [host.segments(0)] * 3, deadline_after(SOON))
    assert statuses(res) == ["OK", "OK", "OK"], [r.reason for r in res]
    assert backend.forged_puts == 2 and store.removed == [k.text() for k in keys[:2]]
    assert backend.stats().put_already_stored == 1  # keys[2], put before
    for b in (1, 2):
        host.clear(b)
    got = backend.get_into(keys[:2], [host.segments(1), host.segments(2)], deadline_after(SOON))
    assert statuses(got) == ["OK", "OK"]
    assert host.read(1) == host.read(0) and host.read(2) == host.read(0)


def test_a_staged_put_replaces_whatever_is_under_its_keys_unread() -> None:
    """Issue 27 item 1: a staged put is one Mooncake call per batch (an upsert):
    no existence check, nothing read back; objects that are not the block (any
    size, under a read lease) are replaced, not trusted, and a block already
    stored is stored again."""
    backend, store, host = open_backend(staged=True)
    keys = make_keys(4)
    assert backend.put_from(keys[3:], [host.segments(0)], deadline_after(SOON))[0].ok
    store.objects[keys[0].text()] = bytes(OBJECT_BYTES)
    store.objects[keys[1].text()] = bytes(100)
    store.objects[keys[2].text()] = bytes(OBJECT_BYTES + 4096)
    got = backend.get_into(keys, [host.segments(b) for b in (1, 2, 3, 4)], deadline_after(SOON))
    assert statuses(got) == ["MISS", "MISS", "MISS", "OK"]  # every key under a read lease
    calls: list[str] = []
    for name in ("batch_is_exist", "batch_get_into", "batch_upsert_from", "remove"):
        honest = getattr(store, name)

        def counted(*args, _name=name, _honest=honest, **kw):
            calls.append(_name)
            return _honest(*args, **kw)

        setattr(store, name, counted)
    res = backend.put_from(keys, [host.segments(0)] * 4, deadline_after(SOON))
    assert statuses(res) == ["OK"] * 4, [r.reason for r in res]
    assert calls == ["batch_upsert_from"]
    assert backend.forged_puts == 0 and store.removed == []
    assert backend.stats().put_already_stored == 0
    for b in (1, 2, 3, 4):
        host.clear(b)
    got = backend.get_into(keys, [host.segments(b) for b in (1, 2, 3, 4)], deadline_after(SOON))
    assert statuses(got) == ["OK"] * 4
    assert all(host.read(b) == host.read(0) for b in (1, 2, 3, 4))


def test_a_staged_put_with_verify_puts_refuses_what_it_reads_back() -> None:
    """Staged puts upsert; with verify_puts each is still read back, and one whose
    object is not the block by then (another client's upsert won) is FAILED and
    removed; the next put stores the block."""
    store = FakeMooncakeStore()
    options = MooncakeOptions(auth=TEST_AUTH, verify_puts=True)
    backend = MooncakeBackend(LAYOUT, options, store=store)
    assert backend.staged
    host = HostMemory(LAYOUT, 2)
    host.fill(0, seed=4)
    keys = make_keys(2)
    honest_put = store._put

    def overwritten(name: str, ptrs: list[int], sizes: list[int]) -> int:
        code = honest_put(name, ptrs, sizes)
        if name == keys[1].text():
            store.objects[name] = bytes(OBJECT_BYTES)  # the other client's upsert
        return code

    store._put = overwritten  # type: ignore[method-assign]
    res = backend.put_from(keys, [host.segments(0)] * 2, deadline_after(SOON))
    store._put = honest_put  # type: ignore[method-assign]
    assert statuses(res) == ["OK", "FAILED"] and "not this block" in res[1].reason
    assert keys[1].text() not in store.objects and backend.forged_puts == 1
    assert backend.put_from(keys[1:], [host.segments(0)], deadline_after(SOON))[0].ok
    got = backend.get_into(keys[1:], [host.segments(1)], deadline_after(SOON))
    assert statuses(got) == ["OK"] and host.read(1) == host.read(0)


def test_puts_are_read_back_in_batches_and_each_key_judged_alone(monkeypatch) -> None:
    """Read-backs go three objects per Mooncake call here; in one put of 8 keys, two
    of which met an object planted in the window, each key gets its own answer."""
    from fastkv.storage.mooncake import memory as mooncake_memory

    monkeypatch.setattr(mooncake_memory, "VERIFY_AREA_BYTES", 3 * OBJECT_BYTES)
    store = FakeMooncakeStore()
    store.reput_code = 0
    options = MooncakeOptions(auth=TEST_AUTH, verify_puts=True)
    backend = MooncakeBackend(LAYOUT, options, store=store)
    host = HostMemory(LAYOUT, 4)
    backend.register_host_memory(host.base, host.nbytes)
    host.fill(0, seed=5)
    keys = make_keys(8)
    planted = {keys[2].text(), keys[6].text()}
    honest_put, reads = store._put, []
    honest_get = store.batch_get_into

    def racing_put(name: str, ptrs: list[int], sizes: list[int]) -> int:
        if name in planted:
            store.objects.setdefault(name, bytes(OBJECT_BYTES))
        return honest_put(name, ptrs, sizes)

    def counting_get(names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        reads.append(len(names))
        return honest_get(names, ptrs, sizes)

    store._put = racing_put  # type: ignore[method-assign]
    store.batch_get_into = counting_get  # type: ignore[method-assign]
    res = backend.put_from(keys, [host.segments(0)] * 8, deadline_after(SOON))
    assert statuses(res) == ["OK", "OK", "FAILED", "OK", "OK", "OK", "FAILED", "OK"]
    assert reads == [3, 3, 2] and backend.forged_puts == 2
    got = backend.get_into(keys[:2], [host.segments(1), host.segments(2)], deadline_after(SOON))
    assert statuses(got) == ["OK", "OK"] and host.read(1) == host.read(0)


@pytest.mark.parametrize("call", ["put", "get"])
def test_a_staged_call_left_behind_never_touches_the_callers_block_again(call: str) -> None:
    """Staged mode: only the backend's own copies touch the caller's block. Once
    the caller is answered TIMEOUT it may reuse the block: a put left behind
    stores at most the block as it was when put_from was called (gathered on the
    caller's thread before it waited), never what the caller wrote afterwards; a
    get left behind writes nothing into it."""
    backend, store, host = open_backend(staged=True)
    keys = make_keys(2)
    assert backend.put_from(keys[:1], [host.segments(0)], deadline_after(SOON))[0].ok
    if call == "put":
        was = host.fill(1, seed=98)
        store.put_delay_s = 0.5  # stuck inside Mooncake's put
        res = backend.put_from(keys[1:], [host.segments(1)], time.monotonic() + 0.1)
    else:
        store.get_delay_s = 0.5  # stuck before it scatters into the block
        res = backend.get_into(keys[:1], [host.segments(1)], time.monotonic() + 0.1)
    assert statuses(res) == ["TIMEOUT"]
    reused = host.fill(1, seed=99)  # the caller reuses its block at once
    store.put_delay_s = store.get_delay_s = 0.0
    assert backend.close(5.0)  # waits for the call left behind to end
    assert host.read(1) == reused
    if call == "put":
        stored = store.objects[keys[1].text()][OBJECT_BYTES - LAYOUT.payload_bytes :]
        assert stored == was != reused


def test_a_put_whose_caller_was_answered_before_it_ran_stores_nothing() -> None:
    """A zero-copy put stuck in its existence check past the deadline: the caller
    is answered TIMEOUT and reuses its block, and the put, when Mooncake returns,
    puts nothing (it would read the block as the caller now has it)."""
    backend, store, host = open_backend()
    keys = make_keys(1)
    host.fill(0, seed=5)
    store.exist_delay_s = 0.5
    res = backend.put_from(keys, [host.segments(0)], time.monotonic() + 0.1)
    assert statuses(res) == ["TIMEOUT"]
    store.exist_delay_s = 0.0
    assert backend.close(5.0)
    assert keys[0].text() not in store.objects


def test_close_waits_for_calls_left_behind_and_keeps_a_stuck_store_open() -> None:
    backend, store, host = open_backend()
    keys = make_keys(1)
    assert backend.put_from(keys, [host.segments(0)], deadline_after(SOON))[0].ok
    closed = []
    store.close = lambda: closed.append(True)  # type: ignore[method-assign]
    store.get_delay_s = 1.0
    res = backend.get_into(keys, [host.segments(1)], time.monotonic() + 0.05)
    assert statuses(res) == ["TIMEOUT"]
    t0 = time.monotonic()
    assert backend.close(0.2) is False  # still inside Mooncake: the store stays open
    assert 0.15 < time.monotonic() - t0 < 0.6 and closed == []
    with pytest.raises(RuntimeError):
        backend.get_into(keys, [host.segments(2)], deadline_after(SOON))
    # the host memory outlives the get left behind (it is freed with the test)
    assert backend.wait_host_quiet([host.segments(1)], 5.0)


def test_wait_host_quiet_checks_its_arguments() -> None:
    backend, _, host = open_backend()
    for bad in (-1, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match="timeout"):
            backend.wait_host_quiet([host.segments(0)], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="blocks"):
        backend.wait_host_quiet([[(0, 1)]], 1.0)
    assert backend.wait_host_quiet([host.segments(0)], 0.0)


@pytest.mark.parametrize("staged", [False, True], ids=["zero-copy", "staged"])
def test_both_block_forms_store_the_same_object_without_auth(staged: bool) -> None:
    """A block handed as one contiguous segment (the host tier's) and as the
    layout's segments store the same object: without a key ring the payload CRC
    is taken per layout segment, so each form reads what the other put, and a
    verified put's read-back (of the layout's segments) accepts it."""
    store = FakeMooncakeStore()
    store.reput_code = 0
    options = MooncakeOptions(
        staging_bytes=4 * 8 * OBJECT_BYTES if staged else 0,
        allow_unauthenticated=True,
        verify_puts=True,
    )
    backend = MooncakeBackend(LAYOUT, options, store=store)
    host = HostMemory(LAYOUT, 4)
    backend.register_host_memory(host.base, host.nbytes)
    host.fill(0, seed=5)
    host.fill(1, seed=6)
    keys = make_keys(2)
    assert statuses(backend.put_from(keys[:1], [host.segments(0)], deadline_after(SOON))) == [
        "OK"
    ]
    assert statuses(
        backend.put_from(keys[1:], [host.tensor_segments(1)], deadline_after(SOON))
    ) == ["OK"]
    # a second put of each, in the other form (one form a call), reads the object
    # back and finds its block
    for key, block in ((keys[0], host.tensor_segments(0)), (keys[1], host.segments(1))):
        assert statuses(backend.put_from([key], [block], deadline_after(SOON))) == ["OK"]
    assert not store.removed and backend.forged_puts == 0
    for key, block, into in (
        (keys[0], host.tensor_segments(2), 2),
        (keys[1], host.segments(3), 3),
        (keys[0], host.segments(3), 3),
        (keys[1], host.tensor_segments(2), 2),
    ):
        host.clear(into, 0xA5)
        assert statuses(backend.get_into([key], [block], deadline_after(SOON))) == ["OK"]
        assert host.read(into) == host.read(0 if key == keys[0] else 1)


@pytest.mark.parametrize("layout_name", ["fp8", "odd"])
@pytest.mark.parametrize("staged", [False, True], ids=["zero-copy", "staged"])
def test_an_authenticated_block_is_sealed_over_its_bytes_however_it_is_cut(
    staged: bool, layout_name: str
) -> None:
    """With a key ring the backend seals and verifies a block over the segments
    the call gives (one contiguous segment, the host tier's, is not cut into the
    layout's first): the object must be the one a seal over the layout's segments
    makes, byte for byte, so each form reads what the other put. The "odd" layout
    has a 3000-byte segment, no multiple of GHASH's 16-byte block."""
    layout = LAYOUTS[layout_name]
    size = HEADER_BYTES + layout.payload_bytes
    store = FakeMooncakeStore()
    options = MooncakeOptions(staging_bytes=4 * 8 * size if staged else 0, auth=TEST_AUTH)
    backend = MooncakeBackend(layout, options, store=store)
    host = HostMemory(layout, 4)
    backend.register_host_memory(host.base, host.nbytes)
    keys = make_keys(2)
    want = [host.fill(0, seed=7), host.fill(1, seed=8)]
    ok = ["OK"]
    assert statuses(backend.put_from(keys[:1], [host.segments(0)], deadline_after(SOON))) == ok
    assert (
        statuses(backend.put_from(keys[1:], [host.tensor_segments(1)], deadline_after(SOON)))
        == ok
    )
    for b, key in enumerate(keys):
        header = bytearray(expected_header(key, layout, 0))
        pairs = np.asarray(host.tensor_segments(b), dtype=np.int64)
        _disk_io.seal_header(header, pairs, ring_of(TEST_AUTH))
        assert store.objects[key.text()] == bytes(header) + want[b]
    for key, block, into, b in (
        (keys[0], host.tensor_segments(2), 2, 0),
        (keys[1], host.segments(3), 3, 1),
    ):
        host.clear(into, 0xA5)
        assert statuses(backend.get_into([key], [block], deadline_after(SOON))) == ok
        assert host.read(into) == want[b]


@pytest.mark.parametrize("call", ["put", "get"])
def test_blocks_that_do_not_match_the_layout_are_refused_before_anything_moves(
    call: str,
) -> None:
    """The blocks are checked in C (`_disk_io.check_pack`); a bad one raises the
    Python check's message (`check_segments`), naming block, segment and bound,
    as does a segment outside the registered memory (zero-copy), and the store is
    never called."""
    backend, store, host = open_backend()
    keys = make_keys(2)
    fn = backend.put_from if call == "put" else backend.get_into
    good = host.segments(1)
    (ptr, n), tensors = good[0], host.tensor_segments(1)
    outside = HostMemory(LAYOUT, 1)  # never registered
    for blocks, match in (
        ([good, [(ptr, n - 1)]], r"blocks\[1\]\[0\]: length \d+ != layout length \d+"),
        ([good, tensors], r"blocks\[1\]: 12 segments, the call \(as blocks\[0\]\) has 1"),
        ([tensors, good], r"blocks\[1\]: 1 segments, the layout has 12"),
        ([good, [(0, n)]], r"blocks\[1\]\[0\]: address must be a positive int, got 0"),
        ([good, [(True, n)]], r"blocks\[1\]\[0\]: address must be a positive int"),
        ([good, [ptr]], r"blocks\[1\]\[0\]: must be an \(address, length\) pair"),
        ([good, [(2**63 - 8, n)]], r"blocks\[1\]\[0\]: address \d+ \+ length \d+ ends past"),
        ([good, [(2**64, n)]], r"blocks\[1\]\[0\]: address \d+ \+ length \d+ ends past"),
        ([good], r"blocks: 1 entries for 2 keys"),
        (
            [host.tensor_segments(0), [*tensors[:3], (outside.base, 32), *tensors[4:]]],
            r"blocks\[1\]\[3\]: not inside memory registered with register_host_memory",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            fn(keys, blocks, deadline_after(SOON))
    assert not store.objects and backend.stats().puts == backend.stats().gets == 0


@pytest.mark.parametrize("staged", [False, True], ids=["zero-copy", "staged"])
def test_an_authenticated_call_neither_cuts_its_blocks_nor_checks_them_in_python(
    staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-call cost the C path saves (about 20 us of an 8-block call): with a
    key ring, valid blocks given as one segment each are checked by
    `_disk_io.check_pack` alone and sealed as given, never cut into the layout's
    segments (`BlockLayout.in_segments`) nor checked by `check_segments`."""

    def refuse(*args: object) -> None:
        raise AssertionError("the Python path ran")

    backend, _, host = open_backend(staged)
    monkeypatch.setattr(BlockLayout, "in_segments", refuse)
    monkeypatch.setattr(backend_module, "check_segments", refuse)
    keys = make_keys(2)
    want = host.read(0)
    blocks = [host.segments(0), host.segments(0)]
    assert statuses(backend.put_from(keys, blocks, deadline_after(SOON))) == ["OK", "OK"]
    host.clear(1, 0x11)
    host.clear(2, 0x22)
    got = backend.get_into(keys, [host.segments(1), host.segments(2)], deadline_after(SOON))
    assert statuses(got) == ["OK", "OK"] and host.read(1) == host.read(2) == want


@pytest.mark.parametrize("form", ["host", "layout"])
def test_a_segment_whose_end_passes_2_63_is_not_inside_registered_memory(form: str) -> None:
    """A segment starting above every registered range whose end wraps past 2**63
    must be refused, not taken for inside (Mooncake would then write a get's
    object there): the call's check names it (its end does not fit in int64), and
    the registered-memory check, which compares ends as int64s, refuses it on its
    own too. Only gets of a key never stored are tried: on a check that lets the
    segment through they touch no memory."""
    backend, _, host = open_backend()
    keys = make_keys(1)
    near = (1 << 63) - 16  # above every registered range; + a segment wraps
    if form == "host":
        block = [(near, LAYOUT.payload_bytes)]
        at = r"blocks\[0\]\[0\]"
    else:
        block = [*host.tensor_segments(0)[:3], (near, LAYOUT.segment_lengths[3])]
        block += host.tensor_segments(0)[4:]
        at = r"blocks\[0\]\[3\]"
    with pytest.raises(ValueError, match=at + r": address \d+ \+ length \d+ ends past"):
        backend.get_into(keys, [block], deadline_after(SOON))
    assert backend.stats().gets == 0
    packed = np.asarray(block, dtype=np.uint64).astype(np.int64).tobytes()
    with pytest.raises(ValueError, match=at + r": not inside memory registered"):
        backend._memory.check_inside(packed, len(block))


def test_host_memory_that_cannot_be_a_range_is_refused_and_nothing_registered() -> None:
    """register_host_memory checks its whole input before Mooncake sees it: a
    range ending past 2**63 - 1 would make the registered-memory check's int64
    ends overflow (it raised OverflowError there)."""
    registered: list[tuple[int, int]] = []

    class Counting(FakeMooncakeStore):
        def register_buffer(self, address: int, nbytes: int) -> int:
            registered.append((address, nbytes))
            return 0

    backend = MooncakeBackend(
        LAYOUT, MooncakeOptions(staging_bytes=0, auth=TEST_AUTH), store=Counting()
    )
    before = list(registered)  # the backend's own areas
    host = HostMemory(LAYOUT, 1)
    for address, nbytes, match in (
        (0, 4096, r"address: must be a positive int, got 0"),
        (True, 4096, r"address: must be a positive int, got True"),
        (4096.0, 4096, r"address: must be a positive int"),
        (4096, 0, r"nbytes: must be a positive int, got 0"),
        (
            (1 << 63) - 4096,
            4097,
            r"nbytes: \[0x7ffffffffffff000, \+4097\) ends past 2\*\*63 - 1",
        ),
        (1 << 63, 4096, r"ends past 2\*\*63 - 1"),
    ):
        with pytest.raises(ValueError, match=match):
            backend.register_host_memory(address, nbytes)
    assert registered == before
    backend.register_host_memory(host.base, host.nbytes)
    with pytest.raises(ValueError, match="overlaps a registered range"):
        backend.register_host_memory(host.base + 4096, 4096)
    assert registered == [*before, (host.base, host.nbytes)]


def test_the_backends_own_registered_areas_are_not_host_memory() -> None:
    """Only memory given to register_host_memory takes zero-copy blocks: the
    backend registers its own header and read-back areas with Mooncake too, and a
    block there would be written by a get while another call seals or verifies in
    it (a put's read-back failing on it removes that put's object)."""
    backend, store, _ = open_backend()
    keys = make_keys(1)
    memory = backend._memory
    for at in (memory.verify_addr, memory.header_addr(0, 0)):
        with pytest.raises(ValueError, match=r"blocks\[0\]\[0\]: not inside memory registered"):
            backend.get_into(keys, [[(at, LAYOUT.payload_bytes)]], deadline_after(SOON))
    assert backend.stats().gets == 0 and not store.objects


def test_a_zero_copy_call_before_any_host_memory_is_registered_is_refused() -> None:
    store = FakeMooncakeStore()
    backend = MooncakeBackend(
        LAYOUT, MooncakeOptions(staging_bytes=0, auth=TEST_AUTH), store=store
    )
    host = HostMemory(LAYOUT, 1)
    with pytest.raises(ValueError, match=r"blocks\[0\]\[0\]: not inside memory registered"):
        backend.put_from(make_keys(1), [host.segments(0)], deadline_after(SOON))
    assert not store.objects
