"""Issue 27: a batch's runs are submitted together (Linux native AIO) and a lone
block's payload is written while its header is sealed. Either way of moving
blocks (AIO, or one pwritev/preadv per run) stores what the other reads back,
byte for byte, authenticated or not, and a damaged block among many reads in
flight is the only one refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, TEST_AUTH, HostMemory, make_keys, statuses

from fastkv.storage import BlockLayout, _disk_io, deadline_after
from fastkv.storage.local_disk import DATA_FILE, LocalDiskBackend, set_lone_write_poll_us

SOON = 30.0


@pytest.fixture
def restore_async() -> Iterator[None]:
    was = _disk_io.set_async(True)
    yield
    _disk_io.set_async(was)


# a lone block of SPLIT_BYTES (256 KiB) or more (bf16, 512 KiB, and 1 MiB) is
# written in two requests under AIO; smaller lone blocks (fp8) and one-run batches
# move with pwritev either way
LAYOUTS_HERE = {**LAYOUTS, "bf16-1m": BlockLayout((128 << 10,) * 8)}


@pytest.mark.parametrize("auth", [None, TEST_AUTH], ids=["crc", "tag"])
@pytest.mark.parametrize("layout", ["bf16", "fp8", "bf16-1m"])
@pytest.mark.parametrize("write_async", [True, False], ids=["aio-write", "sync-write"])
def test_either_way_reads_back_what_the_other_stored(
    tmp_path: Path, restore_async: None, write_async: bool, layout: str, auth: object
) -> None:
    lay = LAYOUTS_HERE[layout]
    host = HostMemory(lay, 24)
    want = [host.fill(b, seed=b) for b in range(12)]
    keys = make_keys(12)
    with LocalDiskBackend(tmp_path, lay, capacity_blocks=16, auth=auth) as backend:
        _disk_io.set_async(write_async)
        # a lone block (split in two requests under AIO), then a batch of runs
        assert statuses(
            backend.put_from(keys[:1], [host.segments(0)], deadline_after(SOON))
        ) == ["OK"]
        rest = [host.segments(b) for b in range(1, 12)]
        assert statuses(backend.put_from(keys[1:], rest, deadline_after(SOON))) == ["OK"] * 11
        _disk_io.set_async(not write_async)
        # every other block: runs of one, many in flight at once; then one alone
        picked = list(range(0, 12, 2))
        segs = [host.segments(12 + b) for b in picked]
        got = backend.get_into([keys[b] for b in picked], segs, deadline_after(SOON))
        assert statuses(got) == ["OK"] * len(picked)
        assert [host.read(12 + b) for b in picked] == [want[b] for b in picked]
        got = backend.get_into(keys[5:6], [host.segments(23)], deadline_after(SOON))
        assert statuses(got) == ["OK"] and host.read(23) == want[5]


@pytest.mark.parametrize("read_async", [True, False], ids=["aio-read", "sync-read"])
def test_a_damaged_block_among_reads_in_flight_is_the_only_miss(
    tmp_path: Path, restore_async: None, read_async: bool
) -> None:
    lay = LAYOUTS["bf16"]
    host = HostMemory(lay, 16)
    want = [host.fill(b, seed=b) for b in range(8)]
    keys = make_keys(8)
    with LocalDiskBackend(tmp_path, lay, capacity_blocks=8, auth=TEST_AUTH) as backend:
        segs = [host.segments(b) for b in range(8)]
        assert statuses(backend.put_from(keys, segs, deadline_after(SOON))) == ["OK"] * 8
        slot, _ = backend._slots.index[keys[5].packed]
        where = slot * backend.geometry.slot_bytes + backend.geometry.header_area + 4096
        fd = os.open(tmp_path / DATA_FILE, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, where)
            os.pwrite(fd, bytes([byte[0] ^ 1]), where)
            os.fsync(fd)
        finally:
            os.close(fd)
        _disk_io.set_async(read_async)
        order = [7, 5, 3, 1, 0, 2, 4, 6]  # no two neighbours: a request each
        got = backend.get_into(
            [keys[b] for b in order],
            [host.segments(8 + k) for k in range(8)],
            deadline_after(SOON),
        )
        assert statuses(got) == ["OK", "MISS", "OK", "OK", "OK", "OK", "OK", "OK"]
        assert "rejected" in got[1].reason
        assert all(host.read(8 + k) == want[b] for k, b in enumerate(order) if b != 5)


@pytest.mark.parametrize(("payload_kib", "split"), [(128, False), (256, True)])
def test_a_lone_block_from_256_kib_up_writes_its_payload_while_it_is_sealed(
    tmp_path: Path, restore_async: None, restore_poll: None, payload_kib: int, split: bool
) -> None:
    """A lone block of a 256 KiB payload (and its header page: a 260 KiB slot) is
    split in two requests under AIO, so its seal overlaps the payload's transfer
    (the latency bench: put p50 from 1.35-1.46x raw to 1.18-1.38x); a smaller one
    is one pwritev. Only a split write waits on the AIO ring, which the polled-wait
    count shows; either way the block reads back byte for byte."""
    lay = BlockLayout(((payload_kib << 10) // 8,) * 8)
    host = HostMemory(lay, 2)
    want = host.fill(0, seed=3)
    (key,) = make_keys(1)
    with LocalDiskBackend(tmp_path, lay, capacity_blocks=2, direct_io=True) as backend:
        _disk_io.write_poll(1_000_000)  # ample: a split write ends while it polls
        _, before = _disk_io.write_poll()
        put = backend.put_from([key], [host.segments(0)], deadline_after(SOON))
        assert statuses(put) == ["OK"]
        assert _disk_io.write_poll()[1] == before + split
        got = backend.get_into([key], [host.segments(1)], deadline_after(SOON))
        assert statuses(got) == ["OK"] and host.read(1) == want


@pytest.fixture
def restore_poll() -> Iterator[None]:
    was, _ = _disk_io.write_poll()
    yield
    _disk_io.write_poll(was)


def test_a_lone_block_write_polls_its_completion_and_batches_sleep(
    tmp_path: Path, restore_async: None, restore_poll: None
) -> None:
    """A lone block's two requests are waited for by polling the AIO ring (a
    sleep costs the wakeup and a cold CPU after it: put p50 1.31x raw sleeping,
    1.14-1.16x polling); a batch, or polling set to 0, sleeps. Either way the
    block reads back byte for byte."""
    lay = LAYOUTS["bf16"]  # 512 KiB: split in two requests
    host = HostMemory(lay, 12)
    want = [host.fill(b, seed=b) for b in range(6)]
    keys = make_keys(6)
    with LocalDiskBackend(tmp_path, lay, capacity_blocks=8, direct_io=True) as backend:
        _disk_io.write_poll(1_000_000)  # ample: the write ends while it polls
        _, before = _disk_io.write_poll()
        put = backend.put_from(keys[:1], [host.segments(0)], deadline_after(SOON))
        _, after_lone = _disk_io.write_poll()
        assert statuses(put) == ["OK"] and after_lone > before
        rest = [host.segments(b) for b in range(1, 4)]
        put = backend.put_from(keys[1:4], rest, deadline_after(SOON))
        assert statuses(put) == ["OK"] * 3 and _disk_io.write_poll()[1] == after_lone
        assert _disk_io.write_poll(0) == (1_000_000, after_lone)
        for b in (4, 5):
            put = backend.put_from(keys[b : b + 1], [host.segments(b)], deadline_after(SOON))
            assert statuses(put) == ["OK"]
        assert _disk_io.write_poll()[1] == after_lone
        got = backend.get_into(keys, [host.segments(6 + b) for b in range(6)], 1e12)
        assert statuses(got) == ["OK"] * 6
        assert [host.read(6 + b) for b in range(6)] == want


@pytest.mark.parametrize("us", [-2, 1_000_001])
def test_write_poll_refuses_a_time_out_of_bounds(us: int, restore_poll: None) -> None:
    with pytest.raises(ValueError, match=rf"us: must be in \[0, 1000000\].*got {us}"):
        _disk_io.write_poll(us)


@pytest.mark.parametrize("us", [-1, 1_000_001, 1.5, True])
def test_the_public_poll_setting_refuses_what_is_not_a_time_and_keeps_the_old(
    us: object, restore_poll: None
) -> None:
    was = set_lone_write_poll_us(250)
    assert set_lone_write_poll_us(was) == 250
    with pytest.raises(ValueError, match=r"us: .* must be an int in \[0, 1000000\]"):
        set_lone_write_poll_us(us)  # type: ignore[arg-type]
    assert _disk_io.write_poll()[0] == was
