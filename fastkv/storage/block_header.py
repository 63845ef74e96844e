"""The 128-byte header in front of every stored block, and its checks.

    offset  field
         0  magic         8 bytes  b"FKVBLK\\0\\1"
         8  version       u32      2
        12  num_segments  u32
        16  namespace     32 bytes StorageNamespace digest
        48  block_hash    32 bytes
        80  rank          u32
        84  layout        u32      BlockLayout.digest32()
        88  payload_len   u64      sum of the segment lengths
        96  seq           u64      write sequence (0 where the store keeps one version)
       104  key_id        u32      the key that made `tag` (fastkv.storage.auth); 0: none
       108  tag           16 bytes key_id != 0: HMAC-SHA256(k1, bytes [0, 108) || G),
                                   first 16 bytes; G = GMAC(k2, fixed IV, segments)
            payload_crc   u32      key_id == 0: crc32c-3way of the segments (below),
                                   then 12 zero bytes
       124  header_crc    u32      CRC-32C of bytes [0, 124)

A read proves it holds the block it asked for when bytes [0, 104) equal the header
it expects, the header CRC verifies and the payload verifies against the bytes that
landed in host memory: by its tag under a key of the reader's ring when the reader
has one (an untagged block is then refused), else by its payload CRC (and a tagged
block is refused: the reader cannot check it). Little-endian throughout. Version 1
(no key id, no tag) is not read: its blocks are misses.

crc32c-3way: per segment, three CRC-32C lanes over its 8-byte words (word i feeds
lane i % 3; the trailing len % 8 bytes feed lane 0 after its words); the block
checksum is CRC-32C over the lanes of all segments as little-endian u32s, in order.
Three independent lanes run about three times as fast as one on x86's crc32
instruction. `fastkv.storage._disk_io` computes it natively; `reference_checksum`
below is the same definition in Python, for tests.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence

import numpy as np

from fastkv.storage import _disk_io
from fastkv.storage.base import BlockLayout, StorageKey

HEADER_BYTES = 128
MAGIC = b"FKVBLK\0\1"
VERSION = 2
_FIXED = struct.Struct("<8sII32s32sIIQQ")  # bytes [0, 104)
MATCHED_BYTES = _FIXED.size
assert MATCHED_BYTES == _disk_io.HDR_CMP_END
assert HEADER_BYTES == _disk_io.HDR_BYTES


def expected_header(key: StorageKey, layout: BlockLayout, seq: int) -> bytes:
    """The 128 bytes a block of `key` written with `seq` starts with, CRC fields zero
    (a writer seals them; a reader compares the first 104 bytes)."""
    nseg, digest, length = _layout_fields(layout)
    fixed = _FIXED.pack(
        MAGIC, VERSION, nseg, key.namespace, key.block_hash, key.rank, digest, length, seq
    )
    return fixed + _PAD


_PAD = bytes(HEADER_BYTES - MATCHED_BYTES)


def expected_headers(
    keys: Sequence[StorageKey], layout: BlockLayout, seqs: Sequence[int]
) -> bytes:
    """`expected_header` of each key with its seq, back to back (one call for a
    batch: a block's header costs a third of packing it field by field; the disk
    backend's C batch makes the same bytes from `header_parts`)."""
    head, tail = header_parts(layout)
    return b"".join(
        [
            head + key.packed + tail + seq.to_bytes(8, "little") + _PAD
            for key, seq in zip(keys, seqs, strict=True)
        ]
    )


@functools.lru_cache(maxsize=64)
def _layout_fields(layout: BlockLayout) -> tuple[int, int, int]:
    return layout.num_segments, layout.digest32(), layout.payload_bytes


@functools.lru_cache(maxsize=64)
def header_parts(layout: BlockLayout) -> tuple[bytes, bytes]:
    """The header bytes around a key's `packed` form (namespace, hash, rank as a
    u16): magic, version and segment count before; the rank's two high bytes,
    layout digest and payload length after. The seq and _PAD follow."""
    nseg, digest, length = _layout_fields(layout)
    head = struct.pack("<8sII", MAGIC, VERSION, nseg)
    tail = struct.pack("<HIQ", 0, digest, length)
    return head, tail


def parse_header(
    raw: bytes | memoryview,
) -> tuple[StorageKey, int, int, int, int, int] | None:
    """(key, num_segments, layout digest, payload length, seq, key id) of a header
    whose magic and version match, else None. The caller has verified its CRC."""
    magic, version, nseg, ns, block_hash, rank, layout, length, seq = _FIXED.unpack_from(raw)
    if magic != MAGIC or version != VERSION or rank > 0xFFFF:
        return None
    key_id = int.from_bytes(bytes(raw[_disk_io.HDR_KEY_ID : _disk_io.HDR_KEY_ID + 4]), "little")
    return StorageKey(bytes(ns), bytes(block_hash), rank), nseg, layout, length, seq, key_id


def reference_checksum(segments: list[bytes]) -> int:
    """crc32c-3way of a block given as the bytes of its segments (slow; tests).

    Needs the `crc32c` package, a test dependency (requirements.txt) that
    install_requires leaves out, hence the import here rather than at the top."""
    import crc32c

    lanes = bytearray()
    for seg in segments:
        nwords = len(seg) // 8
        words = np.frombuffer(seg, dtype="<u8", count=nwords)
        tail = seg[nwords * 8 :]
        lane0 = crc32c.crc32c(words[0::3].tobytes() + tail)
        lane1 = crc32c.crc32c(words[1::3].tobytes())
        lane2 = crc32c.crc32c(words[2::3].tobytes())
        lanes += struct.pack("<III", lane0, lane1, lane2)
    return crc32c.crc32c(bytes(lanes))


__all__ = [
    "HEADER_BYTES",
    "MATCHED_BYTES",
    "expected_header",
    "expected_headers",
    "header_parts",
    "parse_header",
    "reference_checksum",
]
