"""tools/bench_storage.py's Mooncake part against an in-process stand-in store: a
timed operation that fails stops the bench (issue 27: a get answering "not stored"
inside a timing thread was swallowed and timed as a very fast one), and the
segment it asks for holds everything it stores."""

from __future__ import annotations

import importlib.util
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from fake_mooncake import FakeMooncakeStore

from fastkv.storage.block_header import HEADER_BYTES
from fastkv.storage.mooncake.codes import OBJECT_NOT_FOUND, POOL_FULL

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64 << 10  # 16 segments of 4 KiB
BLOCKS = 8


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_storage", ROOT / "tools/bench_storage.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_storage"] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()


class SegmentStore(FakeMooncakeStore):
    """A stand-in with a segment of `capacity` bytes that evicts its oldest objects
    to make room, as Mooncake's master does past its watermark."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.reput_code = 0  # as the real 0.3.13 store
        self.objects = OrderedDict()
        self.capacity = capacity
        self.evicted = 0

    def _put(self, name: str, ptrs: list[int], sizes: list[int]) -> int:
        code = super()._put(name, ptrs, sizes)
        while sum(map(len, self.objects.values())) > self.capacity:
            self.objects.popitem(last=False)
            self.evicted += 1
        return code


def test_the_segment_it_asks_for_holds_what_it_stores() -> None:
    store = SegmentStore(bench.mooncake_segment_bytes(BLOCK, BLOCKS) - (64 << 20))
    row = bench.mooncake_row(store, BLOCK, BLOCKS, reps=2)
    assert store.evicted == 0 and not store.objects  # each repetition removes its sets
    assert row["blocks"] == BLOCKS and row["raw_get_GBps"] > 0


def test_a_segment_too_small_fails_the_bench_loudly() -> None:
    """Two object sets' worth, as before: gets answer "not stored"."""
    store = SegmentStore(2 * BLOCKS * (HEADER_BYTES + BLOCK))
    with pytest.raises(bench.BenchFailure, match="failed"):
        bench.mooncake_row(store, BLOCK, BLOCKS, reps=1)
    assert store.evicted > 0


@pytest.mark.parametrize("way", ["raw", "backend"])
def test_a_get_answering_not_stored_fails_the_bench(way: str) -> None:
    """The first key of a get call answers -704: raw (contiguous) or the backend's
    zero-copy get (a MISS "not stored")."""

    class Losing(FakeMooncakeStore):
        def batch_get_into(self, names, ptrs, sizes):
            codes = super().batch_get_into(names, ptrs, sizes)
            return self.lose(codes) if way == "raw" and names[0].startswith("bench") else codes

        def batch_get_into_multi_buffers(self, names, ptrs, sizes):
            codes = super().batch_get_into_multi_buffers(names, ptrs, sizes)
            return (
                self.lose(codes) if way == "backend" and names[0].startswith("fkv") else codes
            )

        def lose(self, codes: list[int]) -> list[int]:
            return [OBJECT_NOT_FOUND, *codes[1:]]

    store = Losing()
    store.reput_code = 0
    with pytest.raises(bench.BenchFailure, match=r"not stored|-704"):
        bench.mooncake_row(store, BLOCK, BLOCKS, reps=1)


def test_a_put_refused_fails_the_bench() -> None:
    store = FakeMooncakeStore()
    store.reput_code = 0
    store.fail_put["bench-raw-0-3"] = POOL_FULL
    with pytest.raises(bench.BenchFailure, match="bench-raw-0-3"):
        bench.mooncake_row(store, BLOCK, BLOCKS, reps=1)


def test_a_get_that_moves_wrong_bytes_fails_the_bench() -> None:
    """Every code right, the bytes not: the comparison after the timed get catches it."""

    class Lying(FakeMooncakeStore):
        def batch_get_into(self, names, ptrs, sizes):
            return (
                list(sizes)
                if names[0].startswith("bench-raw")
                else super().batch_get_into(names, ptrs, sizes)
            )

    store = Lying()
    store.reput_code = 0
    with pytest.raises(bench.BenchFailure, match="differ"):
        bench.mooncake_row(store, BLOCK, BLOCKS, reps=1)
