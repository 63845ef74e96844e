"""BlockPool: allocation and freeing of block ids, all-or-nothing failures that leave
the pool exactly as it was, and stats."""

from __future__ import annotations

import pytest

from fastkv.scheduler.block_pool import BlockPool, OutOfBlocksError


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable about a pool."""
    return (
        pool.num_free,
        pool.num_used,
        tuple(pool.is_allocated(i) for i in range(pool.capacity)),
        pool.stats(),
    )


def assert_consistent(pool: BlockPool) -> None:
    allocated = [i for i in range(pool.capacity) if pool.is_allocated(i)]
    assert pool.num_used == len(allocated)
    assert pool.num_free + pool.num_used == pool.capacity
    assert pool.allocated_ids() == set(allocated)


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    assert pool.allocate(2) == [4, 5]
    assert_consistent(pool)


def test_allocate_free_round_trip() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(5)
    assert len(set(ids)) == 5 and all(0 <= i < 8 for i in ids)
    assert all(pool.is_allocated(i) for i in ids)
    assert pool.num_free == 3 and pool.num_used == 5
    pool.free(ids[1:3])
    assert not pool.is_allocated(ids[1]) and not pool.is_allocated(ids[2])
    assert pool.num_free == 5
    assert_consistent(pool)
    pool.free([ids[0], *ids[3:]])
    assert pool.num_free == 8 and pool.num_used == 0
    assert_consistent(pool)
    # Every id can be had again, each exactly once.
    again = pool.allocate(8)
    assert sorted(again) == list(range(8))
    assert_consistent(pool)


def test_freed_ids_are_reused() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(4)
    pool.free([ids[2]])
    assert pool.allocate(1) == [ids[2]]


def test_allocate_zero_and_free_empty_are_no_ops() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    before = snapshot(pool)
    assert pool.allocate(0) == []
    pool.free([])
    assert snapshot(pool) == before


@pytest.mark.parametrize(
    ("capacity", "held", "ask"), [(4, 0, 5), (4, 3, 2), (4, 4, 1), (0, 0, 1)]
)
def test_out_of_blocks_is_all_or_nothing(capacity: int, held: int, ask: int) -> None:
    pool = BlockPool(capacity, name="device")
    pool.allocate(held)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError, match=rf"device: asked for {ask} blocks"):
        pool.allocate(ask)
    assert snapshot(pool) == before
    # What is free can still be taken in full.
    assert len(pool.allocate(capacity - held)) == capacity - held
    assert_consistent(pool)


@pytest.mark.parametrize("n", [-1, -100])
def test_negative_allocate_raises(n: int) -> None:
    pool = BlockPool(4)
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"^n: must be >= 0"):
        pool.allocate(n)
    assert snapshot(pool) == before


def test_negative_capacity_raises() -> None:
    with pytest.raises(ValueError, match="capacity"):
        BlockPool(-1)


BAD_FREES = {
    # name: (ids to allocate first, ids to free first, the bad free)
    "double_free": ([0, 1, 2], [1], [1]),
    "never_allocated": ([0, 1, 2], [], [3]),
    "out_of_range": ([0, 1, 2], [], [8]),
    "far_out_of_range": ([0, 1, 2], [], [10**9]),
    "negative": ([0, 1, 2], [], [-1]),
    "same_id_twice": ([0, 1, 2], [], [1, 1]),
    "good_then_double": ([0, 1, 2], [], [0, 2, 2]),
    "good_then_bad": ([0, 1, 2], [], [0, 1, 5]),
    "good_then_negative": ([0, 1, 2], [], [2, 0, -3]),
    "freed_earlier_in_list": ([0, 1, 2], [2], [0, 1, 2]),
}


@pytest.mark.parametrize("case", sorted(BAD_FREES))
def test_bad_free_raises_and_leaves_pool_unchanged(case: str) -> None:
    allocate_n, pre_free, bad = BAD_FREES[case]
    pool = BlockPool(8, name="host")
    assert pool.allocate(len(allocate_n)) == allocate_n
    pool.free(pre_free)
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"^host: block -?\d+ (is not allocated|listed twice)"):
        pool.free(bad)
    assert snapshot(pool) == before
    assert_consistent(pool)
    # The ids that were allocated can still be freed, exactly once each.
    still = [i for i in allocate_n if i not in pre_free]
    pool.free(still)
    assert pool.num_used == 0 and pool.num_free == 8
    assert_consistent(pool)


def test_listed_twice_message_names_the_block() -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    with pytest.raises(ValueError, match="block 3 listed twice"):
        pool.free([3, 3])
    pool.free([2])
    # Twice in one call, but not allocated at all: reported as not allocated.
    with pytest.raises(ValueError, match="block 2 is not allocated"):
        pool.free([2, 2])


def test_free_accepts_any_collection() -> None:
    pool = BlockPool(5)
    pool.allocate(5)
    pool.free((0, 1))
    pool.free({2, 3})
    assert pool.num_free == 4 and pool.allocated_ids() == {4}


def test_is_allocated_outside_the_range_is_false() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    assert not pool.is_allocated(-1)
    assert not pool.is_allocated(2)


def test_stats() -> None:
    pool = BlockPool(10)
    s = pool.stats()
    assert (s.capacity, s.used, s.free, s.peak_used) == (10, 0, 10, 0)
    assert (s.allocated_total, s.freed_total, s.usage) == (0, 0, 0.0)

    a = pool.allocate(6)
    pool.free(a[:4])
    b = pool.allocate(3)
    s = pool.stats()
    assert (s.used, s.free) == (5, 5)
    assert s.peak_used == 6  # the high-water mark, not the current use
    assert (s.allocated_total, s.freed_total) == (9, 4)
    assert s.usage == pytest.approx(0.5)

    pool.free([*a[4:], *b])
    pool.allocate(10)
    s = pool.stats()
    assert (s.used, s.peak_used, s.usage) == (10, 10, 1.0)
    assert (s.allocated_total, s.freed_total) == (19, 9)


def test_failed_operations_do_not_count_in_stats() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([0, 7])
    s = pool.stats()
    assert (s.allocated_total, s.freed_total, s.peak_used) == (2, 0, 2)


def test_empty_pool_usage_is_zero() -> None:
    s = BlockPool(0).stats()
    assert (s.capacity, s.used, s.free, s.usage) == (0, 0, 0, 0.0)


def test_free_ids_lists_what_allocate_can_take_as_a_copy() -> None:
    pool = BlockPool(4, "device")
    taken = pool.allocate(3)
    free = pool.free_ids()
    assert free == [3] and set(free).isdisjoint(taken)
    free.clear()  # a copy: the pool is unchanged
    assert pool.num_free == 1 and pool.allocate(1) == [3]


def test_a_pool_costs_about_five_bytes_per_block() -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = BlockPool(100_000)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # int32 free list + one flag byte per block (a list of ints took about 40).
    assert used < 100_000 * 6, used
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 99_997


def test_capacity_beyond_int32_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^capacity: must be in \[0, 2147483647\], got -1$"):
        BlockPool(-1)
    with pytest.raises(ValueError, match=r"got 2147483648$"):
        BlockPool(2**31)
