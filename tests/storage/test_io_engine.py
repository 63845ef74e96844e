"""The worker-side storage I/O engine over the real local-disk backend: ordering,
bounded store queue, deadlines with a hung backend, host-block hazards."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, HostMemory, make_keys, statuses

from fastkv.storage import KeyResult, StorageBackend, StorageKey, StorageStats, deadline_after
from fastkv.storage.io_engine import RequestKind, StorageIOEngine, Submission
from fastkv.storage.local_disk import LocalDiskBackend

LAYOUT = LAYOUTS["fp8"]
WAIT = 30.0


class GatedBackend(StorageBackend):
    """The real disk backend behind a gate: calls block while the gate is closed (a
    hung disk) and are logged in the order they reach the backend."""

    def __init__(self, inner: LocalDiskBackend) -> None:
        self.inner = inner
        self.layout = inner.layout
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.calls: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _enter(self, name: str, keys: Sequence[StorageKey]) -> None:
        with self._lock:
            self.calls.append((name, len(keys)))
        self.entered.release()
        assert self.gate.wait(WAIT)

    def exists(self, keys: Sequence[StorageKey], deadline: float) -> list[bool]:
        self._enter("exists", keys)
        return self.inner.exists(keys, deadline)

    def get_into(self, keys, blocks, deadline) -> list[KeyResult]:
        self._enter("get", keys)
        return self.inner.get_into(keys, blocks, deadline)

    def put_from(self, keys, blocks, deadline) -> list[KeyResult]:
        self._enter("put", keys)
        return self.inner.put_from(keys, blocks, deadline)

    def stats(self) -> StorageStats:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def disk(tmp_path: Path):
    backend = LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=64)
    yield backend
    backend.close()


def segs(host: HostMemory, blocks: Sequence[int]) -> list:
    return [host.segments(b) for b in blocks]


def wait_for(predicate, what: str) -> None:
    end = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_store_lookup_load_round_trip(disk: LocalDiskBackend) -> None:
    host = HostMemory(LAYOUT, 16)
    want = [host.fill(b, seed=b) for b in range(8)]
    keys = make_keys(8)
    engine = StorageIOEngine(disk, num_threads=2, chunk_bytes=1)  # one block per chunk
    try:
        engine.submit_store(1, keys, segs(host, range(8)), range(8), deadline_after(WAIT))
        (done,) = engine.wait_all(WAIT)
        assert (done.request_id, done.kind, done.success) == (1, RequestKind.STORE, True)
        engine.submit_lookup(2, [*keys[:3], *make_keys(1, 99)], deadline_after(WAIT))
        (found,) = engine.wait_all(WAIT)
        assert found.hits == (True, True, True, False)
        for b in range(8, 16):
            host.clear(b, 0xEE)
        engine.submit_load(
            3, keys, segs(host, range(8, 16)), range(8, 16), deadline_after(WAIT)
        )
        (loaded,) = engine.wait_all(WAIT)
        assert loaded.success and loaded.ok_prefix() == 8
        assert [host.read(b) for b in range(8, 16)] == want
    finally:
        engine.close()


def test_a_load_reports_each_key_and_its_usable_prefix(disk: LocalDiskBackend) -> None:
    host = HostMemory(LAYOUT, 6)
    host.fill(0, seed=0)
    keys = make_keys(3)
    assert disk.put_from([keys[0], keys[2]], segs(host, [0, 0]), deadline_after(WAIT))[0].ok
    engine = StorageIOEngine(disk)
    try:
        engine.submit_load(7, keys, segs(host, [3, 4, 5]), [3, 4, 5], deadline_after(WAIT))
        (done,) = engine.wait_all(WAIT)
        assert statuses(done.results) == ["OK", "MISS", "OK"]
        assert not done.success and done.ok_prefix() == 1
    finally:
        engine.close()


def test_lookups_and_loads_run_before_stores(disk: LocalDiskBackend) -> None:
    gated = GatedBackend(disk)
    host = HostMemory(LAYOUT, 8)
    engine = StorageIOEngine(gated, num_threads=1)
    try:
        gated.gate.clear()
        engine.submit_store(1, make_keys(1), segs(host, [0]), [0], deadline_after(WAIT))
        assert gated.entered.acquire(timeout=WAIT)  # the only thread is busy with it
        engine.submit_store(2, make_keys(1, 1), segs(host, [1]), [1], deadline_after(WAIT))
        engine.submit_load(3, make_keys(1, 2), segs(host, [2]), [2], deadline_after(WAIT))
        engine.submit_lookup(4, make_keys(2, 3), deadline_after(WAIT))
        gated.gate.set()
        done = engine.wait_all(WAIT)
        assert sorted(d.request_id for d in done) == [1, 2, 3, 4]
        assert [name for name, _ in gated.calls] == ["put", "exists", "get", "put"]
    finally:
        gated.gate.set()
        engine.close()


def test_a_full_store_queue_rejects_with_a_failed_result(disk: LocalDiskBackend) -> None:
    gated = GatedBackend(disk)
    host = HostMemory(LAYOUT, 8)
    engine = StorageIOEngine(gated, num_threads=1, max_store_bytes=2 * LAYOUT.payload_bytes)
    try:
        gated.gate.clear()
        engine.submit_store(1, make_keys(2), segs(host, [0, 1]), [0, 1], deadline_after(WAIT))
        engine.submit_store(2, make_keys(1, 2), segs(host, [2]), [2], deadline_after(WAIT))
        (rejected,) = engine.poll()  # at once, while the first store still hangs
        assert rejected.request_id == 2 and statuses(rejected.results) == ["FAILED"]
        assert rejected.results[0].reason == "store queue full"
        assert engine.rejected_stores == 1
        # loads are never refused for want of store room
        engine.submit_load(3, make_keys(1, 5), segs(host, [5]), [5], deadline_after(WAIT))
        gated.gate.set()
        done = {d.request_id: d for d in engine.wait_all(WAIT)}
        assert done[1].success and statuses(done[3].results) == ["MISS"]
        # the room is back
        engine.submit_store(4, make_keys(1, 2), segs(host, [2]), [2], deadline_after(WAIT))
        (again,) = engine.wait_all(WAIT)
        assert again.success
        assert disk.exists(make_keys(3), deadline_after(1)) == [True, True, True]
    finally:
        gated.gate.set()
        engine.close()


def test_hung_backend_fails_at_the_deadline_and_fences_host_blocks(
    disk: LocalDiskBackend,
) -> None:
    gated = GatedBackend(disk)
    host = HostMemory(LAYOUT, 8)
    want = host.fill(0, seed=0)
    keys = make_keys(1)
    assert disk.put_from(keys, segs(host, [0]), deadline_after(WAIT))[0].ok
    engine = StorageIOEngine(gated, num_threads=2)
    try:
        gated.gate.clear()
        engine.submit_load(1, keys, segs(host, [4]), [4], time.monotonic() + 0.2)
        assert gated.entered.acquire(timeout=WAIT)
        (done,) = engine.wait_all(WAIT)  # returns although the read still hangs
        assert not gated.gate.is_set()
        assert statuses(done.results) == ["TIMEOUT"]
        assert engine.busy_host_blocks() == {4}
        # host block 4 may not be reused while the stuck read can still write it
        engine.submit_load(2, keys, segs(host, [4]), [4], deadline_after(WAIT))
        engine.submit_store(3, make_keys(1, 1), segs(host, [4]), [4], deadline_after(WAIT))
        fenced = {d.request_id: d for d in engine.wait_all(WAIT)}
        for rid in (2, 3):
            assert statuses(fenced[rid].results) == ["FAILED"]
            assert "timed-out" in fenced[rid].results[0].reason
        gated.gate.set()
        wait_for(lambda: not engine.busy_host_blocks(), "the stuck read to end")
        assert engine.poll() == []  # its late result is not reported twice
        engine.submit_load(4, keys, segs(host, [4]), [4], deadline_after(WAIT))
        (ok,) = engine.wait_all(WAIT)
        assert ok.success and host.read(4) == want
        assert engine.timed_out_requests == 1
    finally:
        gated.gate.set()
        engine.close()


def test_slow_disk_request_completes_by_its_deadline(tmp_path: Path) -> None:
    backend = LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=64, io_delay_s=0.04)
    host = HostMemory(LAYOUT, 20)
    keys = make_keys(20)
    engine = StorageIOEngine(backend, num_threads=2, chunk_bytes=4 * LAYOUT.payload_bytes)
    try:
        engine.submit_store(1, keys, segs(host, range(20)), range(20), time.monotonic() + 0.15)
        (done,) = engine.wait_all(WAIT)
        got = statuses(done.results)
        assert set(got) <= {"OK", "TIMEOUT"} and "TIMEOUT" in got
        wait_for(lambda: not engine.busy_host_blocks(), "running chunks to end")
        stored = backend.exists(keys, deadline_after(1))
        # a key reported stored is stored (a timed-out one may have landed too)
        assert all(stored[i] for i, s in enumerate(got) if s == "OK")
    finally:
        engine.close()
        backend.close()


def test_invalid_requests_are_refused_and_change_nothing(disk: LocalDiskBackend) -> None:
    gated = GatedBackend(disk)
    host = HostMemory(LAYOUT, 8)
    engine = StorageIOEngine(gated, num_threads=1)
    try:
        gated.gate.clear()
        engine.submit_load(1, make_keys(2), segs(host, [0, 1]), [0, 1], deadline_after(WAIT))
        cases = [
            (
                lambda: engine.submit_load(1, make_keys(1, 5), segs(host, [5]), [5], 1e9),
                "still",
            ),
            (
                lambda: engine.submit_store(2, make_keys(1, 5), segs(host, [1]), [1], 1e9),
                "block 1",
            ),
            (
                lambda: engine.submit_load(2, make_keys(1, 5), segs(host, [0]), [0], 1e9),
                "block 0",
            ),
            (
                lambda: engine.submit_load(2, make_keys(2, 5), segs(host, [5, 6]), [5, 5], 1e9),
                "more than once",
            ),
            (
                lambda: engine.submit_load(2, make_keys(2, 5), segs(host, [5]), [5], 1e9),
                "entries",
            ),
            (
                lambda: engine.submit_store(2, make_keys(1, 5), segs(host, [5]), [-1], 1e9),
                "host_ids",
            ),
            (lambda: engine.submit_lookup(2, ["x"], 1e9), r"keys\[0\]"),
            (lambda: engine.submit_lookup(2, [], float("inf")), "deadline"),
        ]
        for call, match in cases:
            with pytest.raises(ValueError, match=match):
                call()
        assert engine.num_outstanding == 1
        gated.gate.set()
        (done,) = engine.wait_all(WAIT)
        assert done.request_id == 1
    finally:
        gated.gate.set()
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_lookup(9, [], deadline_after(1))


@pytest.mark.parametrize(
    ("second", "match"),
    [
        ((RequestKind.STORE, 4, [3]), "block 3 is used by outstanding storage request 2"),
        ((RequestKind.LOAD, 2, [6]), "request_id: 2 is still outstanding"),
    ],
)
def test_a_batch_that_clashes_within_itself_queues_nothing(
    disk: LocalDiskBackend, second, match
) -> None:
    # A step's lookup, load and write go in together: the write reading a block
    # the load writes (or an id used twice) refuses all three, the lookup included.
    host = HostMemory(LAYOUT, 8)
    engine = StorageIOEngine(disk, num_threads=1)
    try:
        kind, rid, blocks = second
        batch = [
            Submission(RequestKind.LOOKUP, 1, make_keys(2), deadline_after(WAIT)),
            Submission(
                RequestKind.LOAD, 2, make_keys(1), deadline_after(WAIT), segs(host, [3]), [3]
            ),
            Submission(
                kind, rid, make_keys(1, 9), deadline_after(WAIT), segs(host, blocks), blocks
            ),
        ]
        with pytest.raises(ValueError, match=match):
            engine.submit_all(batch)
        assert engine.num_outstanding == 0
        assert engine.wait_all(1) == []
        engine.submit_all(batch[:2])  # without the clash it goes
        assert sorted(c.request_id for c in engine.wait_all(WAIT)) == [1, 2]
    finally:
        engine.close()


def test_close_fails_queued_work_and_waits_for_running_work(disk: LocalDiskBackend) -> None:
    gated = GatedBackend(disk)
    host = HostMemory(LAYOUT, 8)
    engine = StorageIOEngine(gated, num_threads=1)
    gated.gate.clear()
    engine.submit_store(1, make_keys(1), segs(host, [0]), [0], deadline_after(WAIT))
    assert gated.entered.acquire(timeout=WAIT)
    engine.submit_store(2, make_keys(1, 1), segs(host, [1]), [1], deadline_after(WAIT))
    threading.Timer(0.1, gated.gate.set).start()
    done = {d.request_id: d for d in engine.close(WAIT)}
    assert done[1].success
    assert statuses(done[2].results) == ["FAILED"]
    assert done[2].results[0].reason == "storage I/O engine closed"
    assert disk.exists(make_keys(2), deadline_after(1)) == [True, False]


@pytest.mark.parametrize("kind", ["LOAD", 7, None])
def test_a_batch_with_an_unknown_kind_admits_nothing(disk: LocalDiskBackend, kind) -> None:
    # The bad kind comes last: the lookup and load before it must not be queued
    # (they used to sit outstanding until their deadline behind a KeyError).
    host = HostMemory(LAYOUT, 8)
    engine = StorageIOEngine(disk, num_threads=1)
    try:
        batch = [
            Submission(RequestKind.LOOKUP, 1, make_keys(2), deadline_after(WAIT)),
            Submission(
                RequestKind.LOAD, 2, make_keys(1), deadline_after(WAIT), segs(host, [3]), [3]
            ),
            Submission(kind, 3, make_keys(1, 9), deadline_after(WAIT), segs(host, [4]), [4]),
        ]
        with pytest.raises(ValueError, match="kind: must be a RequestKind"):
            engine.submit_all(batch)
        assert engine.num_outstanding == 0
        assert engine.wait_all(1) == []
    finally:
        engine.close()
