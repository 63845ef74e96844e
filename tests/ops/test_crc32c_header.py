"""fkv_crc32c.h, the math of the core's CUDA checksum (`core.crc3way_cuda`), run on
the host: chunks of a segment summed independently and folded in two levels, as
the kernel does, give storage's crc32c-3way bit for bit, whatever the sizes,
alignments, chunk sizes and thread counts."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from . import crc_reference
from .native_harness import build_harness

# storage's extension, imported in the tests: `make gpu-test` collects this module
# (and runs none of it) in a checkout where only the core is built.
_disk_io = None


@pytest.fixture(scope="module", autouse=True)
def _storage() -> None:
    global _disk_io
    from fastkv.storage import _disk_io as ext

    _disk_io = ext


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    lib = build_harness(tmp_path_factory.mktemp("crc"), "crc_harness.cc")
    u64 = ctypes.c_uint64
    lib.crc_harness_checksum.argtypes = [ctypes.c_void_p, ctypes.c_int64, u64, u64]
    lib.crc_harness_checksum.restype = ctypes.c_uint32
    lib.crc_harness_xpow8n.argtypes = [ctypes.c_uint64]
    lib.crc_harness_xpow8n.restype = ctypes.c_uint32
    lib.crc_harness_fold.argtypes = [ctypes.c_uint32, ctypes.c_uint32, u64]
    lib.crc_harness_fold.restype = ctypes.c_uint32
    return lib


def _segs(buf: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    base = buf.ctypes.data
    return np.array([[base + off, n] for off, n in spans], dtype=np.int64)


SIZES = [0, 1, 7, 8, 9, 16, 23, 24, 25, 47, 191, 192, 193, 1000, 4101, 65549]


@pytest.mark.parametrize("chunk_words", [3, 6, 48, 192, 3072])
@pytest.mark.parametrize("threads", [1, 7, 128])
def test_chunked_checksum_equals_storages_crc32c_3way(
    lib: ctypes.CDLL, chunk_words: int, threads: int
) -> None:
    rng = np.random.default_rng(chunk_words * 1000 + threads)
    buf = rng.integers(0, 256, size=1 << 19, dtype=np.uint8)
    for n in SIZES:  # one segment at every odd offset
        for off in (0, 1, 3, 8):
            segs = _segs(buf, [(off, n)])
            want = _disk_io.block_checksum(segs)
            got = lib.crc_harness_checksum(segs.ctypes.data, 1, chunk_words, threads)
            assert got == want, (n, off)
    for _ in range(20):  # many segments, scattered, any order
        spans = [
            (int(rng.integers(0, 1 << 18)), int(rng.choice(SIZES)))
            for _ in range(int(rng.integers(1, 40)))
        ]
        segs = _segs(buf, spans)
        want = _disk_io.block_checksum(segs)
        assert (
            lib.crc_harness_checksum(segs.ctypes.data, len(spans), chunk_words, threads) == want
        )


def test_every_implementation_agrees_with_the_chunked_one(lib: ctypes.CDLL) -> None:
    """storage's three implementations (vector, hw, sw) are the reference."""
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    segs = _segs(buf, [(5, 300_001), (400_000, 65_536), (0, 13)])
    got = lib.crc_harness_checksum(segs.ctypes.data, 3, 192, 128)
    before = _disk_io.set_crc_impl("sw")
    try:
        for impl in ("sw", "hw", "vector"):
            try:
                _disk_io.set_crc_impl(impl)
            except RuntimeError:
                continue  # this CPU lacks it
            assert _disk_io.block_checksum(segs) == got, impl
    finally:
        _disk_io.set_crc_impl(before)


def _raw(data: bytes) -> int:
    """The CRC-32C register fed `data` from state 0, no final xor: the standard
    CRC's initial and final xor cancel against the same of zeros."""
    return _disk_io.crc32c(data) ^ _disk_io.crc32c(bytes(len(data)))


def test_folding_two_parts_is_the_crc_of_both(lib: ctypes.CDLL) -> None:
    assert lib.crc_harness_xpow8n(0) == 0x80000000  # 1
    assert lib.crc_harness_xpow8n(1) == 0x00800000  # x^8
    rng = np.random.default_rng(3)
    for na, nb in [(0, 5), (5, 0), (1, 1), (8, 24), (37, 1001), (4096, 3)]:
        a = rng.integers(0, 256, size=na, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, size=nb, dtype=np.uint8).tobytes()
        assert lib.crc_harness_fold(_raw(a), _raw(b), nb) == _raw(a + b), (na, nb)
        # from the standard initial state: the finished CRC of both
        state = lib.crc_harness_fold(0xFFFFFFFF, _raw(a), na)
        assert lib.crc_harness_fold(state, _raw(b), nb) ^ 0xFFFFFFFF == _disk_io.crc32c(a + b)


def test_the_python_reference_the_gpu_tests_use_is_storages_checksum() -> None:
    rng = np.random.default_rng(9)
    buf = rng.integers(0, 256, size=1 << 14, dtype=np.uint8)
    for spans in ([(0, 0)], [(1, 7)], [(3, 25), (100, 192)], [(5, 4099), (0, 1000), (9, 9)]):
        segs = _segs(buf, spans)
        want = _disk_io.block_checksum(segs)
        assert crc_reference.checksum([buf[o : o + n].tobytes() for o, n in spans]) == want


def test_the_chunk_count_of_huge_segments_saturates_instead_of_wrapping(
    lib: ctypes.CDLL,
) -> None:
    """fkv_cuda_crc3way sizes its buffer by the chunk count and refuses more than
    2^36 chunks; a count that wrapped past 2^64 (many huge segments) would pass
    that check small, and the kernels would index far past the buffer. 64
    segments of 2^58 chunks each (chunks of 3 words) plus one more: 2^64 + 1."""
    lib.crc_harness_plan_total.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
    lib.crc_harness_plan_total.restype = ctypes.c_uint64
    lengths = np.array([3 * (1 << 61)] * 64 + [8], dtype=np.int64)
    total = lib.crc_harness_plan_total(lengths.ctypes.data, len(lengths), 3)
    assert total > 1 << 36, f"the chunk count wrapped to {total}"
    small = np.array([0, 8, 1537], dtype=np.int64)
    assert lib.crc_harness_plan_total(small.ctypes.data, 3, 192) == 3
