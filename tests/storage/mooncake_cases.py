"""Mooncake scenarios, each run by test_mooncake.py as its own process inside a
private network namespace:

    unshare --net --fork python tests/storage/mooncake_cases.py CASE LOGDIR

A case starts a real master (and storage nodes), drives the MooncakeBackend (and
the I/O engine) through it, checks bytes itself, and prints one line
`RESULT <json>` with what it saw for the test to assert on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

import numpy as np  # noqa: E402
from mooncake_cluster import Cluster  # noqa: E402
from storage_helpers import (  # noqa: E402
    LAYOUTS,
    TEST_AUTH,
    HostMemory,
    make_keys,
    make_namespace,
)

from fastkv.storage import KeyStatus, _disk_io, deadline_after  # noqa: E402
from fastkv.storage.block_header import HEADER_BYTES, expected_header  # noqa: E402
from fastkv.storage.io_engine import StorageIOEngine  # noqa: E402
from fastkv.storage.mooncake import MooncakeBackend  # noqa: E402
from fastkv.storage.mooncake.options import MooncakeConnection, MooncakeOptions  # noqa: E402

LAYOUT = LAYOUTS["fp8"]  # 196,800 bytes: K/V of 3 layers and their 32-byte scales


def names(results) -> list[str]:
    return [r.status.name for r in results]


def backend_for(cluster: Cluster, segment_bytes: int = 0, **kw) -> MooncakeBackend:
    kw.setdefault("auth", TEST_AUTH)
    connection = MooncakeConnection(cluster.master_address, segment_bytes=segment_bytes)
    return MooncakeBackend(LAYOUT, MooncakeOptions(connection=connection, **kw))


STAGING = 4 * 2 * (HEADER_BYTES + LAYOUT.payload_bytes)  # 2 objects per concurrent call


def round_trip(cluster: Cluster, two_process: bool, staged: bool = False) -> dict:
    cluster.start_master()
    if two_process:
        cluster.start_node()
    backend = backend_for(
        cluster,
        segment_bytes=0 if two_process else 64 << 20,
        staging_bytes=STAGING if staged else 0,
    )
    host = HostMemory(LAYOUT, 16)
    backend.register_host_memory(host.base, host.nbytes)
    want = [host.fill(b, seed=b) for b in range(8)]
    keys = make_keys(8)
    put = backend.put_from(keys, [host.segments(b) for b in range(8)], deadline_after(10))
    again = backend.put_from(keys[:2], [host.segments(b) for b in range(2)], deadline_after(10))
    for b in range(8, 16):
        host.clear(b, 0x5A)
    got = backend.get_into(keys, [host.segments(b) for b in range(8, 16)], deadline_after(10))
    exact = [host.read(8 + b) == want[b] for b in range(8)]
    # The same objects read as the layout's segments (one per tensor), not as the
    # host tier's one segment a block: both forms hold the same bytes.
    for b in range(8, 16):
        host.clear(b, 0xA5)
    cross = backend.get_into(
        keys, [host.tensor_segments(b) for b in range(8, 16)], deadline_after(10)
    )
    cross_exact = [host.read(8 + b) == want[b] for b in range(8)]
    other_ns = make_keys(2, namespace=make_namespace(kv_dtype="fp8").digest())
    other_rank = make_keys(2, rank=1)
    probes = [*other_ns, *other_rank]
    misses = backend.get_into(
        probes, [host.segments(b) for b in range(12, 16)], deadline_after(10)
    )
    unregistered = HostMemory(LAYOUT, 1)
    try:
        res = backend.get_into(keys[:1], [unregistered.segments(0)], deadline_after(10))
        refused = ""
        unregistered_exact = res[0].ok and unregistered.read(0) == want[0]
    except ValueError as e:
        refused = str(e)
        unregistered_exact = False
    stats = backend.stats()
    return {
        "put": names(put),
        "again": names(again),
        "get": names(got),
        "exact": exact,
        "cross": names(cross),
        "cross_exact": cross_exact,
        "exists": backend.exists([*keys[:2], *probes], deadline_after(10)),
        "probes": names(misses),
        "unregistered": refused,
        "unregistered_exact": unregistered_exact,
        "max_batch": backend.max_batch,
        "corrupt": stats.corrupt,
        "breaker_open": backend.breaker.is_open,
        "stats": dataclasses.asdict(stats),
    }


def bad_objects(cluster: Cluster, staged: bool = False) -> dict:
    """Objects under a block's key that are not that block: short, oversized, a
    same-size object with another key's header, one with a flipped payload byte."""
    cluster.start_master()
    cluster.start_node()
    backend = backend_for(cluster, staging_bytes=STAGING if staged else 0)
    host = HostMemory(LAYOUT, 8)
    backend.register_host_memory(host.base, host.nbytes)
    staging = HostMemory(LAYOUT, 4)  # raw objects are assembled here
    backend.register_host_memory(staging.base, staging.nbytes)
    store = backend.store
    size = HEADER_BYTES + LAYOUT.payload_bytes
    keys = make_keys(5)
    # short and oversized objects, written with the raw Mooncake API
    codes = store.batch_put_from(
        [keys[0].text(), keys[1].text()], [staging.base] * 2, [1000, size + 4096]
    )
    # a genuine block of keys[4], copied under keys[2]: valid object, another header
    want = host.fill(0, seed=0)
    assert backend.put_from(keys[4:5], [host.segments(0)], deadline_after(10))[0].ok
    assert store.get_into(keys[4].text(), staging.base, size) == size
    codes += store.batch_put_from([keys[2].text()], [staging.base], [size])
    # keys[3]'s own sealed header over the block, then one payload byte flipped
    header = bytearray(expected_header(keys[3], LAYOUT, 0))
    _disk_io.seal_header(header, np.array(host.segments(0), dtype=np.int64), TEST_AUTH.ring)
    staging.array[:HEADER_BYTES] = np.frombuffer(bytes(header), dtype=np.uint8)
    staging.array[HEADER_BYTES:size] = np.frombuffer(want, dtype=np.uint8)
    staging.array[HEADER_BYTES + 100] ^= 0x01
    codes += store.batch_put_from([keys[3].text()], [staging.base], [size])
    for b in range(4):
        host.clear(b)
    got = backend.get_into(keys[:4], [host.segments(b) for b in range(4)], deadline_after(10))
    good = backend.get_into(keys[4:], [host.segments(5)], deadline_after(10))
    # every key now under the gets' read lease: a put stores the block over each
    # (staged: replaced unread, whatever its size; zero-copy: read back, removed)
    block = host.fill(6, seed=6)
    replaced = backend.put_from(keys[:4], [host.segments(6)] * 4, deadline_after(10))
    for b in range(4):
        host.clear(b, 0x5A)
    again = backend.get_into(keys[:4], [host.segments(b) for b in range(4)], deadline_after(10))
    return {
        "raw_codes": codes,
        "replaced": names(replaced),
        "replaced_get": names(again),
        "replaced_exact": [host.read(b) == block for b in range(4)],
        "get": names(got),
        "reasons": [r.reason for r in got],
        "good": names(good),
        "good_exact": host.read(5) == want,
        "corrupt": backend.stats().corrupt,
        "breaker_open": backend.breaker.is_open,
    }


def pool_full_storm(cluster: Cluster) -> dict:
    """Four threads put 160 blocks (31 MB) into a 16 MB pool: -200 answers."""
    cluster.start_master()
    cluster.start_node(segment="16MB")
    backend = backend_for(cluster, put_retries=3, retry_backoff_s=0.01, max_batch=8)
    host = HostMemory(LAYOUT, 4)
    backend.register_host_memory(host.base, host.nbytes)
    blocks = [host.fill(b, seed=b) for b in range(4)]
    out: dict[int, list[str]] = {}
    overrun: list[float] = []

    def writer(t: int) -> None:
        keys = make_keys(40, start=1000 * t)
        deadline = deadline_after(5)
        res = backend.put_from(keys, [host.segments(i % 4) for i in range(40)], deadline)
        overrun.append(time.monotonic() - deadline)
        out[t] = names(res)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # whatever was reported stored reads back exactly, or is gone (evicted): no garbage
    wrong = 0
    served = 0
    for t, res in out.items():
        keys = make_keys(40, start=1000 * t)
        for i, status in enumerate(res):
            if status != "OK":
                continue
            host.clear(3)
            got = backend.get_into([keys[i]], [host.segments(3)], deadline_after(10))[0]
            if got.ok:
                served += 1
                wrong += host.read(3) != blocks[i % 4]
    return {
        "threads_done": sorted(out),
        "statuses": sorted({s for res in out.values() for s in res}),
        "ok": sum(res.count("OK") for res in out.values()),
        "failed": sum(res.count("FAILED") for res in out.values()),
        "retries": backend.pool_full_retries,
        "max_overrun_s": max(overrun),
        "served": served,
        "wrong": wrong,
        "breaker_open": backend.breaker.is_open,
    }


def master_killed(cluster: Cluster, during: str) -> dict:
    """The master dies while the I/O engine streams puts or gets; then it restarts."""
    cluster.start_master()
    cluster.start_node()
    backend = backend_for(cluster, breaker_cooldown_s=1.0)
    host = HostMemory(LAYOUT, 8)
    backend.register_host_memory(host.base, host.nbytes)
    want = [host.fill(b, seed=b) for b in range(4)]
    engine = StorageIOEngine(backend, num_threads=2, chunk_bytes=LAYOUT.payload_bytes)
    deadline_s = 1.0
    keys = make_keys(16)
    assert all(
        r.ok
        for r in backend.put_from(
            keys, [host.segments(i % 4) for i in range(16)], deadline_after(10)
        )
    )
    results: list = []
    done_at: list[float] = []
    wrong = [0]
    stop = threading.Event()

    def stream() -> None:
        rid = 0
        while not stop.is_set() and rid < 400:
            rid += 1
            t0 = time.monotonic()
            if during == "put":
                ks = make_keys(4, start=100 + 4 * rid)
                engine.submit_store(rid, ks, [host.segments(b) for b in range(4)], range(4),
                                    t0 + deadline_s)  # fmt: skip
            else:
                ks = [keys[(4 * rid + j) % 16] for j in range(4)]
                engine.submit_load(rid, ks, [host.segments(4 + j) for j in range(4)],
                                   range(4, 8), t0 + deadline_s)  # fmt: skip
            while True:  # the engine's own bounded wait, then wait out fenced blocks
                got = engine.wait_all(deadline_s + 1)
                if got:
                    results.extend(got)
                    if during == "get" and got[0].success:
                        wrong[0] += sum(
                            host.read(4 + j) != want[(4 * rid + j) % 16 % 4] for j in range(4)
                        )
                    done_at.append(time.monotonic() - (t0 + deadline_s))
                    break
            end = time.monotonic() + 10
            while engine.busy_host_blocks() and time.monotonic() < end:
                time.sleep(0.01)

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(0.5)
    ok_before = sum(r.success for r in results)
    cluster.kill_master()
    killed_at = time.monotonic()
    time.sleep(2.5 * deadline_s)
    stop.set()
    streamer.join(30)
    after_kill = results[ok_before:]
    # FASTKV_MASTER_OUTAGE_S (manual runs): keep the master down that long in all,
    # calls failing meanwhile, to see the breaker close after a long outage.
    outage_s = float(os.environ.get("FASTKV_MASTER_OUTAGE_S", "0"))
    while time.monotonic() - killed_at < outage_s:
        backend.put_from(make_keys(1, start=9000), [host.segments(0)], deadline_after(1))
        time.sleep(0.2)
    breaker_tripped = backend.breaker.trips
    # a fresh master: old metadata is gone; the node re-registers, the breaker closes
    cluster.start_master()
    recovered_after = None
    t0 = time.monotonic()
    probe = make_keys(1, start=5000)
    while time.monotonic() - t0 < 20:
        res = backend.put_from(probe, [host.segments(0)], deadline_after(3))
        if res[0].ok:
            recovered_after = round(time.monotonic() - t0, 2)
            break
        time.sleep(0.2)
    host.clear(5)
    back = backend.get_into(probe, [host.segments(5)], deadline_after(3))
    old = backend.get_into(keys[:1], [host.segments(6)], deadline_after(3))
    engine.close(5)
    return {
        "requests": len(results),
        "ok_before_kill": ok_before,
        "after_kill_statuses": sorted({s for r in after_kill for s in names(r.results)}),
        "after_kill_failed": sum(not r.success for r in after_kill),
        "max_report_after_deadline_s": max(done_at) if done_at else None,
        "breaker_trips": breaker_tripped,
        "recovered_after_s": recovered_after,
        "probe_read": names(back),
        "probe_exact": host.read(5) == host.read(0),
        "old_key_after_restart": names(old),
        "wrong_loads": wrong[0],
        "breaker_open_at_end": backend.breaker.is_open,
    }


def node_killed(cluster: Cluster) -> dict:
    """The storage node holding the blocks dies; a new one joins later."""
    cluster.start_master()
    node = cluster.start_node()
    backend = backend_for(cluster, breaker_cooldown_s=1.0)
    host = HostMemory(LAYOUT, 8)
    backend.register_host_memory(host.base, host.nbytes)
    want = host.fill(0, seed=0)
    keys = make_keys(4)
    assert all(r.ok for r in backend.put_from(keys, [host.segments(0)] * 4, deadline_after(10)))
    cluster.kill_node(node)
    host.clear(1)
    t0 = time.monotonic()
    first = backend.get_into(keys[:2], [host.segments(1), host.segments(2)], deadline_after(5))
    first_s = time.monotonic() - t0
    fast = backend.get_into(keys[2:3], [host.segments(3)], deadline_after(5))
    time.sleep(1.1)
    cluster.start_node()
    recovered_after = None
    t0 = time.monotonic()
    probe = make_keys(1, start=77)
    while time.monotonic() - t0 < 20:
        if backend.put_from(probe, [host.segments(0)], deadline_after(3))[0].ok:
            recovered_after = round(time.monotonic() - t0, 2)
            break
        time.sleep(0.2)
    host.clear(4)
    back = backend.get_into(probe, [host.segments(4)], deadline_after(3))
    lost = backend.get_into(keys[:1], [host.segments(5)], deadline_after(3))
    return {
        "first": names(first),
        "first_reasons": [r.reason for r in first],
        "first_call_s": round(first_s, 2),
        "while_open": names(fast),
        "while_open_reason": fast[0].reason,
        "breaker_trips": backend.breaker.trips,
        "recovered_after_s": recovered_after,
        "probe_read": names(back),
        "probe_exact": host.read(4) == want,
        "lost_key": names(lost),
        "lost_exact_or_absent": lost[0].status != KeyStatus.OK or host.read(5) == want,
    }


ATTACKER = """
import sys
sys.path[:0] = sys.argv[1:3]
import numpy as np
from storage_helpers import LAYOUTS, HostMemory, make_keys
from fastkv.storage import deadline_after
from fastkv.storage.auth import StorageAuth
from fastkv.storage.mooncake import MooncakeBackend
from fastkv.storage.mooncake.options import MooncakeConnection, MooncakeOptions
connection = MooncakeConnection(sys.argv[3])
host = HostMemory(LAYOUTS["fp8"], 1)
host.array[:] = 0xAA
keys = make_keys(4)  # the victim's keys: namespace and hashes are predictable
out = []
for keys_, auth in ((keys[0:1] + keys[3:4], None), (keys[1:2], StorageAuth([b"x" * 32]))):
    options = MooncakeOptions(
        connection=connection, auth=auth, allow_unauthenticated=auth is None
    )
    be = MooncakeBackend(LAYOUTS["fp8"], options)
    be.register_host_memory(host.base, host.nbytes)
    res = be.put_from(keys_, [host.segments(0)] * len(keys_), deadline_after(10))
    out += [r.status.name for r in res]
print("ATTACKER", out, flush=True)
import os
os._exit(0)
"""


def forged(cluster: Cluster, zero_copy: bool = False) -> dict:
    """Another user (uid 65534, a client of the same cluster) puts objects under the
    victim's keys first: with a valid CRC header (no secret), or tagged under
    another deployment's secret. The victim's puts must not count them as stored,
    and its gets must never serve them. Staged (the default), the victim's put
    replaces them (upsert); zero-copy, it reads them back and removes them."""
    cluster.lease_ttl_ms = 300  # short, so that only a forced remove explains success
    cluster.start_master()
    cluster.start_node()
    backend = backend_for(cluster, staging_bytes=0 if zero_copy else None)
    host = HostMemory(LAYOUT, 8)
    backend.register_host_memory(host.base, host.nbytes)
    want = host.fill(0, seed=0)
    keys = make_keys(4)
    attacker = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            ATTACKER,
            str(HERE),
            str(HERE.parents[1]),
            cluster.master_address,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/tmp",
    )
    line = [ln for ln in attacker.stdout.splitlines() if ln.startswith("ATTACKER")]
    assert attacker.returncode == 0 and line, attacker.stdout + attacker.stderr
    served = []
    for b in range(1, 5):
        host.clear(b)
    before = backend.get_into(keys, [host.segments(b) for b in range(1, 5)], deadline_after(10))
    served += [host.read(b + 1) for b, r in enumerate(before) if r.ok]
    # the reads above hold Mooncake's read lease (300 ms): the put removes anyway
    first = backend.put_from(keys[:3], [host.segments(0)] * 3, deadline_after(10))
    for b in range(1, 5):
        host.clear(b)
    got = backend.get_into(keys, [host.segments(b) for b in range(1, 5)], deadline_after(10))
    served += [host.read(b + 1) for b, r in enumerate(got) if r.ok]
    return {
        "attacker": line[0],
        "before": names(before),
        "before_reasons": [r.reason for r in before],
        "first": names(first),
        "get": names(got),
        "get_reasons": [r.reason for r in got],
        "served_wrong": sum(b != want for b in served),
        "served_right": sum(b == want for b in served),
        "forged_puts": backend.forged_puts,
    }


def forged_hot_key(cluster: Cluster, zero_copy: bool = False) -> dict:
    """Issue 25 item 11: a forged object under a hot key (a shared system prompt:
    looked up, read and put again every few hundred ms). Every lookup and read
    renews Mooncake's read lease, so a remove that waits for the lease to end never
    comes; the victim's put must still replace it within one lease period plus a
    little. Times scaled down from the report (10 s lease, a put every 2 s) by 5."""
    lease_s = 2.0
    cluster.lease_ttl_ms = int(lease_s * 1000)
    cluster.start_master()
    cluster.start_node()
    backend = backend_for(cluster, staging_bytes=0 if zero_copy else None)
    host = HostMemory(LAYOUT, 4)
    backend.register_host_memory(host.base, host.nbytes)
    want = host.fill(0, seed=7)
    key = make_keys(1, start=900)
    # the forgery: the block's own header with a valid CRC (no secret needed)
    size = HEADER_BYTES + LAYOUT.payload_bytes
    header = bytearray(expected_header(key[0], LAYOUT, 0))
    _disk_io.seal_header(header, np.array(host.segments(1), dtype=np.int64), b"")
    staging = HostMemory(LAYOUT, 2)
    backend.register_host_memory(staging.base, staging.nbytes)
    staging.array[:HEADER_BYTES] = np.frombuffer(bytes(header), dtype=np.uint8)
    staging.array[HEADER_BYTES:size] = np.frombuffer(host.read(1), dtype=np.uint8)
    planted = backend.store.batch_put_from([key[0].text()], [staging.base], [size])
    start = time.monotonic()
    replaced_after = None
    puts: list[str] = []
    wrong = 0
    while time.monotonic() - start < 4 * lease_s:
        backend.exists(key, deadline_after(3))  # other requests look it up ...
        host.clear(2)
        got = backend.get_into(key, [host.segments(2)], deadline_after(3))  # ... and read it
        if got[0].ok:
            wrong += host.read(2) != want
            if replaced_after is None:
                replaced_after = time.monotonic() - start
            break
        puts += names(backend.put_from(key, [host.segments(0)], deadline_after(3)))
        time.sleep(lease_s / 5)
    return {
        "planted": planted,
        "puts": puts,
        "replaced_after_s": replaced_after,
        "lease_s": lease_s,
        "served_wrong": wrong,
        "forged_puts": backend.forged_puts,
    }


def node_killed_locality(cluster: Cluster) -> dict:
    """Two storage nodes; one dies. Keys on the healthy node must keep being served
    (before: one -800 opened the backend's only breaker and refused them all)."""
    cluster.start_master()
    dead = cluster.start_node()
    cluster.start_node()
    backend = backend_for(cluster, breaker_cooldown_s=1.0)
    host = HostMemory(LAYOUT, 8)
    backend.register_host_memory(host.base, host.nbytes)
    want = host.fill(0, seed=0)
    keys = make_keys(24)
    assert all(
        r.ok for r in backend.put_from(keys, [host.segments(0)] * 24, deadline_after(10))
    )
    cluster.kill_node(dead)
    first = backend.get_into(keys, [host.segments(1)] * 24, deadline_after(10))
    healthy = [k for k, r in zip(keys, first, strict=True) if r.ok]
    lost = [k for k, r in zip(keys, first, strict=True) if not r.ok]
    refused = calls = wrong = 0
    lost_fast: list[float] = []
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        for i in range(0, len(keys), 6):  # mixed batches, as the engine sends them
            part = keys[i : i + 6]
            host.clear(2)
            t0 = time.monotonic()
            res = backend.get_into(part, [host.segments(2 + j % 4) for j in range(len(part))],
                                   deadline_after(5))  # fmt: skip
            took = time.monotonic() - t0
            for k, r in zip(part, res, strict=True):
                if k in healthy:
                    calls += 1
                    refused += not r.ok
                elif r.ok:
                    wrong += 1
            if all(k in lost for k in part):
                lost_fast.append(took)
            for j, r in enumerate(res):
                wrong += r.ok and host.read(2 + j % 4) != want
    return {
        "healthy": len(healthy),
        "lost": len(lost),
        "lost_reasons": sorted({r.reason for r in first if not r.ok}),
        "healthy_calls": calls,
        "healthy_refused": refused,
        "wrong": wrong,
        "breaker_trips": backend.breaker.trips,
    }


def tiered(cluster: Cluster) -> dict:
    """device -> host -> Mooncake -> host -> device with the real scheduler and
    worker, per dtype (tests/storage/tiered.py)."""
    from tiered import tiered_round_trip

    cluster.start_master()
    cluster.start_node()
    out = {}
    for dtype, extra in (("bfloat16", 0), ("fp8", 1)):
        out[f"{dtype}+{extra}"] = tiered_round_trip(
            lambda layout: MooncakeBackend(
                layout,
                MooncakeOptions(
                    connection=MooncakeConnection(cluster.master_address, segment_bytes=0),
                    auth=TEST_AUTH,
                ),
            ),
            dtype,
            extra,
        )
    return out


class ThreadNames:
    """A real store whose batch calls note the thread they ran on."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.seen: dict[str, set[str]] = {}

    def __getattr__(self, name: str):
        inner = getattr(self._store, name)
        if not name.startswith("batch_"):
            return inner

        def noted(*args):
            self.seen.setdefault(name, set()).add(threading.current_thread().name)
            return inner(*args)

        return noted


def io_engine_threads(cluster: Cluster) -> dict:
    """The staged backend (the default) through the I/O engine: its Mooncake calls
    run on the engine's threads; a direct caller's on the backend's pool. Bytes
    are checked either way."""
    from fastkv.storage.mooncake.backend import _setup_store

    cluster.start_master()
    cluster.start_node()
    connection = MooncakeConnection(cluster.master_address, segment_bytes=0)
    store = ThreadNames(_setup_store(connection))
    backend = MooncakeBackend(LAYOUT, MooncakeOptions(auth=TEST_AUTH), store=store)
    host = HostMemory(LAYOUT, 16)
    want = [host.fill(b, seed=b) for b in range(8)]
    keys = make_keys(8)
    engine = StorageIOEngine(backend, num_threads=2)
    engine.submit_store(1, keys[:4], [host.segments(b) for b in range(4)], range(4),
                        deadline_after(10))  # fmt: skip
    stored = engine.wait_all(10)
    engine.submit_lookup(2, keys, deadline_after(10))
    looked = engine.wait_all(10)
    engine.submit_load(3, keys[:4], [host.segments(b) for b in range(8, 12)], range(8, 12),
                       deadline_after(10))  # fmt: skip
    loaded = engine.wait_all(10)
    via_engine = {k: sorted(v) for k, v in store.seen.items()}
    store.seen.clear()
    direct_put = backend.put_from(
        keys[4:], [host.segments(b) for b in range(4, 8)], deadline_after(10)
    )
    direct_get = backend.get_into(
        keys[4:], [host.segments(b) for b in range(12, 16)], deadline_after(10)
    )
    engine.close(10)
    return {
        "stored": names(stored[0].results),
        "hits": list(looked[0].hits),
        "loaded": names(loaded[0].results),
        "exact": [host.read(8 + b) == want[b] for b in range(4)],
        "direct": names(direct_put) + names(direct_get),
        "direct_exact": [host.read(12 + b) == want[4 + b] for b in range(4)],
        "via_engine": via_engine,
        "direct_threads": {k: sorted(v) for k, v in store.seen.items()},
        "overruns": backend.overruns,
        "closed": backend.close(10),
    }


CASES = {
    "tiered": tiered,
    "io_engine_threads": io_engine_threads,
    "round_trip_two_process": lambda c: round_trip(c, two_process=True),
    "round_trip_one_process": lambda c: round_trip(c, two_process=False),
    "round_trip_staged": lambda c: round_trip(c, two_process=True, staged=True),
    "bad_objects": bad_objects,
    "bad_objects_staged": lambda c: bad_objects(c, staged=True),
    "pool_full_storm": pool_full_storm,
    "master_killed_mid_put": lambda c: master_killed(c, "put"),
    "master_killed_mid_get": lambda c: master_killed(c, "get"),
    "node_killed": node_killed,
    "forged": forged,
    "forged_zero_copy": lambda c: forged(c, zero_copy=True),
    "forged_hot_key": forged_hot_key,
    "forged_hot_key_zero_copy": lambda c: forged_hot_key(c, zero_copy=True),
    "node_killed_locality": node_killed_locality,
}


def main() -> None:
    case, logdir = sys.argv[1], Path(sys.argv[2])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    cluster = Cluster(logdir)
    code = 0
    try:
        print("RESULT " + json.dumps(CASES[case](cluster)), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        code = 1
    finally:
        cluster.close()
    sys.stderr.flush()
    # Mooncake's client threads keep retrying a dead master; skip their teardown.
    os._exit(code)


if __name__ == "__main__":
    main()
