"""RadixTree through its own API: insertion, matching and locks, per-tier LRU eviction
order (release time, leaves before ancestors), parking of nodes whose children still
hold a copy, and the state transitions the cache manager drives. `tree.check()` runs
after every complete operation."""

from __future__ import annotations

import pytest

from fastkv.scheduler.radix_tree import NodeState, RadixTree, TreeNode


def cache(tree: RadixTree, keys: list[str], blocks: list[int], parent=None) -> list[TreeNode]:
    """Insert a path and release it, as a finished request leaves its blocks."""
    path, existing = tree.insert(parent or tree.root, keys, blocks)
    assert existing == []
    tree.unlock(path)
    tree.check()
    return path


def device_order(tree: RadixTree) -> list[str]:
    return [n.key for n in tree.device_lru]


def host_order(tree: RadixTree) -> list[str]:
    return [n.key for n in tree.host_lru]


def keys_of(nodes) -> list[str]:
    return [n.key for n in nodes]


def evict_one(tree: RadixTree, host_block: int) -> TreeNode:
    """Start evicting the device LRU victim to `host_block`."""
    victim = tree.pop_device_victim()
    assert victim is not None
    tree.start_eviction(victim, host_block)
    tree.check()
    return victim


def move_to_host(tree: RadixTree, host_block: int) -> TreeNode:
    """Evict the device LRU victim and complete the copy."""
    victim = evict_one(tree, host_block)
    device_block = victim.device_block
    assert tree.finish_copy_to_host(victim, True) == (device_block, -1)
    assert victim.state == NodeState.HOST
    tree.check()
    return victim


# -- LRU order ------------------------------------------------------------------


@pytest.mark.parametrize("evict", ["pop_device_victim", "discard_device_leaves"])
def test_device_lru_follows_release_order(evict: str) -> None:
    tree = RadixTree()
    nodes = {}
    for i, key in enumerate("abcd"):
        (nodes[key],) = tree.insert(tree.root, [key], [i])[0]
    for key in "cadb":
        tree.unlock([nodes[key]])
        tree.check()
    assert device_order(tree) == list("cadb")
    if evict == "pop_device_victim":
        victims = []
        for _ in range(3):
            victims.append(tree.pop_device_victim())
            tree.remove(victims[-1])
        assert keys_of(victims) == list("cad")
    else:
        freed = tree.discard_device_leaves(3)
        assert freed == [nodes[k].device_block for k in "cad"]
    tree.check()
    assert [n.key for n in tree] == ["b"]


def test_matching_again_moves_a_node_to_the_tail() -> None:
    tree = RadixTree()
    for i, key in enumerate("abc"):
        cache(tree, [key], [i])
    nodes, _, num_host, waiting = tree.match_and_lock(["a"], 1)
    assert keys_of(nodes) == ["a"] and num_host == 0 and not waiting
    tree.check()
    assert device_order(tree) == ["b", "c"]  # locked: off the list
    tree.unlock(nodes)
    tree.check()
    assert device_order(tree) == ["b", "c", "a"]


def test_chain_is_evicted_tail_first_without_host_tier() -> None:
    tree = RadixTree()
    path = cache(tree, ["k0", "k1", "k2", "k3"], [10, 11, 12, 13])
    assert device_order(tree) == ["k3", "k2", "k1", "k0"]
    assert tree.discard_device_leaves(2) == [13, 12]
    tree.check()
    assert sorted(keys_of(tree)) == ["k0", "k1"]  # the index keeps no order
    assert tree.discard_device_leaves(5) == [11, 10]
    tree.check()
    assert tree.num_nodes == 0
    assert path[0].parent is tree.root


def test_chain_is_evicted_tail_first_to_host() -> None:
    tree = RadixTree()
    cache(tree, ["k0", "k1", "k2"], [0, 1, 2])
    order = [move_to_host(tree, host_block=10 + i).key for i in range(3)]
    assert order == ["k2", "k1", "k0"]
    assert all(n.state == NodeState.HOST for n in tree)
    # Host-tier order: oldest first, and the leaf came first.
    assert host_order(tree) == ["k2", "k1", "k0"]


def _extend(tree: RadixTree, prefix: list[str], keys: list[str], blocks: list[int]) -> None:
    """A request that matched `prefix` caches `keys` below it and finishes, the way the
    cache manager does it: the whole path is locked, then released deepest first."""
    nodes, _, _, _ = tree.match_and_lock(prefix, len(prefix))
    assert keys_of(nodes) == prefix
    path, _ = tree.insert(nodes[-1], keys, blocks)
    tree.unlock(nodes + path)
    tree.check()


def test_descendants_come_before_ancestors_across_branches() -> None:
    tree = RadixTree()
    cache(tree, ["t0", "t1"], [0, 1])
    _extend(tree, ["t0", "t1"], ["x2"], [2])
    _extend(tree, ["t0", "t1"], ["y2"], [3])
    assert device_order(tree) == ["x2", "y2", "t1", "t0"]
    assert tree.discard_device_leaves(4) == [2, 3, 1, 0]
    tree.check()


def test_parent_released_before_its_new_child_is_still_evicted_after_it() -> None:
    """Inserting under an unlocked parent leaves the parent ahead of its child on the
    list; taking victims must park it rather than evict it first."""
    tree = RadixTree()
    trunk = cache(tree, ["t0", "t1"], [0, 1])
    cache(tree, ["x2"], [2], parent=trunk[1])
    assert device_order(tree) == ["t1", "t0", "x2"]
    assert tree.discard_device_leaves(3) == [2, 1, 0]
    tree.check()


# -- locks ----------------------------------------------------------------------


def test_locked_nodes_are_never_victims() -> None:
    tree = RadixTree()
    held, _ = tree.insert(tree.root, ["held"], [0])
    cache(tree, ["free"], [1])
    chain = cache(tree, ["c0", "c1", "c2"], [2, 3, 4])
    nodes, _, _, _ = tree.match_and_lock(["c0", "c1"], 2)  # a request holds the first two
    assert nodes == chain[:2]
    tree.check()
    victims = []
    while (victim := tree.pop_device_victim()) is not None:
        victims.append(victim)
        tree.remove(victim)
    assert keys_of(victims) == ["free", "c2"]
    tree.check()
    assert tree.pop_device_victim() is None
    assert tree.discard_device_leaves(10) == []
    assert sorted(keys_of(tree)) == ["c0", "c1", "held"]
    # Released, they become victims again, leaf first.
    tree.unlock(nodes)
    tree.unlock(held)
    tree.check()
    assert tree.discard_device_leaves(10) == [3, 2, 0]


def test_locked_host_node_is_never_a_host_victim() -> None:
    tree = RadixTree()
    cache(tree, ["a"], [0])
    cache(tree, ["b"], [1])
    move_to_host(tree, 5)  # a
    move_to_host(tree, 6)  # b
    nodes, _, num_host, _ = tree.match_and_lock(["a"], 1)
    assert num_host == 1
    tree.check()
    victim = tree.pop_host_victim()
    assert victim is not None and victim.key == "b"
    assert tree.drop_host_copy(victim) == 6
    tree.check()
    assert tree.pop_host_victim() is None
    tree.unlock(nodes)
    tree.check()
    assert tree.pop_host_victim() is nodes[0]


def test_unlock_below_zero_raises() -> None:
    tree = RadixTree()
    path = cache(tree, ["a"], [0])
    with pytest.raises(AssertionError, match="not locked"):
        tree.unlock(path)
    assert path[0].ref == 0  # refused before the count went below zero


def test_a_node_in_flight_is_on_no_list_until_its_copy_ends() -> None:
    """Transfers take no locks: a node whose copy is in flight stays off the lists
    through its state, even when the request that held it lets go."""
    tree = RadixTree()
    path, _ = tree.insert(tree.root, ["a", "b", "c"], [0, 1, 2])
    tree.start_backup(path[2], 7)
    tree.unlock(path)  # the request finishes before the backup's result
    tree.check()
    assert [n.ref for n in path] == [0, 0, 0]
    assert device_order(tree) == ["b", "a"]  # c is being copied
    assert tree.pop_device_victim() is None  # b and a are parked: c holds the device
    assert tree.finish_copy_to_host(path[2], True) == (-1, -1)
    tree.check()
    assert device_order(tree) == ["c"] and host_order(tree) == ["c"]


# -- parking --------------------------------------------------------------------


def test_parent_of_a_device_child_is_parked_then_returns_to_the_head() -> None:
    tree = RadixTree()
    cache(tree, ["a", "b"], [0, 1])
    cache(tree, ["c"], [2])
    cache(tree, ["d"], [3])
    assert device_order(tree) == ["b", "a", "c", "d"]
    # While b is still on the device, a has a device child: taking the next victim
    # parks a and returns c.
    b = tree.pop_device_victim()
    c = tree.pop_device_victim()
    assert keys_of([b, c]) == ["b", "c"]
    a = b.parent
    assert a.key == "a" and a.state == NodeState.DEVICE and a.ref == 0
    assert device_order(tree) == ["d"]
    tree.remove(c)
    tree.start_eviction(b, host_block=0)  # b leaves the device tier
    tree.check()
    assert device_order(tree) == ["a", "d"]  # a is back, at the head
    assert tree.pop_device_victim().key == "a"


def test_parked_parent_returns_when_its_child_is_dropped() -> None:
    tree = RadixTree()
    path, _ = tree.insert(tree.root, ["a", "b"], [0, 1])
    # b was written through: it has a host copy, so its device block can be dropped.
    tree.start_backup(path[1], 7)
    assert tree.finish_copy_to_host(path[1], True) == (-1, -1)
    tree.unlock(path)
    tree.check()
    b = tree.pop_device_victim()
    assert b.key == "b"
    assert tree.pop_device_victim() is None  # a is parked behind b
    assert tree.detach_device(b) == 1
    tree.check()
    assert device_order(tree) == ["a"]
    assert host_order(tree) == ["b"]


def test_restore_device_victim_puts_it_back_at_the_head() -> None:
    tree = RadixTree()
    for i, key in enumerate("abc"):
        cache(tree, [key], [i])
    a = tree.pop_device_victim()
    tree.restore_device_victim(a)
    tree.check()
    assert device_order(tree) == ["a", "b", "c"]


def test_failed_eviction_reorders_and_parent_is_parked_again() -> None:
    tree = RadixTree()
    a, b = cache(tree, ["a", "b"], [0, 1])
    assert evict_one(tree, host_block=10) is b
    assert evict_one(tree, host_block=11) is a
    assert tree.num_evicting == 2
    # b's copy fails: b keeps its device copy and goes back to the head; its host
    # block is released.
    assert tree.finish_copy_to_host(b, False) == (-1, 10)
    tree.check()
    assert b.state == NodeState.DEVICE and b.host_block == -1 and b.device_block == 1
    # a's copy succeeds, but b needs a as its path on the device: a keeps its block.
    assert tree.finish_copy_to_host(a, True) == (-1, -1)
    tree.check()
    assert a.state == NodeState.DEVICE and a.host_block == 11 and a.device_block == 0
    assert tree.num_evicting == 0
    assert device_order(tree) == ["a", "b"]  # a at the head, ahead of its child
    # Taking victims skips (parks) a, evicts b, then a comes back to the head.
    assert tree.pop_device_victim() is b
    tree.start_eviction(b, host_block=12)
    tree.check()
    assert device_order(tree) == ["a"]
    assert tree.finish_copy_to_host(b, True) == (1, -1)
    tree.check()
    # a already has a host copy: its device block can simply be dropped.
    assert tree.pop_device_victim() is a
    assert tree.detach_device(a) == 0
    tree.check()
    assert all(n.state == NodeState.HOST for n in tree)


def test_host_only_parent_with_children_is_parked_in_host_tier() -> None:
    tree = RadixTree()
    a, b = cache(tree, ["a", "b"], [0, 1])
    evict_one(tree, host_block=20)  # b
    evict_one(tree, host_block=21)  # a
    # Results arrive parent first, so a is ahead of b on the host list.
    assert tree.finish_copy_to_host(a, True) == (0, -1)
    tree.check()
    assert tree.finish_copy_to_host(b, True) == (1, -1)
    tree.check()
    assert host_order(tree) == ["a", "b"]
    victim = tree.pop_host_victim()
    assert victim is b  # a has a child: parked, not removed
    assert a in list(tree)
    assert tree.drop_host_copy(b) == 20
    tree.check()
    assert host_order(tree) == ["a"]  # back once its last child left
    assert tree.pop_host_victim() is a
    assert tree.drop_host_copy(a) == 21
    tree.check()
    assert tree.num_nodes == 0


def test_host_only_parent_is_kept_while_a_child_is_cached() -> None:
    tree = RadixTree()
    a, b = cache(tree, ["a", "b"], [0, 1])
    evict_one(tree, host_block=20)  # b
    evict_one(tree, host_block=21)  # a
    tree.finish_copy_to_host(a, True)
    tree.finish_copy_to_host(b, True)
    tree.check()
    nodes, _, num_host, _ = tree.match_and_lock(["a", "b"], 2)  # b is in use
    assert num_host == 2
    tree.unlock(nodes[:1])  # a released, b still held
    tree.check()
    for _ in range(3):
        assert tree.pop_host_victim() is None
        tree.check()
    assert {n.key for n in tree} == {"a", "b"}
    tree.unlock(nodes[1:])
    tree.check()
    assert tree.pop_host_victim() is b


# -- insert ---------------------------------------------------------------------


def test_insert_new_path_locks_every_node() -> None:
    tree = RadixTree()
    path, existing = tree.insert(tree.root, ["a", "b", "c"], [4, 5, 6])
    tree.check()
    assert existing == []
    assert keys_of(path) == ["a", "b", "c"]
    assert [n.device_block for n in path] == [4, 5, 6]
    assert [n.ref for n in path] == [1, 1, 1]
    assert [n.parent for n in path] == [tree.root, path[0], path[1]]
    assert all(n.state == NodeState.DEVICE for n in path)
    assert device_order(tree) == []


def test_insert_reports_pre_existing_keys() -> None:
    tree = RadixTree()
    old = cache(tree, ["a", "b"], [0, 1])
    path, existing = tree.insert(tree.root, ["a", "b", "c"], [7, 8, 9])
    tree.check()
    assert existing == [0, 1]
    assert path[:2] == old  # the same nodes, with their own blocks
    assert [n.device_block for n in path] == [0, 1, 9]
    assert [n.ref for n in path] == [1, 1, 1]
    assert tree.num_nodes == 3
    tree.unlock(path)
    tree.check()


def test_insert_reports_existing_keys_in_the_middle() -> None:
    tree = RadixTree()
    a, b = cache(tree, ["a", "b"], [0, 1])
    path, existing = tree.insert(a, ["b", "c"], [5, 6])
    tree.check()
    assert existing == [0] and path[0] is b and path[1].parent is b
    tree.unlock(path)
    tree.check()


def test_key_under_another_parent_is_refused_and_changes_nothing() -> None:
    tree = RadixTree()
    cache(tree, ["a"], [0])
    cache(tree, ["b"], [1])
    for keys in (["a", "b", "c"], ["n", "b"]):  # b hangs under the root
        with pytest.raises(ValueError, match="already cached under another prefix"):
            tree.insert(tree.root, keys, [5, 6, 7][: len(keys)])
        tree.check()
        assert sorted(keys_of(tree)) == ["a", "b"] and all(n.ref == 0 for n in tree)


def test_key_repeated_within_one_insert_is_refused() -> None:
    tree = RadixTree()
    with pytest.raises(ValueError, match="appears twice"):
        tree.insert(tree.root, ["a", "x", "a"], [0, 1, 2])
    tree.check()
    assert tree.num_nodes == 0


# -- match and state transitions ------------------------------------------------


def test_match_stops_at_the_first_missing_or_foreign_key() -> None:
    tree = RadixTree()
    cache(tree, ["a", "b", "c"], [0, 1, 2])
    cache(tree, ["z"], [3])
    nodes, _, _, _ = tree.match_and_lock(["a", "b", "x", "c"], 4)
    assert keys_of(nodes) == ["a", "b"]
    tree.unlock(nodes)
    nodes, _, _, _ = tree.match_and_lock(["a", "z"], 2)  # z hangs under the root, not a
    assert keys_of(nodes) == ["a"]
    tree.unlock(nodes)
    nodes, _, _, _ = tree.match_and_lock(["b"], 1)
    assert nodes == []
    tree.check()


def test_match_counts_host_only_nodes_and_locks_them() -> None:
    tree = RadixTree()
    cache(tree, ["a", "b", "c"], [0, 1, 2])
    move_to_host(tree, 10)  # c
    nodes, _, num_host, waiting = tree.match_and_lock(["a", "b", "c"], 3)
    tree.check()
    assert keys_of(nodes) == ["a", "b", "c"] and num_host == 1 and not waiting
    assert all(n.ref == 1 for n in nodes)
    assert host_order(tree) == [] and device_order(tree) == []
    tree.unlock(nodes)
    tree.check()


def test_match_revives_a_node_being_evicted() -> None:
    tree = RadixTree()
    (a,) = cache(tree, ["a"], [0])
    evict_one(tree, host_block=3)
    assert a.state == NodeState.SWAP_TO_HOST and tree.num_evicting == 1
    nodes, _, num_host, _ = tree.match_and_lock(["a"], 1)
    tree.check()
    # Still a device hit; the eviction carries on as a backup.
    assert nodes == [a] and num_host == 0
    assert a.state == NodeState.BACKUP_TO_HOST and tree.num_evicting == 0
    assert tree.finish_copy_to_host(a, True) == (-1, -1)
    tree.check()
    assert a.state == NodeState.DEVICE and a.device_block == 0 and a.host_block == 3
    tree.unlock(nodes)
    tree.check()
    assert device_order(tree) == ["a"] and host_order(tree) == ["a"]


def _loading_tree() -> tuple[RadixTree, TreeNode, list[TreeNode]]:
    tree = RadixTree()
    (a,) = cache(tree, ["a"], [0])
    move_to_host(tree, 5)
    loader, _, num_host, _ = tree.match_and_lock(["a"], 1)
    assert num_host == 1
    tree.attach_device(a, 9, loading=True)
    tree.check()
    assert a.state == NodeState.SWAP_TO_DEVICE
    return tree, a, loader


def test_swap_in_success_and_failure() -> None:
    tree, a, loader = _loading_tree()
    assert tree.finish_swap_in(a, True) == -1
    tree.unlock(loader)
    tree.check()
    assert (a.state, a.device_block, a.host_block) == (NodeState.DEVICE, 9, 5)
    assert device_order(tree) == ["a"] and host_order(tree) == ["a"]

    tree, a, loader = _loading_tree()
    assert tree.finish_swap_in(a, False) == 9  # garbage: the caller frees it
    tree.unlock(loader)
    tree.check()
    assert (a.state, a.device_block, a.host_block) == (NodeState.HOST, -1, 5)
    assert host_order(tree) == ["a"] and device_order(tree) == []


def test_match_stops_at_a_block_being_loaded() -> None:
    tree, _, _ = _loading_tree()
    nodes, _, num_host, waiting = tree.match_and_lock(["a"], 1)
    assert nodes == [] and num_host == 0 and waiting


def test_backup_success_and_failure() -> None:
    tree = RadixTree()
    path, _ = tree.insert(tree.root, ["a", "b"], [0, 1])
    for node, host_block in zip(path, [7, 8], strict=True):
        tree.start_backup(node, host_block)
    tree.check()
    assert [n.state for n in path] == [NodeState.BACKUP_TO_HOST] * 2
    assert tree.finish_copy_to_host(path[0], True) == (-1, -1)
    assert tree.finish_copy_to_host(path[1], False) == (-1, 8)
    tree.unlock(path)
    tree.check()
    assert [(n.state, n.device_block, n.host_block) for n in path] == [
        (NodeState.DEVICE, 0, 7),
        (NodeState.DEVICE, 1, -1),
    ]
    assert host_order(tree) == ["a"]


def test_drop_host_copy_of_a_device_node_keeps_it_on_device() -> None:
    tree = RadixTree()
    path, _ = tree.insert(tree.root, ["a"], [0])
    tree.start_backup(path[0], 4)
    tree.finish_copy_to_host(path[0], True)
    tree.unlock(path)
    tree.check()
    victim = tree.pop_host_victim()
    assert victim is path[0]
    assert tree.drop_host_copy(victim) == 4
    tree.check()
    assert (victim.state, victim.device_block, victim.host_block) == (NodeState.DEVICE, 0, -1)
    assert device_order(tree) == ["a"] and tree.num_nodes == 1


def test_attach_device_to_host_node_without_loading() -> None:
    tree = RadixTree()
    (a,) = cache(tree, ["a"], [0])
    move_to_host(tree, 5)
    nodes, _, _, _ = tree.match_and_lock(["a"], 1)
    tree.attach_device(a, 3, loading=False)  # a request recomputed it
    tree.unlock(nodes)
    tree.check()
    assert (a.state, a.device_block, a.host_block) == (NodeState.DEVICE, 3, 5)


def test_remove_refuses_a_node_with_children() -> None:
    tree = RadixTree()
    a, _ = cache(tree, ["a", "b"], [0, 1])
    with pytest.raises(AssertionError, match="orphan"):
        tree.remove(a)


def test_check_detects_corruption() -> None:
    """check() is what the other tests rely on; it must be able to fail."""
    tree = RadixTree()
    a, b = cache(tree, ["a", "b"], [0, 1])
    a.num_children = 2
    with pytest.raises(AssertionError, match="child count"):
        tree.check()
    a.num_children = 1
    del tree.device_lru[b]
    with pytest.raises(AssertionError, match="device list"):
        tree.check()
    tree.device_lru[b] = None
    b.ref = 1
    with pytest.raises(AssertionError, match="device list"):
        tree.check()


def test_trees_left_in_reference_cycles_do_not_use_up_the_eviction_lists() -> None:
    """A native eviction list has a one-byte id (at most 255 at once), and a tree
    dropped in a reference cycle holds its two until the collector runs: making
    trees must collect those rather than refuse (a test suite, or an engine that
    rebuilds its manager, makes many)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(300):  # 600 lists: more than exist at once
            box: list[object] = [RadixTree()]
            box.append(box)  # the tree is now held only by a cycle
            del box
    finally:
        if was:
            gc.enable()
    assert RadixTree().device_lru is not None
