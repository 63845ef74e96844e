"""Authenticated block headers (issue 15 item 2): a block is served only when its tag
verifies under a key of the reader's ring; what someone without the secret can make
(a header with a valid CRC, a copied key id, a guessed tag) is refused."""

from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fastkv.storage import BlockLayout, StorageKey, _disk_io
from fastkv.storage.auth import ENV_KEY_FILE, NO_AUTH_RING, StorageAuth
from fastkv.storage.block_header import expected_header

LAYOUT = BlockLayout((4096, 32))
KEY = StorageKey(b"n" * 32, b"h" * 32, 3)
SECRET = bytes(range(32))
OLD_SECRET = bytes(range(1, 33))


def block() -> tuple[np.ndarray, np.ndarray]:
    payload = np.random.default_rng(0).integers(0, 256, 4096 + 32, dtype=np.uint8)
    segs = np.array([[payload.ctypes.data, 4096], [payload.ctypes.data + 4096, 32]], np.int64)
    return payload, segs


def sealed(ring: bytes, segs: np.ndarray) -> bytearray:
    header = bytearray(expected_header(KEY, LAYOUT, 7))
    _disk_io.seal_header(header, segs, ring)
    return header


def verify(header: bytes, segs: np.ndarray, ring: bytes) -> int:
    return _disk_io.verify_block(bytes(header), expected_header(KEY, LAYOUT, 7), segs, ring)


def aes_block(key: bytes, block: bytes) -> bytes:
    """One AES-128 block by the openssl command line (an implementation apart)."""
    out = subprocess.run(
        ["openssl", "enc", "-aes-128-ecb", "-K", key.hex(), "-nopad"],
        input=block,
        capture_output=True,
        check=True,
    )
    return out.stdout


def gf_mult(x: int, y: int) -> int:
    """GCM's multiplication in GF(2^128) (NIST SP 800-38D, algorithm 1)."""
    z, v = 0, y
    for i in range(128):
        if (x >> (127 - i)) & 1:
            z ^= v
        v = (v >> 1) ^ (0xE1 << 120) if v & 1 else v >> 1
    return z


def gmac(key: bytes, data: bytes) -> bytes:
    """GMAC with the all-zero 96-bit IV: GHASH of the data and its bit length, masked."""
    h = int.from_bytes(aes_block(key, bytes(16)), "big")
    # GCM's length block: the AAD's bit length, then the (empty) ciphertext's
    lengths = (8 * len(data)).to_bytes(8, "big") + bytes(8)
    padded = data + bytes(-len(data) % 16) + lengths
    x = 0
    for i in range(0, len(padded), 16):
        x = gf_mult(x ^ int.from_bytes(padded[i : i + 16], "big"), h)
    mask = int.from_bytes(aes_block(key, bytes(12) + (1).to_bytes(4, "big")), "big")
    return (x ^ mask).to_bytes(16, "big")


def test_tag_is_the_documented_construction() -> None:
    """tag = HMAC-SHA256(k1, header[0, 108) || GMAC(k2, payload))[:16], recomputed
    with Python's hmac, the openssl command line and GHASH written out here."""
    auth = StorageAuth([SECRET])
    payload, segs = block()
    header = sealed(auth.ring, segs)
    k1 = hmac.new(SECRET, b"fastkv/storage-block-mac/v1", hashlib.sha256).digest()
    k2 = hmac.new(SECRET, b"fastkv/storage-payload-hash/v1", hashlib.sha256).digest()[:16]
    g = gmac(k2, payload.tobytes())
    want = hmac.new(k1, bytes(header[:108]) + g, hashlib.sha256).digest()[:16]
    assert bytes(header[108:124]) == want
    assert int.from_bytes(header[104:108], "little") == auth.write_key_id != 0
    assert verify(header, segs, auth.ring) == _disk_io.ST_OK


def test_what_no_key_holder_can_make_is_refused() -> None:
    auth = StorageAuth([SECRET])
    payload, segs = block()
    # An attacker seals a header without the secret: valid CRCs, no tag.
    forged = sealed(NO_AUTH_RING, segs)
    assert verify(forged, segs, NO_AUTH_RING) == _disk_io.ST_OK  # fine for an open store
    assert verify(forged, segs, auth.ring) == _disk_io.ST_UNAUTHENTICATED
    # ... or copies the victim's key id and guesses a tag (then fixes the header CRC).
    guessed = bytearray(sealed(StorageAuth([os.urandom(32)]).ring, segs))
    guessed[104:108] = auth.write_key_id.to_bytes(4, "little")
    guessed[124:128] = _disk_io.crc32c(bytes(guessed[:124])).to_bytes(4, "little")
    assert verify(guessed, segs, auth.ring) == _disk_io.ST_BAD_MAC
    # ... or keeps a genuine header and swaps the payload.
    genuine = sealed(auth.ring, segs)
    payload[100] ^= 1
    assert verify(genuine, segs, auth.ring) == _disk_io.ST_BAD_MAC
    # A reader without the ring cannot check a tagged block: refused, not trusted.
    payload[100] ^= 1
    assert verify(genuine, segs, NO_AUTH_RING) == _disk_io.ST_UNKNOWN_KEY


def test_rotation_old_key_verifies_reads_new_key_signs_writes() -> None:
    _, segs = block()
    old = sealed(StorageAuth([OLD_SECRET]).ring, segs)
    rotated = StorageAuth([SECRET, OLD_SECRET])
    assert verify(old, segs, rotated.ring) == _disk_io.ST_OK
    new = sealed(rotated.ring, segs)
    assert int.from_bytes(new[104:108], "little") == StorageAuth([SECRET]).write_key_id
    # the old secret retired: its blocks are no longer served
    assert verify(old, segs, StorageAuth([SECRET]).ring) == _disk_io.ST_UNKNOWN_KEY


def test_key_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# current\n{SECRET.hex()}\n{OLD_SECRET.hex()}  # retiring\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        StorageAuth.from_file(path)
    path.chmod(0o600)
    auth = StorageAuth.from_file(path)
    assert auth.key_ids == StorageAuth([SECRET, OLD_SECRET]).key_ids
    assert SECRET.hex() not in repr(auth)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ValueError, match="symbolic link"):
        StorageAuth.from_file(link)
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match="owned by uid 65534"):
        StorageAuth.from_file(path)
    os.chown(path, os.geteuid(), os.getegid())
    assert StorageAuth.from_environment({ENV_KEY_FILE: str(path)}).key_ids == auth.key_ids
    assert StorageAuth.from_environment({}) is None
    path.write_text("abcd\n")
    with pytest.raises(ValueError, match="line 1 holds 2 bytes"):
        StorageAuth.from_file(path)


@pytest.mark.parametrize(
    "content, match",
    [
        (os.urandom(32) + b"\xff", r"not UTF-8 text \(byte \d+ is 0x"),
        (b"# pad\n" * 200_000 + SECRET.hex().encode(), "larger than 1048576 bytes"),
        (b"", "is empty: no secret"),
        (b"# a comment\n\n", "holds only comments and blank lines: no secret"),
        (b"zz" * 32 + b"\n", "line 1 is not hex"),
    ],
    ids=["binary", "oversized", "empty", "comments_only", "not_hex"],
)
def test_key_file_errors_say_what_is_wrong(tmp_path: Path, content: bytes, match: str) -> None:
    """Issue 25 item 13: raw key bytes raised UnicodeDecodeError; a secret after
    1 MiB of comments was cut off and reported as "holds no secret"."""
    path = tmp_path / "keys"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ValueError, match=match) as e:
        StorageAuth.from_file(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    "secrets, match",
    [([], "non-empty"), ([b"short"], r"secrets\[0\]"), ([SECRET, SECRET], "same secret")],
)
def test_bad_rings_are_refused(secrets: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StorageAuth(secrets)


@pytest.mark.parametrize("impl", ["native", "libcrypto"])
def test_both_gmac_implementations_match_the_reference(impl: str) -> None:
    """The VPCLMULQDQ GHASH (_ghash.h) and libcrypto's GMAC give the same G, for
    segment lengths that split blocks anywhere; small cases against GHASH written
    out in Python."""
    rng = np.random.default_rng(7)
    k2 = bytes(range(16))
    gkeys = k2 + _disk_io.gmac_subkeys(k2)
    before = _disk_io.set_gmac_impl(impl)
    try:
        for case in range(40):
            lengths = rng.integers(1, 3000 if case < 8 else 40_000, rng.integers(1, 6))
            arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
            segs = np.array([[a.ctypes.data, a.size] for a in arrays], dtype=np.int64)
            got = _disk_io.payload_gmac(gkeys, segs)
            _disk_io.set_gmac_impl("libcrypto")
            assert got == _disk_io.payload_gmac(gkeys, segs), (case, lengths)
            _disk_io.set_gmac_impl(impl)
            if case < 8:
                assert got == gmac(k2, b"".join(a.tobytes() for a in arrays)), lengths
    finally:
        _disk_io.set_gmac_impl(before)


def _native_or_skip() -> str:
    try:
        return _disk_io.set_gmac_impl("native")
    except RuntimeError as e:  # no VPCLMULQDQ: the one-pass copy is not used
        pytest.skip(str(e))


def test_staged_objects_copied_and_hashed_in_one_pass_match_the_two_pass_path() -> None:
    """stage_block / unstage_block copy and hash the payload in one pass where the
    native GHASH runs (_ghash_copy.h): the object bytes and tag are those of the
    libcrypto path (seal, then copy), for segment lengths that split GHASH blocks
    and 512-byte strides anywhere; the payload scattered back is the block's."""
    rng = np.random.default_rng(11)
    ring = StorageAuth([SECRET]).ring
    before = _native_or_skip()
    try:
        for case in range(30):
            lengths = [int(n) for n in rng.integers(1, 5000, rng.integers(1, 7))]
            layout = BlockLayout(tuple(lengths))
            key = StorageKey(b"n" * 32, case.to_bytes(32, "little"), 0)
            arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]
            segs = np.array([[a.ctypes.data, a.size] for a in arrays], dtype=np.int64)
            objects = {}
            for impl in ("native", "libcrypto"):
                _disk_io.set_gmac_impl(impl)
                obj = np.zeros(128 + sum(lengths) + 1, dtype=np.uint8)
                header = bytearray(expected_header(key, layout, 0))
                _disk_io.stage_block(obj.ctypes.data + 1, header, segs, ring)  # unaligned
                objects[impl] = obj.tobytes()
            assert objects["native"] == objects["libcrypto"], lengths
            _disk_io.set_gmac_impl("native")
            src = np.frombuffer(objects["native"], dtype=np.uint8).copy()
            outs = [np.zeros(n, dtype=np.uint8) for n in lengths]
            out_segs = np.array([[a.ctypes.data, a.size] for a in outs], dtype=np.int64)
            want = expected_header(key, layout, 0)
            assert _disk_io.unstage_block(src.ctypes.data + 1, want, out_segs, ring) == 0
            assert all(np.array_equal(a, b) for a, b in zip(outs, arrays, strict=True))
    finally:
        _disk_io.set_gmac_impl(before)


@pytest.mark.parametrize("impl", ["native", "libcrypto"])
def test_unstage_refuses_what_the_ring_does_not_vouch_for(impl: str) -> None:
    """A staged object with one payload bit flipped, under a key the ring lacks, or
    written without a ring is refused by unstage_block (both GMAC paths)."""
    before = _disk_io.set_gmac_impl(impl) if impl == "libcrypto" else _native_or_skip()
    try:
        payload, segs = block()
        ring = StorageAuth([SECRET]).ring
        want = expected_header(KEY, LAYOUT, 7)
        obj = np.zeros(128 + payload.size, dtype=np.uint8)
        out = np.zeros(payload.size, dtype=np.uint8)
        out_segs = np.array([[out.ctypes.data, 4096], [out.ctypes.data + 4096, 32]], np.int64)

        def staged(ring_used: bytes) -> None:
            _disk_io.stage_block(obj.ctypes.data, bytearray(want), segs, ring_used)

        staged(ring)
        assert _disk_io.unstage_block(obj.ctypes.data, want, out_segs, ring) == _disk_io.ST_OK
        obj[128 + 4100] ^= 1
        got = _disk_io.unstage_block(obj.ctypes.data, want, out_segs, ring)
        assert got == _disk_io.ST_BAD_MAC
        staged(StorageAuth([OLD_SECRET]).ring)
        got = _disk_io.unstage_block(obj.ctypes.data, want, out_segs, ring)
        assert got == _disk_io.ST_UNKNOWN_KEY
        staged(NO_AUTH_RING)
        got = _disk_io.unstage_block(obj.ctypes.data, want, out_segs, ring)
        assert got == _disk_io.ST_UNAUTHENTICATED
    finally:
        _disk_io.set_gmac_impl(before)


def test_pack_segments_gives_the_int64_pairs_numpy_gives_and_refuses_bad_shapes() -> None:
    """The Mooncake backend's per-call segment arrays (pack_segments): the bytes of
    numpy's int64 array of the same pairs; a block of the wrong segment count, a
    segment that is not a pair or not ints raises, naming the block."""
    blocks = [[((1 << 40) + 4096 * s + b, 512 + s) for s in range(5)] for b in range(3)]
    packed = _disk_io.pack_segments(blocks, 5)
    assert bytes(packed) == np.asarray(blocks, dtype=np.int64).tobytes()
    assert bytes(_disk_io.pack_segments([], 5)) == b""
    with pytest.raises(ValueError, match=r"blocks\[1\] has 4 segments, expected 5"):
        _disk_io.pack_segments([blocks[0], blocks[1][:4]], 5)
    with pytest.raises(ValueError, match=r"blocks\[0\]\[2\] is not an \(address"):
        _disk_io.pack_segments([[*blocks[0][:2], (1, 2, 3), *blocks[0][3:]]], 5)
    with pytest.raises(TypeError):
        _disk_io.pack_segments([[(1.5, 2)] * 5], 5)
    with pytest.raises(ValueError, match="nseg"):
        _disk_io.pack_segments(blocks, 0)
