"""Prefill/decode disaggregation benchmark: each layer next to what it is built on,
measured in the same run.

    .venv/bin/python tools/bench_pd.py [--json] [--quick] [--only hook|te|pd|e2e]
        [--layers-measured N] [--block-kib N ...] [--layers N] [--reps N]

fastkv's own costs (`--only hook`), whatever the transport:
  - P's CPU time per layer in the send hook (`PDSender.after_layer`): thread CPU
    time (`time.thread_time_ns`) around each call, median and p99 over at least
    1,000 layers, with nothing to send and with 64 blocks to send (two tensors per
    layer, blocks scattered so no run coalesces: 128 pieces per layer). Measured
    with a null transport whose `write` returns a settled handle (fastkv's share of
    the hook: targets <= 20 us empty, <= 100 us at 64 blocks) and with the
    in-process transport holding its writes (its Python checks of every piece are
    a test transport's cost, not a real engine's).
  - The block checksum P computes after the last layer and D before it commits
    (storage's crc32c-3way over each block's segments): GB/s over 64 blocks.

Mooncake Transfer Engine (`--only te`), TCP loopback between two processes in a
private network namespace (the engine listens on every interface):
1. `bench_raw_te`: raw `batch_transfer_async_write` + `get_batch_transfer_status` of
   a prefill's KV as per-layer pieces (each block split into K and V of every layer,
   layer by layer, as a per-layer sender submits them) against the same bytes as
   whole contiguous blocks (one entry per block): the cost of a layout that splits
   blocks into pieces. Raw batches hold at most 512 pieces, two in flight (the
   engine's TCP transport queues 1024 pieces per peer by default and fails the
   peer past that).
2. `bench_te_transport`: `MooncakeTransport.write` (Piece lists) and `write_lists`
   (address lists) of exactly those pieces, one call per layer (the transport cuts
   them the same way), against raw TE: target >= 0.9x.
3. `bench_te_call_overhead`: the calling thread's CPU time per write call of 64
   pieces (`time.thread_time_ns`, median over >= 1000 calls): raw submit, the
   transport with pieces in one registered region and in two (K and V tensors),
   each split into the engine's submit and the rest, with the submit on the
   transport's peer thread (the default) and on the caller's
   (`submit_in_caller=True`); `bench_te_python_cost`: the same calls with the
   engine stubbed out, the transport's own cost alone.
Runs alternate the variants in every repetition; medians are reported.

fastkv's PD path (`--only pd`), the same namespace and TCP loopback: `PDSender` in
this process and `PDReceiver` in a child, each over its `MooncakeTransport`, timed
from P's first `after_layer` to D's `RankReport` (writes, notices, D's checks), with
the layer checksums off and on (`checksums=` on both sides), against raw TE batch
writes of exactly the pieces the sender builds (`bench_raw_te`) and against the
transport's `write` of them alone. Blocks of `--block-kib` over `--layers` layers
(K and V each: pieces of block / (2 x layers) bytes; D's block ids reversed so no
run coalesces). Both sides poll every millisecond, as an engine would per step.
Also reported: D's report minus P's (D's check of the layers no progress notice
covered, once the final notice arrived).

End to end (`--only e2e`), the demo engine's P and D instances over Mooncake TE in a
private network namespace (examples/engine/pd.py; CPU model, one rank each), at 3
and at 32 layers (`--e2e-layers`):
  - the share of the transfer hidden behind P's prefill: per P step, the time from
    the first layer handed to the transport to P's forward end, over the time to
    the last write settled (1.0: nothing left to wait for once P finished);
  - D's time to first token (offer to KV committed on D, P's first token in hand)
    against the same run's D prefilling every prompt itself (no P), medians over
    the requests of one multi-turn workload served both ways.

The machine is shared and noisy (2 cores): read ratios, not absolute figures, and
rerun before believing a difference under ~20 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastkv.metadata import Epoch
from fastkv.pd.inproc import InProcFabric
from fastkv.pd.layout import KVLayout, layer_checksum
from fastkv.pd.messages import SendPlan
from fastkv.pd.receiver import PDReceiver
from fastkv.pd.sender import PDSender
from fastkv.pd.transport import Piece, WriteState
from fastkv.worker.streams import DONE, HostEvent

MiB = 1 << 20
HOST = "127.0.0.1"


# -- fastkv's own costs (--only hook) ---------------------------------------------

LAYERS = 32
BLOCK_SIZE = 16
HEADS = 8
HEAD_DIM = 128  # 32 KiB per block per tensor in fp16


class _Settled:
    def state(self) -> WriteState:
        return WriteState.DONE

    def wait(self, timeout_s: float) -> WriteState:
        return WriteState.DONE


class NullTransport:
    """Takes every write at once, moves nothing: the hook's own cost."""

    _done = _Settled()

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def address(self) -> str:
        return self._name

    def register(self, addr: int, length: int) -> None:
        pass

    def write(self, peer: str, pieces: list[Piece]) -> _Settled:
        return self._done

    def notify(self, peer: str, payload: bytes, timeout_s: float) -> None:
        pass

    def poll_notices(self) -> list[tuple[str, bytes]]:
        return []

    def close(self) -> None:
        pass


class _DoneFences:
    """A fence source whose fences are complete: the fenced hook's own cost (a
    CUDA event record through the core adds a few us on a GPU)."""

    def record(self, stream: int | None) -> HostEvent:
        return DONE


def _arrays(num_blocks: int) -> list[np.ndarray]:
    shape = (num_blocks, HEADS, BLOCK_SIZE, HEAD_DIM)
    return [np.zeros(shape, dtype=np.float16) for _ in range(2 * LAYERS)]


def _layout(arrays: list[np.ndarray]) -> KVLayout:
    return KVLayout.of_arrays(arrays, tensors_per_layer=2, block_size=BLOCK_SIZE)


def hook_costs(kind: str, num_blocks: int, min_layers: int) -> dict[str, float]:
    """Thread CPU ns per `after_layer` call over enough sends to reach `min_layers`."""
    p_arrays, d_arrays = _arrays(256), _arrays(256)
    if kind in ("null", "null_fenced"):
        p_end, d_end = NullTransport("p"), NullTransport("d")
    else:
        fabric = InProcFabric(write_timeout_s=3600.0)
        fabric.hold_writes = True
        p_end, d_end = fabric.endpoint("p"), fabric.endpoint("d")
    fences = _DoneFences() if kind == "null_fenced" else None
    sender = PDSender(p_end, _layout(p_arrays), fences=fences)
    receiver = PDReceiver(d_end, _layout(d_arrays))
    sender.connect(*receiver.handshake())
    src = tuple(range(0, 2 * num_blocks, 2))  # scattered: no run coalesces
    dst = tuple(range(1, 2 * num_blocks, 2))
    samples: list[int] = []
    starts: list[int] = []
    tid = 0
    clock = time.thread_time_ns
    while len(samples) < min_layers:
        tid += 1
        if num_blocks:
            t0 = clock()
            sender.start(SendPlan(tid, Epoch(0), b"k" * 32, src, dst, 1, 3600.0))
            starts.append(clock() - t0)
        for layer in range(LAYERS):
            t0 = clock()
            sender.after_layer(layer)
            samples.append(clock() - t0)
        if kind == "inproc":
            fabric.pump()
        sender._sends.clear()  # settled or not: the notices are not what is timed
    samples.sort()
    return {
        "layers": len(samples),
        "median_us": statistics.median(samples) / 1e3,
        "p99_us": samples[int(len(samples) * 0.99)] / 1e3,
        "start_us": statistics.median(starts) / 1e3 if starts else 0.0,
    }


def checksum_cost(num_blocks: int, rounds: int = 20) -> dict[str, float]:
    arrays = _arrays(num_blocks)
    for a in arrays:
        a.view(np.uint16)[:] = np.random.default_rng(0).integers(0, 1 << 16, a.shape)
    layout = _layout(arrays)
    ids = list(range(num_blocks))
    t0 = time.perf_counter()
    for _ in range(rounds):
        for layer in range(layout.num_layers):
            layer_checksum(layout.layer(layer), ids)
    dt = (time.perf_counter() - t0) / rounds
    nbytes = sum(t.block_bytes for t in layout.tensors) * num_blocks
    return {
        "blocks": num_blocks,
        "block_mib": nbytes / num_blocks / 2**20,
        "gb_s": nbytes / dt / 1e9,
    }


def hook_section(min_layers: int) -> dict[str, object]:
    return {
        "hook_empty_null": hook_costs("null", 0, min_layers),
        "hook_64_blocks_null": hook_costs("null", 64, min_layers),
        "hook_64_blocks_inproc_held": hook_costs("inproc", 64, min_layers),
        "hook_64_blocks_null_fenced": hook_costs("null_fenced", 64, min_layers),
        "checksum": checksum_cost(64),
    }


def print_hook_section(res: dict[str, object]) -> None:
    print(f"P's send hook, thread CPU time per layer ({LAYERS} layers per send, 2 tensors)")
    print(f"{'case':<34}{'layers':>8}{'median us':>12}{'p99 us':>10}{'start us':>10}")
    for name, target in (
        ("hook_empty_null", "<= 20"),
        ("hook_64_blocks_null", "<= 100"),
        ("hook_64_blocks_inproc_held", "(test transport)"),
        ("hook_64_blocks_null_fenced", "<= 100 (a fence per layer)"),
    ):
        r = res[name]
        print(
            f"{name:<34}{r['layers']:>8}{r['median_us']:>12.2f}{r['p99_us']:>10.2f}"
            f"{r['start_us']:>10.1f}   target {target}"
        )
    c = res["checksum"]
    print(
        f"layer checksums (crc32c-3way) of {c['blocks']} blocks of {c['block_mib']:.2f} MiB: "
        f"{c['gb_s']:.2f} GB/s"
    )


# -- Mooncake Transfer Engine: raw engine vs MooncakeTransport ------------------


def _te_receiver(size: int) -> None:
    """The receiving process: one engine, `size` registered bytes, until stdin closes."""
    import numpy as np
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("initialize failed")
    buf = np.zeros(size, dtype=np.uint8)
    engine.register_memory(buf.ctypes.data, size)
    address = f"{HOST}:{engine.get_rpc_port()}"
    print(json.dumps({"address": address, "base": buf.ctypes.data}), flush=True)
    sys.stdin.read()
    os._exit(0)


def _te_layout(src: int, dst: int, block: int, blocks: int, layers: int):
    """Per-layer pieces (layer-major tensors: K then V of layer l for every block)
    and whole blocks, as (srcs, dsts, lengths) lists; the same bytes either way."""
    piece = block // (2 * layers)
    per_layer = []
    for layer in range(layers):
        s, d, n = [], [], []
        for kv in range(2):
            tensor = (2 * layer + kv) * blocks * piece
            for b in range(blocks):
                s.append(src + tensor + b * piece)
                d.append(dst + tensor + b * piece)
                n.append(piece)
        per_layer.append((s, d, n))
    whole = (
        [src + b * block for b in range(blocks)],
        [dst + b * block for b in range(blocks)],
        [block] * blocks,
    )
    return per_layer, whole


def _te_chunks(batches: list[tuple[list, list, list]], size: int) -> list:
    """The batches cut into batches of at most `size` pieces."""
    return [
        (s[i : i + size], d[i : i + size], n[i : i + size])
        for s, d, n in batches
        for i in range(0, len(s), size)
    ]


def bench_raw_te(engine, peer: str, batches: list[tuple[list, list, list]]) -> float:
    """Seconds to write `batches` with the raw engine, two batches in flight (the
    engine's TCP transport queues at most 1024 pieces per peer by default and
    fails the peer past that: callers give it batches of at most 512)."""
    t0 = time.perf_counter()
    pending: list[int] = []
    for s, d, n in batches:
        if len(pending) == 2:
            _raw_wait(engine, pending.pop(0))
        pending.append(engine.batch_transfer_async_write(peer, s, d, n))
    for batch_id in pending:
        _raw_wait(engine, batch_id)
    return time.perf_counter() - t0


def _raw_wait(engine, batch_id: int) -> None:
    if not batch_id or engine.get_batch_transfer_status([batch_id]) != 0:
        raise RuntimeError("raw TE batch failed")


def bench_te_transport(transport, peer: str, batches: list, as_pieces: bool) -> float:
    """Seconds to write the same batches through `MooncakeTransport` (`write` of
    Piece lists, or `write_lists` of the address lists)."""
    from fastkv.pd.transport import WriteState

    t0 = time.perf_counter()
    if as_pieces:
        handles = [transport.write(peer, pieces) for pieces in batches]
    else:
        handles = [transport.write_lists(peer, s, d, n) for s, d, n in batches]
    if any(h.wait(60) is not WriteState.DONE for h in handles):
        raise RuntimeError("transport write failed")
    return time.perf_counter() - t0


class _TimedEngine:
    """The engine with the calling thread's CPU time inside each submit recorded,
    so a transport call's own Python cost is its time less the engine's."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._caller = threading.get_ident()
        self.last_ns = 0  # the caller's last submit; reset before each call

    def batch_transfer_async_write(self, *args):
        if threading.get_ident() != self._caller:  # the transport's peer thread
            return self._engine.batch_transfer_async_write(*args)
        t0 = time.thread_time_ns()
        try:
            return self._engine.batch_transfer_async_write(*args)
        finally:
            self.last_ns = time.thread_time_ns() - t0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def bench_te_call_overhead(transport, peer: str, calls: int, dst: int, regions: list[int]):
    """Thread CPU microseconds per write call of 64 pieces of 4 KiB: the raw
    submit alone, and the transport's `write` / `write_lists` with the pieces in
    one region and spread over two (K and V tensors), each split into the
    engine's submit and the transport's own (Python) part, measured in the same
    call. Medians and p90 over `calls`."""
    from fastkv.pd.transport import Piece

    engine = transport._engine
    timed = _TimedEngine(engine)
    transport._engine = timed
    for state in transport._peers.values():
        state._engine = timed
    one = [Piece(regions[0] + i * 4096, dst + i * 4096, 4096) for i in range(64)]
    two = [Piece(regions[i % 2] + i * 4096, dst + i * 4096, 4096) for i in range(64)]
    lists = ([p.src for p in two], [p.dst for p in two], [p.length for p in two])

    def inline(call):
        def run():
            transport._submit_in_caller = True
            try:
                return call()
            finally:
                transport._submit_in_caller = False

        return run

    variants = {
        "raw_submit": lambda: timed.batch_transfer_async_write(peer, *lists),
        "write_1_region": lambda: transport.write(peer, one),
        "write_2_regions": lambda: transport.write(peer, two),
        "write_lists_2_regions": lambda: transport.write_lists(peer, *lists),
        "write_2_regions_submit_in_caller": inline(lambda: transport.write(peer, two)),
    }
    total: dict[str, list[int]] = {k: [] for k in variants}
    own: dict[str, list[int]] = {k: [] for k in variants}
    for _ in range(calls):
        for name, call in variants.items():
            timed.last_ns = 0
            t0 = time.thread_time_ns()
            out = call()
            spent = time.thread_time_ns() - t0
            total[name].append(spent)
            own[name].append(spent - timed.last_ns)
            if name == "raw_submit":
                engine.get_batch_transfer_status([out])
            else:
                out.wait(30)
    transport._engine = engine

    def q(ts: list[int], f: float) -> float:
        return round(sorted(ts)[int(len(ts) * f)] / 1e3, 1)

    return [
        {
            "call": name,
            "total_median_us": q(total[name], 0.5),
            "engine_submit_median_us": q(
                [t - o for t, o in zip(total[name], own[name], strict=True)], 0.5
            ),
            "own_median_us": q(own[name], 0.5) if name != "raw_submit" else 0.0,
            "own_p90_us": q(own[name], 0.9) if name != "raw_submit" else 0.0,
            "calls": len(total[name]),
        }
        for name in variants
    ]


class _StubEngine:
    """Takes every batch and reports it complete at once: what is left of a write
    call is the transport's own Python work."""

    def batch_transfer_async_write(self, *args) -> int:
        return 1

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        return 0


def bench_te_python_cost(transport, calls: int, dst: int, regions: list[int]) -> list[dict]:
    """Thread CPU microseconds of `write` / `write_lists` with the engine stubbed
    out (`_StubEngine`), 64 pieces of 4 KiB: the transport's own per-call cost,
    free of the engine's noise. Median and p90 over `calls`."""
    from fastkv.pd.te_batches import PeerBatches
    from fastkv.pd.transport import Piece

    stub = _StubEngine()
    saved_engine, saved_peers = transport._engine, transport._peers
    transport._engine, transport._peers = (
        stub,
        {"127.0.0.1:1": PeerBatches(stub, "127.0.0.1:1", 1024)},
    )
    one = [Piece(regions[0] + i * 4096, dst + i * 4096, 4096) for i in range(64)]
    two = [Piece(regions[i % 2] + i * 4096, dst + i * 4096, 4096) for i in range(64)]
    lists = ([p.src for p in two], [p.dst for p in two], [p.length for p in two])
    variants = {
        "write_1_region": lambda: transport.write("127.0.0.1:1", one),
        "write_2_regions": lambda: transport.write("127.0.0.1:1", two),
        "write_lists_2_regions": lambda: transport.write_lists("127.0.0.1:1", *lists),
    }
    rows = []
    try:
        for name, call in variants.items():
            ts = []
            for _ in range(calls):
                t0 = time.thread_time_ns()
                handle = call()
                ts.append(time.thread_time_ns() - t0)
                handle.wait(30)
            ts.sort()
            rows.append(
                {
                    "call": name + " (engine stubbed)",
                    "median_us": round(ts[len(ts) // 2] / 1e3, 1),
                    "p90_us": round(ts[int(len(ts) * 0.9)] / 1e3, 1),
                    "calls": calls,
                }
            )
    finally:
        transport._peers["127.0.0.1:1"].close()
        transport._engine, transport._peers = saved_engine, saved_peers
    return rows


def bench_te_inside(block_sizes: list[int], total: int, layers: int, reps: int, calls: int):
    """Runs inside a private network namespace (see `bench_te`)."""
    import numpy as np

    from fastkv.pd.mooncake_te import MooncakeTransport
    from fastkv.pd.transport import Piece

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--te-receiver", str(total)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    hello = json.loads(receiver.stdout.readline())  # type: ignore[union-attr]
    peer, dst = hello["address"], hello["base"]
    transport = MooncakeTransport(HOST, write_timeout_s=120)
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    extra = np.ones(64 * 4096, dtype=np.uint8)
    transport.register(src.ctypes.data, total)
    transport.register(extra.ctypes.data, extra.nbytes)
    engine = transport._engine  # the raw engine: same process, same registrations
    transport.connect(peer, 10)
    rows = []
    for block in block_sizes:
        blocks = total // block
        per_layer, whole = _te_layout(src.ctypes.data, dst, block, blocks, layers)
        pieces = [[Piece(*x) for x in zip(*b, strict=True)] for b in per_layer]
        runs: dict[str, list[float]] = {
            "raw_blocks": [],
            "raw_pieces": [],
            "write": [],
            "write_lists": [],
        }
        raw_layers, raw_whole = _te_chunks(per_layer, 512), _te_chunks([whole], 512)
        bench_raw_te(engine, peer, raw_whole)  # warm the connections
        for r in range(reps):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                if name == "raw_blocks":
                    runs[name].append(bench_raw_te(engine, peer, raw_whole))
                elif name == "raw_pieces":
                    runs[name].append(bench_raw_te(engine, peer, raw_layers))
                else:
                    batches = pieces if name == "write" else per_layer
                    runs[name].append(
                        bench_te_transport(transport, peer, batches, name == "write")
                    )
        gbps = {k: blocks * block / statistics.median(v) / 1e9 for k, v in runs.items()}
        rows.append(
            {
                "block_KiB": block >> 10,
                "piece_KiB": round(block / (2 * layers) / 1024, 1),
                "blocks": blocks,
                "raw_blocks_GBps": round(gbps["raw_blocks"], 2),
                "raw_pieces_GBps": round(gbps["raw_pieces"], 2),
                "pieces_vs_blocks": round(gbps["raw_pieces"] / gbps["raw_blocks"], 2),
                "write_GBps": round(gbps["write"], 2),
                "write_vs_raw": round(gbps["write"] / gbps["raw_pieces"], 2),
                "write_lists_GBps": round(gbps["write_lists"], 2),
                "write_lists_vs_raw": round(gbps["write_lists"] / gbps["raw_pieces"], 2),
            }
        )
    overhead = bench_te_call_overhead(
        transport, peer, calls, dst, [src.ctypes.data, extra.ctypes.data]
    )
    python_cost = bench_te_python_cost(
        transport, calls, dst, [src.ctypes.data, extra.ctypes.data]
    )
    receiver.stdin.close()  # type: ignore[union-attr]
    receiver.wait(10)
    return {
        "throughput": rows,
        "call_overhead": overhead,
        "python_cost": python_cost,
        "layers": layers,
        "reps": reps,
    }


def bench_te(block_sizes: list[int], total: int, layers: int, reps: int, calls: int):
    """The engine listens on every interface: run it in a private network namespace."""
    env = dict(os.environ, GLOG_minloglevel="1")  # the engine logs every batch at INFO
    proc = subprocess.run(
        [
            "unshare",
            "--net",
            "--fork",
            sys.executable,
            __file__,
            "--te-inside",
            json.dumps([block_sizes, total, layers, reps, calls]),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TE ")]
    if proc.returncode != 0 or not lines:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    return json.loads(lines[-1][3:])


def print_te(te: dict | str) -> None:
    if isinstance(te, str):
        print(f"\nMooncake TE: {te}")
        return
    print_table(
        f"Mooncake TE over TCP loopback, two processes: per-layer pieces ({te['layers']} "
        "layers, K and V: one batch per layer) vs whole blocks, raw engine vs "
        f"MooncakeTransport, GB/s (median of {te['reps']})",
        te["throughput"],
        list(te["throughput"][0]),
    )
    print_table(
        "MooncakeTransport per-call CPU (calling thread), 64 pieces of 4 KiB, microseconds: "
        "the whole call, the engine's submit in it, and the rest (own)",
        te["call_overhead"],
        list(te["call_overhead"][0]),
    )
    print_table(
        "The same calls with the engine stubbed out: the transport's own Python cost",
        te["python_cost"],
        list(te["python_cost"][0]),
    )


# -- fastkv's PD path over Mooncake TE vs raw TE of the same pieces (--only pd) ----


class _PreRegistered:
    """A `MooncakeTransport` whose buffer was registered whole once: the layouts cut
    from it per block size register nothing again (the transport refuses overlap)."""

    def __init__(self, transport) -> None:
        self._t = transport

    def register(self, addr: int, length: int) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._t, name)


def _pd_layout(base: int, buf, block: int, layers: int) -> KVLayout:
    """`2 * layers` tensors cut from `buf` (K and V per layer), `block // (2 *
    layers)` bytes per block each: one block is `block` bytes over all layers."""
    piece = block // (2 * layers)
    blocks = buf.nbytes // block
    arrays = [
        buf[i * blocks * piece : (i + 1) * blocks * piece].reshape(blocks, 1, piece)
        for i in range(2 * layers)
    ]
    assert arrays[0].ctypes.data == base
    return KVLayout.of_arrays(arrays, tensors_per_layer=2, block_size=BLOCK_SIZE)


def _pd_receiver(total: int) -> None:
    """D's process: one transport over `total` registered bytes; JSON commands on
    stdin (`layout`, `expect`), answers on stdout, until stdin closes."""
    from fastkv.pd.messages import Acceptance
    from fastkv.pd.mooncake_te import MooncakeTransport

    transport = MooncakeTransport(HOST, write_timeout_s=120)
    buf = np.zeros(total, dtype=np.uint8)
    transport.register(buf.ctypes.data, total)
    wrapped = _PreRegistered(transport)
    print(json.dumps({"address": transport.address}), flush=True)
    receivers: dict[bool, PDReceiver] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if "layout" in cmd:
            block, layers = cmd["layout"]
            lay = _pd_layout(buf.ctypes.data, buf, block, layers)
            receivers = {c: PDReceiver(wrapped, lay, checksums=c) for c in (True, False)}
            print(json.dumps({"layout": dataclasses.asdict(lay)}), flush=True)
            continue
        rec = receivers[cmd["checksums"]]
        acc = Acceptance(
            "r", cmd["tid"], Epoch(0), 1, 0, tuple(cmd["ids"]), bytes.fromhex(cmd["key"]), 60, 1
        )
        rec.expect(acc, 1)
        print(json.dumps({"ready": True}), flush=True)
        while not (reports := rec.poll()):
            time.sleep(0.001)  # an engine polls once per step
        t = time.monotonic()
        rec.forget(Epoch(0), cmd["tid"])
        print(
            json.dumps({"ok": reports[0].ok, "reason": reports[0].reason, "t": t}), flush=True
        )
    os._exit(0)


class _PDRun:
    """P's side of `--only pd`: D's process, the transport, the source buffer."""

    def __init__(self, total: int) -> None:
        from fastkv.pd.mooncake_te import MooncakeTransport

        self.d = subprocess.Popen(
            [sys.executable, __file__, "--pd-receiver", str(total)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.peer = self.read()["address"]
        self.transport = MooncakeTransport(HOST, write_timeout_s=120)
        self.src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
        self.transport.register(self.src.ctypes.data, total)
        self.transport.connect(self.peer, 10)
        self.wrapped, self.engine = _PreRegistered(self.transport), self.transport._engine
        self.tid = 0

    def read(self) -> dict:
        return json.loads(self.d.stdout.readline())  # type: ignore[union-attr]

    def ask(self, cmd: dict) -> dict:
        self.d.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.d.stdin.flush()  # type: ignore[union-attr]
        return self.read()

    def pd_once(self, sender: PDSender, src_ids: tuple, dst_ids: tuple) -> tuple[float, float]:
        """One transfer: seconds from the first `after_layer` to D's `RankReport`,
        and from P's own report (notice sent) to D's."""
        self.tid += 1
        key = os.urandom(32)
        sender.start(SendPlan(self.tid, Epoch(0), key, src_ids, dst_ids, 1, 60.0))
        self.ask(
            {"tid": self.tid, "ids": dst_ids, "key": key.hex(), "checksums": sender.checksums}
        )
        t0 = time.monotonic()
        for layer in range(sender.layout.num_layers):
            sender.after_layer(layer)
        while not (mine := sender.poll()):
            time.sleep(0.001)  # an engine polls once per step
        t_p = time.monotonic()
        got = self.read()
        if not (mine[0].ok and got["ok"]):
            raise RuntimeError(f"PD transfer failed: P {mine[0]}, D {got}")
        return got["t"] - t0, got["t"] - t_p

    def block_row(self, block: int, layers: int, reps: int) -> dict:
        from fastkv.pd.layout import TensorRegion

        lay = _pd_layout(self.src.ctypes.data, self.src, block, layers)
        dd = self.ask({"layout": [block, layers]})["layout"]
        d_lay = KVLayout(**{**dd, "tensors": tuple(TensorRegion(**t) for t in dd["tensors"])})
        senders = {c: PDSender(self.wrapped, lay, checksums=c) for c in (True, False)}
        for s in senders.values():
            s.connect(self.peer, d_lay)
        blocks = lay.num_blocks
        # Reversed destinations: no run of blocks coalesces, one piece per block
        # per tensor per layer, `block // (2 * layers)` bytes each.
        src_ids, dst_ids = tuple(range(blocks)), tuple(reversed(range(blocks)))
        s0 = senders[True]
        pieces = [s0._pieces(s0._runs(src_ids, dst_ids, 1), 1, la, 0) for la in range(layers)]
        raw = _te_chunks(
            [
                ([p.src for p in ps], [p.dst for p in ps], [p.length for p in ps])
                for ps in pieces
            ],
            512,
        )
        bench_raw_te(self.engine, self.peer, raw)  # warm the connection
        runs: dict[str, list[float]] = {"raw": [], "write": [], "off": [], "on": []}
        tails: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {k: [] for k in runs}  # P's process CPU seconds
        for r in range(reps):
            for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
                c0 = time.process_time()
                self.run_one(name, runs, tails, senders, pieces, raw, src_ids, dst_ids)
                cpu[name].append(time.process_time() - c0)
        gbps = {k: blocks * block / statistics.median(v) / 1e9 for k, v in runs.items()}
        # P's CPU per GB moved: the engine's own wait spins a core throughout a
        # raw transfer; fastkv's peer thread sleeps through most of it
        cpu_ms_gb = {
            k: statistics.median(v) * 1e3 / (blocks * block / 1e9) for k, v in cpu.items()
        }
        return {
            "block_KiB": block >> 10,
            "piece_KiB": round(block / (2 * layers) / 1024, 1),
            "blocks": blocks,
            "raw_te_GBps": round(gbps["raw"], 2),
            "write_GBps": round(gbps["write"], 2),
            "pd_sum_off_GBps": round(gbps["off"], 2),
            "pd_sum_on_GBps": round(gbps["on"], 2),
            "off_vs_raw": round(gbps["off"] / gbps["raw"], 2),
            "on_vs_raw": round(gbps["on"] / gbps["raw"], 2),
            # the same ratio per repetition (raw and PD side by side in it),
            # median over repetitions: steadier when the load moves between them
            "on_vs_raw_paired": round(
                statistics.median(r / o for r, o in zip(runs["raw"], runs["on"], strict=True)),
                2,
            ),
            "raw_ms": round(statistics.median(runs["raw"]) * 1e3, 1),
            "d_after_p_off_ms": round(statistics.median(tails["off"]) * 1e3, 1),
            "d_after_p_on_ms": round(statistics.median(tails["on"]) * 1e3, 1),
            "P_cpu_ms_per_GB_raw": round(cpu_ms_gb["raw"]),
            "P_cpu_ms_per_GB_on": round(cpu_ms_gb["on"]),
        }

    def run_one(self, name, runs, tails, senders, pieces, raw, src_ids, dst_ids) -> None:
        """One timed transfer of series `name`, appended to `runs` (and `tails`)."""
        if name == "raw":
            runs[name].append(bench_raw_te(self.engine, self.peer, raw))
        elif name == "write":  # the transport alone: one `write` per layer
            runs[name].append(bench_te_transport(self.transport, self.peer, pieces, True))
        else:
            total_s, tail_s = self.pd_once(senders[name == "on"], src_ids, dst_ids)
            runs[name].append(total_s)
            tails[name].append(tail_s)


def bench_pd_inside(block_sizes: list[int], total: int, layers: int, reps: int) -> dict:
    """Runs inside a private network namespace (see `bench_pd`)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    run = _PDRun(total)
    rows = [run.block_row(block, layers, reps) for block in block_sizes]
    run.d.stdin.close()  # type: ignore[union-attr]
    run.d.wait(10)
    return {"rows": rows, "layers": layers, "reps": reps, "MiB": total >> 20}


def bench_pd(block_sizes: list[int], total: int, layers: int, reps: int) -> dict | str:
    """The engine listens on every interface: run it in a private network namespace."""
    inside = json.dumps([block_sizes, total, layers, reps])
    proc = subprocess.run(
        ["unshare", "--net", "--fork", sys.executable, __file__, "--pd-inside", inside],
        capture_output=True,
        text=True,
        timeout=1800,
        env=dict(os.environ, GLOG_minloglevel="1"),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PD ")]
    if proc.returncode != 0 or not lines:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    return json.loads(lines[-1][3:])


def print_pd(pd: dict | str) -> None:
    if isinstance(pd, str):
        print(f"\nfastkv PD over Mooncake TE: {pd}")
        return
    print_table(
        f"fastkv PD (PDSender -> PDReceiver over MooncakeTransport, first after_layer to "
        f"D's RankReport) vs raw TE batch writes of the same pieces, {pd['MiB']} MiB, "
        f"{pd['layers']} layers, block checksum off and on, GB/s (median of {pd['reps']})",
        pd["rows"],
        list(pd["rows"][0]),
    )


# -- end to end: the demo engine's P and D instances ------------------------------


def bench_e2e_inside(layers_list: list[int], conversations: int) -> dict:
    """Runs inside a private network namespace (see `bench_e2e`)."""
    import dataclasses

    from examples.engine.config import EngineConfig, ModelConfig
    from examples.engine.pd import PDEngine
    from examples.engine.workload import ConversationSpec, MultiTurnChat

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    spec = ConversationSpec(conversations=conversations, turns=2, new_tokens=2)
    rows = []
    for layers in layers_list:
        config = EngineConfig(
            device="cpu",
            num_device_blocks=1024,
            model=dataclasses.replace(ModelConfig(), num_layers=layers),
        )
        pd = PDEngine(config, 1, 1)
        pd.run(MultiTurnChat(spec))
        local = PDEngine(config, 1, 1, local_d=True)
        local.run(MultiTurnChat(spec))
        st = pd.stats
        rows.append(
            {
                "layers": layers,
                "requests": len(st.ttft_s),
                "MiB_sent": round(st.bytes_sent / MiB, 1),
                "hidden_frac": round(st.overlap_frac, 3),
                "transfer_ms": round(st.transfer_s * 1e3, 1),
                "ttft_pd_ms": round(statistics.median(st.ttft_s) * 1e3, 1),
                "ttft_recompute_on_d_ms": round(statistics.median(local.stats.ttft_s) * 1e3, 1),
            }
        )
    return {"rows": rows}


def bench_e2e(layers_list: list[int], conversations: int) -> dict | str:
    inside = json.dumps([layers_list, conversations])
    proc = subprocess.run(
        ["unshare", "--net", "--fork", sys.executable, __file__, "--e2e-inside", inside],
        capture_output=True,
        text=True,
        timeout=1800,
        env=dict(os.environ, GLOG_minloglevel="1"),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("E2E ")]
    if proc.returncode != 0 or not lines:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
    return json.loads(lines[-1][4:])


def print_e2e(e2e: dict | str) -> None:
    if isinstance(e2e, str):
        print(f"\nend to end: {e2e}")
        return
    print_table(
        "End to end, the demo engine (CPU) P -> D over Mooncake TE: transfer hidden behind "
        "P's prefill, and D's time to first token (median) against D prefilling itself",
        e2e["rows"],
        list(e2e["rows"][0]),
    )


# -- shared ----------------------------------------------------------------------


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="less data, fewer repetitions")
    parser.add_argument("--only", choices=["hook", "te", "pd", "e2e"], default=None)
    parser.add_argument("--e2e-layers", type=int, nargs="+", default=[3, 32])
    parser.add_argument("--e2e-inside", help=argparse.SUPPRESS)
    parser.add_argument("--layers-measured", type=int, default=2048, help="at least 1000")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--layers", type=int, default=4, help="pieces per block: 2 x layers")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--te-inside", help=argparse.SUPPRESS)
    parser.add_argument("--te-receiver", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pd-inside", help=argparse.SUPPRESS)
    parser.add_argument("--pd-receiver", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.te_receiver:
        _te_receiver(args.te_receiver)
    if args.pd_receiver:
        _pd_receiver(args.pd_receiver)
    if args.pd_inside:
        print("PD " + json.dumps(bench_pd_inside(*json.loads(args.pd_inside))), flush=True)
        os._exit(0)
    if args.e2e_inside:
        print("E2E " + json.dumps(bench_e2e_inside(*json.loads(args.e2e_inside))), flush=True)
        os._exit(0)
    if args.te_inside:
        print("TE " + json.dumps(bench_te_inside(*json.loads(args.te_inside))), flush=True)
        os._exit(0)  # skip the engine's teardown
    if args.layers_measured < 1000:
        parser.error(f"--layers-measured: at least 1000, got {args.layers_measured}")
    reps = args.reps or (3 if args.quick else 7)
    result: dict = {}
    if args.only in (None, "hook"):
        result["hook"] = hook_section(args.layers_measured)
    if args.only in (None, "te"):
        total = (64 if args.quick else 256) * MiB
        calls = 1000 if args.quick else 3000
        result["te"] = bench_te(
            [k << 10 for k in args.block_kib], total, args.layers, reps, calls
        )
    if args.only in (None, "pd"):
        total = (64 if args.quick else 256) * MiB
        result["pd"] = bench_pd([k << 10 for k in args.block_kib], total, args.layers, reps)
    if args.only in (None, "e2e"):
        result["e2e"] = bench_e2e(args.e2e_layers, 3 if args.quick else 8)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    if "hook" in result:
        print_hook_section(result["hook"])
    if "te" in result:
        print_te(result["te"])
    if "pd" in result:
        print_pd(result["pd"])
    if "e2e" in result:
        print_e2e(result["e2e"])


if __name__ == "__main__":
    main()
