"""The local-disk backend on a real filesystem: every test asserts that nothing is
served wrong (bit-exact or a counted miss)."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from storage_helpers import LAYOUTS, HostMemory, make_keys, make_namespace, statuses

from fastkv.storage import (
    BlockLayout,
    KeyStatus,
    StorageKey,
    _disk_io,
    deadline_after,
    local_disk,
)
from fastkv.storage.base import check_segments
from fastkv.storage.local_disk import (
    DATA_FILE,
    LocalDiskBackend,
    SlotGeometry,
    StorageDirectoryLocked,
)

REPO = Path(__file__).resolve().parents[2]
SOON = 30.0


def open_backend(path: Path, layout: BlockLayout, capacity: int = 16, **kw) -> LocalDiskBackend:
    return LocalDiskBackend(path, layout, capacity_blocks=capacity, **kw)


def put(backend, host: HostMemory, keys, blocks) -> list[str]:
    return statuses(
        backend.put_from(keys, [host.segments(b) for b in blocks], deadline_after(SOON))
    )


def get(backend, host: HostMemory, keys, blocks) -> list[str]:
    return statuses(
        backend.get_into(keys, [host.segments(b) for b in blocks], deadline_after(SOON))
    )


@pytest.mark.parametrize("direct_io", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_round_trip_is_bit_exact(tmp_path: Path, layout_name: str, direct_io: bool) -> None:
    layout = LAYOUTS[layout_name]
    host = HostMemory(layout, 12)
    want = [host.fill(b, seed=b) for b in range(6)]
    keys = make_keys(6)
    with open_backend(tmp_path, layout, direct_io=direct_io) as backend:
        assert backend.direct_io is direct_io
        assert put(backend, host, keys, range(6)) == ["OK"] * 6
        for b in range(6, 12):
            host.clear(b, 0xAB)
        assert get(backend, host, keys, range(6, 12)) == ["OK"] * 6
        assert [host.read(b) for b in range(6, 12)] == want
        stats = backend.stats()
    assert (stats.puts, stats.gets, stats.misses, stats.corrupt) == (6, 6, 0, 0)
    assert stats.put_bytes == stats.get_bytes == 6 * layout.payload_bytes


def test_small_slots_go_through_the_page_cache_large_ones_direct(tmp_path: Path) -> None:
    # direct_io=None: a slot under DIRECT_MIN_SLOT_BYTES is written buffered (an
    # O_DIRECT write of a few KiB is a device round trip); larger ones O_DIRECT,
    # on this filesystem, which takes it (the tests above require it).
    small = BlockLayout((4096,))
    large = BlockLayout((local_disk.DIRECT_MIN_SLOT_BYTES,))
    assert SlotGeometry.of(small).slot_bytes < local_disk.DIRECT_MIN_SLOT_BYTES
    with open_backend(tmp_path / "small", small) as backend:
        assert backend.direct_io is False
        host = HostMemory(small, 4)
        want = [host.fill(b, seed=b) for b in range(2)]
        assert put(backend, host, make_keys(2), range(2)) == ["OK"] * 2
        assert get(backend, host, make_keys(2), range(2, 4)) == ["OK"] * 2
        assert [host.read(b) for b in range(2, 4)] == want
    with open_backend(tmp_path / "large", large) as backend:
        assert backend.direct_io is True
    with open_backend(tmp_path / "forced", small, direct_io=True) as backend:
        assert backend.direct_io is True


def test_misaligned_host_memory_goes_through_the_bounce_buffer(tmp_path: Path) -> None:
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 4, misalign=64)
    assert host.segments(0)[0][0] % 4096 == 64
    want = [host.fill(b, seed=10 + b) for b in range(2)]
    with open_backend(tmp_path, layout, direct_io=True) as backend:
        assert put(backend, host, make_keys(2), [0, 1]) == ["OK", "OK"]
        assert get(backend, host, make_keys(2), [2, 3]) == ["OK", "OK"]
    assert [host.read(2), host.read(3)] == want


def test_a_read_without_a_staging_buffer_fails_and_keeps_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ST_NO_BOUNCE (the Python side chose pipelined reads, the C side finds host
    memory O_DIRECT cannot take) is a local staging problem: FAILED, not a corrupt
    block to forget."""
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 4, misalign=64)
    want = [host.fill(b, seed=20 + b) for b in range(2)]
    keys = make_keys(2)
    with open_backend(tmp_path, layout, direct_io=True) as backend:
        assert put(backend, host, keys, [0, 1]) == ["OK", "OK"]
        monkeypatch.setattr(backend, "_needs_full_bounce", lambda blocks, todo: False)
        res = backend.get_into(keys, [host.segments(b) for b in (2, 3)], deadline_after(SOON))
        assert statuses(res) == ["FAILED", "FAILED"]
        assert "no staging buffer" in res[0].reason
        stats = backend.stats()
        assert (stats.corrupt, stats.get_failures, stats.misses) == (0, 2, 0)
        assert backend.exists(keys, deadline_after(1)) == [True, True]
        monkeypatch.undo()
        assert get(backend, host, keys, [2, 3]) == ["OK", "OK"]
    assert [host.read(2), host.read(3)] == want


def test_round_trip_from_the_cache_controllers_host_tier(tmp_path: Path) -> None:
    """fp8 K/V per layer, their float32 scales and an extra layer, exactly as the
    worker's host cache lays them out."""
    from fastkv.worker import CacheController, KVCacheSpec

    spec = KVCacheSpec(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        num_device_blocks=4,
        num_host_blocks=8,
        dtype="fp8",
        num_extra_layers=1,
    )
    with CacheController(spec) as ctrl:
        n = len(ctrl.block_bytes)
        assert n == 12
        layout = BlockLayout(tuple(ctrl.block_bytes))

        def segments(b: int) -> list[tuple[int, int]]:
            """Host block b as the storage bridge hands it: one contiguous segment."""
            return [(ctrl.host_ptrs[0] + b * ctrl.host_stride, ctrl.host_stride)]

        def per_tensor(b: int) -> list[tuple[int, int]]:
            """The same block as the layout's segments, one per cache tensor."""
            return [
                (ctrl.host_ptrs[i] + b * ctrl.host_stride, ctrl.block_bytes[i])
                for i in range(n)
            ]

        rng = np.random.default_rng(5)
        for i in range(n):
            view = ctrl.host_blocks(i)
            view[:4] = rng.integers(0, 256, view[:4].shape, dtype=np.uint8)
        want = [[ctrl.host_blocks(i)[b].copy() for i in range(n)] for b in range(4)]
        keys = make_keys(4)
        with open_backend(tmp_path, layout) as backend:
            res = backend.put_from(keys, [segments(b) for b in range(4)], deadline_after(SOON))
            assert statuses(res) == ["OK"] * 4
            res = backend.get_into(
                keys, [segments(b) for b in range(4, 8)], deadline_after(SOON)
            )
            assert statuses(res) == ["OK"] * 4
            for b in range(4):
                for i in range(n):
                    assert np.array_equal(ctrl.host_blocks(i)[4 + b], want[b][i])
            # Byte-compatible: what one form stored, the other reads back.
            ctrl.host_tier()[4:8] = 0
            res = backend.get_into(
                keys, [per_tensor(b) for b in range(4, 8)], deadline_after(SOON)
            )
            assert statuses(res) == ["OK"] * 4
            assert np.array_equal(ctrl.host_tier()[4:8], ctrl.host_tier()[0:4])


def _slot_offset(backend: LocalDiskBackend, key: StorageKey) -> int:
    slot, _ = backend._slots.index[key.packed]
    return slot * backend.geometry.slot_bytes


def _flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["large_segment", "scale_segment", "header"])
def test_flipped_byte_is_a_counted_miss(tmp_path: Path, where: str) -> None:
    layout = LAYOUTS["fp8"]
    geometry = SlotGeometry.of(layout)
    host = HostMemory(layout, 6)
    want = [host.fill(b, seed=b) for b in range(3)]
    keys = make_keys(3)
    with open_backend(tmp_path, layout) as backend:
        assert put(backend, host, keys, range(3)) == ["OK"] * 3
        inside = {
            "large_segment": int(geometry.segment_offsets[1]) + 1000,
            "scale_segment": int(geometry.segment_offsets[2]) + 5,
            "header": 50,  # inside the block hash
        }[where]
        _flip_byte(tmp_path / DATA_FILE, _slot_offset(backend, keys[1]) + inside)
        res = backend.get_into(
            keys, [host.segments(b) for b in range(3, 6)], deadline_after(SOON)
        )
        assert statuses(res) == ["OK", "MISS", "OK"]
        assert "rejected" in res[1].reason
        assert [host.read(3), host.read(5)] == [want[0], want[2]]
        stats = backend.stats()
        assert (stats.corrupt, stats.misses) == (1, 1)
        # forgotten: a second read is a plain miss, and the slot is free again
        assert backend.exists(keys, deadline_after(1)) == [True, False, True]
        assert get(backend, host, keys[1:2], [4]) == ["MISS"]
        assert backend.stats().corrupt == 1


def test_truncated_slab_is_a_miss_and_the_rest_is_served(tmp_path: Path) -> None:
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 8)
    want = [host.fill(b, seed=b) for b in range(4)]
    keys = make_keys(4)
    with open_backend(tmp_path, layout, capacity=4) as backend:
        assert put(backend, host, keys, range(4)) == ["OK"] * 4
        last = max(range(4), key=lambda i: _slot_offset(backend, keys[i]))
        cut = _slot_offset(backend, keys[last]) + backend.geometry.slot_bytes // 2
        os.truncate(tmp_path / DATA_FILE, cut)
        res = get(backend, host, keys, range(4, 8))
        assert res == ["MISS" if i == last else "OK" for i in range(4)]
        assert all(host.read(4 + i) == want[i] for i in range(4) if i != last)
        assert backend.stats().corrupt == 1
    # a new process drops the partial slot and recovers the others
    with open_backend(tmp_path, layout, capacity=4) as backend:
        assert backend.wait_recovered(SOON)
        assert backend.exists(keys, deadline_after(1)) == [i != last for i in range(4)]


def test_slot_holding_another_block_is_a_miss(tmp_path: Path) -> None:
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 4)
    host.fill(0, seed=0)
    host.fill(1, seed=1)
    keys = make_keys(2)
    with open_backend(tmp_path, layout) as backend:
        assert put(backend, host, keys, [0, 1]) == ["OK", "OK"]
        slot_bytes = backend.geometry.slot_bytes
        fd = os.open(tmp_path / DATA_FILE, os.O_RDWR)
        a, b = _slot_offset(backend, keys[0]), _slot_offset(backend, keys[1])
        os.pwrite(fd, os.pread(fd, slot_bytes, a), b)  # a same-size, valid, wrong block
        os.close(fd)
        assert get(backend, host, keys, [2, 3]) == ["OK", "MISS"]
        assert backend.stats().corrupt == 1


def test_restart_recovers_in_the_background_and_lookups_never_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 16)
    want = [host.fill(b, seed=b) for b in range(8)]
    keys = make_keys(8)
    with open_backend(tmp_path, layout, capacity=16) as backend:
        assert put(backend, host, keys, range(8)) == ["OK"] * 8

    gate = threading.Event()
    real_scan = local_disk._disk_io.scan_headers

    def gated_scan(*args):
        assert gate.wait(SOON)
        return real_scan(*args)

    monkeypatch.setattr(local_disk._disk_io, "scan_headers", gated_scan)
    # a larger capacity than the file holds: a put may grow the file meanwhile
    with open_backend(tmp_path, layout, capacity=32) as backend:
        # the scan has not reached anything: misses, answered at once
        assert backend.recovering
        assert backend.exists(keys, deadline_after(1)) == [False] * 8
        assert get(backend, host, keys[:2], [8, 9]) == ["MISS", "MISS"]
        # a put during the scan takes a new slot, never an unscanned one
        new = make_keys(1, start=100)
        host.fill(10, seed=100)
        assert put(backend, host, new, [10]) == ["OK"]
        gate.set()
        assert backend.wait_recovered(SOON)
        assert backend.exists([*keys, *new], deadline_after(1)) == [True] * 9
        assert get(backend, host, keys, range(8, 16)) == ["OK"] * 8
        assert [host.read(b) for b in range(8, 16)] == want
        assert backend.stats().stored_blocks == 9


def test_put_into_a_full_file_during_recovery_fails_fast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = LAYOUTS["odd"]
    host = HostMemory(layout, 4)
    host.fill(0, seed=0)
    with open_backend(tmp_path, layout, capacity=2) as backend:
        assert put(backend, host, make_keys(2), [0, 0]) == ["OK", "OK"]
    gate = threading.Event()
    real_scan = local_disk._disk_io.scan_headers
    monkeypatch.setattr(
        local_disk._disk_io, "scan_headers", lambda *a: gate.wait(SOON) and real_scan(*a)
    )
    with open_backend(tmp_path, layout, capacity=2) as backend:
        res = backend.put_from(make_keys(1, 50), [host.segments(1)], deadline_after(SOON))
        assert statuses(res) == ["FAILED"]
        assert "recovery" in res[0].reason
        gate.set()
        assert backend.wait_recovered(SOON)
        assert backend.exists(make_keys(2), deadline_after(1)) == [True, True]


def test_second_backend_on_a_directory_is_refused(tmp_path: Path) -> None:
    layout = LAYOUTS["odd"]
    with open_backend(tmp_path, layout):
        with pytest.raises(StorageDirectoryLocked, match=f"pid {os.getpid()}"):
            open_backend(tmp_path, layout)
        code = (
            "import sys; from fastkv.storage import BlockLayout\n"
            "from fastkv.storage.local_disk import LocalDiskBackend, StorageDirectoryLocked\n"
            "try:\n"
            f"    LocalDiskBackend(sys.argv[1], BlockLayout({layout.segment_lengths}), 4)\n"
            "except StorageDirectoryLocked as e:\n"
            "    print('LOCKED', e); sys.exit(0)\n"
            "sys.exit(1)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "in use by another fastkv storage backend" in proc.stdout
    # released on close
    open_backend(tmp_path, layout).close()


def test_directory_of_another_layout_is_refused(tmp_path: Path) -> None:
    open_backend(tmp_path, LAYOUTS["odd"]).close()
    with pytest.raises(ValueError, match="another layout"):
        open_backend(tmp_path, LAYOUTS["fp8"])
    open_backend(tmp_path, LAYOUTS["odd"]).close()  # the lock was released


def test_lru_eviction_keeps_recently_used_blocks(tmp_path: Path) -> None:
    layout = LAYOUTS["odd"]
    host = HostMemory(layout, 8)
    want = [host.fill(b, seed=b) for b in range(4)]
    keys = make_keys(4)
    with open_backend(tmp_path, layout, capacity=3) as backend:
        assert put(backend, host, keys[:3], range(3)) == ["OK"] * 3
        assert get(backend, host, keys[:1], [5]) == ["OK"]  # 0 is now the most recent
        assert put(backend, host, keys[3:], [3]) == ["OK"]  # evicts 1
        assert backend.exists(keys, deadline_after(1)) == [True, False, True, True]
        assert get(backend, host, keys, range(4, 8)) == ["OK", "MISS", "OK", "OK"]
        assert [host.read(4), host.read(6), host.read(7)] == [want[0], want[2], want[3]]
        stats = backend.stats()
    assert (stats.evictions, stats.stored_blocks, stats.corrupt) == (1, 3, 0)


def test_capacity_in_bytes_rounds_down_to_whole_slots(tmp_path: Path) -> None:
    layout = LAYOUTS["bf16"]
    slot = SlotGeometry.of(layout).slot_bytes
    with LocalDiskBackend(tmp_path, layout, capacity_bytes=3 * slot + slot // 2) as backend:
        assert backend.stats().capacity_blocks == 3


def test_slot_being_read_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 4)
    want = host.fill(0, seed=0)
    host.fill(1, seed=1)
    a, b = make_keys(2)
    reading, release = threading.Event(), threading.Event()
    real_read = local_disk._disk_io.read_batch

    def slow_read(*args):
        reading.set()
        assert release.wait(SOON)
        return real_read(*args)

    with open_backend(tmp_path, layout, capacity=1) as backend:
        assert put(backend, host, [a], [0]) == ["OK"]
        monkeypatch.setattr(local_disk._disk_io, "read_batch", slow_read)
        out: list = []
        reader = threading.Thread(target=lambda: out.append(get(backend, host, [a], [2])))
        reader.start()
        assert reading.wait(SOON)
        res = backend.put_from([b], [host.segments(1)], deadline_after(SOON))
        assert statuses(res) == ["FAILED"]  # the only slot is being read
        assert "being read or written" in res[0].reason
        release.set()
        reader.join(SOON)
        assert out == [["OK"]]
        assert host.read(2) == want
        monkeypatch.setattr(local_disk._disk_io, "read_batch", real_read)
        assert put(backend, host, [b], [1]) == ["OK"]  # now it may evict a
        assert backend.exists([a, b], deadline_after(1)) == [False, True]


def test_slow_disk_deadlines_hold(tmp_path: Path) -> None:
    layout = LAYOUTS["odd"]
    host = HostMemory(layout, 20)
    want = [host.fill(b, seed=b) for b in range(10)]
    keys = make_keys(10)
    with open_backend(tmp_path, layout, io_delay_s=0.05) as backend:
        res = backend.put_from(
            keys, [host.segments(b) for b in range(10)], time.monotonic() + 0.12
        )
        got = statuses(res)
        assert set(got) <= {"OK", "TIMEOUT"}
        assert "TIMEOUT" in got
        ok = got.count("OK")
        assert got == ["OK"] * ok + ["TIMEOUT"] * (10 - ok)  # in order, nothing lost
        assert backend.exists(keys, deadline_after(1)) == [s == "OK" for s in got]
        # a deadline already passed: nothing is read (keys not stored answer miss)
        late = backend.get_into(
            keys, [host.segments(b) for b in range(10, 20)], time.monotonic()
        )
        assert statuses(late) == ["TIMEOUT"] * ok + ["MISS"] * (10 - ok)
        backend.io_delay_s = 0.0
        assert get(backend, host, keys[:ok], range(10, 10 + ok)) == ["OK"] * ok
        assert [host.read(10 + b) for b in range(ok)] == want[:ok]
        assert backend.stats().timeouts == 10


def test_namespaces_differing_in_one_field_never_share_a_hit(tmp_path: Path) -> None:
    layout = LAYOUTS["odd"]
    host = HostMemory(layout, 2)
    host.fill(0, seed=0)
    base = make_namespace()
    changes = {
        "cache_namespace": "other-ns",
        "model_id": "other-model",
        "revision": "r2",
        "kv_dtype": "fp8",
        "block_size": 32,
        "tp_size": 2,
        "num_layers": 5,
        "num_extra_layers": 1,
        "num_kv_heads": 4,
        "head_dim": 128,
        "scale_format": "per-head-f32",
        "layout_version": 2,
    }
    assert set(changes) == {f.name for f in dataclasses.fields(base)}
    others = [dataclasses.replace(base, **{k: v}).digest() for k, v in changes.items()]
    assert len({base.digest(), *others}) == len(others) + 1
    with open_backend(tmp_path, layout) as backend:
        stored = make_keys(1, namespace=base.digest())
        assert put(backend, host, stored, [0]) == ["OK"]
        probes = [make_keys(1, namespace=ns)[0] for ns in others]
        probes.append(make_keys(1, namespace=base.digest(), rank=1)[0])  # another rank
        assert backend.exists(probes, deadline_after(1)) == [False] * len(probes)
        assert get(backend, host, probes, [1] * len(probes)) == ["MISS"] * len(probes)
        assert backend.exists(stored, deadline_after(1)) == [True]


def test_invalid_input_is_refused_before_anything_changes(tmp_path: Path) -> None:
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 2)
    keys = make_keys(2)
    segs = [host.tensor_segments(0), host.tensor_segments(1)]  # the layout's form
    one = [host.segments(0), host.segments(1)]  # the host tier's: one segment a block
    with open_backend(tmp_path, layout) as backend:
        before = backend.stats()
        bad_cases = [
            (keys, segs[:1], "blocks: 1 entries for 2 keys"),
            (keys, [segs[0], segs[1][:-1]], r"blocks\[1\]: 11 segments"),
            (keys, [segs[0], [*segs[1][:-1], (segs[1][-1][0], 31)]], r"length 31"),
            (keys, [segs[0], [(0, n) for _, n in segs[1]]], r"address must be"),
            ([keys[0], "nope"], segs, r"keys\[1\]"),
            (keys, [one[0], segs[1]], r"blocks\[1\]: 12 segments, the call \(as blocks\[0\]\)"),
            (keys, [one[0], [(one[1][0][0], 100)]], r"blocks\[1\]\[0\]: length 100 != layout"),
            (keys, [segs[0], one[1]], r"blocks\[1\]: 1 segments, the layout has 12"),
        ]
        for k, s, match in bad_cases:
            with pytest.raises(ValueError, match=match):
                backend.put_from(k, s, deadline_after(1))
            with pytest.raises(ValueError, match=match):
                backend.get_into(k, s, deadline_after(1))
        with pytest.raises(ValueError, match="deadline"):
            backend.put_from(keys, segs, float("nan"))
        assert backend.stats() == before
        assert backend.exists(keys, deadline_after(1)) == [False, False]
    with pytest.raises(ValueError, match="capacity_blocks"):
        LocalDiskBackend(tmp_path / "x", layout, capacity_blocks=0)
    with pytest.raises(ValueError, match="exactly one"):
        LocalDiskBackend(tmp_path / "x", layout, capacity_blocks=1, capacity_bytes=1 << 30)
    with pytest.raises(ValueError, match="rank"):
        StorageKey(b"n" * 32, b"h" * 32, 70000)


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: s[:-1],
        lambda s: [*s[:-1], (s[-1][0], 31)],
        lambda s: [*s[:-1], (s[-1][0], 32.5)],
        lambda s: [*s[:-1], (s[-1][0], "32")],
        lambda s: [(0, s[0][1]), *s[1:]],
        lambda s: [(-4096, s[0][1]), *s[1:]],
        lambda s: [(True, s[0][1]), *s[1:]],
        lambda s: [(float(s[0][0]), s[0][1]), *s[1:]],
        lambda s: [(s[0][0],), *s[1:]],
        lambda s: [(s[0][0], s[0][1], 0), *s[1:]],
        lambda s: [5, *s[1:]],
        # an end past int64 (the address fits, its end wraps), an address past
        # int64, one past 64 bits, and the largest one that still fits
        lambda s: [(2**63 - 16, s[0][1]), *s[1:]],
        lambda s: [*s[:-1], (2**63 - s[-1][1] + 1, s[-1][1])],
        lambda s: [(2**63, s[0][1]), *s[1:]],
        lambda s: [(2**64 + 4096, s[0][1]), *s[1:]],
        lambda s: [(2**64 + 4096, s[0][1] + 1), *s[1:]],
        # an int subclass: its arithmetic (a block cut at the layout's segments)
        # could answer another address than the one checked
        lambda s: [(Address(s[0][0]), s[0][1]), *s[1:]],
    ],
)
def test_the_disk_backend_refuses_segments_as_check_segments_does(tmp_path: Path, bad) -> None:
    """The backend checks and packs a call's segments in one C pass
    (`_disk_io.check_pack`): it refuses what base.check_segments refuses, with the
    same message, and leaves everything as it was."""
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 2)
    blocks = [host.tensor_segments(0), bad(host.tensor_segments(1))]
    with pytest.raises(ValueError) as want:
        check_segments(blocks, layout)
    with open_backend(tmp_path, layout) as backend:
        for call in (backend.put_from, backend.get_into):
            with pytest.raises(ValueError) as got:
                call(make_keys(2), blocks, deadline_after(1))
            assert str(got.value) == str(want.value)
        assert backend.stats().puts == backend.stats().gets == 0


class Address(int):
    """An address whose sums are its own to answer."""

    def __add__(self, other: object) -> int:
        return 4096


CHANGED_WHILE_CHECKED = """
import numpy as np
from fastkv.storage import _disk_io

class Emptying:
    # a length (check_pack) or an address (pack_segments) whose comparison or
    # conversion empties the list being checked: the checked items must stay alive
    def __init__(self, victim, value):
        self.victim, self.value = victim, value
    def __eq__(self, other):
        self.victim.clear()
        return other == self.value
    def __index__(self):
        self.victim.clear()
        return self.value

lengths = np.array([64, 64], dtype=np.int64).tobytes()
pairs = [(4096 * (i + 1), 64) for i in range(2 * 51)]
want = np.array(pairs, dtype=np.int64).tobytes()
outer = [[pairs[2 * b], pairs[2 * b + 1]] for b in range(51)]
outer[0][0] = (4096, Emptying(outer, 64))
assert _disk_io.check_pack(outer, lengths)[0] == want
outer = [[pairs[2 * b], pairs[2 * b + 1]] for b in range(51)]
outer[0][0] = (Emptying(outer, 4096), 64)
assert _disk_io.pack_segments(outer, 2) == want
print("ok")
"""


def test_a_list_changed_while_it_is_checked_cannot_crash_the_check() -> None:
    """check_pack and pack_segments run Python code of the caller's objects (a
    length's __eq__, an address's __index__) while they check a call's blocks;
    code that empties the call's list meanwhile must not free the items still in
    use (it crashed the process: run in a child, which a crash fails). What was
    checked is what is packed: the lists as they were when the call began."""
    run = subprocess.run(
        [sys.executable, "-c", CHANGED_WHILE_CHECKED],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr)


def test_check_pack_packs_what_numpy_packs_and_flags_misaligned_zero_copy_segments() -> None:
    layout = LAYOUTS["fp8"]
    lengths = np.array(layout.segment_lengths, dtype=np.int64).tobytes()
    # A page-aligned region per segment (not the host tier, whose segments after
    # the 32-byte scales are misaligned), so alignment is the flag's to find.
    sizes = [-(-3 * n // 4096) * 4096 for n in layout.segment_lengths]
    area = mmap.mmap(-1, sum(sizes))
    base = np.frombuffer(area, dtype=np.uint8).ctypes.data
    starts = np.cumsum([0, *sizes[:-1]])
    blocks = [
        [
            (base + int(r) + b * n, n)
            for r, n in zip(starts, layout.segment_lengths, strict=True)
        ]
        for b in range(3)
    ]
    pairs, misaligned = _disk_io.check_pack(blocks, lengths)
    assert np.array_equal(np.frombuffer(pairs, dtype=np.int64), np.array(blocks).reshape(-1))
    assert not misaligned
    # a length equal to the layout's (numpy int) is that length
    same = [[(p, np.int32(n)) for p, n in blocks[0]]]
    assert _disk_io.check_pack(same, lengths)[0] == _disk_io.check_pack(blocks[:1], lengths)[0]
    small = [i for i, n in enumerate(layout.segment_lengths) if n % 4096]
    large = [i for i, n in enumerate(layout.segment_lengths) if n % 4096 == 0]
    assert small and large
    n0 = blocks[0][0][1]
    for addr in (2**64, 2**63, 2**63 - n0 + 1):
        with pytest.raises(
            ValueError, match=rf"blocks\[0\]\[0\]: address {addr} \+ length {n0} ends past"
        ):
            _disk_io.check_pack([[(addr, n0), *blocks[0][1:]]], lengths)
    # the last segment that ends at 2**63 - 1 is not the check's to refuse
    top = _disk_io.check_pack([[(2**63 - 1 - n0, n0), *blocks[0][1:]]], lengths)[0]
    assert np.frombuffer(top, dtype=np.int64)[:2].tolist() == [2**63 - 1 - n0, n0]
    for i, flagged in ((small[0], False), (large[0], True)):
        shifted = [list(b) for b in blocks]
        shifted[2][i] = (shifted[2][i][0] + 64, shifted[2][i][1])
        assert _disk_io.check_pack(shifted, lengths)[1] is flagged


def test_a_bool_is_not_a_number_of_seconds(tmp_path: Path) -> None:
    # True == 1 to isinstance(int): a flag passed where seconds go must be refused.
    with pytest.raises(ValueError, match=r"io_delay_s: .* got True"):
        LocalDiskBackend(tmp_path / "x", LAYOUTS["fp8"], capacity_blocks=1, io_delay_s=True)
    for flag in (True, False):
        with pytest.raises(ValueError, match=rf"timeout: .* got {flag}"):
            deadline_after(flag)


def test_put_of_a_stored_key_keeps_the_stored_block(tmp_path: Path) -> None:
    layout = LAYOUTS["odd"]
    host = HostMemory(layout, 3)
    want = host.fill(0, seed=0)
    host.fill(1, seed=1)
    key = make_keys(1)
    with open_backend(tmp_path, layout) as backend:
        assert put(backend, host, key + key, [0, 0]) == ["OK", "OK"]  # duplicate in a batch
        assert put(backend, host, key, [1]) == ["OK"]  # keys name content: no rewrite
        assert get(backend, host, key, [2]) == ["OK"]
        assert host.read(2) == want
        assert backend.stats().stored_blocks == 1


def test_torn_block_after_a_crash_is_never_served(tmp_path: Path) -> None:
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 8)
    want = [host.fill(b, seed=b) for b in range(4)]
    keys = make_keys(4)
    with open_backend(tmp_path, layout) as backend:
        assert put(backend, host, keys, range(4)) == ["OK"] * 4
        torn = _slot_offset(backend, keys[2])
        slot_bytes = backend.geometry.slot_bytes
    # the second half of slot 2 never reached the disk (old bytes stayed)
    fd = os.open(tmp_path / DATA_FILE, os.O_RDWR)
    os.pwrite(fd, bytes(slot_bytes // 2), torn + slot_bytes // 2)
    os.close(fd)
    with open_backend(tmp_path, layout) as backend:
        assert backend.wait_recovered(SOON)
        assert get(backend, host, keys, range(4, 8)) == ["OK", "OK", "MISS", "OK"]
        assert [host.read(4), host.read(5), host.read(7)] == [want[0], want[1], want[3]]
        assert backend.stats().corrupt == 1


_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from storage_helpers import LAYOUTS, HostMemory, make_keys
    from fastkv.storage import deadline_after
    from fastkv.storage.local_disk import LocalDiskBackend

    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 4)
    backend = LocalDiskBackend(sys.argv[1], layout, capacity_blocks=4096)
    for i in range(4096):
        host.fill(i % 4, seed=i)
        key = make_keys(1, start=i)
        res = backend.put_from(key, [host.segments(i % 4)], deadline_after(30))
        assert res[0].ok, res
        print(i, flush=True)
    """
)


def test_writer_killed_mid_write_then_restart(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(store), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    acked = -1
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            acked = int(line)
            if acked >= 40:
                break
        time.sleep(0.003)  # into the next write
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(SOON)
    assert acked >= 40, "the writer died before writing"
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 1)
    with open_backend(store, layout, capacity=4096) as backend:
        assert backend.wait_recovered(SOON)
        probe = acked + 64
        keys = make_keys(probe)
        found = backend.exists(keys, deadline_after(1))
        assert all(found[: acked + 1]), "a block acknowledged before the kill was lost"
        served = 0
        for i in range(probe):
            if not found[i]:
                continue
            host.clear(0)
            res = backend.get_into([keys[i]], [host.segments(0)], deadline_after(SOON))
            if res[0].ok:
                scratch = HostMemory(layout, 1)
                assert host.read(0) == scratch.fill(0, seed=i), f"block {i} served wrong"
                served += 1
            else:
                assert res[0].status == KeyStatus.MISS and i > acked
        assert served >= acked + 1


_DISK_FULL = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from storage_helpers import LAYOUTS, HostMemory, make_keys
    from fastkv.storage import deadline_after
    from fastkv.storage.local_disk import LocalDiskBackend

    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 24)
    want = [host.fill(b, seed=b) for b in range(12)]
    keys = make_keys(12)
    out = {}
    with LocalDiskBackend(sys.argv[1], layout, capacity_blocks=100) as backend:
        out["direct_io"] = backend.direct_io
        res = backend.put_from(keys, [host.segments(b) for b in range(12)], deadline_after(30))
        out["first"] = [r.status.name for r in res]
        out["reasons"] = sorted({r.reason for r in res if not r.ok})
        res = backend.put_from(make_keys(4, 50), [host.segments(b) for b in range(4)],
                               deadline_after(30))
        out["again"] = [r.status.name for r in res]
        for b in range(12, 24):
            host.clear(b)
        segs = [host.segments(b) for b in range(12, 24)]
        res = backend.get_into(keys, segs, deadline_after(30))
        out["reads"] = [r.status.name for r in res]
        out["exact"] = [host.read(12 + b) == want[b] for b in range(12) if res[b].ok]
    print(json.dumps(out))
    """
)


def test_disk_full_puts_fail_fast_and_reads_keep_working(tmp_path: Path) -> None:
    """A 1 MiB tmpfs in a private mount namespace holds a few 196 KiB slots."""
    script = tmp_path / "full.py"
    script.write_text(_DISK_FULL)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    shell = (
        f"mount -t tmpfs -o size=1m fastkv-test {mnt} && "
        f"exec {sys.executable} {script} {mnt}/store {Path(__file__).parent}"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = out["first"].count("OK")
    assert 1 <= ok < 12, out
    assert out["first"] == ["OK"] * ok + ["FAILED"] * (12 - ok)
    assert all("no space" in r for r in out["reasons"]), out
    assert out["again"] == ["FAILED"] * 4
    assert out["reads"] == ["OK"] * ok + ["MISS"] * (12 - ok)  # every stored block reads
    assert out["exact"] == [True] * ok


def _syscalls() -> tuple[int, int]:
    """(read, write) system calls this process has made (/proc/self/io)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["syscr"]), int(fields["syscw"])


@pytest.mark.parametrize("direct_io", [True, False], ids=["o_direct", "buffered"])
def test_blocks_in_consecutive_slots_move_in_one_call(tmp_path: Path, direct_io: bool) -> None:
    """Small blocks whose slots follow one another are written and read with one
    pwritev / preadv per run (a few other calls allowed), not one per block (a call
    costs more than the bytes of a small block); each still round-trips bit-exact."""
    layout = BlockLayout((4096,))
    host = HostMemory(layout, 32)
    want = [host.fill(b, seed=b) for b in range(16)]
    keys = make_keys(16)
    with open_backend(tmp_path, layout, capacity=64, direct_io=direct_io) as backend:
        _, w0 = _syscalls()
        assert put(backend, host, keys, range(16)) == ["OK"] * 16
        r1, w1 = _syscalls()
        assert get(backend, host, keys, range(16, 32)) == ["OK"] * 16
        r2, _ = _syscalls()
    assert [host.read(16 + b) for b in range(16)] == want
    assert w1 - w0 <= 4, f"{w1 - w0} write calls for 16 blocks in consecutive slots"
    assert r2 - r1 <= 4, f"{r2 - r1} read calls for 16 blocks in consecutive slots"


@pytest.mark.parametrize("rank", [0, 258, 65535])
def test_the_header_the_c_batch_writes_is_expected_header(tmp_path: Path, rank: int) -> None:
    """The C batch makes each header from the layout's parts, the key and its seq:
    on disk it is `expected_header`'s bytes, and a read made the same way finds it."""
    from fastkv.storage.block_header import HEADER_BYTES, MATCHED_BYTES, expected_header

    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 3)
    for b in range(3):
        host.fill(b, seed=b)
    keys = [StorageKey(bytes([9]) * 32, bytes([b + 1]) * 32, rank) for b in range(3)]
    with LocalDiskBackend(tmp_path, layout, capacity_blocks=4) as backend:
        # a call whose middle key is stored already: the C batch takes keys[todo[i]]
        assert statuses(backend.put_from(keys[1:2], [host.segments(1)], 1e12)) == ["OK"]
        assert (
            statuses(backend.put_from(keys, [host.segments(b) for b in range(3)], 1e12))
            == ["OK"] * 3
        )
        slot_bytes = backend.geometry.slot_bytes
        with open(tmp_path / DATA_FILE, "rb") as f:
            for key in keys:
                slot, seq = backend._slots.index[key.packed]
                f.seek(slot * slot_bytes)
                got = f.read(HEADER_BYTES)
                assert got[:MATCHED_BYTES] == expected_header(key, layout, seq)[:MATCHED_BYTES]
        assert (
            statuses(backend.get_into(keys[::-1], [host.segments(b) for b in range(3)], 1e12))
            == ["OK"] * 3
        )


def test_a_put_refused_as_closed_does_not_count_out_a_call_still_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() gave up on a put stuck in its write (the files stay open until it
    returns); a later put is refused as closed. That refusal counted itself out
    though it was never counted in: the stuck put's count went, and the files were
    closed under its write (its fd could name another file by then)."""
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 2)
    host.fill(0, seed=0)
    a, b = make_keys(2)
    writing, release = threading.Event(), threading.Event()
    real_write = local_disk._disk_io.write_batch

    def stuck_write(*args):
        writing.set()
        assert release.wait(SOON)
        return real_write(*args)

    backend = open_backend(tmp_path, layout)
    monkeypatch.setattr(local_disk._disk_io, "write_batch", stuck_write)
    out: list = []
    writer = threading.Thread(target=lambda: out.append(put(backend, host, [a], [0])))
    writer.start()
    try:
        assert writing.wait(SOON)
        assert backend.close(timeout=0) is False  # the put is still writing
        with pytest.raises(RuntimeError, match="closed"):
            backend.put_from([b], [host.segments(1)], deadline_after(SOON))
        assert backend._fd >= 0  # still open for the put in flight
    finally:
        release.set()
        writer.join(SOON)
    assert out == [["FAILED"]]  # closed before its block started: not written
    assert backend._fd < 0 and backend._users == 0  # closed when it returned


@pytest.mark.parametrize("misalign", [0, 64])
def test_cut_pack_packs_what_check_pack_packs_of_the_cut_blocks(misalign: int) -> None:
    layout = LAYOUTS["fp8"]
    lengths = np.array(layout.segment_lengths, dtype=np.int64).tobytes()
    host = HostMemory(layout, 3, misalign=misalign)
    blocks = [host.segments(b) for b in range(3)]
    want = _disk_io.check_pack(layout.in_segments(blocks), lengths)
    assert _disk_io.cut_pack(blocks, lengths) == want
    # (fp8's segments after its 32-byte scales are misaligned in the host tier)
    assert want[1] is True
    n, (p, total) = layout.num_segments, blocks[0][0]
    # anything but one contiguous (address, payload) tuple per block in a list:
    # not for cut_pack to judge (None); the general check answers it
    for other in (
        layout.in_segments(blocks[:1]),  # the layout's segments
        [[[p, total]]],
        [[(True, total)]],
        [[(0, total)]],
        [[(p, total - 1)]],
        [[(p, float(total))]],
        [[(2**63 - 1, total)]],
        tuple(blocks),
        [[(p, total), (p, total)]],
    ):
        assert _disk_io.cut_pack(other, lengths) is None, other
    assert n > 1


def test_a_lone_put_in_the_host_tiers_form_answers_and_counts_as_a_batch_does(
    tmp_path: Path,
) -> None:
    layout = LAYOUTS["bf16"]  # aligned: zero-copy under O_DIRECT
    host = HostMemory(layout, 6)
    want = [host.fill(b, seed=b) for b in range(2)]
    keys = make_keys(4)
    with open_backend(tmp_path, layout, capacity=3) as backend:
        assert put(backend, host, keys[3:], [5]) == ["OK"]  # the file has grown
        calls: list[str] = []

        def count(frame, event: str, arg: object) -> None:
            if event == "call":
                calls.append(frame.f_code.co_name)

        blocks, deadline = [host.segments(0)], deadline_after(SOON)
        sys.setprofile(count)
        try:
            first = backend.put_from(keys[:1], blocks, deadline)
        finally:
            sys.setprofile(None)
        # checked, cut and packed in C: 7 Python calls where the batch path makes 26
        assert statuses(first) == ["OK"] and len(calls) <= 7, calls
        assert statuses(backend.put_from(keys[:1], [host.segments(1)], 1e12)) == ["OK"]
        assert put(backend, host, keys[1:2], [1]) == ["OK"]
        assert get(backend, host, keys[:2], [2, 3]) == ["OK", "OK"]
        assert [host.read(2), host.read(3)] == want  # the stored key kept its block
        with pytest.raises(ValueError, match=r"blocks\[0\]\[0\]: length 1 != layout"):
            backend.put_from(keys[2:3], [[(host.segments(4)[0][0], 1)]], 1e12)
        with pytest.raises(ValueError, match="deadline"):
            backend.put_from(keys[2:3], [host.segments(4)], float("nan"))
        stats = backend.stats()
    assert (stats.puts, stats.put_already_stored, stats.put_failures) == (4, 1, 0)
    assert stats.put_bytes == 3 * layout.payload_bytes
    with pytest.raises(RuntimeError, match="closed"):
        backend.put_from(keys[2:3], [host.segments(4)], 1e12)


class InterruptOnRelease:
    """A backend's lock whose first release raises KeyboardInterrupt as it
    returns: where a Ctrl-C lands once a put's first locked section is over."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock, self.armed = lock, True

    def __enter__(self) -> bool:
        return self.lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)
        if self.armed and exc[0] is None:
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("form", ["host", "layout"], ids=["lone_path", "batch_path"])
def test_an_interrupt_after_a_put_took_its_slot_gives_the_slot_back(
    tmp_path: Path, form: str
) -> None:
    """A KeyboardInterrupt as the put's first locked section ends (its slot
    taken, the call counted in) leaves no slot taken, no call counted in and no
    put counted: the next put of the key fills the one slot, and close does not
    wait for a call that never ends."""
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 2)
    keys = make_keys(1)
    blocks = [host.segments(0) if form == "host" else host.tensor_segments(0)]
    with open_backend(tmp_path, layout, capacity=1) as backend:
        lock = backend._lock
        backend._lock = InterruptOnRelease(lock)
        try:
            with pytest.raises(KeyboardInterrupt):
                backend.put_from(keys, blocks, deadline_after(SOON))
        finally:
            backend._lock = lock
        assert backend._users == 0
        assert backend.stats().puts == backend.stats().stored_blocks == 0
        assert statuses(backend.put_from(keys, blocks, deadline_after(SOON))) == ["OK"]
        assert backend.exists(keys, deadline_after(SOON)) == [True]


@pytest.mark.parametrize("form", ["host", "layout"], ids=["lone_path", "batch_path"])
def test_a_put_whose_write_raises_leaves_the_counters_as_they_were(
    tmp_path: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A put that raises (here the C batch, as when it cannot allocate) changes
    # nothing: no put or failure counted, the slot back for the next put; the
    # lone put in the host tier's form (`_put_one`) as the batch path.
    layout = LAYOUTS["bf16"]
    host = HostMemory(layout, 2)
    keys = make_keys(1)
    blocks = [host.segments(0) if form == "host" else host.tensor_segments(0)]

    def fail(*args: object) -> list[int]:
        raise MemoryError("no memory for the batch")

    with open_backend(tmp_path, layout, capacity=1) as backend:
        with monkeypatch.context() as m:
            m.setattr(local_disk._disk_io, "write_batch", fail)
            with pytest.raises(MemoryError):
                backend.put_from(keys, blocks, deadline_after(SOON))
        stats = backend.stats()
        assert (stats.puts, stats.put_failures, stats.put_bytes, stats.stored_blocks) == (
            0,
            0,
            0,
            0,
        )
        assert put(backend, host, keys, [0]) == ["OK"]  # its slot came back
        assert get(backend, host, keys, [1]) == ["OK"] and host.read(1) == host.read(0)
