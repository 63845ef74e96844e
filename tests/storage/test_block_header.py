"""The block checksum and header: native code against the documented definition."""

from __future__ import annotations

import subprocess
import sys

import crc32c
import numpy as np
import pytest

from fastkv.storage import BlockLayout, StorageKey, _disk_io
from fastkv.storage.auth import NO_AUTH_RING
from fastkv.storage.block_header import (
    HEADER_BYTES,
    MATCHED_BYTES,
    expected_header,
    expected_headers,
    parse_header,
    reference_checksum,
)


@pytest.mark.parametrize("length", [1, 7, 8, 23, 24, 25, 95, 96, 97, 4096, 100_003])
def test_crc32c_matches_the_crc32c_package(length: int) -> None:
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert _disk_io.crc32c(data) == crc32c.crc32c(data)


@pytest.mark.parametrize(
    "lengths", [(8,), (1, 2, 3), (4096, 32, 32, 4096), (100_001, 96, 7), (1 << 20,)]
)
def test_native_block_checksum_matches_reference(lengths: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(lengths))
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
    segs = np.array([[a.ctypes.data, a.size] for a in arrays], dtype=np.int64)
    want = reference_checksum([a.tobytes() for a in arrays])
    assert _disk_io.block_checksum(segs) == want
    arrays[-1][-1] ^= 1  # any flipped bit changes it
    assert _disk_io.block_checksum(segs) != want


def _impls() -> list[str]:
    """The block checksum implementations this CPU runs (`set_crc_impl`)."""
    have = []
    for impl in ("vector", "hw", "sw"):
        try:
            before = _disk_io.set_crc_impl(impl)
        except RuntimeError:
            continue
        _disk_io.set_crc_impl(before)
        have.append(impl)
    return have


@pytest.mark.parametrize("impl", ["vector", "hw", "sw"])
def test_every_checksum_implementation_matches_the_reference(impl: str) -> None:
    """Random segment counts, lengths (around the vector path's 768-byte minimum,
    its 192-byte steps and word tails) and misaligned addresses, scattered over one
    buffer in any order: each implementation gives the reference's value."""
    if impl not in _impls():
        pytest.skip(f"this CPU has no {impl!r} checksum (has {_impls()})")
    rng = np.random.default_rng(22)
    buf = rng.integers(0, 256, 1 << 21, dtype=np.uint8)
    before = _disk_io.set_crc_impl(impl)
    try:
        for _ in range(150):
            segs = []
            for _ in range(int(rng.integers(1, 7))):
                n = int(
                    rng.choice(
                        [
                            rng.integers(1, 40),
                            rng.integers(760, 800),
                            192 * int(rng.integers(4, 40)) + int(rng.integers(0, 24)),
                            rng.integers(1, 300_000),
                        ]
                    )
                )
                segs.append((int(rng.integers(0, buf.size - n)), n))
            arr = np.array([[buf.ctypes.data + o, n] for o, n in segs], dtype=np.int64)
            want = reference_checksum([buf[o : o + n].tobytes() for o, n in segs])
            assert _disk_io.block_checksum(arr) == want, (impl, segs)
    finally:
        _disk_io.set_crc_impl(before)


def test_set_crc_impl_refuses_an_unknown_name_and_keeps_the_current_one() -> None:
    before = _disk_io.set_crc_impl("sw")
    try:
        with pytest.raises(ValueError, match="'vector', 'hw' or 'sw'"):
            _disk_io.set_crc_impl("fast")
        assert _disk_io.set_crc_impl("sw") == "sw"
    finally:
        _disk_io.set_crc_impl(before)


def test_checksum_depends_on_segment_boundaries() -> None:
    data = np.arange(64, dtype=np.uint8)
    one = np.array([[data.ctypes.data, 64]], dtype=np.int64)
    two = np.array([[data.ctypes.data, 32], [data.ctypes.data + 32, 32]], dtype=np.int64)
    assert _disk_io.block_checksum(one) != _disk_io.block_checksum(two)


def test_header_round_trip_and_seal() -> None:
    layout = BlockLayout((4096, 32))
    key = StorageKey(b"n" * 32, b"h" * 32, 3)
    header = bytearray(expected_header(key, layout, seq=42))
    assert len(header) == HEADER_BYTES
    payload = np.zeros(4096 + 32, dtype=np.uint8)
    segs = np.array([[payload.ctypes.data, 4096], [payload.ctypes.data + 4096, 32]], np.int64)
    _disk_io.seal_header(header, segs, NO_AUTH_RING)
    assert (
        _disk_io.verify_block(bytes(header), expected_header(key, layout, 42), segs, b"") == 0
    )
    parsed = parse_header(bytes(header))
    assert parsed == (key, 2, layout.digest32(), 4096 + 32, 42, 0)
    # another seq, rank or hash: the header does not match
    for other in (
        expected_header(key, layout, 43),
        expected_header(StorageKey(b"n" * 32, b"h" * 32, 4), layout, 42),
        expected_header(StorageKey(b"n" * 32, b"g" * 32, 3), layout, 42),
    ):
        assert _disk_io.verify_block(bytes(header), other, segs, b"") == _disk_io.ST_BAD_HEADER
    payload[5] = 1
    assert _disk_io.verify_block(
        bytes(header), expected_header(key, layout, 42), segs, b""
    ) == (_disk_io.ST_BAD_CHECKSUM)
    header[MATCHED_BYTES + 4] ^= 0xFF  # key id and tag are covered by the header CRC
    assert _disk_io.verify_block(
        bytes(header), expected_header(key, layout, 42), segs, b""
    ) == (_disk_io.ST_BAD_HEADER)


def test_a_batch_of_expected_headers_is_each_keys_header_back_to_back() -> None:
    """expected_headers builds the header around a key's packed form: the same
    bytes as expected_header, field by field, for every rank and seq width."""
    layout = BlockLayout((4096, 32))
    keys = [
        StorageKey(bytes([r % 251]) * 32, bytes([7 + r % 13]) * 32, r)
        for r in (0, 1, 258, 65535)
    ]
    seqs = [0, 1, 2**40 + 3, 2**64 - 1]
    got = expected_headers(keys, layout, seqs)
    assert got == b"".join(
        expected_header(k, layout, s) for k, s in zip(keys, seqs, strict=True)
    )
    assert [parse_header(got[i * HEADER_BYTES :])[0] for i in range(4)] == keys
    assert expected_headers([], layout, []) == b""


def test_storage_imports_without_the_crc32c_package() -> None:
    # crc32c is a test dependency only (install_requires is numpy); a None entry in
    # sys.modules makes `import crc32c` raise as if it were not installed.
    code = (
        "import sys; sys.modules['crc32c'] = None; "
        "import fastkv.storage.block_header, fastkv.storage.local_disk"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
