"""The `PDTransport` contract (fastkv/pd/transport.py) as checks any implementation
must pass, both ends in one process so a check can read the receiver's memory.

A check takes a `make_pair` factory (a fresh `Pair` per call) and raises
AssertionError on a breach. test_mooncake_te.py runs them over Mooncake TE inside a
private network namespace; another transport runs them with its own factory:

    for name, check in CHECKS.items(): check(my_make_pair)

`pair_from(sender, receiver)` allocates and registers the buffers for a factory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fastkv.pd.transport import PDTransport, Piece, TransportError, WriteState

SIZE = 1 << 20  # registered on each side
GUARD = 64 << 10  # past the receiver's region, never registered: must stay zero
SETTLE_S = 10.0


@dataclass
class Pair:
    sender: PDTransport
    receiver: PDTransport
    src: np.ndarray  # SIZE random bytes registered on the sender
    dst: np.ndarray  # SIZE + GUARD zero bytes; the first SIZE registered on the receiver

    @property
    def src_base(self) -> int:
        return self.src.ctypes.data

    @property
    def dst_base(self) -> int:
        return self.dst.ctypes.data

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


MakePair = Callable[[], Pair]


def pair_from(sender: PDTransport, receiver: PDTransport, seed: int = 0) -> Pair:
    src = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE + GUARD, dtype=np.uint8)
    sender.register(src.ctypes.data, SIZE)
    receiver.register(dst.ctypes.data, SIZE)
    return Pair(sender, receiver, src, dst)


def _raises(fn: Callable[[], object], *words: str) -> str:
    try:
        fn()
    except TransportError as exc:
        msg = str(exc)
        for w in words:
            assert w in msg, f"{msg!r} does not name {w!r}"
        return msg
    raise AssertionError(f"no TransportError (expected one naming {words})")


def _poll_until(t: PDTransport, count: int, timeout_s: float) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    end = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < end:
        got += t.poll_notices()
        time.sleep(0.002)
    return got


def check_bytes_land_exactly(make_pair: MakePair) -> None:
    """Pieces of odd sizes at odd offsets land byte for byte; nothing else moves."""
    p = make_pair()
    try:
        spec = [(3, 10, 1), (100, 5000, 7), (4096, 20000, 4096), (70001, 90000, 65537)]
        spec += [(500000, 600000, 300000), (SIZE - 1, SIZE - 1, 1)]
        pieces = [Piece(p.src_base + s, p.dst_base + d, n) for s, d, n in spec]
        assert p.sender.write(p.receiver.address, pieces).wait(SETTLE_S) is WriteState.DONE
        want = np.zeros_like(p.dst)
        for s, d, n in spec:
            want[d : d + n] = p.src[s : s + n]
        assert np.array_equal(p.dst, want)
    finally:
        p.close()


def check_pieces_from_two_regions_land(make_pair: MakePair) -> None:
    """One batch drawing on two registered regions (K and V tensors, say)."""
    p = make_pair()
    other = np.full(SIZE, 0xA5, dtype=np.uint8)
    try:
        p.sender.register(other.ctypes.data, SIZE)
        n = 4096
        pieces = [
            Piece((p.src_base if i % 2 else other.ctypes.data) + i * n, p.dst_base + i * n, n)
            for i in range(64)
        ]
        assert p.sender.write(p.receiver.address, pieces).wait(SETTLE_S) is WriteState.DONE
        for i in range(64):
            want = p.src[i * n : (i + 1) * n] if i % 2 else other[i * n : (i + 1) * n]
            assert np.array_equal(p.dst[i * n : (i + 1) * n], want), f"piece {i}"
        bad = [*pieces[:3], Piece(other.ctypes.data + SIZE - 8, p.dst_base, 16)]
        _raises(lambda: p.sender.write(p.receiver.address, bad), "pieces[3]")
    finally:
        p.close()


def check_batches_of_thousands_of_pieces_land(make_pair: MakePair) -> None:
    """Three writes of 3000 small pieces each, all in flight at once (more than a
    transport's own queue may hold): every byte lands, and the peer still takes
    writes afterwards."""
    p = make_pair()
    try:
        n, count = 100, 3000
        bad = [Piece(p.src_base + i * n, p.dst_base + i * n, n) for i in range(count)]
        bad[2500] = Piece(p.src_base + 2500 * n, p.dst_base + 2500.5 * n, n)  # type: ignore[arg-type]
        _raises(lambda: p.sender.write(p.receiver.address, bad), "pieces[2500]")
        time.sleep(0.05)
        assert not p.dst.any(), "a refused write moved bytes"
        handles = []
        for w in range(3):
            base = w * count * n
            pieces = [
                Piece(p.src_base + base + i * n, p.dst_base + base + i * n, n)
                for i in range(count)
            ]
            handles.append(p.sender.write(p.receiver.address, pieces))
        assert [h.wait(SETTLE_S) for h in handles] == [WriteState.DONE] * 3
        total = 3 * count * n
        assert np.array_equal(p.dst[:total], p.src[:total])
        last = [Piece(p.src_base + total, p.dst_base + total, 4096)]
        assert p.sender.write(p.receiver.address, last).wait(SETTLE_S) is WriteState.DONE
    finally:
        p.close()


def check_many_batches_in_flight_all_settle(make_pair: MakePair) -> None:
    p = make_pair()
    try:
        n = SIZE // 32
        handles = [
            p.sender.write(
                p.receiver.address, [Piece(p.src_base + i * n, p.dst_base + i * n, n)]
            )
            for i in range(32)
        ]
        assert [h.wait(SETTLE_S) for h in handles] == [WriteState.DONE] * 32
        assert np.array_equal(p.dst[:SIZE], p.src)
        assert [h.state() for h in handles] == [WriteState.DONE] * 32  # settled stays
    finally:
        p.close()


def check_empty_write_is_done(make_pair: MakePair) -> None:
    p = make_pair()
    try:
        assert p.sender.write(p.receiver.address, []).wait(1.0) is WriteState.DONE
    finally:
        p.close()


def check_bad_pieces_refused_before_anything_starts(make_pair: MakePair) -> None:
    """A source outside the sender's regions, a zero or negative length, a
    non-integer address: TransportError, and no byte of the batch moved."""
    p = make_pair()
    try:
        good = Piece(p.src_base, p.dst_base, 4096)
        bad = [
            Piece(p.src_base + SIZE - 10, p.dst_base + 8192, 4096),  # past the region
            Piece(p.src_base - 4096, p.dst_base + 8192, 4096),  # before it
            Piece(p.src_base + 8192, p.dst_base + 8192, 0),
            Piece(p.src_base + 8192, p.dst_base + 8192, -5),
            Piece(p.src_base + 8192.5, p.dst_base + 8192, 16),  # type: ignore[arg-type]
        ]
        for piece in bad:
            _raises(
                lambda piece=piece: p.sender.write(p.receiver.address, [good, piece]), "pieces"
            )
        assert not p.dst.any(), "a refused batch moved bytes"
        # the transport is as it was: a good write still works
        assert p.sender.write(p.receiver.address, [good]).wait(SETTLE_S) is WriteState.DONE
        assert np.array_equal(p.dst[:4096], p.src[:4096])
    finally:
        p.close()


def check_write_past_peer_region_refused(make_pair: MakePair) -> None:
    """The receiver refuses a piece past its registered region: the write raises or
    the handle settles FAILED, and not one byte lands outside the region."""
    p = make_pair()
    try:
        piece = Piece(p.src_base, p.dst_base + SIZE - 100, 4096)
        try:
            state = p.sender.write(p.receiver.address, [piece]).wait(SETTLE_S)
        except TransportError:
            state = WriteState.FAILED
        assert state is WriteState.FAILED
        assert not p.dst[SIZE:].any(), "bytes landed past the receiver's region"
    finally:
        p.close()


def check_malformed_inputs_name_field_and_value(make_pair: MakePair) -> None:
    p = make_pair()
    try:
        one = [Piece(p.src_base, p.dst_base, 16)]
        _raises(lambda: p.sender.write("no-port", one), "peer", "no-port")
        _raises(lambda: p.sender.write("127.0.0.1:0", one), "peer")
        _raises(lambda: p.sender.notify(p.receiver.address, b"x", 0), "timeout_s", "0")
        _raises(lambda: p.sender.notify(p.receiver.address, "text", 1.0), "payload")  # type: ignore[arg-type]
        _raises(lambda: p.sender.register(p.src_base + 10, 100), "overlaps")
        _raises(lambda: p.sender.register(0, 100), "addr")
        _raises(lambda: p.sender.register(p.src_base + 2 * SIZE, 0), "length")
        handle = p.sender.write(p.receiver.address, one)
        _raises(lambda: handle.wait(-1), "timeout_s")
        assert handle.wait(SETTLE_S) is WriteState.DONE
        assert not p.dst[16:].any()
    finally:
        p.close()


def check_unreachable_peer_refused_or_failed(make_pair: MakePair) -> None:
    """Nobody listens at the peer's address: the write raises or fails, the notice
    raises, both promptly."""
    p = make_pair()
    try:
        nobody = p.receiver.address.rsplit(":", 1)[0] + ":1"
        t = time.monotonic()
        try:
            state = p.sender.write(nobody, [Piece(p.src_base, p.dst_base, 16)]).wait(SETTLE_S)
        except TransportError:
            state = WriteState.FAILED
        assert state is WriteState.FAILED
        _raises(lambda: p.sender.notify(nobody, b"x", 2.0), "notify")
        assert time.monotonic() - t < 5.0
    finally:
        p.close()


def check_notices_delivered_once_bytes_exact(make_pair: MakePair) -> None:
    p = make_pair()
    try:
        payloads = [b"", bytes(range(256)) * 4, b"\x00" * 3, np.random.bytes(4096)]
        for payload in payloads:
            p.sender.notify(p.receiver.address, payload, 5.0)
        got = _poll_until(p.receiver, len(payloads), 5.0)
        time.sleep(0.05)
        got += p.receiver.poll_notices()  # nothing more comes: at most once
        assert sorted(payload for _, payload in got) == sorted(payloads)
        assert {sender for sender, _ in got} == {p.sender.address}
        assert p.sender.poll_notices() == []
    finally:
        p.close()


def check_waits_are_bounded(make_pair: MakePair) -> None:
    """`state` never blocks, `wait` returns by its timeout."""
    p = make_pair()
    try:
        pieces = [Piece(p.src_base, p.dst_base, SIZE)] * 8
        handle = p.sender.write(p.receiver.address, pieces)
        t = time.monotonic()
        handle.state()
        handle.wait(0.001)
        assert time.monotonic() - t < 0.5
        assert handle.wait(SETTLE_S) is WriteState.DONE
    finally:
        p.close()


def check_closed_transport_refuses(make_pair: MakePair) -> None:
    p = make_pair()
    p.close()
    p.close()  # twice is fine
    one = [Piece(p.src_base, p.dst_base, 16)]
    _raises(lambda: p.sender.write(p.receiver.address, one), "closed")
    _raises(lambda: p.sender.notify(p.receiver.address, b"x", 1.0), "closed")
    _raises(lambda: p.sender.register(p.src_base + 2 * SIZE, 16), "closed")
    _raises(p.receiver.poll_notices, "closed")


CHECKS: dict[str, Callable[[MakePair], None]] = {
    name[len("check_") :]: fn for name, fn in globals().items() if name.startswith("check_")
}
