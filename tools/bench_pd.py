"""Prefill/decode transfer benchmarks (issue 22).

    .venv/bin/python tools/bench_pd.py [--layers-measured N] [--json]

Section 1 (below, `hook_costs`, `checksum_cost`): what fastkv's own code costs P and
D, whatever the transport.
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

Section 2 (raw Mooncake Transfer Engine against fastkv's PD path over it): added by
the Mooncake TE transport's change, in this file, below section 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastkv.metadata import Epoch
from fastkv.pd.inproc import InProcFabric
from fastkv.pd.layout import KVLayout, block_checksums
from fastkv.pd.messages import SendPlan
from fastkv.pd.receiver import PDReceiver
from fastkv.pd.sender import PDSender
from fastkv.pd.transport import Piece, WriteState

# -- section 1: fastkv's own costs ------------------------------------------------

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


def _arrays(num_blocks: int) -> list[np.ndarray]:
    shape = (num_blocks, HEADS, BLOCK_SIZE, HEAD_DIM)
    return [np.zeros(shape, dtype=np.float16) for _ in range(2 * LAYERS)]


def _layout(arrays: list[np.ndarray]) -> KVLayout:
    return KVLayout.of_arrays(arrays, tensors_per_layer=2, block_size=BLOCK_SIZE)


def hook_costs(kind: str, num_blocks: int, min_layers: int) -> dict[str, float]:
    """Thread CPU ns per `after_layer` call over enough sends to reach `min_layers`."""
    p_arrays, d_arrays = _arrays(256), _arrays(256)
    if kind == "null":
        p_end, d_end = NullTransport("p"), NullTransport("d")
    else:
        fabric = InProcFabric(write_timeout_s=3600.0)
        fabric.hold_writes = True
        p_end, d_end = fabric.endpoint("p"), fabric.endpoint("d")
    sender = PDSender(p_end, _layout(p_arrays))
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
        if kind != "null":
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
        block_checksums(layout.tensors, ids)
    dt = (time.perf_counter() - t0) / rounds
    nbytes = sum(t.block_bytes for t in layout.tensors) * num_blocks
    return {
        "blocks": num_blocks,
        "block_mib": nbytes / num_blocks / 2**20,
        "gb_s": nbytes / dt / 1e9,
    }


def section1(min_layers: int) -> dict[str, object]:
    return {
        "hook_empty_null": hook_costs("null", 0, min_layers),
        "hook_64_blocks_null": hook_costs("null", 64, min_layers),
        "hook_64_blocks_inproc_held": hook_costs("inproc", 64, min_layers),
        "checksum": checksum_cost(64),
    }


def print_section1(res: dict[str, object]) -> None:
    print(f"P's send hook, thread CPU time per layer ({LAYERS} layers per send, 2 tensors)")
    print(f"{'case':<34}{'layers':>8}{'median us':>12}{'p99 us':>10}{'start us':>10}")
    for name, target in (
        ("hook_empty_null", "<= 20"),
        ("hook_64_blocks_null", "<= 100"),
        ("hook_64_blocks_inproc_held", "(test transport)"),
    ):
        r = res[name]
        print(
            f"{name:<34}{r['layers']:>8}{r['median_us']:>12.2f}{r['p99_us']:>10.2f}"
            f"{r['start_us']:>10.1f}   target {target}"
        )
    c = res["checksum"]
    print(
        f"block checksum (crc32c-3way): {c['blocks']} blocks of {c['block_mib']:.2f} MiB: "
        f"{c['gb_s']:.2f} GB/s"
    )


# -- section 2: raw Mooncake TE vs fastkv's PD path (added by the TE transport) ----


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers-measured", type=int, default=2048, help="at least 1000")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.layers_measured < 1000:
        ap.error("--layers-measured: at least 1000")
    res = {"section1": section1(args.layers_measured)}
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_section1(res["section1"])


if __name__ == "__main__":
    main()
