"""CacheManager's receiving blocks (reserved for bytes another instance writes) and
the two scheduler halves' edges the stateful test reaches only by chance."""

from __future__ import annotations

import hashlib

import pytest

from fastkv import CacheConfig
from fastkv.metadata import Epoch
from fastkv.pd.decode import DecodeTransfers
from fastkv.pd.messages import Offer, RankReport, Rejection
from fastkv.pd.prefill import PrefillTransfers
from fastkv.scheduler import AllocStatus, CacheManager

BS = 4


def H(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def hashes(n: int, tag: str = "x") -> list[bytes]:
    return [H(f"{tag}{i}") for i in range(n)]


def test_receiving_blocks_are_neither_free_evictable_nor_matchable() -> None:
    mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=4))
    ids = mgr.reserve_receiving(3)
    assert isinstance(ids, list) and len(ids) == 3
    assert mgr.num_free_device_blocks == 1 and mgr.num_obtainable_device_blocks(4) == 1
    mgr.match("r", hashes(2), 2 * BS + 1)
    assert mgr.allocate("r", num_tokens=4 * BS).status is AllocStatus.NO_SPACE
    mgr.check_invariants()
    mgr.device_pool.free([ids[0]])  # behind the manager's back: the check sees it
    with pytest.raises(AssertionError, match="owned but free"):
        mgr.check_invariants()


def test_commit_received_caches_the_blocks_and_undoes_on_error() -> None:
    mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=8))
    hs = hashes(3)
    mgr.match("r", hs, 3 * BS + 2)
    ids = mgr.reserve_receiving(4)
    assert isinstance(ids, list)
    with pytest.raises(ValueError, match="only 3 block hashes"):
        mgr.commit_received("r", ids, num_computed_tokens=4 * BS)
    assert mgr.num_blocks("r") == 0 and mgr.num_receiving_blocks == 4
    with pytest.raises(ValueError, match="not a receiving block"):
        mgr.commit_received("r", [*ids, 7], num_computed_tokens=3 * BS + 2)
    mgr.commit_received("r", ids, num_computed_tokens=3 * BS + 2)
    assert mgr.num_receiving_blocks == 0 and mgr.num_blocks("r") == 4
    mgr.check_invariants()
    mgr.finish("r")
    hit = mgr.match("again", hs, 3 * BS + 1)
    assert hit.num_device_hits == 3
    mgr.finish("again")
    mgr.check_invariants()
    assert mgr.device_pool.num_used == 3  # the partial last block went back


def test_reserve_receiving_takes_no_block_an_untaken_eviction_reads() -> None:
    mgr = CacheManager(
        CacheConfig(
            block_size=BS, num_device_blocks=2, num_host_blocks=4, reuse_evicted_blocks=True
        )
    )
    mgr.match("a", hashes(2), 2 * BS)
    assert mgr.allocate("a", num_tokens=2 * BS)
    mgr.commit("a", num_computed_tokens=2 * BS)
    mgr.finish("a")
    assert mgr.reserve_receiving(1) is AllocStatus.NO_SPACE
    mgr.check_invariants()


def test_reserve_receiving_evicts_cached_blocks_when_no_host_copy_reads_them() -> None:
    """FastDeploy's adapter runs with reuse_evicted_blocks; a D without a host tier
    discards what it evicts, so its cached blocks serve a transfer (before, only
    free blocks did: a D full of cached KV refused every transfer)."""
    mgr = CacheManager(
        CacheConfig(
            block_size=BS, num_device_blocks=2, num_host_blocks=0, reuse_evicted_blocks=True
        )
    )
    mgr.match("a", hashes(2), 2 * BS)
    assert mgr.allocate("a", num_tokens=2 * BS)
    mgr.commit("a", num_computed_tokens=2 * BS)
    mgr.finish("a")
    got = mgr.reserve_receiving(2)
    assert sorted(got) == [0, 1]  # type: ignore[arg-type]
    assert mgr.match("b", hashes(2), 2 * BS + 1).num_device_hits == 0
    mgr.finish("b")
    mgr.release_receiving(got)  # type: ignore[arg-type]
    mgr.check_invariants()


def _pair(clock: list[float], d_blocks: int = 8) -> tuple[DecodeTransfers, CacheManager]:
    mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=d_blocks))
    d = DecodeTransfers(
        mgr, layout_digest=b"L" * 32, timeout_s=5.0, fence_grace_s=1.0, clock=lambda: clock[0]
    )
    return d, mgr


def test_d_reuses_its_prefix_and_reserves_only_the_tail() -> None:
    clock = [0.0]
    d, mgr = _pair(clock)
    hs = hashes(4)
    mgr.match("local", hs[:2], 2 * BS)
    assert mgr.allocate("local", num_tokens=2 * BS)
    mgr.commit("local", num_computed_tokens=2 * BS)
    mgr.finish("local")
    acc = d.accept(Offer("r", 4 * BS + 1, b"L" * 32, 1), hs)
    assert not isinstance(acc, Rejection)
    assert acc.num_prefix_blocks == 2 and len(acc.block_ids) == 3
    assert d.on_reports([RankReport(acc.transfer_id, acc.epoch, 0, True)])[0].success
    d.check_invariants()


def test_d_rejects_mismatched_layout_tp_and_no_room_leaving_nothing() -> None:
    clock = [0.0]
    d, mgr = _pair(clock, d_blocks=3)
    assert isinstance(d.accept(Offer("a", 9, b"M" * 32, 1), hashes(2)), Rejection)
    d.num_ranks = 3
    rej = d.accept(Offer("a", 9, b"L" * 32, 2), hashes(2))
    assert isinstance(rej, Rejection) and "multiple" in rej.reason
    d.num_ranks = 1
    assert isinstance(d.accept(Offer("a", 4 * BS, b"L" * 32, 1), hashes(4)), Rejection)
    mgr.reserve_receiving(2)
    rej = d.accept(Offer("b", 2 * BS, b"L" * 32, 1), hashes(2))
    assert isinstance(rej, Rejection) and "no room" in rej.reason
    assert mgr.active_request_ids() == []
    assert d.counters.rejected == 4


def test_abort_while_receiving_frees_blocks_only_when_fenced() -> None:
    clock = [0.0]
    d, mgr = _pair(clock)
    acc = d.accept(Offer("r", 2 * BS, b"L" * 32, 1), hashes(2))
    assert not isinstance(acc, Rejection)
    d.abort("r")
    assert not mgr.is_active("r") and mgr.num_receiving_blocks == 2
    clock[0] = 5.5  # past the deadline, inside the grace
    d.tick()
    assert mgr.num_receiving_blocks == 2
    clock[0] = 6.0
    d.tick()
    assert mgr.num_receiving_blocks == 0
    d.check_invariants()
    # A late report of the released transfer is dropped and counted.
    assert d.on_reports([RankReport(acc.transfer_id, acc.epoch, 0, True)]) == []
    assert d.counters.unknown == 1


def test_p_unpins_on_rejection_and_at_the_answer_deadline() -> None:
    clock = [0.0]
    mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=8))
    p = PrefillTransfers(
        mgr, layout_digest=b"L" * 32, answer_timeout_s=2.0, clock=lambda: clock[0]
    )
    for rid in ("a", "b"):
        mgr.match(rid, hashes(2, rid), 2 * BS)
        assert mgr.allocate(rid, num_tokens=2 * BS)
        p.offer(rid, 2 * BS)
        p.release(rid)
    assert mgr.is_active("a") and mgr.is_active("b")
    p.on_answer(Rejection("a", "no room"))
    assert not mgr.is_active("a")
    clock[0] = 2.0
    p.tick()
    assert not mgr.is_active("b") and p.counters.expired == 1
    p.check_invariants()
    assert mgr.device_pool.num_used == 0


def test_epoch_advance_fails_receiving_and_drops_old_reports() -> None:
    clock = [0.0]
    d, mgr = _pair(clock)
    acc = d.accept(Offer("r", 2 * BS, b"L" * 32, 1), hashes(2))
    assert not isinstance(acc, Rejection)
    (out,) = d.advance_epoch(Epoch(1))
    assert not out.success and mgr.is_active("r")
    # The old epoch's report still fences its blocks (P's writes settled).
    d.on_reports([RankReport(acc.transfer_id, Epoch(0), 0, True)])
    assert mgr.num_receiving_blocks == 0 and d.counters.late == 1
    d.on_reports([RankReport(acc.transfer_id, Epoch(0), 0, True)])
    assert d.counters.stale_epoch == 1
    with pytest.raises(ValueError, match="epoch"):
        d.advance_epoch(Epoch(1))


def test_d_and_its_manager_share_one_epoch_across_a_cache_reset() -> None:
    clock = [0.0]
    d, mgr = _pair(clock)
    assert d.epoch == mgr.epoch == 0
    acc = d.accept(Offer("r", 2 * BS, b"L" * 32, 1), hashes(2))
    assert not isinstance(acc, Rejection)
    with pytest.raises(ValueError, match="2 blocks receiving"):
        mgr.reset_cache()
    assert mgr.epoch == 0 and mgr.num_receiving_blocks == 2
    d.advance_epoch(Epoch(mgr.epoch + 1))
    d.on_reports([RankReport(acc.transfer_id, Epoch(0), 0, True)])  # fenced
    mgr.finish("r")
    mgr.reset_cache()
    assert mgr.epoch == d.epoch == 1
    d.check_invariants()
    later = DecodeTransfers(mgr, layout_digest=b"L" * 32)
    assert later.epoch == 1


def test_a_commit_the_manager_refuses_ends_in_failure_not_an_exception() -> None:
    clock = [0.0]
    d, mgr = _pair(clock)
    acc = d.accept(Offer("r", 2 * BS, b"L" * 32, 1), hashes(2))
    assert not isinstance(acc, Rejection)
    assert mgr.allocate("r", num_tokens=2 * BS)  # the engine scheduled it anyway
    (out,) = d.on_reports([RankReport(acc.transfer_id, acc.epoch, 0, True)])
    assert not out.success and "commit refused" in out.reason
    assert mgr.num_receiving_blocks == 0  # every rank reported: fenced, released
    mgr.finish("r")
    d.check_invariants()


def test_a_batch_with_a_non_report_changes_nothing() -> None:
    clock = [0.0]
    d, mgr = _pair(clock)
    acc = d.accept(Offer("r", 2 * BS, b"L" * 32, 1), hashes(2))
    assert not isinstance(acc, Rejection)
    with pytest.raises(TypeError, match=r"reports\[1\]"):
        d.on_reports([RankReport(acc.transfer_id, acc.epoch, 0, True), "junk"])  # type: ignore[list-item]
    assert d.is_receiving("r") and mgr.num_receiving_blocks == 2
