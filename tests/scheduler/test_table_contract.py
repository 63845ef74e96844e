"""Issue 16: the manager's block table is the only truth an engine reads, counts are
tokens, and protocol mistakes are loud. Each case below was reproduced against the
earlier API (an engine that appended `Allocation.new_blocks` to its match-time table,
block counts passed for token counts, results applied rank by rank...)."""

from __future__ import annotations

import logging

import pytest

from fastkv import CacheConfig, LookupResult, TransferResult
from fastkv.hashing import BlockHasher, namespace_root
from fastkv.scheduler import AllocStatus, CacheManager, Slot
from fastkv.scheduler.radix_tree import NodeState
from tests.scheduler.test_cache_manager import (
    BS,
    Checked,
    H,
    assert_no_leak,
    complete,
    keys,
    make,
    node,
    on_host,
    prompt,
    serve,
)
from tests.scheduler.test_storage_tier import answer, to_storage
from tests.scheduler.test_storage_tier import assert_no_leak as assert_no_storage_leak


def test_device_blocks_below_a_host_hit_are_in_the_table_allocate_builds() -> None:
    """Case 1: a failed swap-in leaves X host-only above a device-resident Y. The
    match's table is empty and says so (no device hit counted), and the table after
    allocate names every position: X's destination (LOADING), Y's block (CACHED),
    the new block (COMPUTE). Before, `new_blocks` listed only [X', new] while the
    table was [X', Y, new]: an engine appending them read position 1 from a new block."""
    mgr = on_host("write_back", device=6, host=8, chain=[H("X")])
    mgr.match("C", [H("X")], BS + 1)
    assert mgr.allocate("C", num_tokens=BS)  # C loads X...
    load = mgr.take_swap_metadata().swap_in
    mgr.match("A", [H("X"), H("Y")], 2 * BS + 1)  # ...while A computes X and Y itself
    assert mgr.allocate("A", num_tokens=2 * BS)
    mgr.commit("A", num_computed_tokens=2 * BS)
    mgr.finish("A")
    mgr.apply_results([TransferResult(load.transfer_id, False)])  # X: host only again
    mgr.abort("C")
    x, y = node(mgr, "X"), node(mgr, "Y")
    assert (x.state, y.state, y.parent) == (NodeState.HOST, NodeState.DEVICE, x)

    hit = mgr.match("D", [H("X"), H("Y"), H("Z")], 3 * BS + 1)
    assert (hit.num_device_hits, hit.num_host_hits) == (0, 2)  # as the table says
    assert mgr.block_table("D").num_blocks == 0
    alloc = mgr.allocate("D", num_tokens=3 * BS + 1)
    table = mgr.block_table("D")
    assert alloc.num_new_blocks == 4 == table.num_blocks
    assert table.block_ids[1] == y.device_block
    assert table.block_ids[0] == x.device_block  # X's swap-in destination
    assert table.slots == (Slot.LOADING, Slot.CACHED, Slot.COMPUTE, Slot.COMPUTE)
    assert table.num_cached_tokens == alloc.num_cached_tokens == 2 * BS
    assert table.loading == (0,)
    complete(mgr)
    assert mgr.block_table("D").slots[0] is Slot.CACHED  # landed
    mgr.finish("D")
    assert_no_leak(mgr)


def test_a_host_hit_another_request_loaded_meanwhile_is_in_the_table() -> None:
    """Case 2: R1 matched X on host; R2 loaded X before R1 allocated. The allocation
    adds X's (now device) block and the fresh ones: all are in the table, counted."""
    mgr = on_host("write_back", device=6, host=8, chain=keys("a", 2))
    hashes = [*keys("a", 2), H("r1-tail")]
    assert mgr.match("r1", hashes, prompt(hashes)).num_host_hits == 2
    mgr.match("r2", keys("a", 2), prompt(keys("a", 2)))
    assert mgr.allocate("r2", num_tokens=2 * BS)
    complete(mgr)  # r2's swap-in lands: a0, a1 are on the device now
    assert node(mgr, "a0").state == NodeState.DEVICE
    alloc = mgr.allocate("r1", num_tokens=3 * BS)
    table = mgr.block_table("r1")
    assert alloc.num_new_blocks == 3 == table.num_blocks  # earlier: 1 listed of 3
    assert table.block_ids[:2] == (node(mgr, "a0").device_block, node(mgr, "a1").device_block)
    assert table.slots == (Slot.CACHED, Slot.CACHED, Slot.COMPUTE)
    for rid in ("r1", "r2"):
        mgr.finish(rid)
    assert_no_leak(mgr)


def test_a_lookup_answer_longer_than_its_lookup_is_refused() -> None:
    """Case 3: the lookup leaves the prompt's last block out (its token is computed);
    an answer claiming it would load it and leave no token to compute. Refused, the
    whole batch with it; the honest answer loads what was asked about."""
    mgr = to_storage()
    mgr.match("r", keys("a", 3), 3 * BS)  # block-aligned: the lookup asks about 2
    tasks = mgr.take_swap_metadata()
    (lookup,) = tasks.lookups
    assert len(lookup.block_hashes) == 2
    before = mgr.get_stats()
    with pytest.raises(ValueError, match="asked about 2 blocks, the answer says 3"):
        mgr.apply_results([LookupResult(lookup.lookup_id, 3)])
    with pytest.raises(ValueError, match="num_hits: must be an int >= 0"):
        mgr.apply_results([LookupResult(lookup.lookup_id, -1)])
    assert mgr.get_stats() == before
    mgr.apply_results([LookupResult(lookup.lookup_id, 2)])
    while not mgr.allocate("r", num_tokens=3 * BS):
        answer(mgr, 0)
    table = mgr.block_table("r")
    assert table.num_cached_tokens == 2 * BS < 3 * BS  # the last block is computed
    assert table.slots[2] is Slot.COMPUTE
    mgr.abort("r")


def test_an_exactly_cached_prompt_never_holds_two_blocks_for_one_position() -> None:
    """Alone in the cache with a prompt of exactly k cached blocks, a request hits k - 1
    (its last token is computed), computes block k - 1 into a new block and commits
    it: the cached copy nobody else holds gives way to the request's, so its decode
    block fits. Before, both copies stayed and the request waited for NO_SPACE
    forever, for a table a fresh request fits at once."""
    mgr = make(device=4, host=0)
    serve(mgr, "first", keys("a", 3))
    hashes = keys("a", 3)
    assert mgr.match("again", hashes, 3 * BS).num_hits == 2
    assert mgr.allocate("again", num_tokens=3 * BS)
    mgr.commit("again", num_computed_tokens=3 * BS)
    table = mgr.block_table("again")
    assert node(mgr, "a2").device_block == table.block_ids[2]
    assert mgr.device_pool.num_used == 3
    alloc = mgr.allocate("again", num_tokens=3 * BS + 1)  # decode: position 3
    assert alloc and mgr.block_table("again").num_blocks == 4
    mgr.finish("again")
    assert_no_leak(mgr)


def test_a_block_held_by_another_request_stays_and_the_copy_stays_private() -> None:
    """The other side of that rule: a cached copy another request holds is not
    replaced (its table names it); the committing request keeps its own block."""
    mgr = make(device=8, host=0)
    serve(mgr, "first", keys("a", 3))
    mgr.match("reader", keys("a", 3), 3 * BS + 1)  # holds a0..a2
    mgr.match("again", keys("a", 3), 3 * BS)
    assert mgr.allocate("again", num_tokens=3 * BS)
    own = mgr.block_table("again").block_ids[2]
    mgr.commit("again", num_computed_tokens=3 * BS)
    assert node(mgr, "a2").device_block != own
    for rid in ("reader", "again"):
        mgr.finish(rid)
    assert_no_leak(mgr)


def test_counts_are_tokens_and_the_table_grows_only_across_a_block_boundary() -> None:
    mgr = make(device=8)
    mgr.match("r", keys("a", 2), 2 * BS + 1)
    assert mgr.allocate("r", num_tokens=2 * BS + 1).num_new_blocks == 3
    for length in range(2 * BS + 1, 3 * BS + 1):  # decode: the request's length each step
        assert mgr.allocate("r", num_tokens=length).num_new_blocks == 0
    assert mgr.allocate("r", num_tokens=3 * BS + 1).num_new_blocks == 1
    assert mgr.block_table("r").num_tokens == 4 * BS
    # A count of blocks where tokens belong: keyword-only names refuse it.
    with pytest.raises(TypeError):
        mgr.allocate("r", 1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        mgr.commit("r", 2)  # type: ignore[misc]
    mgr.finish("r")


def test_the_token_entry_point_hashes_like_an_engine_that_hashes_itself() -> None:
    """`add_request`/`append_tokens`: the manager owns the hashing (namespace, chain,
    extra keys); the digests are those `BlockHasher` makes, so both kinds of engine
    share one cache."""
    config = CacheConfig(block_size=BS, num_device_blocks=8, model_id="m")
    mgr = Checked(CacheManager(config))
    tokens = list(range(3 * BS))
    assert mgr.add_request("t", tokens[: 2 * BS + 1]).num_hits == 0
    assert mgr.allocate("t", num_tokens=3 * BS)
    assert mgr.append_tokens("t", tokens[2 * BS + 1 :]) == 1  # completes block 2
    with pytest.raises(ValueError, match="append_tokens"):
        mgr.append_hashes("t", [H("x")])
    mgr.commit("t", num_computed_tokens=3 * BS)
    mgr.finish("t")
    hashes = BlockHasher(BS, namespace_root(config.namespace_key())).append(tokens)
    assert mgr.match("h", hashes, 3 * BS + 1).num_device_hits == 3
    with pytest.raises(ValueError, match="append_hashes"):
        mgr.append_tokens("h", [1])
    mgr.finish("h")
    # Extra keys and a request key change every digest: no hit.
    assert mgr.add_request("lora", [*tokens, 0], request_key="adapter-7").num_hits == 0
    mgr.finish("lora")
    assert mgr.add_request("img", [*tokens, 0], extra_keys={0: b"image"}).num_hits == 0
    mgr.finish("img")
    with pytest.raises(TypeError, match="expected an int"):
        mgr.add_request("bad", [1.5])  # type: ignore[list-item]
    assert not mgr.is_active("bad")
    mgr.add_request("dup", [1])
    with pytest.raises(ValueError, match="already active"):
        mgr.add_request("dup", [2])
    mgr.finish("dup")
    assert_no_leak(mgr)


def test_the_whole_list_passed_to_append_hashes_again_is_refused_and_commit_still_works() -> (
    None
):
    """Before, the whole list was appended again; commit then failed with a misleading
    'cached under another prefix' and the request could never commit again."""
    mgr = make(device=8)
    hashes = keys("a", 2)
    mgr.match("r", hashes, 2 * BS)
    assert mgr.allocate("r", num_tokens=3 * BS)
    with pytest.raises(ValueError, match="holds this hash already"):
        mgr.append_hashes("r", [*hashes, H("a2")])
    mgr.append_hashes("r", [H("a2")])
    mgr.commit("r", num_computed_tokens=3 * BS)
    assert node(mgr, "a2") is not None
    mgr.finish("r")
    assert_no_leak(mgr)


def test_waits_with_metadata_never_taken_raise_naming_the_missing_call() -> None:
    mgr = make("write_back", device=2, host=4)
    for k in ("c0", "c1"):
        serve(mgr, k, [k])
    mgr.match("r", [], 1)
    for _ in range(2):  # the evictions it needs are planned, never sent
        assert mgr.allocate("r", num_tokens=2 * BS).status is AllocStatus.WAIT_FOR_TRANSFERS
    with pytest.raises(RuntimeError, match=r"take_swap_metadata\(\)"):
        mgr.allocate("r", num_tokens=2 * BS)
    complete(mgr)  # the documented loop: send, apply, retry
    assert mgr.allocate("r", num_tokens=2 * BS)
    mgr.finish("r")
    assert_no_leak(mgr)


def test_transfers_without_results_are_reported_as_stalled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    mgr = Checked(
        CacheManager(
            CacheConfig(block_size=BS, num_device_blocks=2, num_host_blocks=4),
            clock=lambda: now[0],
            stall_after_s=30,
        )
    )
    for k in ("c0", "c1"):
        serve(mgr, k, [k])
    mgr.match("r", [], 1)
    assert not mgr.allocate("r", num_tokens=BS)
    evict = mgr.take_swap_metadata().evict
    now[0] = 29.0
    assert mgr.stalled_transfers() == [] and mgr.get_stats().stalled_transfers == 0
    now[0] = 31.0
    (stalled,) = mgr.stalled_transfers()
    assert (stalled.transfer_id, stalled.direction, stalled.num_blocks) == (
        evict.transfer_id,
        "device->host",
        1,
    )
    assert stalled.age_s == 31.0 and mgr.get_stats().stalled_transfers == 1
    with caplog.at_level(logging.WARNING, logger="fastkv.scheduler.transfers"):
        mgr.take_swap_metadata()
        mgr.take_swap_metadata()  # logged once
    assert sum("has no result yet" in r.message for r in caplog.records) == 1
    mgr.apply_results([TransferResult(evict.transfer_id, True)])
    assert mgr.stalled_transfers() == [] and mgr.get_stats().stalled_transfers == 0
    mgr.finish("r")
    assert_no_leak(mgr)
    with pytest.raises(ValueError, match="stall_after_s"):
        CacheManager(CacheConfig(), stall_after_s=0)


def test_stall_after_s_can_be_changed_on_a_running_manager() -> None:
    now = [0.0]
    mgr = CacheManager(
        CacheConfig(block_size=BS, num_device_blocks=2, num_host_blocks=4),
        clock=lambda: now[0],
        stall_after_s=30,
    )
    for k in ("c0", "c1"):
        serve(Checked(mgr), k, [k])  # names its blocks by string
    mgr.match("r", [], 1)
    assert not mgr.allocate("r", num_tokens=BS)
    mgr.take_swap_metadata()
    now[0] = 10.0
    assert mgr.stalled_transfers() == []
    mgr.stall_after_s = 5
    assert mgr.stall_after_s == 5.0 and len(mgr.stalled_transfers()) == 1
    for bad in (0, -1.0, float("inf"), True, "5"):
        with pytest.raises(ValueError, match="stall_after_s"):
            mgr.stall_after_s = bad  # type: ignore[assignment]
    assert mgr.stall_after_s == 5.0  # unchanged


def test_a_block_handed_over_by_an_untaken_eviction_cannot_be_committed() -> None:
    """Found by the stateful machine (1,500 examples): with reuse_evicted_blocks, a
    request committed a block handed to it by an eviction not taken yet, so an
    eviction in the same step handed it over again and the worker got one block
    listed twice. Its KV cannot have been computed before the step runs."""
    mgr = Checked(
        CacheManager(
            CacheConfig(
                block_size=BS,
                num_device_blocks=2,
                num_host_blocks=4,
                reuse_evicted_blocks=True,
            )
        )
    )
    for k in ("c0", "c1"):
        serve(mgr, k, [k])
    mgr.match("r", [H("n0")], BS)
    assert mgr.allocate("r", num_tokens=BS)  # c0's block, handed over at once
    with pytest.raises(ValueError, match="not taken yet"):
        mgr.commit("r", num_computed_tokens=BS)
    complete(mgr)  # the step runs: the copy reads, then the model writes
    mgr.commit("r", num_computed_tokens=BS)
    mgr.finish("r")
    assert_no_leak(mgr)


def test_storage_answers_of_every_length_keep_the_table_consistent() -> None:
    for hits in range(3):
        mgr = to_storage()
        mgr.match("r", keys("a", 3), 3 * BS + 1)
        answer(mgr, hits)
        while not (alloc := mgr.allocate("r", num_tokens=3 * BS + 1)):
            answer(mgr, 0)
        table = mgr.block_table("r")
        assert table.num_blocks == 4 and alloc.num_cached_tokens == table.num_cached_tokens
        assert table.num_cached_blocks == hits
        assert all(s is not Slot.COMPUTE for s in table.slots[:hits])
        assert all(s is Slot.COMPUTE for s in table.slots[hits:])
        mgr.abort("r")
        assert_no_storage_leak(mgr)


def test_waits_on_a_copy_already_taken_never_raise() -> None:
    """Found in review: the rule must look at what the WAIT depends on, not at any
    queued work. R2 waits for R1's swap-in, which was taken; an unrelated backup
    queued since does not make R2's waits a protocol mistake."""
    mgr = make("write_through", device=8, host=8)
    serve(mgr, "setup", keys("a", 2))
    mgr.match("filler", [], 1)
    assert mgr.allocate("filler", num_tokens=8 * BS)  # a0, a1 leave the device
    complete(mgr)
    mgr.finish("filler")
    complete(mgr)
    mgr.match("r2", keys("a", 2), 2 * BS + 1)
    mgr.match("r1", keys("a", 2), 2 * BS + 1)
    assert mgr.allocate("r1", num_tokens=3 * BS)
    swap_in = mgr.take_swap_metadata().swap_in  # taken: its result comes later
    assert swap_in is not None
    mgr.match("r3", [H("c")], BS + 1)
    assert mgr.allocate("r3", num_tokens=2 * BS)
    mgr.commit("r3", num_computed_tokens=BS)  # queues a backup nobody takes yet
    assert mgr.num_queued_blocks
    for _ in range(4):  # waits for r1's load, which is in flight
        assert mgr.allocate("r2", num_tokens=3 * BS).status is AllocStatus.WAIT_FOR_TRANSFERS
    mgr.apply_results([TransferResult(swap_in.transfer_id, True)])
    assert mgr.allocate("r2", num_tokens=3 * BS)
    for rid in ("r1", "r2", "r3"):
        mgr.finish(rid)
    assert_no_leak(mgr)


def test_block_ids_are_the_tables_blocks_as_an_int32_array() -> None:
    """Issue 27: an engine that fills an int32 table of its own reads the window's
    device blocks as an int32 array (no int object per block), equal to the
    table's; a bad window is refused, naming `start` and its bound."""
    mgr = make(device=8)
    hashes = keys("a", 3)
    serve(mgr, "r", hashes)
    mgr.match("s", [*hashes, H("tail")], 4 * BS + 1)
    assert mgr.allocate("s", num_tokens=4 * BS + 1)
    table = mgr.block_table("s")
    ids = mgr.block_ids("s")
    assert ids.typecode == "i" and ids.itemsize == 4
    assert tuple(ids) == table.block_ids and len(ids) == 5
    assert tuple(mgr.block_ids("s", 3)) == mgr.block_table("s", 3).block_ids
    ids[0] = -7  # a copy: the manager's table does not change
    assert mgr.block_table("s").block_ids == table.block_ids
    with pytest.raises(ValueError, match=r"start.*6"):
        mgr.block_ids("s", 6)
    mgr.finish("s")
    assert_no_leak(mgr)


def test_an_allocation_that_adds_nothing_reports_each_requests_own_cached_tokens() -> None:
    """Issue 27: allocations that add no block share one frozen result per count of
    cached tokens; each request still reads its own count, and a decode step within
    its block reads the same as the full hit before it."""
    mgr = make(device=8)
    serve(mgr, "r", keys("a", 3))
    mgr.match("two", keys("a", 2), 2 * BS + 1)
    mgr.match("three", keys("a", 3), 3 * BS + 1)
    two = mgr.allocate("two", num_tokens=2 * BS)
    three = mgr.allocate("three", num_tokens=3 * BS)
    assert (two.status, two.num_new_blocks, two.num_cached_tokens) == (
        AllocStatus.ALLOCATED,
        0,
        2 * BS,
    )
    assert three.num_cached_tokens == 3 * BS and three.num_new_blocks == 0 and three
    assert mgr.allocate("two", num_tokens=2 * BS) == two
    for rid in ("two", "three"):
        mgr.finish(rid)
    assert_no_leak(mgr)
