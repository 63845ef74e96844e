"""crc32c-3way in plain Python, from its definition (fastkv/storage/_crc32c.h):
the GPU tests' reference where storage's extension is not built (`make gpu-test`
builds the core alone). Slow: for tests of up to a few hundred KiB."""

from __future__ import annotations

POLY = 0x82F63B78


def _table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (POLY if c & 1 else 0)
        out.append(c)
    return out


TABLE = _table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """Standard CRC-32C (initial and final xor ~0), continuing from `crc`."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = (c >> 8) ^ TABLE[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


def checksum(segments: list[bytes]) -> int:
    """Per segment three lanes over its 8-byte words (word i to lane i % 3, the
    trailing bytes to lane 0 after its words), then CRC-32C of every segment's
    lanes, 4 little-endian bytes each, in order."""
    lanes = bytearray()
    for seg in segments:
        nw = len(seg) // 8
        parts = [bytearray(), bytearray(), bytearray()]
        for i in range(nw):
            parts[i % 3] += seg[8 * i : 8 * i + 8]
        parts[0] += seg[8 * nw :]
        for part in parts:
            lanes += crc32c(bytes(part)).to_bytes(4, "little")
    return crc32c(bytes(lanes))
