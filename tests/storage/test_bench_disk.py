"""tools/bench_storage.py's disk part: an operation that fails inside a timing
thread stops the bench (issue 27: `in_threads` swallowed what its threads raised,
so a failed put or get was timed as a fast one)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fastkv.storage.base import KeyResult, KeyStatus
from fastkv.storage.local_disk import LocalDiskBackend

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64 << 10  # 16 segments of 4 KiB


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_storage_disk", ROOT / "tools/bench_storage.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_storage_disk"] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def test_a_raise_in_a_timing_thread_fails_the_bench() -> None:
    def work(lo: int, hi: int) -> None:
        if lo:
            raise OSError(5, "second thread's write failed")

    with pytest.raises(bench.BenchFailure, match="1 of 2 timing threads failed") as info:
        bench.in_threads(2, 8, work)
    assert isinstance(info.value.__cause__, OSError)


def test_a_timed_get_that_misses_fails_the_disk_bench(tmp_path, monkeypatch) -> None:
    real_get = LocalDiskBackend.get_into

    def lossy_get(self, keys, segments, deadline):
        results = real_get(self, keys, segments, deadline)
        return [KeyResult(KeyStatus.MISS, "lost"), *results[1:]]

    monkeypatch.setattr(LocalDiskBackend, "get_into", lossy_get)
    with pytest.raises(bench.BenchFailure, match="disk get: 1 of"):
        bench.bench_disk(tmp_path, BLOCK, 8 * BLOCK, reps=1)


def test_a_timed_one_block_put_that_fails_fails_the_latency_bench(
    tmp_path, monkeypatch
) -> None:
    calls = []
    real_put = LocalDiskBackend.put_from

    def failing_put(self, keys, segments, deadline):
        calls.append(len(keys))
        if len(calls) > 20:  # past the warm-up: a timed put
            return [KeyResult(KeyStatus.FAILED, "disk full")] * len(keys)
        return real_put(self, keys, segments, deadline)

    monkeypatch.setattr(LocalDiskBackend, "put_from", failing_put)
    with pytest.raises(bench.BenchFailure, match="put of block"):
        bench.bench_disk_latency(tmp_path, BLOCK, 8)


@pytest.mark.parametrize("segments", [16, 1])
def test_the_latency_bench_labels_each_row_with_its_segments_per_block(
    tmp_path, segments: int
) -> None:
    """Both host layouts are measured and told apart: 16 segments per block (one
    per layer tensor) and 1 (a block in one contiguous region)."""
    rows = bench.bench_disk_latency(tmp_path, BLOCK, 8, segments)
    assert [(r["segments"], r["auth"]) for r in rows] == [(segments, "off"), (segments, "on")]
    assert all(r["put_p50_us"] > 0 and r["raw_put_p50_us"] > 0 for r in rows)
