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
   on: p50 and p99 in microseconds, raw beside them.
2. Mooncake Store over TCP loopback to a storage-node process (mooncake_client),
   in a private network namespace: the backend zero-copy (one Mooncake buffer per
   segment) and staged (`staging_bytes`: one contiguous object per block), header
   and checksum on, against raw `batch_put_from` / `batch_get_into` of contiguous
   blocks; and zero-copy puts read back (`verify_puts=True`): `put_verify_cost` is
   1 - verified / unverified put throughput.
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
    cache (one region per segment index), filled with random bytes."""
    host = HostMemory(layout, n)
    host.array[:] = np.random.default_rng(0).integers(0, 256, host.nbytes, dtype=np.uint8)
    return host


def keys_for(rep: int, n: int, ns: bytes) -> list[StorageKey]:
    return [
        StorageKey(ns, rep.to_bytes(8, "little") + i.to_bytes(8, "little") + bytes(16))
        for i in range(n)
    ]


def in_threads(n_threads: int, n: int, work: Callable[[int, int], None]) -> float:
    """Run work(start, stop) over [0, n) split among threads; returns seconds."""
    bounds = np.linspace(0, n, n_threads + 1).astype(int)
    threads = [
        threading.Thread(target=work, args=(int(bounds[i]), int(bounds[i + 1])))
        for i in range(n_threads)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


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
                        assert all(r.ok for r in res), res

                def get(
                    lo: int, hi: int, keys: list = keys, be: LocalDiskBackend = backend
                ) -> None:
                    for s in range(lo, hi, BATCH):
                        e = min(hi, s + BATCH)
                        segs = [host.segments(b) for b in range(s, e)]
                        res = be.get_into(keys[s:e], segs, deadline_after(600))
                        assert all(r.ok for r in res), res

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
                    "auth_write_cost": round(1 - med["aw"] / med["bw"], 3),
                    "auth_read_GBps": round(med["ar"], 3),
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


def bench_disk_latency(directory: Path, block_bytes: int, count: int) -> list[dict]:
    """One block at a time: `put_from` / `get_into` of a single key against one raw
    O_DIRECT `os.pwritev` / `os.preadv` of the same segments, alternating block by
    block (who goes first rotates), with authentication off and on. Returns one row
    per auth setting: p50 and p99 latency in microseconds, raw beside them."""
    layout = BlockLayout((block_bytes // SEGMENTS,) * SEGMENTS)
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

    def timed(name: str, op: Callable[[], object]) -> None:
        t0 = time.perf_counter_ns()
        op()
        lat.setdefault(name, []).append(time.perf_counter_ns() - t0)

    def one(be: LocalDiskBackend, key: StorageKey, b: int, write: bool) -> None:
        call = be.put_from if write else be.get_into
        res = call([key], [host.segments(b)], deadline_after(600))
        if not res[0].ok:
            raise RuntimeError(f"{'put' if write else 'get'} of block {b} failed: {res[0]}")

    try:
        for b in range(n):  # warm-up: every slot and raw block written once
            os.pwritev(raw_fd, host.views(b), b * block_bytes)
            for be in backends.values():
                one(be, keys_for(0, n, ns)[b], b, True)
        for i in range(count):
            b = i % n
            key = keys_for(1 + i // n, n, ns)[b]
            writes = [
                ("raw_put", lambda b=b: os.pwritev(raw_fd, host.views(b), b * block_bytes)),
                *(
                    (f"put_{a}", lambda be=be, b=b, key=key: one(be, key, b, True))
                    for a, be in backends.items()
                ),
            ]
            reads = [
                ("raw_get", lambda b=b: os.preadv(raw_fd, host.views(b), b * block_bytes)),
                *(
                    (f"get_{a}", lambda be=be, b=b, key=key: one(be, key, b, False))
                    for a, be in backends.items()
                ),
            ]
            k = i % 3
            for name, op in writes[k:] + writes[:k] + reads[k:] + reads[:k]:
                timed(name, op)
    finally:
        for be in backends.values():
            be.close()
        os.close(raw_fd)
        shutil.rmtree(run_dir, ignore_errors=True)

    def pct(name: str, q: float) -> float:
        return float(np.percentile(np.array(lat[name]) / 1e3, q))

    rows = []
    for auth in ("off", "on"):
        row: dict = {"block_KiB": block_bytes // 1024, "auth": auth, "ops": count}
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


def bench_mooncake_inside(block_bytes: int, total: int, reps: int) -> list[dict]:
    """Runs inside a private network namespace (see `bench_mooncake`)."""
    from mooncake_cluster import Cluster

    from fastkv.storage.mooncake import MooncakeBackend
    from fastkv.storage.mooncake.options import MooncakeConnection, MooncakeOptions

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    logdir = Path(tempfile.mkdtemp(prefix="bench-mooncake-"))
    cluster = Cluster(logdir)
    rows = []
    try:
        cluster.start_master()
        n = max(4, total // block_bytes)
        segment_gb = -(-(2 * reps * n * (block_bytes + 8192) + (256 << 20)) // (1 << 30))
        cluster.start_node(segment=f"{segment_gb}GB")
        layout = BlockLayout((block_bytes // SEGMENTS,) * SEGMENTS)
        options = MooncakeOptions(
            connection=MooncakeConnection(cluster.master_address),
            max_batch=BATCH,
            auth=BENCH_AUTH,
        )
        backend = MooncakeBackend(layout, options)
        host = random_host(layout, n)
        backend.register_host_memory(host.base, host.nbytes)
        staged_options = MooncakeOptions(
            max_batch=BATCH,
            staging_bytes=4 * BATCH * (HEADER_BYTES + layout.payload_bytes),
            auth=BENCH_AUTH,
        )
        staged = MooncakeBackend(layout, staged_options, store=backend.store)
        contiguous = mmap.mmap(-1, n * block_bytes)
        arr = np.frombuffer(contiguous, dtype=np.uint8)
        arr[:] = 7
        flat = arr.ctypes.data
        backend.register_host_memory(flat, arr.size)
        store = backend.store
        ns = os.urandom(32)
        figures: dict[str, list[float]] = {
            k: [] for k in ("rw", "rr", "bw", "br", "sw", "sr", "vw")
        }
        nbytes = n * block_bytes
        for rep in range(reps):
            keys = keys_for(rep, n, ns)
            staged_keys = keys_for(1000 + rep, n, ns)
            verified_keys = keys_for(2000 + rep, n, ns)
            raw_keys = [f"raw-{rep}-{i}" for i in range(n)]
            ptrs = [flat + i * block_bytes for i in range(n)]

            def raw_put(lo: int, hi: int, raw_keys: list = raw_keys, ptrs: list = ptrs) -> None:
                for s in range(lo, hi, BATCH):
                    e = min(hi, s + BATCH)
                    sizes = [block_bytes] * (e - s)
                    codes = store.batch_put_from(raw_keys[s:e], ptrs[s:e], sizes)
                    assert all(c == 0 for c in codes), codes

            def raw_get(lo: int, hi: int, raw_keys: list = raw_keys, ptrs: list = ptrs) -> None:
                for s in range(lo, hi, BATCH):
                    e = min(hi, s + BATCH)
                    sizes = [block_bytes] * (e - s)
                    codes = store.batch_get_into(raw_keys[s:e], ptrs[s:e], sizes)
                    assert all(c == block_bytes for c in codes), codes

            def put(lo: int, hi: int, keys: list = keys, be: MooncakeBackend = backend) -> None:
                for s in range(lo, hi, BATCH):
                    e = min(hi, s + BATCH)
                    segs = [host.segments(b) for b in range(s, e)]
                    res = be.put_from(keys[s:e], segs, deadline_after(600))
                    assert all(r.ok for r in res), res

            def get(lo: int, hi: int, keys: list = keys, be: MooncakeBackend = backend) -> None:
                for s in range(lo, hi, BATCH):
                    e = min(hi, s + BATCH)
                    segs = [host.segments(b) for b in range(s, e)]
                    res = be.get_into(keys[s:e], segs, deadline_after(600))
                    assert all(r.ok for r in res), res

            def staged_put(lo: int, hi: int, keys: list = staged_keys) -> None:
                put(lo, hi, keys, staged)

            def staged_get(lo: int, hi: int, keys: list = staged_keys) -> None:
                get(lo, hi, keys, staged)

            def verified_put(lo: int, hi: int, keys: list = verified_keys) -> None:
                backend.verify_puts = True  # every put read back
                try:
                    put(lo, hi, keys, backend)
                finally:
                    backend.verify_puts = False

            runs = [("rw", raw_put), ("bw", put), ("vw", verified_put), ("sw", staged_put)]
            runs += [("rr", raw_get), ("br", get), ("sr", staged_get)]
            if rep % 2:
                runs = [runs[2], runs[1], runs[3], runs[0], runs[5], runs[6], runs[4]]
            for name, work in runs:
                figures[name].append(nbytes / in_threads(1, n, work) / 1e9)
        med = {k: statistics.median(v) for k, v in figures.items()}
        rows.append(
            {
                "block_KiB": block_bytes // 1024,
                "raw_put_GBps": round(med["rw"], 3),
                "backend_put_GBps": round(med["bw"], 3),
                "put_ratio": round(med["bw"] / med["rw"], 3),
                "verified_put_GBps": round(med["vw"], 3),
                "put_verify_cost": round(1 - med["vw"] / med["bw"], 3),
                "raw_get_GBps": round(med["rr"], 3),
                "backend_get_GBps": round(med["br"], 3),
                "get_ratio": round(med["br"] / med["rr"], 3),
                "staged_put_GBps": round(med["sw"], 3),
                "staged_put_ratio": round(med["sw"] / med["rw"], 3),
                "staged_get_GBps": round(med["sr"], 3),
                "staged_get_ratio": round(med["sr"] / med["rr"], 3),
                "blocks": n,
                "reps": reps,
            }
        )
    finally:
        cluster.close()
        shutil.rmtree(logdir, ignore_errors=True)
    return rows


def bench_mooncake(block_sizes: list[int], total: int, reps: int) -> list[dict] | str:
    """Mooncake listens on every interface: run it in a private network namespace."""
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
        return f"failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    return json.loads(lines[-1][5:])


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


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
        count = 60 if args.quick else 300
        for kib in args.block_kib:
            latency += bench_disk_latency(directory, kib << 10, count)
    seal: list[dict] = []
    if args.only in (None, "seal"):
        seal = [bench_seal(kib << 10, reps) for kib in args.block_kib]
    recovery: dict | None = None
    if args.only in (None, "recovery"):
        recovery = bench_recovery(directory, 10_000 if args.quick else args.recovery_slots)
    mooncake: list[dict] | str | None = None
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
            "Local disk, authenticated (HMAC-SHA256 tag per block) vs the same backend "
            "unauthenticated: GB/s and cost (1 - auth / unauth)",
            disk,
            [
                "block_KiB",
                "threads",
                "backend_write_GBps",
                "auth_write_GBps",
                "auth_write_cost",
                "backend_read_GBps",
                "auth_read_GBps",
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
    if mooncake is None:
        return
    if isinstance(mooncake, str):
        print(f"\nMooncake: {mooncake}")
    else:
        print_table(
            "Mooncake over TCP loopback (storage-node process): backend zero-copy (one "
            "buffer per segment) and staged (one contiguous object), authenticated "
            "(HMAC-SHA256 tag, existence check before each put; verified: every put "
            "also read back, verify_puts=True), vs raw "
            "batch_put_from/batch_get_into of contiguous blocks, GB/s",
            mooncake,
            [
                "block_KiB",
                "raw_put_GBps",
                "backend_put_GBps",
                "put_ratio",
                "verified_put_GBps",
                "put_verify_cost",
                "raw_get_GBps",
                "backend_get_GBps",
                "get_ratio",
                "staged_put_GBps",
                "staged_put_ratio",
                "staged_get_GBps",
                "staged_get_ratio",
            ],
        )


if __name__ == "__main__":
    main()
