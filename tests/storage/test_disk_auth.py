"""Forged slots on disk are never served (issue 15 item 2): whoever can write the
cache directory's slot file (the same uid, root, a restored copy) writes blocks under
a victim's keys in the public format; a backend with a key ring serves none of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, TEST_AUTH, HostMemory, make_keys, statuses

from fastkv.storage.auth import StorageAuth
from fastkv.storage.local_disk import DATA_FILE, META_FILE, LocalDiskBackend, SlotGeometry

LAYOUT = LAYOUTS["fp8"]


@pytest.mark.parametrize("forgery", ["untagged", "other_key", "flipped_byte"])
def test_forged_slots_are_never_served(tmp_path: Path, forgery: str) -> None:
    """The victim stores keys[0] and keys[1]; keys[0]'s slot is then replaced:
    untagged (the public format: a valid CRC, a newer sequence number), tagged under
    another deployment's secret, or the genuine slot with one payload byte flipped."""
    host = HostMemory(LAYOUT, 8)
    want = host.fill(0, seed=0)
    keys = make_keys(2)
    with LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=4, auth=TEST_AUTH) as victim:
        assert statuses(victim.put_from(keys, [host.segments(0)] * 2, 1e12)) == ["OK"] * 2
        slot = victim._slots.index[keys[0].packed][0]
    host.fill(1, seed=99)  # the attacker's KV
    forged = host.read(1)
    if forgery == "flipped_byte":
        geometry = SlotGeometry.of(LAYOUT)
        with open(tmp_path / DATA_FILE, "r+b") as f:
            f.seek(slot * geometry.slot_bytes + geometry.header_area + 10)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
    else:
        auth = None if forgery == "untagged" else StorageAuth([b"o" * 32])
        # recover=False: every slot free, the first one (keys[0]'s) written first;
        # the attacker leaves the metadata file as it found it
        meta = (tmp_path / META_FILE).read_bytes()
        with LocalDiskBackend(
            tmp_path, LAYOUT, capacity_blocks=4, recover=False, auth=auth, reclaim=True
        ) as attacker:
            assert attacker.auth is auth
            assert statuses(attacker.put_from(keys[:1], [host.segments(1)], 1e12)) == ["OK"]
            assert attacker._slots.index[keys[0].packed][0] == slot
        (tmp_path / META_FILE).write_bytes(meta)
    with LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=4, auth=TEST_AUTH) as victim:
        assert victim.wait_recovered(10)
        host.clear(2)
        host.clear(3)
        got = victim.get_into(keys, [host.segments(2), host.segments(3)], 1e12)
        assert statuses(got) == ["MISS", "OK"], [r.reason for r in got]
        assert host.read(3) == want
        if forgery == "flipped_byte":  # indexed (its header is genuine), refused by its tag
            assert "tag does not verify" in got[0].reason
            assert victim.stats().corrupt == 1
        else:  # a slot no key of the ring made is not even indexed: its slot is free
            assert got[0].reason == "not stored"
        assert host.read(2) != forged
        # the victim's next put stores its block again
        assert victim.put_from(keys[:1], [host.segments(0)], 1e12)[0].ok
        assert statuses(victim.get_into(keys[:1], [host.segments(4)], 1e12)) == ["OK"]
        assert host.read(4) == want


def test_a_backend_without_the_ring_serves_no_tagged_block(tmp_path: Path) -> None:
    """A tagged block cannot be checked without the ring: a miss, never trusted
    (opening without the ring at all is refused: test_disk_keys.py; told to give
    the blocks up, it opens and serves none)."""
    host = HostMemory(LAYOUT, 2)
    host.fill(0, seed=0)
    keys = make_keys(1)
    with LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=2, auth=TEST_AUTH) as b:
        assert b.put_from(keys, [host.segments(0)], 1e12)[0].ok
        b_key_ids = b.auth.key_ids
    assert b_key_ids
    with LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=2, reclaim=True) as plain:
        assert plain.wait_recovered(10)
        assert statuses(plain.get_into(keys, [host.segments(1)], 1e12)) == ["MISS"]
