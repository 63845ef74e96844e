"""The engine ranks' collective: every rank gets every payload in rank order, large
payloads do not deadlock, and a lost, silent or diverged peer raises instead of
hanging."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from examples.engine.rank_group import PeerLostError, RankDivergedError, RankGroup


def groups(size: int, timeout: float = 10.0) -> list[RankGroup]:
    return [RankGroup(r, size, peers, timeout) for r, peers in enumerate(RankGroup.mesh(size))]


def on_every_rank(
    gs: list[RankGroup], fn: Callable[[RankGroup], object], timeout: float = 30.0
) -> list[object]:
    """fn(group) on one thread per rank; each rank's return value or exception."""
    out: list[object] = [None] * len(gs)

    def body(g: RankGroup) -> None:
        try:
            out[g.rank] = fn(g)
        except Exception as e:
            out[g.rank] = e

    threads = [threading.Thread(target=body, args=(g,), daemon=True) for g in gs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_all_gather_returns_every_payload_in_rank_order(size: int) -> None:
    gs = groups(size)
    big = 4 << 20  # larger than a socket buffer: both ends sending at once would block

    def exchange(g: RankGroup) -> list[list[bytes]]:
        return [[bytes(p) for p in g.all_gather(bytes([g.rank]) * n)] for n in (3, big, 0, 5)]

    results = on_every_rank(gs, exchange)
    for rank_result in results:
        assert not isinstance(rank_result, Exception), rank_result
        for n, gathered in zip((3, big, 0, 5), rank_result, strict=True):
            assert gathered == [bytes([r]) * n for r in range(size)]
    for g in gs:
        g.close()


def test_agree_is_true_only_when_every_rank_says_true() -> None:
    gs = groups(3)
    votes = {0: [True, True, False], 1: [True, False, True], 2: [True, True, True]}
    results = on_every_rank(gs, lambda g: [g.agree(v) for v in votes[g.rank]])
    assert results == [[True, False, False]] * 3
    for g in gs:
        g.close()


def test_a_peer_that_is_gone_raises_at_once_not_at_the_timeout() -> None:
    a, b = groups(2, timeout=60.0)
    b.close()  # as when its process exits
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="rank 1"):
        a.all_gather(b"x" * 1000)
    assert time.monotonic() - start < 30  # far below the 60 s bound: noticed, not waited out
    a.close()


def test_a_silent_peer_raises_after_the_timeout() -> None:
    a, b = groups(2, timeout=0.3)
    with pytest.raises(TimeoutError, match="rank 1"):
        a.agree(True)  # rank 1 never joins
    a.close()
    b.close()


def test_ranks_that_run_different_exchanges_raise_instead_of_mixing_data() -> None:
    gs = groups(2, timeout=5.0)

    def diverge(g: RankGroup) -> object:
        try:
            return g.agree(True) if g.rank == 0 else g.all_gather(b"layer output")
        finally:
            g.close()  # what a failed worker does: its peer stops waiting

    results = on_every_rank(gs, diverge)
    assert isinstance(results[1], RankDivergedError), results
    assert "agree #0" in str(results[1]) and "all_gather #0" in str(results[1])
    assert isinstance(results[0], (PeerLostError, RankDivergedError)), results


def test_bad_arguments_are_refused_naming_the_field() -> None:
    peers = RankGroup.mesh(2)
    with pytest.raises(ValueError, match="rank"):
        RankGroup(2, 2, peers[0], 1.0)
    with pytest.raises(ValueError, match="size"):
        RankGroup(0, 0, {}, 1.0)
    with pytest.raises(ValueError, match=r"peers: .*\[1\]"):
        RankGroup(0, 2, {}, 1.0)
    with pytest.raises(ValueError, match="timeout"):
        RankGroup(0, 2, peers[0], 0)
    with pytest.raises(ValueError, match="size"):
        RankGroup.mesh(0)
    for ends in peers:
        for sock in ends.values():
            sock.close()
