"""Issue 25 item 12: a disk cache directory keeps the blocks its backend cannot
verify. One start without the key file used to treat every tagged slot as free
(16 of 16 blocks lost when the key came back), and a key file rolled back one
version lost the newer key's blocks the same way."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, HostMemory, make_keys, statuses

from fastkv.storage import deadline_after
from fastkv.storage.auth import ENV_KEY_FILE, StorageAuth
from fastkv.storage.disk_keys import ENV_RECLAIM, StorageKeyMissing
from fastkv.storage.local_disk import META_FILE, LocalDiskBackend

LAYOUT = LAYOUTS["fp8"]
OLD = StorageAuth([b"\x01" * 32])
NEW = StorageAuth([b"\x02" * 32, b"\x01" * 32])  # the next version of the key file
SOON = 30.0


def open_disk(
    path: Path, auth: StorageAuth | None, capacity: int = 8, **kw
) -> LocalDiskBackend:
    backend = LocalDiskBackend(path, LAYOUT, capacity_blocks=capacity, auth=auth, **kw)
    assert backend.wait_recovered(SOON)
    return backend


def put_all(backend: LocalDiskBackend, host: HostMemory, keys: list, first: int) -> None:
    blocks = [host.segments(first + i) for i in range(len(keys))]
    assert statuses(backend.put_from(keys, blocks, deadline_after(SOON))) == ["OK"] * len(keys)


def read_back(backend: LocalDiskBackend, host: HostMemory, keys: list, want: list) -> list:
    """Each key's status, and whether an OK one holds exactly its block."""
    out = []
    for key, block in zip(keys, want, strict=True):
        host.clear(host.num_blocks - 1)
        res = backend.get_into([key], [host.segments(host.num_blocks - 1)], deadline_after(5))
        exact = host.read(host.num_blocks - 1) == block
        out.append(res[0].status.name if not res[0].ok or exact else "WRONG")
    return out


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.delenv(ENV_RECLAIM, raising=False)
    return monkeypatch


@pytest.mark.parametrize("without", ["unset", "empty", "another_key"])
def test_a_start_without_the_key_is_refused_and_every_block_survives(
    tmp_path: Path, no_env: pytest.MonkeyPatch, without: str
) -> None:
    host = HostMemory(LAYOUT, 17)
    want = [host.fill(b, seed=b) for b in range(16)]
    keys = make_keys(16)
    with open_disk(tmp_path, OLD, capacity=16) as backend:
        put_all(backend, host, keys, 0)
    meta = (tmp_path / META_FILE).read_bytes()
    auth = StorageAuth([b"\x03" * 32]) if without == "another_key" else None
    if without == "empty":
        no_env.setenv(ENV_KEY_FILE, "")
    with pytest.raises(StorageKeyMissing) as refused:
        LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=16, auth=auth)
    message = str(refused.value)
    assert str(tmp_path) in message and ENV_KEY_FILE in message and ENV_RECLAIM in message
    assert f"{OLD.write_key_id:#010x}" in message
    assert (tmp_path / META_FILE).read_bytes() == meta  # nothing changed
    with open_disk(tmp_path, OLD, capacity=16) as backend:  # the key is back
        assert read_back(backend, host, keys, want) == ["OK"] * 16


def test_a_key_file_rolled_back_one_version_keeps_the_newer_keys_blocks(
    tmp_path: Path, no_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    host = HostMemory(LAYOUT, 13)
    want = [host.fill(b, seed=b) for b in range(12)]
    keys = make_keys(12)
    a, b, c = keys[:4], keys[4:8], keys[8:]
    with open_disk(tmp_path, OLD) as backend:
        put_all(backend, host, a, 0)
    with open_disk(tmp_path, NEW) as backend:  # the new key signs from now on
        put_all(backend, host, b, 4)
    with caplog.at_level(logging.WARNING), open_disk(tmp_path, OLD) as backend:  # rolled back
        assert read_back(backend, host, a, want[:4]) == ["OK"] * 4
        assert backend.exists(b, deadline_after(1)) == [False] * 4
        assert backend._slots.held == 4
        # a full directory: new blocks take the old key's slots, never the held ones
        put_all(backend, host, c, 8)
        assert backend.stats().evictions == 4
    assert any("4 slots hold blocks signed by key ids" in r.message for r in caplog.records)
    with open_disk(tmp_path, NEW) as backend:
        assert read_back(backend, host, b + c, want[4:]) == ["OK"] * 8


@pytest.mark.parametrize("told", ["argument", "environment"])
def test_reclaim_gives_the_blocks_of_a_missing_key_up(
    tmp_path: Path, no_env: pytest.MonkeyPatch, told: str
) -> None:
    host = HostMemory(LAYOUT, 9)
    want = [host.fill(b, seed=b) for b in range(8)]
    keys = make_keys(8)
    with open_disk(tmp_path, OLD) as backend:
        put_all(backend, host, keys[:4], 0)
    with open_disk(tmp_path, NEW) as backend:
        put_all(backend, host, keys[4:], 4)
    if told == "environment":
        no_env.setenv(ENV_RECLAIM, "1")
    with open_disk(tmp_path, OLD, reclaim=True if told == "argument" else None) as backend:
        assert backend._slots.held == 0 and len(backend._slots.free) == 4
        assert read_back(backend, host, keys, want) == ["OK"] * 4 + ["MISS"] * 4
    no_env.delenv(ENV_RECLAIM, raising=False)
    assert json.loads((tmp_path / META_FILE).read_bytes())["key_ids"] == [OLD.write_key_id]
    with open_disk(tmp_path, OLD) as backend:  # not held again by a later start
        assert backend._slots.held == 0 and len(backend._slots.free) == 4
    # no ring and reclaim: every tagged slot is free
    with open_disk(tmp_path, None, reclaim=True) as backend:
        assert len(backend._slots.free) == 8 and backend.auth is None
    no_env.setenv(ENV_RECLAIM, "yes")
    with pytest.raises(ValueError, match=f"{ENV_RECLAIM}: must be 1 .* got 'yes'"):
        LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=8, auth=OLD)
    with pytest.raises(ValueError, match="reclaim: must be None, True or False"):
        LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=8, auth=OLD, reclaim=1)  # type: ignore[arg-type]


def test_a_directory_from_before_key_ids_were_recorded_keeps_its_blocks(
    tmp_path: Path, no_env: pytest.MonkeyPatch
) -> None:
    """Its metadata names no key: the first start without the key holds every
    tagged slot and records their key ids; the next such start is refused."""
    host = HostMemory(LAYOUT, 5)
    want = [host.fill(b, seed=b) for b in range(4)]
    keys = make_keys(4)
    with open_disk(tmp_path, OLD, capacity=4) as backend:
        put_all(backend, host, keys, 0)
    meta = json.loads((tmp_path / META_FILE).read_bytes())
    del meta["key_ids"]
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with open_disk(tmp_path, None, capacity=4) as backend:
        assert backend._slots.held == 4
        res = backend.put_from(make_keys(1, 50), [host.segments(0)], deadline_after(SOON))
        assert statuses(res) == ["FAILED"] and "4 held" in res[0].reason
    with pytest.raises(StorageKeyMissing):
        LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=4)
    with open_disk(tmp_path, OLD, capacity=4) as backend:
        assert read_back(backend, host, keys, want) == ["OK"] * 4
