"""Notices (encoding, authentication, keys under a deployment secret) and the
in-process transport's own contract (regions, timeouts, kill)."""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest

from fastkv import CacheConfig
from fastkv.metadata import Epoch
from fastkv.pd.decode import DecodeTransfers
from fastkv.pd.inproc import InProcFabric
from fastkv.pd.messages import (
    Acceptance,
    Notice,
    NoticeError,
    Offer,
    decode_notice,
    encode_notice,
    peek_progress,
    transfer_secret,
)
from fastkv.pd.prefill import PrefillTransfers
from fastkv.pd.transport import Piece, TransportError, WriteState
from fastkv.scheduler import CacheManager

NOTICE = Notice(Epoch(3), 42, 1, 2, 3, 4, False, 5, (1, 2, 0xFFFFFFFF))


def test_notice_round_trip_and_every_flipped_byte_refused() -> None:
    key = b"k" * 32
    raw = encode_notice(NOTICE, key)
    assert decode_notice(raw, key) == NOTICE
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 1
        with pytest.raises(NoticeError):
            decode_notice(bytes(bad), key)
    with pytest.raises(NoticeError, match="authenticator"):
        decode_notice(raw, b"j" * 32)
    with pytest.raises(NoticeError):
        decode_notice(raw[:-1], key)


def test_a_stopped_notice_is_a_failed_one_told_apart_from_a_failed_write() -> None:
    """Stopped (every write started settled done: D may free at once) and failed
    (a write failed: D fences by its grace) differ on the wire, under the MAC."""
    key = b"k" * 32
    stopped = Notice(Epoch(3), 42, 1, 2, 3, 4, True, 5, (), stopped=True)
    failed = Notice(Epoch(3), 42, 1, 2, 3, 4, True, 5, ())
    raw_stopped, raw_failed = encode_notice(stopped, key), encode_notice(failed, key)
    assert decode_notice(raw_stopped, key) == stopped
    assert decode_notice(raw_failed, key) == failed
    assert raw_stopped[:32] == raw_failed[:32] and raw_stopped[32:36] != raw_failed[32:36]
    with pytest.raises(ValueError, match="stopped notice is a failed one"):
        encode_notice(Notice(Epoch(3), 42, 1, 2, 3, 4, False, 5, (), stopped=True), key)


def test_progress_notice_round_trip_and_malformed_ones_refused() -> None:
    key = b"k" * 32
    progress = Notice(Epoch(3), 42, 1, 2, 3, 4, False, 5, (7, 8), 2, True)
    raw = encode_notice(progress, key)
    assert decode_notice(raw, key) == progress
    assert peek_progress(raw) and not peek_progress(encode_notice(NOTICE, key))
    for bad in (
        Notice(Epoch(3), 42, 1, 2, 3, 4, True, 5, (7,), 2, True),  # failed and progress
        Notice(Epoch(3), 42, 1, 2, 3, 4, False, 5, (), 2, True),  # nothing to verify
    ):
        with pytest.raises(ValueError, match="progress"):
            encode_notice(bad, key)
    empty = bytearray(encode_notice(Notice(Epoch(3), 42, 1, 2, 3, 4, False, 5, ()), key))
    empty[32] = 2  # a progress status without checksums, authenticated
    body = bytes(empty[:-32])
    signed = body + hmac.new(key, body, hashlib.sha256).digest()
    with pytest.raises(NoticeError, match="progress"):
        decode_notice(signed, key)


def test_deployment_secret_keys_differ_per_transfer_and_never_travel() -> None:
    s = b"d" * 32
    assert transfer_secret(s, Epoch(0), 1) != transfer_secret(s, Epoch(0), 2)
    assert transfer_secret(s, Epoch(0), 1) != transfer_secret(s, Epoch(1), 1)
    mgr = CacheManager(CacheConfig(block_size=4, num_device_blocks=8))
    d = DecodeTransfers(mgr, layout_digest=b"L" * 32, deployment_secret=s)
    acc = d.accept(Offer("r", 8, b"L" * 32, 1), [bytes([i]) * 32 for i in range(2)])
    assert isinstance(acc, Acceptance)
    assert acc.secret == transfer_secret(s, acc.epoch, acc.transfer_id)
    with pytest.raises(ValueError, match="deployment_secret"):
        DecodeTransfers(mgr, layout_digest=b"L" * 32, deployment_secret=b"short")


@pytest.mark.parametrize("digest", [5, b"L" * 31, "L" * 32])
def test_both_halves_refuse_a_layout_digest_that_is_not_32_bytes(digest: object) -> None:
    mgr = CacheManager(CacheConfig(block_size=4, num_device_blocks=8))
    for half in (DecodeTransfers, PrefillTransfers):
        with pytest.raises(ValueError, match="layout_digest: must be 32 bytes"):
            half(mgr, layout_digest=digest)


def _pair(**kw: object) -> tuple[InProcFabric, object, object, np.ndarray, np.ndarray]:
    now = [0.0]
    fabric = InProcFabric(clock=lambda: now[0], **kw)  # type: ignore[arg-type]
    fabric.now = now  # type: ignore[attr-defined]
    a, b = fabric.endpoint("a"), fabric.endpoint("b")
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    return fabric, a, b, src, dst


def test_writes_outside_registered_regions_are_refused_whole() -> None:
    _, a, _, src, dst = _pair()
    good = Piece(src.ctypes.data, dst.ctypes.data, 16)
    with pytest.raises(TransportError, match="destination"):
        a.write("b", [good, Piece(src.ctypes.data, dst.ctypes.data + 250, 16)])
    with pytest.raises(TransportError, match="source"):
        a.write("b", [Piece(src.ctypes.data - 1, dst.ctypes.data, 16)])
    assert not dst.any()
    with pytest.raises(TransportError, match="unknown"):
        a.write("nobody", [good])
    assert a.write("b", [good]).state() is WriteState.DONE
    assert dst[:16].tolist() == list(range(16))


def test_a_held_write_past_its_timeout_fails_and_never_lands() -> None:
    fabric, a, _, src, dst = _pair(write_timeout_s=1.0)
    fabric.hold_writes = True
    h = a.write("b", [Piece(src.ctypes.data, dst.ctypes.data, 64)])
    assert h.state() is WriteState.PENDING
    fabric.now[0] = 1.0
    assert h.state() is WriteState.FAILED
    fabric.pump()
    assert not dst.any()


def test_kill_lands_part_of_the_dying_writers_bytes_and_fails_the_rest() -> None:
    fabric, a, b, src, dst = _pair()
    fabric.hold_writes = fabric.hold_notices = True
    h = a.write("b", [Piece(src.ctypes.data, dst.ctypes.data, 100)])
    a.notify("b", b"x", 1.0)
    fabric.kill("a", land_fraction=0.5)
    assert h.state() is WriteState.FAILED
    assert dst[:50].tolist() == list(range(50)) and not dst[50:].any()
    fabric.pump()
    assert b.poll_notices() == []
    with pytest.raises(TransportError):
        a.write("b", [Piece(src.ctypes.data, dst.ctypes.data, 1)])
    with pytest.raises(TransportError):
        b.notify("a", b"y", 1.0)


def test_with_a_deployment_secret_the_key_never_travels() -> None:
    from fastkv.pd.prefill import PrefillTransfers

    s = b"d" * 32
    d_mgr = CacheManager(CacheConfig(block_size=4, num_device_blocks=8))
    p_mgr = CacheManager(CacheConfig(block_size=4, num_device_blocks=8))
    d = DecodeTransfers(d_mgr, layout_digest=b"L" * 32, deployment_secret=s)
    hs = [bytes([i]) * 32 for i in range(2)]
    for p_secret, sent in ((None, False), (s, True)):
        p = PrefillTransfers(p_mgr, layout_digest=b"L" * 32, deployment_secret=p_secret)
        rid = f"r{sent}"
        p_mgr.match(rid, hs, 8)
        assert p_mgr.allocate(rid, num_tokens=8)
        acc = d.accept(p.offer(rid, 8), hs)
        assert isinstance(acc, Acceptance)
        assert p.on_answer(acc.public()) is sent  # no key and no secret: refused
        if sent:
            assert p.plan(rid).secret == acc.secret
        p.release(rid)
