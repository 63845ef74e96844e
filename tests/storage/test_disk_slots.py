"""The local-disk backend's slot table (fastkv.storage.disk_slots): free slots
first, then the file grows a slab at a time up to capacity, then the least
recently used block not being read is evicted; a slot dropped while read is
free only once its last read ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastkv.storage import disk_slots
from fastkv.storage.disk_slots import SlotTable


@pytest.fixture
def fd(tmp_path: Path):
    fd = os.open(tmp_path / "blocks", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


def test_free_slots_then_a_slab_then_the_least_recently_used(
    fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_slots, "SLAB_BYTES", 2 * 4096)
    table = SlotTable(3, fd, 4096)  # slabs of 2 slots
    assert [table.take(), table.take()] == [0, 1] and table.allocated == 2
    assert os.fstat(fd).st_size == 2 * 4096
    assert table.take() == 2 and table.allocated == 3  # the last slab: what is left
    for key, slot in ((b"a", 0), (b"b", 1), (b"c", 2)):
        table.index[key] = (slot, slot + 1)
    table.index.move_to_end(b"a")  # b is now the least recently used
    table.pins[1] += 1  # ... and being read: c goes instead
    assert table.take() == 2 and list(table.index) == [b"b", b"a"]
    assert table.evictions == 1
    table.pins[0] += 1
    assert table.take() is None  # every block left is being read
    del table.index[b"b"]
    table.release(1)  # dropped while read: not free yet
    assert table.free == [] and table.retired == {1}
    table.unpin(1)
    assert table.free == [1] and table.retired == set()
    assert table.take() == 1


def test_a_file_that_cannot_grow_fails_fast_until_the_retry(
    fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def no_space(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    table = SlotTable(8, fd, 4096)
    assert table.take() is None and calls == [8 * 4096, 4 * 4096, 2 * 4096, 4096]
    assert table.grow_error is not None and table.grow_error.errno == 28
    assert table.take() is None and len(calls) == 4  # within GROW_RETRY_S: no I/O
    monkeypatch.undo()
    monkeypatch.setattr(disk_slots.time, "monotonic", lambda: 1e12)  # past the retry
    assert table.take() == 0 and table.allocated == 8 and table.grow_error is None
