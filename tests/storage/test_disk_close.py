"""LocalDiskBackend.close() with calls in flight (issue 15 item 1): nothing a put
acknowledged is lost, no file outside the cache directory is written, and close()
waits a bounded time, saying what it waits for."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, HostMemory, make_keys, statuses

from fastkv.storage import KeyResult, deadline_after
from fastkv.storage.local_disk import LocalDiskBackend, StorageDirectoryLocked

LAYOUT = LAYOUTS["bf16"]  # 512 KiB blocks, zero-copy segments
PER_THREAD = 12


def test_close_during_puts_loses_nothing_and_writes_nowhere_else(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    host = HostMemory(LAYOUT, 2 * PER_THREAD)
    want = [host.fill(b, seed=b) for b in range(2 * PER_THREAD)]
    keys = make_keys(2 * PER_THREAD)
    backend = LocalDiskBackend(cache, LAYOUT, capacity_blocks=64, io_delay_s=0.05)
    results: list[list[KeyResult]] = [[], []]
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        part = range(t * PER_THREAD, (t + 1) * PER_THREAD)
        try:
            results[t] = backend.put_from(
                [keys[b] for b in part], [host.segments(b) for b in part], deadline_after(60)
            )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # both calls are inside the C batch, a few blocks written
    assert backend.close(timeout=10) is True
    # Files the process opens next take the numbers close() freed; a batch still
    # writing through its old fd number would write into them.
    others = []
    for i in range(4):
        path = tmp_path / f"unrelated-{i}"
        path.write_bytes(b"u" * 4096)
        others.append((path, os.open(path, os.O_RDWR)))
    for t in threads:
        t.join(30)
    time.sleep(0.3)
    for path, fd in others:
        os.close(fd)
        assert path.read_bytes() == b"u" * 4096, f"{path.name} was written"
    assert not errors
    got = [s for part in results for s in statuses(part)]
    assert set(got) <= {"OK", "FAILED"} and "FAILED" in got and "OK" in got, got
    for part in results:
        for r in part:
            assert r.ok or "closed before the write" in r.reason
    with pytest.raises(RuntimeError, match="closed"):
        backend.put_from(keys[:1], [host.segments(0)], deadline_after(1))
    # Every acknowledged block is there after a restart, bit-exact.
    acked = [b for b, s in enumerate(got) if s == "OK"]
    host2 = HostMemory(LAYOUT, len(acked))
    with LocalDiskBackend(cache, LAYOUT, capacity_blocks=64) as again:
        assert again.wait_recovered(30)
        back = again.get_into(
            [keys[b] for b in acked], [host2.segments(i) for i in range(len(acked))], 1e12
        )
        assert statuses(back) == ["OK"] * len(acked)
        assert [host2.read(i) for i in range(len(acked))] == [want[b] for b in acked]


def test_close_with_a_stuck_call_waits_bounded_and_never_closes_under_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A call stuck longer than close()'s bound (here: 1.5 s inside one block) keeps
    the files open and the directory locked until it returns; close() says so."""
    host = HostMemory(LAYOUT, 2)
    host.fill(0, seed=0)
    keys = make_keys(2)
    backend = LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=4, io_delay_s=1.5)
    out: list[list[KeyResult]] = []
    t = threading.Thread(
        target=lambda: out.append(
            backend.put_from(keys, [host.segments(0)] * 2, deadline_after(60))
        )
    )
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastkv.storage.local_disk"):
        assert backend.close(timeout=0.3) is False
    assert 0.25 < time.monotonic() - t0 < 1.0
    assert "1 call(s) still inside a disk read or write" in caplog.text
    with pytest.raises(StorageDirectoryLocked):
        LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=4)
    t.join(10)
    # the stall (injected before each block's I/O) ended after close(): no block
    # started, none is acknowledged, and the last call out released the files
    assert [r.reason for r in out[0]] == ["the backend closed before the write"] * 2
    with LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=4) as again:
        assert again.wait_recovered(10)
        assert statuses(again.get_into(keys, [host.segments(1)] * 2, 1e12)) == ["MISS"] * 2


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_call_whose_io_raises_counts_out_and_gives_its_slots_back(
    tmp_path: Path, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put or get whose batch raises leaves nothing behind: its slot is free
    again (a put) or unpinned (a get), and close() finds no call in flight."""
    from fastkv.storage import local_disk

    host = HostMemory(LAYOUT, 2)
    host.fill(0, seed=0)
    keys = make_keys(2)
    backend = LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=1)
    assert statuses(backend.put_from(keys[:1], [host.segments(0)], deadline_after(10))) == [
        "OK"
    ]

    def broken(*args: object) -> list[int]:
        raise OSError(5, "injected")

    name = "write_batch" if op == "put" else "read_batch"
    monkeypatch.setattr(local_disk._disk_io, name, broken)
    call = backend.put_from if op == "put" else backend.get_into
    with pytest.raises(OSError, match="injected"):
        call(keys[1:] if op == "put" else keys[:1], [host.segments(1)], deadline_after(10))
    monkeypatch.undo()
    # the one slot: a put's failed write gave it back (it evicted keys[0] to take
    # it); a get's pin is gone, so a new put may evict keys[0] and reuse it
    assert statuses(backend.put_from(keys[1:], [host.segments(1)], deadline_after(10))) == [
        "OK"
    ]
    t0 = time.monotonic()
    assert backend.close(timeout=5.0) is True
    assert time.monotonic() - t0 < 1.0
