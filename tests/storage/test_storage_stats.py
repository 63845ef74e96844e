"""Both backends count the same way: every key of every call once, by its result
(puts = keys asked to store, so put_failures never exceeds puts)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from fake_mooncake import FakeMooncakeStore
from storage_helpers import LAYOUTS, TEST_AUTH, HostMemory, make_keys, statuses

from fastkv.storage import KeyResult, KeyStatus, StorageStats, deadline_after
from fastkv.storage.base import ALREADY_STORED, OK
from fastkv.storage.local_disk import LocalDiskBackend
from fastkv.storage.mooncake import MooncakeBackend
from fastkv.storage.mooncake.options import MooncakeOptions

LAYOUT = LAYOUTS["fp8"]
SOON = 30.0


def check_counts(
    stats: StorageStats, gets: Sequence[list[KeyResult]], puts: Sequence[list[KeyResult]]
) -> None:
    """The counters agree with the results the calls returned."""
    got = [r for call in gets for r in call]
    put = [r for call in puts for r in call]
    payload = LAYOUT.payload_bytes

    def count(results: list[KeyResult], status: KeyStatus) -> int:
        return sum(r.status == status for r in results)

    already = sum(r == ALREADY_STORED for r in put)
    assert stats.puts == len(put)
    assert stats.put_failures == len(put) - count(put, KeyStatus.OK)
    assert stats.put_already_stored == already
    assert stats.put_failures + stats.put_already_stored <= stats.puts
    assert stats.put_bytes == (count(put, KeyStatus.OK) - already) * payload
    assert stats.gets == len(got)
    assert stats.misses == count(got, KeyStatus.MISS)
    assert stats.get_failures == count(got, KeyStatus.FAILED)
    assert stats.get_bytes == count(got, KeyStatus.OK) * payload
    assert stats.timeouts == count(got, KeyStatus.TIMEOUT) + count(put, KeyStatus.TIMEOUT)


def test_local_disk_counts_every_key_asked(tmp_path: Path) -> None:
    host = HostMemory(LAYOUT, 4)
    host.fill(0, seed=0)
    k = make_keys(4)
    block = host.segments(0)
    gets: list[list[KeyResult]] = []
    puts: list[list[KeyResult]] = []
    with LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=1) as backend:
        # one slot: k0 is written, its repeat shares it, k1 finds no free slot
        puts.append(backend.put_from([k[0], k[1], k[0]], [block] * 3, deadline_after(SOON)))
        assert statuses(puts[-1]) == ["OK", "FAILED", "OK"]
        assert puts[-1][2] == ALREADY_STORED
        puts.append(backend.put_from([k[0]], [block], deadline_after(SOON)))
        assert puts[-1] == [ALREADY_STORED]
        stats = backend.stats()
        assert (stats.puts, stats.put_failures, stats.put_already_stored) == (4, 1, 2)
        gets.append(
            backend.get_into(
                [k[0], k[2], k[0]], [host.segments(b) for b in (1, 2, 3)], deadline_after(SOON)
            )
        )
        assert statuses(gets[-1]) == ["OK", "MISS", "OK"]
        gets.append(backend.get_into([k[0]], [host.segments(1)], time.monotonic() - 1))
        assert statuses(gets[-1]) == ["TIMEOUT"]
        # a deadline already passed: the write and its repeat both time out
        puts.append(backend.put_from([k[3], k[3]], [block] * 2, time.monotonic() - 1))
        assert statuses(puts[-1]) == ["TIMEOUT", "TIMEOUT"]
        check_counts(backend.stats(), gets, puts)


@pytest.mark.parametrize("staged", [False, True], ids=["zero_copy", "staged"])
def test_mooncake_counts_every_key_asked(staged: bool) -> None:
    store = FakeMooncakeStore()
    object_bytes = 128 + LAYOUT.payload_bytes
    options = MooncakeOptions(
        staging_bytes=4 * 4 * object_bytes if staged else 0, auth=TEST_AUTH
    )
    backend = MooncakeBackend(LAYOUT, options, store=store)
    host = HostMemory(LAYOUT, 4)
    backend.register_host_memory(host.base, host.nbytes)
    host.fill(0, seed=0)
    k = make_keys(4)
    block = host.segments(0)
    store.fail_put[k[1].text()] = -1
    gets: list[list[KeyResult]] = []
    puts: list[list[KeyResult]] = []
    with backend:
        puts.append(backend.put_from([k[0], k[1], k[3]], [block] * 3, deadline_after(SOON)))
        assert statuses(puts[-1]) == ["OK", "FAILED", "OK"]
        store.fail_get[k[3].text()] = -1  # after its put: the put's read-back passed
        # stored before: zero-copy finds it and counts it as already stored; staged
        # replaces it unread (an upsert), so it counts as stored again
        puts.append(backend.put_from([k[0]], [block], deadline_after(SOON)))
        assert puts[-1] == [OK if staged else ALREADY_STORED]
        assert backend.stats().put_already_stored == (0 if staged else 1)
        puts.append(backend.put_from([k[2]], [block], time.monotonic() - 1))
        assert statuses(puts[-1]) == ["TIMEOUT"]
        gets.append(
            backend.get_into(
                [k[0], k[2], k[3]], [host.segments(b) for b in (1, 2, 3)], deadline_after(SOON)
            )
        )
        assert statuses(gets[-1]) == ["OK", "MISS", "FAILED"]
        assert host.read(1) == host.read(0)
        gets.append(backend.get_into([k[0]], [host.segments(1)], time.monotonic() - 1))
        assert statuses(gets[-1]) == ["TIMEOUT"]
        check_counts(backend.stats(), gets, puts)
