"""Per-rank transfer results combine into one per transfer: applied when every rank
has reported, successful only if every rank succeeded."""

from __future__ import annotations

import pytest

from fastkv import TransferResult
from fastkv.metadata import LookupResult
from fastkv.tp import RankResults


def test_a_transfer_completes_when_every_rank_has_reported() -> None:
    ranks = RankResults(3)
    assert ranks.add(0, [TransferResult(1, True), TransferResult(2, True)]) == []
    assert ranks.add(2, [TransferResult(2, True)]) == []
    assert ranks.missing() == {("transfer", 1): [1, 2], ("transfer", 2): [1]}
    # A combined result speaks for every rank: the manager applies only those.
    assert ranks.add(1, [TransferResult(2, True)]) == [TransferResult(2, True, num_ranks=3)]
    assert ranks.add(1, [TransferResult(1, True)]) == []
    assert ranks.add(2, [TransferResult(1, True)]) == [TransferResult(1, True, num_ranks=3)]
    assert ranks.missing() == {}


@pytest.mark.parametrize("failing", [0, 1])
def test_one_failing_rank_fails_the_transfer_and_is_named(failing: int) -> None:
    ranks = RankResults(2)
    first = 1 - failing
    assert ranks.add(first, [TransferResult(7, True)]) == []
    (combined,) = ranks.add(failing, [TransferResult(7, False, "injected")])
    assert combined == TransferResult(7, False, f"rank {failing}: injected", num_ranks=2)


def test_a_single_rank_passes_results_through() -> None:
    ranks = RankResults(1)
    batch = [TransferResult(3, False, "x"), TransferResult(4, True)]
    assert ranks.add(0, batch) == [TransferResult(3, False, "rank 0: x"), batch[1]]


@pytest.mark.parametrize(
    ("rank", "batch", "error"),
    [
        (2, [TransferResult(1, True)], ValueError),
        (-1, [TransferResult(1, True)], ValueError),
        (True, [TransferResult(1, True)], ValueError),
        (0, [TransferResult(1, True), TransferResult(1, True)], ValueError),
        (0, [TransferResult(9, True)], ValueError),  # reported before
        (0, [TransferResult(1, True), "done"], TypeError),
    ],
)
def test_bad_reports_are_refused_and_record_nothing(rank, batch, error) -> None:
    ranks = RankResults(2)
    ranks.add(0, [TransferResult(9, True)])
    with pytest.raises(error):
        ranks.add(rank, batch)
    assert ranks.missing() == {("transfer", 9): [1]}
    assert ranks.add(1, [TransferResult(9, True)]) == [TransferResult(9, True, num_ranks=2)]
    with pytest.raises(ValueError, match="tp_size"):
        RankResults(0)


def test_a_lookup_prefix_is_the_minimum_over_ranks() -> None:
    from fastkv.metadata import LookupResult

    ranks = RankResults(2)
    assert ranks.add(0, [LookupResult(5, 7), TransferResult(5, True)]) == []
    assert ranks.missing() == {("lookup", 5): [1], ("transfer", 5): [1]}  # ids per kind
    assert ranks.add(1, [LookupResult(5, 3)]) == [LookupResult(5, 3, 2)]
    assert ranks.add(1, [TransferResult(5, True)]) == [TransferResult(5, True, num_ranks=2)]
    with pytest.raises(ValueError, match="lookup 6 twice"):
        ranks.add(0, [LookupResult(6, 1), LookupResult(6, 2)])


def test_a_storage_block_failed_on_any_rank_failed() -> None:
    ranks = RankResults(2)
    ranks.add(0, [TransferResult(1, False, "miss", (3,))])
    (combined,) = ranks.add(1, [TransferResult(1, False, "timeout", (1, 3))])
    assert combined == TransferResult(1, False, "rank 0: miss", (1, 3), 2)


def test_pending_results_are_bounded_and_the_oldest_given_up() -> None:
    """Issue 15 item 5: a rank that never completes its share left every partial
    result behind (+185 MB for 300k). At most max_pending wait; the oldest is then
    completed as failed, and its late report is dropped."""
    ranks = RankResults(2, max_pending=100)
    done = []
    for tid in range(30_000):
        done += ranks.add(0, [TransferResult(tid, True, "", (tid % 7,))])
    assert len(ranks.missing()) == 100
    assert len(ranks._given_up) == 100
    assert ranks.given_up == len(done) == 30_000 - 100
    assert done[0] == TransferResult(
        0,
        False,
        "ranks [1] never reported it (100 newer transfers and lookups were waiting); given up",
        (0,),
        2,
    )
    # rank 1 wakes up: a given-up transfer is not resurrected, a pending one completes
    assert ranks.add(1, [TransferResult(29_999, True), TransferResult(29_899, True)]) == [
        TransferResult(29_999, True, "", (29_999 % 7,), 2)
    ]
    assert ranks.late_dropped == 1
    assert ("transfer", 29_899) not in ranks.missing()


def test_given_up_lookups_have_no_hits() -> None:
    ranks = RankResults(3, max_pending=1)
    assert ranks.add(0, [LookupResult(1, 5)]) == []
    assert ranks.add(2, [LookupResult(2, 4)]) == [LookupResult(1, 0, 3)]


def test_max_pending_is_validated() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        RankResults(2, max_pending=0)


def test_a_manager_of_two_ranks_applies_only_combined_results() -> None:
    """Issue 16: rank 0's success applied alone kept host hits rank 1 never copied.
    A manager configured for two ranks refuses a one-rank result, naming RankResults,
    and applies the combined one."""
    import hashlib

    from fastkv import CacheConfig
    from fastkv.scheduler import CacheManager

    mgr = CacheManager(
        CacheConfig(block_size=4, num_device_blocks=4, num_host_blocks=4, tp_size=2)
    )
    digest = hashlib.sha256(b"a").digest()
    mgr.match("r", [digest], 5)
    assert mgr.allocate("r", num_tokens=4)
    mgr.commit("r", num_computed_tokens=4)
    mgr.finish("r")
    mgr.match("s", [], 1)
    assert not mgr.allocate("s", num_tokens=16)  # evicts "a" to host first
    meta = mgr.take_swap_metadata().evict
    with pytest.raises(ValueError, match=r"1 of this cache's 2 .*RankResults"):
        mgr.apply_results([TransferResult(meta.transfer_id, True)])
    ranks = RankResults(2)
    assert ranks.add(0, [TransferResult(meta.transfer_id, True)]) == []
    mgr.apply_results(ranks.add(1, [TransferResult(meta.transfer_id, True)]))
    assert mgr.allocate("s", num_tokens=16)
    mgr.check_invariants()


def test_a_stale_report_from_before_a_reset_cannot_complete_a_new_transfer() -> None:
    """Issue 25: after a cache reset transfer ids restart. Rank 0's report of the old
    transfer 0 (still a partial here) must not combine with rank 1's report of the
    new transfer 0, nor may a late report of the old epoch apply to the new one."""
    import hashlib

    from fastkv import CacheConfig
    from fastkv.scheduler import CacheManager

    mgr = CacheManager(
        CacheConfig(block_size=4, num_device_blocks=4, num_host_blocks=4, tp_size=2)
    )

    def evict_one(name: bytes):
        mgr.match("r", [hashlib.sha256(name).digest()], 5)
        assert mgr.allocate("r", num_tokens=4)
        mgr.commit("r", num_computed_tokens=4)
        mgr.finish("r")
        mgr.match("s", [], 1)
        assert not mgr.allocate("s", num_tokens=16)  # evicts it to host first
        return mgr.take_swap_metadata().evict

    ranks = RankResults(2)
    old = evict_one(b"a")
    assert (old.transfer_id, old.epoch) == (0, 0)
    stale = TransferResult(old.transfer_id, True, epoch=old.epoch)
    assert ranks.add(0, [stale]) == []  # rank 1 never reports it: it is given up
    mgr.apply_results([TransferResult(old.transfer_id, False, "given up", num_ranks=2)])
    mgr.finish("s")
    mgr.reset_cache()
    assert mgr.epoch == 1
    new = evict_one(b"b")
    assert (new.transfer_id, new.epoch) == (0, 1)  # the same id, a new epoch
    # Rank 1 reports the new transfer: rank 0 has not, whatever its old report said.
    assert ranks.add(1, [TransferResult(new.transfer_id, True, epoch=new.epoch)]) == []
    assert ranks.missing() == {("transfer", 0): [0]}
    # The old epoch's report, duplicated or late, completes nothing new...
    done = ranks.add(1, [stale])
    assert done == [TransferResult(0, True, num_ranks=2, epoch=0)]
    # ...and the manager drops it (counted), the new transfer still in flight.
    assert mgr.apply_results(done) == []
    assert mgr.stale_results == 1 and mgr.is_inflight(new.transfer_id)
    mgr.apply_results(ranks.add(0, [TransferResult(new.transfer_id, True, epoch=1)]))
    assert not mgr.is_inflight(new.transfer_id)
    assert mgr.allocate("s", num_tokens=16)
    mgr.check_invariants()


def test_reset_cache_refuses_a_busy_cache_and_changes_nothing() -> None:
    from fastkv import CacheConfig
    from fastkv.scheduler import CacheManager

    mgr = CacheManager(CacheConfig(block_size=4, num_device_blocks=4, num_host_blocks=4))
    mgr.match("r", [], 1)
    with pytest.raises(ValueError, match="1 requests active"):
        mgr.reset_cache()
    assert mgr.epoch == 0 and mgr.is_active("r")
    with pytest.raises(ValueError, match="epoch"):
        CacheManager(CacheConfig(block_size=4, num_device_blocks=4), epoch=True)
