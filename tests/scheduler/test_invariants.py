"""`CacheManager.check_invariants` fails on each kind of corruption it is there to
catch: a checker that cannot fail would let every other test pass blind."""

from __future__ import annotations

import hashlib

import pytest

from fastkv import CacheConfig, TransferResult
from fastkv.scheduler import CacheManager
from fastkv.scheduler.radix_tree import STORING

BS = 4


def _hashes(*names: str) -> list[bytes]:
    return [hashlib.sha256(n.encode()).digest() for n in names]


def _cached() -> tuple[CacheManager, list[bytes]]:
    """A manager with two committed blocks of a finished request, backed up to host
    (write_through): cached on both tiers, unlocked."""
    config = CacheConfig(
        block_size=BS, num_device_blocks=8, num_host_blocks=8, write_policy="write_through"
    )
    mgr = CacheManager(config)
    hashes = _hashes("a", "b")
    mgr.match("r", hashes, 2 * BS + 1)
    assert mgr.allocate("r", num_tokens=2 * BS + 1)
    mgr.commit("r", num_computed_tokens=2 * BS)
    mgr.finish("r")
    backup = mgr.take_swap_metadata().evict
    assert backup is not None
    mgr.apply_results([TransferResult(backup.transfer_id, True)])
    mgr.check_invariants()
    return mgr, hashes


def _node(mgr: CacheManager, key: bytes):
    return next(n for n in mgr.tree if n.key == key)


def test_a_block_taken_from_the_pool_by_no_one_is_a_leak() -> None:
    mgr, _ = _cached()
    mgr.device_pool.allocate(1)
    with pytest.raises(AssertionError, match="device: leaked"):
        mgr.check_invariants()


def test_a_lock_no_request_holds_is_caught() -> None:
    mgr, hashes = _cached()
    mgr.tree.lock([_node(mgr, hashes[1])])
    with pytest.raises(AssertionError, match="ref 1, holders 0"):
        mgr.check_invariants()


def test_a_node_queued_in_two_copies_is_caught() -> None:
    mgr, hashes = _cached()
    mgr.match("s", hashes, 2 * BS + 1)
    node = _node(mgr, hashes[0])
    book = mgr.transfers
    for _ in range(2):  # the same node planned twice for a copy to host
        book.to_host.nodes.append(node)
        book.to_host.device_ids.append(node.device_block)
    with pytest.raises(AssertionError, match="in two transfers"):
        mgr.check_invariants()


def test_a_host_copy_pinned_by_no_write_is_caught() -> None:
    mgr, hashes = _cached()
    node = _node(mgr, hashes[0])
    node.storage = STORING
    with pytest.raises(AssertionError, match="pinned by no storage write"):
        mgr.check_invariants()


def test_one_block_in_two_tables_is_caught() -> None:
    mgr, hashes = _cached()
    mgr.match("s", hashes[:1], BS + 1)
    mgr.match("t", _hashes("x"), BS + 1)
    assert mgr.allocate("s", num_tokens=2 * BS) and mgr.allocate("t", num_tokens=BS)
    mgr.request_state("t").blocks[0] = mgr.request_state("s").blocks[1]
    with pytest.raises(AssertionError, match="owned by s and t"):
        mgr.check_invariants()
