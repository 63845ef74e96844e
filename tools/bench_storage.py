"""Storage-tier benchmark: each backend next to the raw I/O it is built on, measured
in the same run on the same blocks.

    .venv/bin/python tools/bench_storage.py [--json] [--dir DIR] [--quick]
        [--only disk|seal|recovery|mooncake] [--block-kib N ...] [--reps N]

1. Local disk: `LocalDiskBackend.put_from` / `get_into` (header, crc32c-3way checksum
   and verification always on) against raw O_DIRECT `os.pwritev` / `os.preadv` of the
   same blocks' segment iovecs, one call per block, at 256 KiB, 2 MiB and 8 MiB
   blocks (16 segments each, as K/V of 8 layers) with 1 and 2 threads; and the same
   backend authenticating every block (HMAC-SHA256 tag under a key ring instead of
   the CRC): `auth_*_cost` is 1 - authenticated / unauthenticated throughput. Runs
   alternate raw and backends (and which goes first); the median is reported.
   One block at a time (`--only latency`): a single-key put / get against one raw
   pwritev / preadv of the same segments, alternating block by block, auth off and
   on: p50 and p99 in microseconds, raw beside them (1000 each, `--latency-ops`);
   with 16 segments per block
   (a host tier per layer tensor) and 1 (a block in one contiguous region),
   `--segments`.
2. Mooncake Store over TCP loopback to a storage-node process (mooncake_client),
   in a private network namespace, against raw `batch_put_from` / `batch_get_into`
   of contiguous blocks: raw multi-buffer (`*_multi_buffers`, one buffer per
   segment, no header: what Mooncake's per-buffer cost alone does); the backend
   on blocks laid out as the host tier's, zero-copy (`staging_bytes=0`: two Mooncake
   buffers per block, the header and the host block) and staged (the default: one
   contiguous object per block), header and tag on; and zero-copy
   puts read back (`verify_puts=True`): `put_verify_cost` is 1 - verified /
   unverified put throughput. The backends are called as the worker calls them,
   from a thread that owns its deadlines (its I/O engine's: each call runs on
   the calling thread), and staged once more as a direct caller calls it (`pool_*`:
   each call handed to the backend's deadline pool and waited for). Every way
   has its own object set; the ways take turns batch by batch (who goes first
   rotates), each call timed on its own, so
   a slow moment of the shared machine falls on all alike; ratios are medians of
   each repetition's ratios. Each repetition removes what it stored (the segment
   holds one repetition's sets). Every operation is timed in this thread and
   every key's answer checked: one that fails (a get answering "not stored")
   stops the bench with BenchFailure, and each get's bytes are compared with
   what was put.
3. Seal: the CPU cost of a block's check alone, one thread, host memory larger than
   the caches: `seal_header` with the CRC (no ring) and with the tag (a ring), GB/s
   and microseconds per block. The disk figures above hide most of it (a helper
   thread seals block i+1 while block i is written) unless the CPUs are busy.
4. Recovery: a new backend on a directory of 100k slots (2 MiB blocks; a sparse
   file holding only the headers): time until the background scan has indexed all.

The machine is shared and noisy (2 cores, a virtual disk): read ratios, not
absolute figures, and rerun before believing a difference under ~20 %.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "storage"))

from storage_helpers import HostMemory

from fastkv.storage import BlockLayout, StorageKey, deadline_after
from fastkv.storage.auth import ENV_KEY_FILE, StorageAuth
from fastkv.storage.block_header import HEADER_BYTES, expected_header
from fastkv.storage.local_disk import DATA_FILE, LocalDiskBackend, SlotGeometry

SEGMENTS = 16
BATCH = 8  # blocks per backend call, as an I/O engine chunk
MiB = 1 << 20
BENCH_AUTH = StorageAuth([os.urandom(32)])


def random_host(layout: BlockLayout, n: int) -> HostMemory:
    """Page-aligned host memory for `n` blocks of `layout`, laid out as the host
    tier (host block b one contiguous region of every segment), filled with random
    bytes."""
    host = HostMemory(layout, n)
    host.array[:] = np.random.default_rng(0).integers(0, 256, host.nbytes, dtype=np.uint8)
    return host


def keys_for(rep: int, n: int, ns: bytes) -> list[StorageKey]:
    return [
        StorageKey(ns, rep.to_bytes(8, "little") + i.to_bytes(8, "little") + bytes(16))
        for i in range(n)
    ]


class BenchFailure(RuntimeError):
    """A timed operation did not move and verify every block: no figure is printed."""


def in_threads(n_threads: int, n: int, work: Callable[[int, int], None]) -> float:
    """Run work(start, stop) over [0, n) split among threads; returns seconds.

    Raises BenchFailure when work raised in any thread (its errors chained and
    named): a failed operation must not be timed as a fast one."""
    bounds = np.linspace(0, n, n_threads + 1).astype(int)
    errors: list[BaseException] = []

    def run(lo: int, hi: int) -> None:
        try:
            work(lo, hi)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(int(bounds[i]), int(bounds[i + 1])))
        for i in range(n_threads)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise BenchFailure(
            f"{len(errors)} of {n_threads} timing threads failed: {errors!r}"
        ) from errors[0]
    return elapsed


def bench_disk(directory: Path, block_bytes: int, total: int, reps: int) -> list[dict]:
    layout = BlockLayout((block_bytes // SEGMENTS,) * SEGMENTS)
    n = max(4, total // block_bytes)
    host = random_host(layout, n)
    nbytes = n * block_bytes
    run_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=directory))
    backend = LocalDiskBackend(run_dir / "store", layout, capacity_blocks=n)
    authed = LocalDiskBackend(run_dir / "authed", layout, capacity_blocks=n, auth=BENCH_AUTH)
    raw_fd = os.open(run_dir / "raw", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(raw_fd, 0, nbytes)
    ns = os.urandom(32)
    rows = []
    try:
        # warm-up: every slot and every raw block written once (allocation)
        backend.put_from(keys_for(0, n, ns), [host.segments(b) for b in range(n)], 1e12)
        authed.put_from(keys_for(0, n, ns), [host.segments(b) for b in range(n)], 1e12)
        for b in range(n):
            os.pwritev(raw_fd, host.views(b), b * block_bytes)
        for threads in (1, 2):
            figures: dict[str, list[float]] = {
                k: [] for k in ("rw", "rr", "bw", "br", "aw", "ar")
            }
            for rep in range(reps):
                keys = keys_for(1 + rep + 100 * threads, n, ns)

                def raw_write(lo: int, hi: int) -> None:
                    for b in range(lo, hi):
                        os.pwritev(raw_fd, host.views(b), b * block_bytes)

                def raw_read(lo: int, hi: int) -> None:
                    for b in range(lo, hi):
                        os.preadv(raw_fd, host.views(b), b * block_bytes)

                def put(
                    lo: int, hi: int, keys: list = keys, be: LocalDiskBackend = backend
                ) -> None:
                    for s in range(lo, hi, BATCH):
                        e = min(hi, s + BATCH)
                        segs = [host.segments(b) for b in range(s, e)]
                        res = be.put_from(keys[s:e], segs, deadline_after(600))
                        failed_results("disk put", keys[s:e], res)

                def get(
                    lo: int, hi: int, keys: list = keys, be: LocalDiskBackend = backend
                ) -> None:
                    for s in range(lo, hi, BATCH):
                        e = min(hi, s + BATCH)
                        segs = [host.segments(b) for b in range(s, e)]
                        res = be.get_into(keys[s:e], segs, deadline_after(600))
                        failed_results("disk get", keys[s:e], res)

                def aput(lo: int, hi: int, keys: list = keys) -> None:
                    put(lo, hi, keys, authed)

                def aget(lo: int, hi: int, keys: list = keys) -> None:
                    get(lo, hi, keys, authed)

                writes = [("rw", raw_write), ("bw", put), ("aw", aput)]
                reads = [("rr", raw_read), ("br", get), ("ar", aget)]
                # rotate who goes first: the disk's write-back favours none of them
                k = rep % 3
                runs = writes[k:] + writes[:k] + reads[k:] + reads[:k]
                for name, work in runs:
                    figures[name].append(nbytes / in_threads(threads, n, work) / 1e9)
            med = {k: statistics.median(v) for k, v in figures.items()}
            rows.append(
                {
                    "block_KiB": block_bytes // 1024,
                    "threads": threads,
                    "raw_write_GBps": round(med["rw"], 3),
                    "backend_write_GBps": round(med["bw"], 3),
                    "write_ratio": round(med["bw"] / med["rw"], 3),
                    "raw_read_GBps": round(med["rr"], 3),
                    "backend_read_GBps": round(med["br"], 3),
                    "read_ratio": round(med["br"] / med["rr"], 3),
                    "auth_write_GBps": round(med["aw"], 3),
                    "auth_write_ratio": round(med["aw"] / med["rw"], 3),
                    "auth_write_cost": round(1 - med["aw"] / med["bw"], 3),
                    "auth_read_GBps": round(med["ar"], 3),
                    "auth_read_ratio": round(med["ar"] / med["rr"], 3),
                    "auth_read_cost": round(1 - med["ar"] / med["br"], 3),
                    "direct_io": backend.direct_io,
                    "blocks": n,
                    "reps": reps,
                }
            )
    finally:
        backend.close()
        authed.close()
        os.close(raw_fd)
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def bench_disk_latency(
    directory: Path, block_bytes: int, count: int, segments: int = SEGMENTS
) -> list[dict]:
    """One block at a time: `put_from` / `get_into` of a single key against one raw
    O_DIRECT `os.pwritev` / `os.preadv` of the same segments, alternating block by
    block (who goes first rotates), with authentication off and on. Returns one row
    per auth setting: p50 and p99 latency in microseconds, raw beside them.
    `segments` per block: 16 is a host tier laid out per layer tensor (the
    controller's layout until it gave each block one region), 1 a host tier whose
    block is one contiguous region."""
    layout = BlockLayout((block_bytes // segments,) * segments)
    n = max(8, min(count, (256 * MiB) // block_bytes))
    host = random_host(layout, n)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-latency-", dir=directory))
    backends = {
        "off": LocalDiskBackend(run_dir / "store", layout, capacity_blocks=n),
        "on": LocalDiskBackend(run_dir / "authed", layout, capacity_blocks=n, auth=BENCH_AUTH),
    }
    raw_fd = os.open(run_dir / "raw", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(raw_fd, 0, n * block_bytes)
    ns = os.urandom(32)
    lat: dict[str, list[int]] = {}

    def one(be: LocalDiskBackend, key: StorageKey, b: int, write: bool) -> None:
        call = be.put_from if write else be.get_into
        res = call([key], [host.segments(b)], deadline_after(600))
        failed_results(f"{'put' if write else 'get'} of block {b}", [key], res)

    def timed_call(name: str, be: LocalDiskBackend, key: StorageKey, b: int) -> None:
        """One put or get of block b, only the backend's call timed (its arguments
        made before, as raw's iovecs are; its result checked after)."""
        call = be.put_from if name.startswith("put") else be.get_into
        keys, blocks, deadline = [key], [host.segments(b)], deadline_after(600)
        t0 = time.perf_counter_ns()
        res = call(keys, blocks, deadline)
        lat.setdefault(name, []).append(time.perf_counter_ns() - t0)
        failed_results(f"{name[:3]} of block {b}", keys, res)

    def timed_raw(name: str, b: int) -> None:
        views, off = host.views(b), b * block_bytes
        op = os.pwritev if name == "raw_put" else os.preadv
        t0 = time.perf_counter_ns()
        op(raw_fd, views, off)
        lat.setdefault(name, []).append(time.perf_counter_ns() - t0)

    try:
        for b in range(n):  # warm-up: every slot and raw block written once
            os.pwritev(raw_fd, host.views(b), b * block_bytes)
            for be in backends.values():
                one(be, keys_for(0, n, ns)[b], b, True)
        for i in range(count):
            b = i % n
            key = keys_for(1 + i // n, n, ns)[b]
            writes = [
                lambda b=b: timed_raw("raw_put", b),
                *(
                    lambda be=be, b=b, key=key, a=a: timed_call(f"put_{a}", be, key, b)
                    for a, be in backends.items()
                ),
            ]
            reads = [
                lambda b=b: timed_raw("raw_get", b),
                *(
                    lambda be=be, b=b, key=key, a=a: timed_call(f"get_{a}", be, key, b)
                    for a, be in backends.items()
                ),
            ]
            k = i % 3
            for op in writes[k:] + writes[:k] + reads[k:] + reads[:k]:
                op()
    finally:
        for be in backends.values():
            be.close()
        os.close(raw_fd)
        shutil.rmtree(run_dir, ignore_errors=True)

    def pct(name: str, q: float) -> float:
        return float(np.percentile(np.array(lat[name]) / 1e3, q))

    rows = []
    for auth in ("off", "on"):
        row: dict = {
            "block_KiB": block_bytes // 1024,
            "segments": segments,
            "auth": auth,
            "ops": count,
        }
        for op in ("put", "get"):
            for q in (50, 99):
                raw, ours = pct(f"raw_{op}", q), pct(f"{op}_{auth}", q)
                row[f"raw_{op}_p{q}_us"] = round(raw, 1)
                row[f"{op}_p{q}_us"] = round(ours, 1)
                row[f"{op}_p{q}_ratio"] = round(ours / raw, 2)
        rows.append(row)
    return rows


LATENCY_COLUMNS = [
    "block_KiB",
    "segments",
    "auth",
    "raw_put_p50_us",
    "put_p50_us",
    "put_p50_ratio",
    "raw_put_p99_us",
    "put_p99_us",
    "put_p99_ratio",
    "raw_get_p50_us",
    "get_p50_us",
    "get_p50_ratio",
    "raw_get_p99_us",
    "get_p99_us",
    "get_p99_ratio",
]


def bench_seal(block_bytes: int, reps: int) -> dict:
    from fastkv.storage import _disk_io

    layout = BlockLayout((block_bytes // SEGMENTS,) * SEGMENTS)
    n = max(4, (256 * MiB) // block_bytes)
    host = random_host(layout, n)
    segs = [np.array(host.segments(b), dtype=np.int64) for b in range(n)]
    header = bytearray(HEADER_BYTES)
    figures: dict[str, list[float]] = {"crc": [], "tag": []}
    for _ in range(reps):
        for name, ring in (("crc", b""), ("tag", BENCH_AUTH.ring)):
            t0 = time.perf_counter()
            for b in range(n):
                _disk_io.seal_header(header, segs[b], ring)
            figures[name].append(time.perf_counter() - t0)
    crc, tag = (statistics.median(figures[k]) for k in ("crc", "tag"))
    return {
        "block_KiB": block_bytes // 1024,
        "crc_GBps": round(n * block_bytes / crc / 1e9, 2),
        "tag_GBps": round(n * block_bytes / tag / 1e9, 2),
        "crc_us_per_block": round(crc / n * 1e6, 1),
        "tag_us_per_block": round(tag / n * 1e6, 1),
    }


def bench_recovery(directory: Path, slots: int) -> dict:
    """A directory of `slots` slots of 2 MiB blocks whose headers are all valid (the
    payloads are holes: the scan reads headers only)."""
    from fastkv.storage import _disk_io

    layout = BlockLayout((2 * MiB // SEGMENTS,) * SEGMENTS)
    geometry = SlotGeometry.of(layout)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=directory))
    store = run_dir / "store"
    LocalDiskBackend(store, layout, capacity_blocks=1).close()  # lock file, geometry
    ns = os.urandom(32)
    payload = np.zeros(16, dtype=np.uint8)
    segs = np.array([[payload.ctypes.data, 16]], dtype=np.int64)
    fd = os.open(store / DATA_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, slots * geometry.slot_bytes)
        t0 = time.perf_counter()
        for i in range(slots):
            header = bytearray(
                expected_header(StorageKey(ns, i.to_bytes(32, "little")), layout, i + 1)
            )
            _disk_io.seal_header(header, segs, b"")  # header CRC valid; payload never read
            os.pwrite(fd, bytes(header), i * geometry.slot_bytes)
        os.fsync(fd)
        build_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    assert len(header) == HEADER_BYTES
    t0 = time.perf_counter()
    backend = LocalDiskBackend(store, layout, capacity_blocks=slots)
    open_s = time.perf_counter() - t0
    try:
        assert backend.wait_recovered(600)
        scan_s = time.perf_counter() - t0
        found = backend.stats().stored_blocks
    finally:
        backend.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "slots": slots,
        "slot_MiB": round(geometry.slot_bytes / MiB, 3),
        "recovered": found,
        "open_s": round(open_s, 4),
        "scan_s": round(scan_s, 3),
        "slots_per_s": round(slots / scan_s),
        "direct_io": backend.direct_io,
        "build_s": round(build_s, 2),
    }


# -- Mooncake -------------------------------------------------------------------------

MOONCAKE_SETS = (
    "raw",
    "raw_multi",
    "zero_copy",
    "verified",
    "staged",
    "staged_pool",
    "open",
    "floor",
)
"""The object sets each repetition stores (one per way of putting; all removed at the
end of the repetition): the storage segment is sized for all of them at once."""


def mooncake_segment_bytes(block_bytes: int, n: int) -> int:
    """The storage node's segment for one repetition: every set of `MOONCAKE_SETS`,
    `n` objects each (header + block, rounded up to a page), a quarter more for the
    allocator and the master's eviction watermark, and 64 MiB."""
    per_object = -(-(HEADER_BYTES + block_bytes) // 4096) * 4096
    return len(MOONCAKE_SETS) * n * per_object * 5 // 4 + (64 << 20)


def failed_codes(what: str, names: list[str], codes: list[int], want: int) -> None:
    """Raises BenchFailure naming every key whose Mooncake code is not `want`."""
    bad = [(k, c) for k, c in zip(names, codes, strict=True) if c != want]
    if bad:
        raise BenchFailure(f"{what}: {len(bad)} of {len(names)} keys failed: {bad[:8]}")


def failed_results(what: str, keys: list[StorageKey], results: list) -> None:
    """Raises BenchFailure naming every key whose backend result is not OK (the
    names made only then: a timed call that succeeded pays one pass over its
    results, not a key's text per block)."""
    if len(results) == len(keys) and all(r.ok for r in results):
        return
    bad = [(k.text(), r.status.name, r.reason) for k, r in zip(keys, results, strict=True)]
    bad = [b for b, r in zip(bad, results, strict=True) if not r.ok]
    if bad:
        raise BenchFailure(f"{what}: {len(bad)} of {len(keys)} keys failed: {bad[:8]}")


def same_bytes(what: str, got: np.ndarray, want: np.ndarray) -> None:
    """After a timed get: the destination must hold what was put (checked untimed)."""
    if not np.array_equal(got, want):
        wrong = int(np.count_nonzero(got != want))
        raise BenchFailure(f"{what}: {wrong} bytes differ from what was put")


class MooncakeFloor:
    """The least any verified put or get can do on this machine, timed next to the
    backend as a diagnostic (not a way fastkv stores): each object one buffer, its
    header in the page before its payload (as a host tier padded for it would hold
    it), sealed or verified in one pass over the payload, nothing copied, no backend
    around the Mooncake call. Its ratio to raw is the ceiling for every verified
    path: the tag's pass over the bytes is all it adds.

    Puts read `src`; gets land in `dst` (zeroed by the caller, compared after)."""

    PAD = 4096  # the page before each payload; its last HEADER_BYTES hold the header

    def __init__(self, store: object, layout: BlockLayout, want: np.ndarray) -> None:
        from fastkv.storage import _disk_io
        from fastkv.storage.auth import ring_of

        self._io, self._ring = _disk_io, ring_of(BENCH_AUTH)
        self.store, self.layout = store, layout
        self.block = layout.payload_bytes
        self.n = want.size // self.block
        self.stride = self.PAD + self.block
        self.src, self.dst = (
            np.frombuffer(mmap.mmap(-1, self.n * self.stride), dtype=np.uint8) for _ in "sd"
        )
        for b in range(self.n):
            self.payload(self.src, b)[:] = want[b * self.block : (b + 1) * self.block]
        for arr in (self.src, self.dst):
            if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise BenchFailure("register_buffer of the floor's buffers failed")

    def payload(self, arr: np.ndarray, b: int) -> np.ndarray:
        start = b * self.stride + self.PAD
        return arr[start : start + self.block]

    def header(self, arr: np.ndarray, b: int) -> memoryview:
        end = b * self.stride + self.PAD
        return memoryview(arr[end - HEADER_BYTES : end])

    def pairs(self, arr: np.ndarray, b: int) -> np.ndarray:
        """The payload as one (address, length) pair: the tag is the same however a
        block is cut, so this object verifies as the backend's would."""
        addr = arr.ctypes.data + b * self.stride + self.PAD
        return np.array([[addr, self.block]], dtype=np.int64)

    def object_ptrs(self, arr: np.ndarray, s: int, e: int) -> list[int]:
        return [
            arr.ctypes.data + b * self.stride + self.PAD - HEADER_BYTES for b in range(s, e)
        ]

    def put(self, keys: list[StorageKey], s: int, e: int) -> None:
        for b in range(s, e):
            header = self.header(self.src, b)
            header[:] = expected_header(keys[b], self.layout, 0)
            self._io.seal_header(header, self.pairs(self.src, b), self._ring)
        names = [k.text() for k in keys[s:e]]
        size = HEADER_BYTES + self.block
        codes = self.store.batch_upsert_from(
            names, self.object_ptrs(self.src, s, e), [size] * (e - s)
        )
        failed_codes("floor batch_upsert_from", names, codes, 0)

    def get(self, keys: list[StorageKey], s: int, e: int) -> None:
        names = [k.text() for k in keys[s:e]]
        size = HEADER_BYTES + self.block
        codes = self.store.batch_get_into(
            names, self.object_ptrs(self.dst, s, e), [size] * (e - s)
        )
        failed_codes("floor batch_get_into", names, codes, size)
        for b in range(s, e):
            want = expected_header(keys[b], self.layout, 0)
            status = self._io.verify_block(
                self.header(self.dst, b), want, self.pairs(self.dst, b), self._ring
            )
            if status != self._io.ST_OK:
                raise BenchFailure(
                    f"floor get of {names[b - s]}: verification answered {status}"
                )

    def received(self) -> np.ndarray:
        """The payloads the gets landed, block after block."""
        return np.concatenate([self.payload(self.dst, b) for b in range(self.n)])


class MooncakeBench:
    """One block size on one Mooncake store: raw contiguous and multi-buffer puts and
    gets, and the backend's ways, each on its own object set, every result checked
    (a failed key raises BenchFailure) and every get's bytes compared with what was
    put. `store` is set up already (a real one, or a test's stand-in)."""

    def __init__(self, store: object, block_bytes: int, n: int) -> None:
        from fastkv.storage.mooncake import MooncakeBackend
        from fastkv.storage.mooncake.options import MooncakeOptions

        self.store, self.block_bytes, self.n = store, block_bytes, n
        self.layout = BlockLayout((block_bytes // SEGMENTS,) * SEGMENTS)
        self.host = random_host(self.layout, n)  # what every put reads
        self.want = self.host.array.copy()
        self.dest = HostMemory(self.layout, n)  # raw multi-buffer gets land here
        self.src = np.frombuffer(mmap.mmap(-1, n * block_bytes), dtype=np.uint8)
        self.src[:] = np.random.default_rng(1).integers(0, 256, self.src.size, dtype=np.uint8)
        self.dst = np.frombuffer(mmap.mmap(-1, n * block_bytes), dtype=np.uint8)
        zero_copy = MooncakeOptions(max_batch=BATCH, staging_bytes=0, auth=BENCH_AUTH)
        self.zero_copy = MooncakeBackend(self.layout, zero_copy, store=store)
        self.zero_copy.register_host_memory(self.host.base, self.host.nbytes)
        # staged: the default (its own staging area, one contiguous object per block)
        staged = MooncakeOptions(max_batch=BATCH, auth=BENCH_AUTH)
        self.staged = MooncakeBackend(self.layout, staged, store=store)
        # The worker calls a backend only from its I/O engine's threads, which own
        # the deadlines: its calls run on the calling thread. This thread times the
        # backends as such a thread calls them; `staged_pool` as a direct caller
        # does (each call handed to the backend's deadline pool and waited for).
        self.staged_pool = MooncakeBackend(self.layout, staged, store=store)
        # `open`: staged without a key ring (allow_unauthenticated), CRC only: what
        # the tag costs, next to the default's figures (not a way to run by default)
        open_ = MooncakeOptions(max_batch=BATCH, allow_unauthenticated=True)
        self.open = MooncakeBackend(self.layout, open_, store=store)
        self.floor = MooncakeFloor(store, self.layout, self.want)
        self.zero_copy.run_calls_on_this_thread()
        self.staged.run_calls_on_this_thread()
        self.open.run_calls_on_this_thread()
        for arr in (self.dest.array, self.src, self.dst):
            if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise BenchFailure("register_buffer of the bench's raw buffers failed")

    def raw_put(self, names: list[str], s: int, e: int) -> None:
        bb = self.block_bytes
        ptrs = [self.src.ctypes.data + i * bb for i in range(s, e)]
        codes = self.store.batch_put_from(names[s:e], ptrs, [bb] * (e - s))
        failed_codes("raw batch_put_from", names[s:e], codes, 0)

    def raw_get(self, names: list[str], s: int, e: int) -> None:
        bb = self.block_bytes
        ptrs = [self.dst.ctypes.data + i * bb for i in range(s, e)]
        codes = self.store.batch_get_into(names[s:e], ptrs, [bb] * (e - s))
        failed_codes("raw batch_get_into", names[s:e], codes, bb)

    def multi_put(self, names: list[str], s: int, e: int) -> None:
        segs = [self.host.tensor_segments(b) for b in range(s, e)]  # one buffer each
        ptrs, sizes = [[p for p, _ in g] for g in segs], [[n for _, n in g] for g in segs]
        codes = self.store.batch_put_from_multi_buffers(names[s:e], ptrs, sizes)
        failed_codes("raw batch_put_from_multi_buffers", names[s:e], codes, 0)

    def multi_get(self, names: list[str], s: int, e: int) -> None:
        segs = [self.dest.tensor_segments(b) for b in range(s, e)]
        ptrs, sizes = [[p for p, _ in g] for g in segs], [[n for _, n in g] for g in segs]
        codes = self.store.batch_get_into_multi_buffers(names[s:e], ptrs, sizes)
        failed_codes("raw batch_get_into_multi_buffers", names[s:e], codes, self.block_bytes)

    def backend_op(self, backend: object, op: str, keys: list, s: int, e: int) -> None:
        """One put_from or get_into call; every result must be OK (a get's object
        verified by the backend)."""
        call = backend.put_from if op == "put" else backend.get_into
        segs = [self.host.segments(b) for b in range(s, e)]
        failed_results(f"backend {op}", keys[s:e], call(keys[s:e], segs, deadline_after(600)))

    def verified_put(self, keys: list, s: int, e: int) -> None:
        self.zero_copy.verify_puts = True  # every put read back
        try:
            self.backend_op(self.zero_copy, "put", keys, s, e)
        finally:
            self.zero_copy.verify_puts = False

    def interleaved(self, ways: list[tuple[str, Callable[[int, int], None]]]) -> dict:
        """GB/s of each way over all n blocks (and `<way>_cpu`: this process's CPU
        microseconds per block, less sensitive to the machine's load than the wall
        clock), the ways taking turns batch by batch
        (who goes first rotates), each call timed on its own in this thread: a
        slow moment of the machine falls on all of them alike, and a call that
        fails raises here."""
        seconds = dict.fromkeys((name for name, _ in ways), 0.0)
        cpu = dict.fromkeys(seconds, 0.0)
        for k, s in enumerate(range(0, self.n, BATCH)):
            e = min(self.n, s + BATCH)
            turn = k % len(ways)
            for name, work in ways[turn:] + ways[:turn]:
                t0, c0 = time.perf_counter(), time.process_time()
                work(s, e)
                seconds[name] += time.perf_counter() - t0
                cpu[name] += time.process_time() - c0
        out = {name: self.n * self.block_bytes / t / 1e9 for name, t in seconds.items()}
        # this process's CPU (every thread: Mooncake's transfer threads too) per block
        return out | {f"{name}_cpu": c / self.n * 1e6 for name, c in cpu.items()}

    def repetition(self, rep: int, ns: bytes) -> dict[str, float]:
        """Every set put, then got, the ways interleaved; each get's bytes compared
        with what was put; then every set removed."""
        names = {s: [f"bench-{s}-{rep}-{i}" for i in range(self.n)] for s in ("raw", "multi")}
        sets = MOONCAKE_SETS[2:]
        keys = {s: keys_for(1000 * i + rep, self.n, ns) for i, s in enumerate(sets)}
        zc, st, sp, op = self.zero_copy, self.staged, self.staged_pool, self.open
        out = self.interleaved(
            [
                ("rw", lambda s, e: self.raw_put(names["raw"], s, e)),
                ("mw", lambda s, e: self.multi_put(names["multi"], s, e)),
                ("bw", lambda s, e: self.backend_op(zc, "put", keys["zero_copy"], s, e)),
                ("vw", lambda s, e: self.verified_put(keys["verified"], s, e)),
                ("sw", lambda s, e: self.backend_op(st, "put", keys["staged"], s, e)),
                ("pw", lambda s, e: self.backend_op(sp, "put", keys["staged_pool"], s, e)),
                ("ow", lambda s, e: self.backend_op(op, "put", keys["open"], s, e)),
                ("fw", lambda s, e: self.floor.put(keys["floor"], s, e)),
            ]
        )
        # the backends' gets land in the same host blocks: one at a time, compared
        # after each; raw gets in buffers of their own
        for arr in (self.dst, self.dest.array, self.host.array, self.floor.dst):
            arr[:] = 0
        out |= self.interleaved(
            [
                ("rr", lambda s, e: self.raw_get(names["raw"], s, e)),
                ("mr", lambda s, e: self.multi_get(names["multi"], s, e)),
                ("br", lambda s, e: self.backend_op(zc, "get", keys["zero_copy"], s, e)),
            ]
        )
        for name, got, want in (
            ("rr", self.dst, self.src),
            ("mr", self.dest.array, self.want),
            ("br", self.host.array, self.want),
        ):
            same_bytes(name, got, want)
        self.host.array[:] = 0
        out |= self.interleaved(
            [
                ("rr2", lambda s, e: self.raw_get(names["raw"], s, e)),
                ("sr", lambda s, e: self.backend_op(st, "get", keys["staged"], s, e)),
                ("pr", lambda s, e: self.backend_op(sp, "get", keys["staged_pool"], s, e)),
                ("fr", lambda s, e: self.floor.get(keys["floor"], s, e)),
            ]
        )
        same_bytes("sr, pr", self.host.array, self.want)
        same_bytes("fr", self.floor.received(), self.want)
        self.host.array[:] = 0
        out |= self.interleaved(
            [
                ("rr3", lambda s, e: self.raw_get(names["raw"], s, e)),
                ("or", lambda s, e: self.backend_op(op, "get", keys["open"], s, e)),
            ]
        )
        same_bytes("or", self.host.array, self.want)
        self.remove(
            names["raw"] + names["multi"] + [k.text() for v in keys.values() for k in v]
        )
        return out

    def remove(self, names: list[str]) -> None:
        """Frees the segment for the next repetition (forced: the reads hold a lease)."""
        for s in range(0, len(names), 512):
            codes = self.store.batch_remove(names[s : s + 512], True)
            failed_codes("batch_remove", names[s : s + 512], codes, 0)


def mooncake_row(store: object, block_bytes: int, n: int, reps: int) -> dict:
    """Medians over `reps` repetitions of `MooncakeBench` on `store`: GB/s, and each
    ratio the median of its repetitions' ratios (paired: measured interleaved)."""
    bench = MooncakeBench(store, block_bytes, n)
    ns = os.urandom(32)
    runs = [bench.repetition(rep, ns) for rep in range(reps)]

    def med(k: str) -> float:
        return round(statistics.median(r[k] for r in runs), 3)

    def ratio(k: str, base: str) -> float:
        return round(statistics.median(r[k] / r[base] for r in runs), 3)

    return {
        "block_KiB": block_bytes // 1024,
        "raw_put_GBps": med("rw"),
        "multi_put_ratio": ratio("mw", "rw"),
        "backend_put_GBps": med("bw"),
        "put_ratio": ratio("bw", "rw"),
        "verified_put_GBps": med("vw"),
        "put_verify_cost": round(1 - ratio("vw", "bw"), 3),
        "raw_get_GBps": med("rr"),
        "multi_get_ratio": ratio("mr", "rr"),
        "backend_get_GBps": med("br"),
        "get_ratio": ratio("br", "rr"),
        "staged_put_GBps": med("sw"),
        "staged_put_ratio": ratio("sw", "rw"),
        "staged_get_GBps": med("sr"),
        "staged_get_ratio": ratio("sr", "rr2"),
        "pool_put_ratio": ratio("pw", "rw"),
        "pool_get_ratio": ratio("pr", "rr2"),
        "staged_put_vs_pool": ratio("sw", "pw"),
        "open_put_ratio": ratio("ow", "rw"),
        "open_get_ratio": ratio("or", "rr3"),
        "floor_put_ratio": ratio("fw", "rw"),
        "floor_get_ratio": ratio("fr", "rr2"),
        "staged_put_vs_floor": ratio("sw", "fw"),
        "staged_get_vs_floor": ratio("sr", "fr"),
        "staged_get_vs_pool": ratio("sr", "pr"),
        "raw_put_cpu_us": med("rw_cpu"),
        "staged_put_cpu_us": med("sw_cpu"),
        "raw_get_cpu_us": med("rr2_cpu"),
        "staged_get_cpu_us": med("sr_cpu"),
        "pool_put_cpu_us": med("pw_cpu"),
        "pool_get_cpu_us": med("pr_cpu"),
        "zero_copy_put_cpu_us": med("bw_cpu"),
        "zero_copy_get_cpu_us": med("br_cpu"),
        "blocks": n,
        "reps": reps,
    }


def bench_mooncake_inside(block_bytes: int, total: int, reps: int) -> list[dict]:
    """Runs inside a private network namespace (see `bench_mooncake`): a master and
    one storage node whose segment holds one repetition's sets."""
    from mooncake.store import MooncakeDistributedStore
    from mooncake_cluster import Cluster

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    logdir = Path(tempfile.mkdtemp(prefix="bench-mooncake-"))
    cluster = Cluster(logdir)
    n = max(4, total // block_bytes)
    try:
        cluster.start_master()
        cluster.start_node(segment=f"{-(-mooncake_segment_bytes(block_bytes, n) // MiB)}MB")
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", cluster.master_address)
        if rc != 0:
            raise BenchFailure(f"Mooncake setup answered {rc}")
        return [mooncake_row(store, block_bytes, n, reps)]
    finally:
        cluster.close()
        shutil.rmtree(logdir, ignore_errors=True)


def bench_mooncake(block_sizes: list[int], total: int, reps: int) -> list[dict]:
    """Mooncake listens on every interface: run it in a private network namespace.
    Raises BenchFailure when anything in there failed (its error is in the message)."""
    proc = subprocess.run(
        [
            "unshare",
            "--net",
            "--fork",
            sys.executable,
            __file__,
            "--mooncake-inside",
            json.dumps([block_sizes, total, reps]),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")]
    if proc.returncode != 0 or not lines:
        raise BenchFailure(
            f"Mooncake bench failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return json.loads(lines[-1][5:])


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def print_mooncake(rows: list[dict]) -> None:
    print_table(
        "Mooncake over TCP loopback (storage-node process), GB/s and ratios to raw "
        "batch_put_from/batch_get_into of contiguous blocks (median; every key checked, "
        "every get compared with what was put): raw multi-buffer (one buffer per "
        "segment, no header); the backend zero-copy (staging_bytes=0, two buffers: "
        "header, host block) and staged (the default: one contiguous object), authenticated "
        "(HMAC-SHA256 over the header, GMAC over the payload; staged puts replace what "
        "is under the key (upsert), "
        "zero-copy ones check existence first; verified: every zero-copy put also read "
        "back, verify_puts=True)",
        rows,
        [
            "block_KiB",
            "raw_put_GBps",
            "multi_put_ratio",
            "backend_put_GBps",
            "put_ratio",
            "verified_put_GBps",
            "put_verify_cost",
            "raw_get_GBps",
            "multi_get_ratio",
            "backend_get_GBps",
            "get_ratio",
            "staged_put_GBps",
            "staged_put_ratio",
            "staged_get_GBps",
            "staged_get_ratio",
        ],
    )
    print_table(
        "Mooncake staged: as the worker's I/O threads call it (each call on the calling "
        "thread: staged_*) against a direct caller's calls, each handed to the backend's "
        "deadline pool and waited for (pool_*); ratios to raw as above, and staged / pool",
        rows,
        [
            "block_KiB",
            "staged_put_ratio",
            "pool_put_ratio",
            "staged_put_vs_pool",
            "staged_get_ratio",
            "pool_get_ratio",
            "staged_get_vs_pool",
        ],
    )
    print_table(
        "Mooncake staged without a key ring (open: allow_unauthenticated, CRC32C only), "
        "ratios to raw as above: what the payload's GMAC costs the default",
        rows,
        [
            "block_KiB",
            "staged_put_ratio",
            "open_put_ratio",
            "staged_get_ratio",
            "open_get_ratio",
        ],
    )
    print_table(
        "Mooncake floor (a diagnostic, not a way fastkv stores): each object one "
        "buffer, header in the page before its payload, sealed or verified in one "
        "pass, nothing copied, no backend: the most any verified path reaches on this "
        "machine; ratios to raw as above, and the default staged against it",
        rows,
        [
            "block_KiB",
            "floor_put_ratio",
            "staged_put_ratio",
            "staged_put_vs_floor",
            "floor_get_ratio",
            "staged_get_ratio",
            "staged_get_vs_floor",
        ],
    )
    print_table(
        "Mooncake: this process's CPU (all threads) per block, microseconds (median)",
        rows,
        [
            "block_KiB",
            "raw_put_cpu_us",
            "staged_put_cpu_us",
            "pool_put_cpu_us",
            "zero_copy_put_cpu_us",
            "raw_get_cpu_us",
            "staged_get_cpu_us",
            "pool_get_cpu_us",
            "zero_copy_get_cpu_us",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the test files")
    parser.add_argument("--quick", action="store_true", help="less data, fewer repetitions")
    parser.add_argument("--recovery-slots", type=int, default=100_000)
    parser.add_argument(
        "--only",
        choices=["disk", "latency", "seal", "recovery", "mooncake"],
        help="run one part only",
    )
    parser.add_argument(
        "--block-kib", type=int, nargs="+", default=[256, 2048, 8192], help="disk block sizes"
    )
    parser.add_argument("--reps", type=int, default=None, help="repetitions (median)")
    parser.add_argument(
        "--latency-ops",
        type=int,
        default=1000,
        help="puts and gets per way in the latency part (p99 is the 10th slowest of 1000)",
    )
    parser.add_argument(
        "--segments",
        type=int,
        nargs="+",
        default=[SEGMENTS, 1],
        help="segments per block in the latency part (16: one per layer tensor; 1: one "
        "contiguous region per block)",
    )
    parser.add_argument("--mooncake-inside", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.pop(ENV_KEY_FILE, None)  # each backend here is given its ring (or none)
    if args.mooncake_inside:
        sizes, total, reps = json.loads(args.mooncake_inside)
        rows = [row for bs in sizes for row in bench_mooncake_inside(bs, total, reps)]
        print("ROWS " + json.dumps(rows), flush=True)
        os._exit(0)  # skip Mooncake's client teardown
    directory = args.dir or Path(tempfile.gettempdir())
    total = (128 if args.quick else 512) * MiB
    reps = args.reps or (2 if args.quick else 5)
    disk: list[dict] = []
    if args.only in (None, "disk"):
        for kib in args.block_kib:
            disk += bench_disk(directory, kib << 10, total, reps)
    latency: list[dict] = []
    if args.only in (None, "latency"):
        count = 60 if args.quick else args.latency_ops
        for kib in args.block_kib:
            for segments in args.segments:
                latency += bench_disk_latency(directory, kib << 10, count, segments)
    seal: list[dict] = []
    if args.only in (None, "seal"):
        seal = [bench_seal(kib << 10, reps) for kib in args.block_kib]
    recovery: dict | None = None
    if args.only in (None, "recovery"):
        recovery = bench_recovery(directory, 10_000 if args.quick else args.recovery_slots)
    mooncake: list[dict] | None = None
    if args.only in (None, "mooncake"):
        mooncake = bench_mooncake([256 << 10, 2 * MiB], total // 2, reps)
    result = {
        "disk": disk,
        "latency": latency,
        "seal": seal,
        "recovery": recovery,
        "mooncake": mooncake,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    if disk:
        print_table(
            "Local disk: backend (header + crc32c-3way, verified reads) vs raw O_DIRECT "
            "pwritev/preadv of the same segments, GB/s (median)",
            disk,
            [
                "block_KiB",
                "threads",
                "raw_write_GBps",
                "backend_write_GBps",
                "write_ratio",
                "raw_read_GBps",
                "backend_read_GBps",
                "read_ratio",
            ],
        )
        print_table(
            "Local disk, authenticated (HMAC-SHA256 tag per block) vs raw O_DIRECT of the "
            "same run (ratio) and vs the same backend unauthenticated (cost: 1 - auth / "
            "unauth), GB/s",
            disk,
            [
                "block_KiB",
                "threads",
                "raw_write_GBps",
                "auth_write_GBps",
                "auth_write_ratio",
                "auth_write_cost",
                "raw_read_GBps",
                "auth_read_GBps",
                "auth_read_ratio",
                "auth_read_cost",
            ],
        )
    if latency:
        print_table(
            "Local disk, one block at a time (alternating with raw O_DIRECT pwritev/preadv "
            "of the same segments): latency in microseconds, auth off and on",
            latency,
            LATENCY_COLUMNS,
        )
    if seal:
        print_table(
            "Seal one block, one thread: CRC (no ring) vs tag (HMAC-SHA256 over header and "
            "GMAC of the payload)",
            seal,
            ["block_KiB", "crc_GBps", "tag_GBps", "crc_us_per_block", "tag_us_per_block"],
        )
    if recovery is not None:
        print_table(
            "Recovery: new backend on a directory of slots (background header scan)",
            [recovery],
            ["slots", "slot_MiB", "recovered", "open_s", "scan_s", "slots_per_s", "direct_io"],
        )
    if mooncake:
        print_mooncake(mooncake)


if __name__ == "__main__":
    main()
