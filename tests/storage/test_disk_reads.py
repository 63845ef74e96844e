"""Issue 25 item 14: a read that does not get the block's bytes whole (a partial
transfer, bytes moving under the read) must not lose a good block, and a cache
directory on a read-only mount still serves its blocks."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, TEST_AUTH, HostMemory, make_keys, statuses

from fastkv.storage import _disk_io, deadline_after
from fastkv.storage.local_disk import DATA_FILE, LocalDiskBackend

REPO = Path(__file__).resolve().parents[2]
SOON = 30.0


def test_a_read_that_meets_moving_bytes_is_a_miss_and_keeps_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read of keys[1] meets a payload byte that is not the block's (a
    write of the slot in flight); by the time it is read again the slot is whole.
    It was dropped (a later read: "not stored"); now it is a miss once, then
    served."""
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 6)
    want = [host.fill(b, seed=b) for b in range(3)]
    keys = make_keys(3)
    real_read = _disk_io.read_batch
    with LocalDiskBackend(tmp_path, layout, capacity_blocks=4) as backend:
        blocks = [host.segments(b) for b in range(3)]
        assert statuses(backend.put_from(keys, blocks, deadline_after(SOON))) == ["OK"] * 3
        slot, _ = backend._slots.index[keys[1].packed]
        where = slot * backend.geometry.slot_bytes + backend.geometry.header_area + 10
        calls = []

        def racing_read(*args: object) -> list[int]:
            calls.append(1)
            if len(calls) > 1:
                return real_read(*args)
            fd = os.open(tmp_path / DATA_FILE, os.O_RDWR)
            try:
                byte = os.pread(fd, 1, where)
                os.pwrite(fd, bytes([byte[0] ^ 0x20]), where)  # the bytes in flight
                try:
                    return real_read(*args)
                finally:
                    os.pwrite(fd, byte, where)  # the slot whole again
            finally:
                os.close(fd)

        monkeypatch.setattr(_disk_io, "read_batch", racing_read)
        got = backend.get_into(keys, [host.segments(b) for b in range(3, 6)], deadline_after(5))
        assert statuses(got) == ["OK", "MISS", "OK"], [r.reason for r in got]
        assert "a second read did; the stored block is kept" in got[1].reason
        assert len(calls) == 2  # the rejected block alone was read again
        stats = backend.stats()
        assert (stats.corrupt, stats.misses) == (0, 1)
        host.clear(4)
        again = backend.get_into(keys[1:2], [host.segments(4)], deadline_after(5))
        assert statuses(again) == ["OK"] and host.read(4) == want[1]


_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* Every read and write of the file moves at most LIMIT bytes, as POSIX allows
   (a network or FUSE filesystem, a signal). */
#define LIMIT 3000

static int clip(const struct iovec *iov, int n, struct iovec *out) {
    size_t left = LIMIT;
    int m = 0;
    for (int k = 0; k < n && left; k++) {
        out[m] = iov[k];
        if (out[m].iov_len > left) out[m].iov_len = left;
        left -= out[m].iov_len;
        m++;
    }
    return m;
}

ssize_t preadv64(int fd, const struct iovec *iov, int n, off_t off) {
    static ssize_t (*real)(int, const struct iovec *, int, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "preadv64");
    struct iovec cut[n > 0 ? n : 1];
    return real(fd, cut, clip(iov, n, cut), off);
}

ssize_t pwritev64(int fd, const struct iovec *iov, int n, off_t off) {
    static ssize_t (*real)(int, const struct iovec *, int, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwritev64");
    struct iovec cut[n > 0 ? n : 1];
    return real(fd, cut, clip(iov, n, cut), off);
}

ssize_t pread64(int fd, void *buf, size_t len, off_t off) {
    static ssize_t (*real)(int, void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pread64");
    return real(fd, buf, len > 100 ? 100 : len, off);
}
"""

_PARTIAL = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = sys.argv[2:4]
    from storage_helpers import LAYOUTS, HostMemory, make_keys
    from fastkv.storage import _disk_io, deadline_after
    from fastkv.storage.local_disk import LocalDiskBackend

    _disk_io.set_async(False)  # the preload clips pwritev/preadv, which AIO does not call
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 8)
    want = [host.fill(b, seed=b) for b in range(4)]
    keys = make_keys(4)
    out = {}
    kw = dict(capacity_blocks=8, direct_io=False)
    with LocalDiskBackend(sys.argv[1], layout, **kw) as backend:
        res = backend.put_from(keys, [host.segments(b) for b in range(4)], deadline_after(30))
        out["put"] = [r.status.name for r in res]
    with LocalDiskBackend(sys.argv[1], layout, **kw) as backend:  # the scan reads headers
        backend.wait_recovered(30)
        segs = [host.segments(b) for b in range(4, 8)]
        res = backend.get_into(keys, segs, deadline_after(30))
        out["get"] = [r.status.name for r in res]
        out["exact"] = [host.read(4 + b) == want[b] for b in range(4)]
    print(json.dumps(out))
    """
)


def test_partial_reads_and_writes_go_on_until_the_block_is_whole(tmp_path: Path) -> None:
    """Under a preload that lets each pread/preadv/pwritev move a few KiB at most, a
    partial write failed the put ("no space") and a partial read dropped the block
    ("truncated"); now each goes on from where it stopped."""
    shim = tmp_path / "short_io.so"
    source = tmp_path / "short_io.c"
    source.write_text(_SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", shim, source, "-ldl"], check=True)
    script = tmp_path / "partial.py"
    script.write_text(_PARTIAL)
    proc = subprocess.run(
        [sys.executable, script, tmp_path / "store", Path(__file__).parent, REPO],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "LD_PRELOAD": str(shim)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"put": ["OK"] * 4, "get": ["OK"] * 4, "exact": [True] * 4}, out


_READ_ONLY = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = sys.argv[2:4]
    from storage_helpers import LAYOUTS, TEST_AUTH, HostMemory, make_keys
    from fastkv.storage import deadline_after
    from fastkv.storage.local_disk import LocalDiskBackend

    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 8)
    want = [host.fill(b, seed=b) for b in range(4)]
    keys = make_keys(4)
    out = {}
    with LocalDiskBackend(sys.argv[1], layout, capacity_blocks=8, auth=TEST_AUTH) as backend:
        out["read_only"] = backend.read_only
        out["recovered"] = backend.wait_recovered(30)
        segs = [host.segments(b) for b in range(4, 8)]
        res = backend.get_into(keys, segs, deadline_after(30))
        out["get"] = [r.status.name for r in res]
        out["exact"] = [host.read(4 + b) == want[b] for b in range(4)]
        res = backend.put_from(make_keys(2, 10), [host.segments(0)] * 2, deadline_after(30))
        out["put"] = [r.status.name for r in res]
        out["put_reason"] = res[0].reason
        out["put_failures"] = backend.stats().put_failures
    try:
        LocalDiskBackend(sys.argv[1], layout, capacity_blocks=8, read_only=False)
    except OSError as e:
        out["required_writable"] = str(e)
    print(json.dumps(out))
    """
)


def test_a_cache_directory_on_a_read_only_mount_serves_its_blocks(tmp_path: Path) -> None:
    """It could not be opened at all (the LOCK file is created read-write); now its
    blocks are served and every put answers FAILED, counted."""
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 4)
    store = tmp_path / "store"
    with LocalDiskBackend(store, layout, capacity_blocks=8, auth=TEST_AUTH) as backend:
        blocks = [host.segments(b) for b in range(4)]
        for b in range(4):
            host.fill(b, seed=b)
        assert (
            statuses(backend.put_from(make_keys(4), blocks, deadline_after(SOON))) == ["OK"] * 4
        )
    script = tmp_path / "read_only.py"
    script.write_text(_READ_ONLY)
    shell = (
        f"mount --bind {store} {store} && mount -o remount,bind,ro {store} && "
        f"exec {sys.executable} {script} {store} {Path(__file__).parent} {REPO}"
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
    assert out["read_only"] and out["recovered"], out
    assert out["get"] == ["OK"] * 4 and out["exact"] == [True] * 4, out
    assert out["put"] == ["FAILED"] * 2 and "read-only" in out["put_reason"], out
    assert out["put_failures"] == 2
    assert "read-only filesystem" in out["required_writable"], out


def test_read_only_on_a_writable_directory_changes_nothing(tmp_path: Path) -> None:
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 2)
    host.fill(0, seed=0)
    keys = make_keys(1)
    with LocalDiskBackend(tmp_path, layout, capacity_blocks=4, auth=TEST_AUTH) as backend:
        assert backend.put_from(keys, [host.segments(0)], deadline_after(SOON))[0].ok
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with LocalDiskBackend(
        tmp_path, layout, capacity_blocks=2, auth=TEST_AUTH, read_only=True
    ) as backend:
        assert backend.wait_recovered(SOON)
        assert backend.get_into(keys, [host.segments(1)], deadline_after(SOON))[0].ok
        res = backend.put_from(make_keys(1, 5), [host.segments(0)], deadline_after(SOON))
        assert statuses(res) == ["FAILED"] and backend.stats().put_failures == 1
    assert host.read(1) == host.read(0)
    # capacity 2 < the file's 4 slots: a writer would have cut the file; not this one
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    with pytest.raises(ValueError, match="read_only: must be None, True or False"):
        LocalDiskBackend(tmp_path, layout, capacity_blocks=2, read_only=1)  # type: ignore[arg-type]


def test_a_slot_whose_header_read_fails_at_recovery_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error reading slot 0's header during the recovery scan made the slot
    free: the next put overwrote a good block. Now it is left alone."""
    layout = LAYOUTS["fp8"]
    host = HostMemory(layout, 6)
    want = [host.fill(b, seed=b) for b in range(5)]
    keys = make_keys(5)
    with LocalDiskBackend(tmp_path, layout, capacity_blocks=4) as backend:
        blocks = [host.segments(b) for b in range(4)]
        assert statuses(backend.put_from(keys[:4], blocks, deadline_after(SOON))) == ["OK"] * 4
        in_slot_0 = next(i for i in range(4) if backend._slots.index[keys[i].packed][0] == 0)
    real_scan = _disk_io.scan_headers

    def failing_scan(fd: int, offsets, out, addr: int, align: int) -> list[int]:
        got = real_scan(fd, offsets, out, addr, align)
        if len(offsets) and offsets[0] == 0:
            got[0] = -errno.EIO
        return got

    monkeypatch.setattr(_disk_io, "scan_headers", failing_scan)
    with LocalDiskBackend(tmp_path, layout, capacity_blocks=4) as backend:
        assert backend.wait_recovered(SOON)
        assert backend.put_from(keys[4:], [host.segments(4)], deadline_after(SOON))[0].ok
        assert backend.stats().evictions == 1  # an indexed block gave way, not slot 0
    monkeypatch.undo()
    with LocalDiskBackend(tmp_path, layout, capacity_blocks=4) as backend:
        assert backend.wait_recovered(SOON)
        host.clear(5)
        got = backend.get_into(
            keys[in_slot_0 : in_slot_0 + 1], [host.segments(5)], deadline_after(SOON)
        )
        assert statuses(got) == ["OK"] and host.read(5) == want[in_slot_0]
