"""The C radix-tree node (`fastkv.scheduler._tree_node`): per-block state out of the
garbage collector's reach, bounded integer fields, eviction lists with OrderedDict's
semantics, and the same behaviour as the pure-Python twin it replaces."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable

import pytest

from fastkv import CacheConfig, WritePolicy
from fastkv.scheduler import radix_tree as rt
from fastkv.scheduler.radix_tree import NodeState, RadixTree
from tools.trace_replay import replay, synthetic_trace

HAVE_NATIVE = importlib.util.find_spec("fastkv.scheduler._tree_node") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_NATIVE, reason="fastkv.scheduler._tree_node is not built (make install builds it)"
)

INT32_MAX = 2**31 - 1


def _native():
    from fastkv.scheduler import _tree_node

    return _tree_node


def _fill(tree: RadixTree, num_paths: int, depth: int) -> None:
    block = 0
    for p in range(num_paths):
        keys = [(p * depth + d).to_bytes(32, "big") for d in range(depth)]
        path, _ = tree.insert(tree.root, keys, list(range(block, block + depth)))
        block += depth
        tree.unlock(path)


def test_the_tree_uses_the_native_node() -> None:
    assert rt.TreeNode is _native().TreeNode


def test_a_filled_tree_leaves_nothing_per_block_to_the_collector() -> None:
    gc.collect()
    before = len(gc.get_objects())
    tree = RadixTree()
    _fill(tree, num_paths=100, depth=100)
    gc.collect()
    assert tree.num_nodes == 10_000
    assert len(tree.device_lru) == 10_000
    node_type = rt.TreeNode
    assert not any(type(o) is node_type for o in gc.get_objects())
    assert not any(gc.is_tracked(n) for n in tree)
    for container in (tree._index, tree.device_lru, tree.host_lru):
        assert not gc.is_tracked(container)
    # The tree itself and a few small sets: nothing that grows with the blocks.
    assert len(gc.get_objects()) - before < 50
    tree.check()


def test_new_node_fields() -> None:
    parent = rt.TreeNode(None, None, -1)
    node = rt.TreeNode(b"k", parent, 7, 2)
    assert node.key == b"k" and node.parent is parent
    assert node.state is NodeState.DEVICE
    assert (node.device_block, node.host_block, node.ref, node.hits, node.storage) == (
        7,
        -1,
        1,
        0,
        rt.NOT_STORED,
    )
    assert node.num_children == node.num_device_children == 2
    assert parent.parent is None and parent.key is None


@pytest.mark.parametrize(
    ("field", "low", "high"),
    [
        ("device_block", -1, INT32_MAX),
        ("host_block", -1, INT32_MAX),
        ("ref", 0, INT32_MAX),
        ("num_children", 0, INT32_MAX),
        ("num_device_children", 0, INT32_MAX),
        ("hits", 0, 2**63 - 1),
        ("storage", 0, 2),
    ],
)
def test_int_fields_take_their_range_and_refuse_beyond(field: str, low: int, high: int) -> None:
    node = rt.TreeNode(b"k", None, 3)
    for value in (low, high):
        setattr(node, field, value)
        # hits keeps at most 2**32 - 1 (thresholds compared with it are < 2**31)
        assert getattr(node, field) == (min(value, 2**32 - 1) if field == "hits" else value)
    setattr(node, field, low)
    for bad in (low - 1, high + 1, 2**70, -(2**70)):
        with pytest.raises(
            OverflowError, match=rf"TreeNode\.{field}: .*{bad}.*\[{low}, {high}\]"
        ):
            setattr(node, field, bad)
        assert getattr(node, field) == low  # unchanged
    with pytest.raises(TypeError, match=field):
        setattr(node, field, 1.0)
    with pytest.raises(AttributeError):
        delattr(node, field)


def test_state_returns_the_enum_member() -> None:
    node = rt.TreeNode(b"k", None, 3)
    for state in NodeState:
        node.state = state
        assert node.state is state
        node.state = int(state)  # a plain int names the same member
        assert node.state is state
    with pytest.raises(OverflowError, match=r"TreeNode\.state: 8 is out of range \[0, 7\]"):
        node.state = 8
    with pytest.raises(TypeError, match="state"):
        node.state = "HOST"
    assert node.state is NodeState.LOADING_FROM_STORAGE


def test_storage_returns_the_enum_member() -> None:
    node = rt.TreeNode(b"k", None, 3)
    assert node.storage is rt.StorageState.NOT_STORED
    for storage in rt.StorageState:
        node.storage = storage
        assert node.storage is storage
        node.storage = int(storage)  # a plain int names the same member
        assert node.storage is storage
    with pytest.raises(OverflowError, match=r"TreeNode\.storage: 3 is out of range \[0, 2\]"):
        node.storage = 3
    assert node.storage is rt.StorageState.STORED


def test_enum_members_are_installed_only_whole_and_in_order() -> None:
    native = _native()
    with pytest.raises(ValueError, match="needs a tuple of the 3 StorageState members"):
        native.set_storage_states((0, 1))
    with pytest.raises(ValueError, match="member 1 is 2, not an int equal to 1"):
        native.set_storage_states((0, 2, 1))
    assert rt.TreeNode(b"k", None, 3).storage is rt.StorageState.NOT_STORED  # unchanged


def test_key_and_parent_are_read_only_and_checked() -> None:
    node = rt.TreeNode(b"k", None, 3)
    with pytest.raises(AttributeError):
        node.key = b"other"
    with pytest.raises(AttributeError):
        node.parent = None
    with pytest.raises(TypeError, match="parent"):
        rt.TreeNode(b"k", object(), 3)
    with pytest.raises(OverflowError, match="device_block"):
        rt.TreeNode(b"k", None, 2**31)
    with pytest.raises(OverflowError, match="num_children"):
        rt.TreeNode(b"k", None, 1, -1)


def test_repr_matches_the_python_node() -> None:
    parent = rt.TreeNode(None, None, -1)
    node, twin = rt.TreeNode(b"k", parent, 5), rt._PyTreeNode(b"k", None, 5)
    for n in (node, twin):
        n.state, n.host_block, n.ref = NodeState.BACKUP_TO_HOST, 9, 3
    assert repr(node) == repr(twin) == "TreeNode(b'k', BACKUP_TO_HOST, dev=5, host=9, ref=3)"


def test_a_deep_path_is_freed_without_recursion() -> None:
    node = rt.TreeNode(None, None, -1)
    root = node
    for i in range(300_000):
        node = rt.TreeNode(i, node, i % 1000)
    del root
    del node  # frees 300,001 nodes, each the last holder of its parent


def test_lru_list_has_ordered_dict_semantics() -> None:
    lru, ref = _native().LRUList(0), OrderedDict()
    nodes = [rt.TreeNode(i, None, i) for i in range(6)]
    for n in nodes[:4]:
        lru[n] = ref[n] = None
    lru[nodes[0]] = ref[nodes[0]] = None  # already listed: keeps its place
    lru.move_to_end(nodes[1], last=False)
    ref.move_to_end(nodes[1], last=False)
    lru.move_to_end(nodes[2])
    ref.move_to_end(nodes[2])
    assert list(lru) == list(ref) and len(lru) == len(ref) == 4
    assert lru.pop(nodes[3], "x") is ref.pop(nodes[3], "x") is None
    assert lru.pop(nodes[3], "x") == ref.pop(nodes[3], "x") == "x"
    with pytest.raises(KeyError):
        lru.pop(nodes[3])
    assert nodes[0] in lru and nodes[3] not in lru and "x" not in lru
    assert lru.popitem(last=False) == ref.popitem(last=False)
    assert lru.popitem() == ref.popitem()
    del lru[nodes[0]]
    del ref[nodes[0]]
    with pytest.raises(KeyError):
        del lru[nodes[0]]
    assert list(lru) == list(ref) == []
    assert lru.pop_oldest() is None
    with pytest.raises(KeyError):
        lru.popitem()
    with pytest.raises(TypeError):
        lru["x"] = None
    with pytest.raises(TypeError):
        lru[nodes[0]] = 1
    with pytest.raises(ValueError, match="slot"):
        _native().LRUList(2)


def test_lru_lists_share_no_slot_and_refuse_changes_while_iterated() -> None:
    native = _native()
    device, host, other = native.LRUList(0), native.LRUList(1), native.LRUList(0)
    node = rt.TreeNode(1, None, 1)
    device[node] = host[node] = None  # one link pair each
    with pytest.raises(ValueError, match="another list"):
        other[node] = None
    assert node not in other
    second = rt.TreeNode(2, None, 2)
    device[second] = None
    it = iter(device)
    assert next(it) is node
    device.pop(second)
    with pytest.raises(RuntimeError, match="changed during iteration"):
        next(it)


@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.parametrize("host_blocks", [0, 300])
def test_native_and_python_trees_replay_identically(
    monkeypatch: pytest.MonkeyPatch,
    use_python_radix_tree: Callable[[pytest.MonkeyPatch], None],
    policy: WritePolicy,
    host_blocks: int,
) -> None:
    trace = synthetic_trace(400, seed=3)
    config = CacheConfig(
        block_size=16,
        num_device_blocks=250,
        num_host_blocks=host_blocks,
        write_policy=policy if host_blocks else WritePolicy.WRITE_BACK,
    )

    def run() -> dict:
        stats = dataclasses.asdict(replay(trace, config).stats)
        return stats

    native = run()
    with monkeypatch.context() as m:
        use_python_radix_tree(m)
        python = run()
    assert native == python
    assert native["device_evictions"] > 0


def test_node_index_matches_a_dict_through_growth_and_collisions() -> None:
    import random

    index, ref = _native().NodeIndex(), {}
    rng = random.Random(5)
    modulus = 2**61 - 1  # ints k and k + modulus hash alike: they share buckets
    universe = [k for i in range(3000) for k in (i, i + modulus)]
    saw_growth = False
    for _ in range(40_000):
        key = rng.choice(universe)
        if key in ref and rng.random() < 0.4:
            del index[key]
            del ref[key]
        elif key not in ref:
            node = rt.TreeNode(key, None, 1)
            index.add(node)
            ref[key] = node
        assert index.get(key) is ref.get(key)
        saw_growth |= index.growing()
    assert saw_growth
    assert len(index) == len(ref)
    assert sorted(n.key for n in index.values()) == sorted(ref)
    assert sorted(index.items(), key=lambda kv: kv[0]) == sorted(ref.items())
    for key in universe:
        assert (key in index) == (key in ref)
        assert index.get(key, "x") is ref.get(key, "x")


def test_node_index_refuses_duplicates_and_foreign_keys_unchanged() -> None:
    index = _native().NodeIndex()
    node = rt.TreeNode(b"a", None, 1)
    index[b"a"] = node
    with pytest.raises(ValueError, match="indexed already"):
        index.add(rt.TreeNode(b"a", None, 2))
    with pytest.raises(ValueError, match="indexed already"):
        index.add(node)
    with pytest.raises(ValueError, match="not the node's key"):
        index[b"b"] = rt.TreeNode(b"c", None, 3)
    with pytest.raises(TypeError):
        index[b"b"] = "not a node"
    with pytest.raises(KeyError):
        del index[b"b"]
    with pytest.raises(KeyError):
        index[b"b"]
    with pytest.raises(TypeError):
        index.get([])  # unhashable
    assert len(index) == 1 and index[b"a"] is node
    assert index.isdisjoint([b"b", b"c"]) and not index.isdisjoint({b"c", b"a"})


def test_a_dropped_tree_frees_its_nodes() -> None:
    def churn() -> None:
        tree = RadixTree()
        _fill(tree, num_paths=50, depth=100)
        tree.discard_device_leaves(2_000)  # through the lists and the index
        for node in tree.device_lru:
            tree.host_lru[node] = None  # nodes on both lists when the tree goes
        assert tree.num_nodes == 3_000

    churn()  # warm-up: free lists and caches reach their size
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(3):
        churn()
    gc.collect()
    assert sys.getallocatedblocks() - before < 100  # 3,000 nodes per tree


def test_a_dropped_tree_gives_its_nodes_back_to_the_arena() -> None:
    gc.collect()
    live_before, _ = _native().arena_stats()
    tree = RadixTree()
    _fill(tree, num_paths=50, depth=100)
    assert _native().arena_stats()[0] == live_before + 5_001  # and the root
    del tree
    gc.collect()
    assert _native().arena_stats()[0] == live_before


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_node_costs_at_most_112_bytes() -> None:
    # 200,000 nodes with inline digest keys: the arena's 112-byte slots (pymalloc's
    # 128-byte size class before), counted as the process grows.
    n = 200_000
    keys = [i.to_bytes(32, "big") for i in range(n)]
    nodes: list[object] = [None] * n
    gc.collect()
    before = _rss()
    for i, key in enumerate(keys):
        nodes[i] = rt.TreeNode(key, None, i)
    per_node = (_rss() - before) / n
    assert rt.TreeNode.__basicsize__ == 112
    assert per_node <= 114, per_node
    assert all(nodes[i].key == keys[i] for i in range(0, n, 997))  # type: ignore[union-attr]


def test_lru_lists_link_nodes_across_slabs_and_emptied_slabs_go_back() -> None:
    native = _native()
    gc.collect()
    live0, slabs0 = native.arena_stats()
    n = 80_000  # three slabs of 32,767 nodes
    nodes = [rt.TreeNode(i.to_bytes(32, "big"), None, i) for i in range(n)]
    live, slabs = native.arena_stats()
    # the nodes fill the free slots of slabs already there first (earlier tests
    # may leave a few live nodes spread over two): count what they need in all
    assert live == live0 + n and slabs >= -(-(live0 + n) // 32_767) >= 3
    lists = (native.LRUList(0), native.LRUList(1))
    refs: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())
    for lru, ref in zip(lists, refs, strict=True):
        for node in nodes[::3] + nodes[1::3] + nodes[2::3]:  # neighbours in other slabs
            lru[node] = ref[node] = None
    for lru, ref in zip(lists, refs, strict=True):
        for node in nodes[5::7]:
            del lru[node]
            del ref[node]
        for node in nodes[::11]:
            if node in ref:
                lru.move_to_end(node, last=False)
                ref.move_to_end(node, last=False)
        assert list(lru) == list(ref)
    del nodes  # the lists hold the rest: freed slots are reused by new nodes
    refilled = [rt.TreeNode(i.to_bytes(32, "little"), None, i) for i in range(n // 7)]
    assert native.arena_stats()[1] <= slabs
    for lru, ref in zip(lists, refs, strict=True):
        for node in refilled:
            lru[node] = ref[node] = None
        assert list(lru) == list(ref)
        while ref:
            assert lru.pop_oldest() is ref.popitem(last=False)[0]
        assert len(lru) == 0
    refs[0].clear()
    refs[1].clear()
    del refilled, lru, ref, node
    gc.collect()
    live, slabs = native.arena_stats()
    assert live == live0 and slabs <= max(slabs0, 1)


def test_node_index_survives_keys_whose_eq_changes_it() -> None:
    index = _native().NodeIndex()

    class Key:
        """Hashes alike; comparing removes the victim from the index."""

        victim: object = None

        def __init__(self, name: str) -> None:
            self.name = name

        def __hash__(self) -> int:
            return 7

        def __eq__(self, other: object) -> bool:
            victim, Key.victim = Key.victim, None
            if victim is not None:
                del index[victim]
            return isinstance(other, Key) and other.name == self.name

    keys = [Key(str(i)) for i in range(5)]
    for k in keys:
        index.add(rt.TreeNode(k, None, 1))
    # The newest node heads the bucket: the lookup compares with it first, and that
    # comparison unindexes (and frees) the very node being compared.
    Key.victim = keys[4]
    assert index.get(Key("0")).key is keys[0]
    assert len(index) == 4 and Key("4") not in index


_BAD_HASHES = [
    (
        [b"\0" * 32, b"\0" * 31],
        TypeError,
        r"^block_hashes\[1\]: expected a 32-byte digest \(bytes\), got 31 bytes$",
    ),
    (
        [b"\1" * 32, "x" * 32],
        TypeError,
        r"^block_hashes\[1\]: expected a 32-byte digest \(bytes\), got str$",
    ),
    (
        [bytearray(32)],
        TypeError,
        r"^block_hashes\[0\]: expected a 32-byte digest \(bytes\), got bytearray$",
    ),
    (
        [bytes([i]) * 32 for i in range(200)] + [bytes([7]) * 32],
        ValueError,
        r"^block_hashes: a hash appears twice \(chained hashes never repeat\)$",
    ),
]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("hashes", "error", "message"), _BAD_HASHES)
def test_digest_checks_are_the_same_in_c_and_python(
    monkeypatch: pytest.MonkeyPatch, native: bool, hashes: list, error: type, message: str
) -> None:
    from fastkv.scheduler import request

    if not native:
        monkeypatch.setattr(request, "_check_digests", None)
    with pytest.raises(error, match=message):
        request.checked_hashes(hashes)
    good = [i.to_bytes(32, "big") for i in range(1000)]  # past the C stack table
    assert request.checked_hashes(good) == good
    assert request.checked_hashes(()) == []


@pytest.mark.parametrize("native", [True, False])
def test_native_match_locks_the_same_nodes_and_blocks_as_the_python_walk(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """Both walks lock the same nodes and hand back the same device blocks, as an
    int32 array: no int object per matched block."""
    if not native:
        monkeypatch.setattr(rt, "_match_path", None)
    tree = RadixTree()
    keys = [i.to_bytes(32, "big") for i in range(6)]
    path, _ = tree.insert(tree.root, keys, [10, 11, 12, 13, 14, 15])
    tree.unlock(path)
    # Block 2 is host-only, block 4 is still loading: the walk stops there.
    tree.start_eviction(path[5], 5)  # a leaf being evicted: matched, becomes a backup
    path[2].state, path[2].device_block, path[2].host_block = NodeState.HOST, -1, 2
    path[4].state = NodeState.SWAP_TO_DEVICE
    for node in (path[2], path[4]):
        tree.device_lru.pop(node, None)
    nodes, blocks, num_host, waiting = tree.match_and_lock(keys, 6)
    assert type(blocks) is array and blocks.typecode == "i"
    assert nodes == path[:4] and blocks.tolist() == [10, 11] and num_host == 1 and waiting
    assert [n.ref for n in path] == [1, 1, 1, 1, 0, 0]
    assert all(n not in tree.device_lru for n in path[:4])
    tree.unlock(nodes)
    nodes, blocks, num_host, waiting = tree.match_and_lock(keys[:2], 1)
    assert nodes == path[:1] and blocks == array("i", [10]) and not num_host and not waiting
    tree.unlock(nodes)


def test_digest_checks_can_leave_distinctness_to_the_match() -> None:
    from fastkv.scheduler import request

    twice = [b"\1" * 32, b"\2" * 32, b"\1" * 32]
    assert request.checked_hashes(twice, distinct=False) == twice
    with pytest.raises(TypeError, match=r"^block_hashes\[1\]: expected a 32-byte digest"):
        request.checked_hashes([b"\1" * 32, b"x"], distinct=False)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    ("tail", "num_tokens"),
    [
        ([0], 17),  # the tail repeats a matched key
        ([0], 16),  # the same, the walk stopped by the limit (the last block computed)
        ([7, 8, 7], 25),  # the tail repeats itself
    ],
)
def test_match_refuses_repeated_hashes_before_locking_anything(
    monkeypatch: pytest.MonkeyPatch, native: bool, tail: list[int], num_tokens: int
) -> None:
    """Distinctness is checked in the match walk, and only when the walk stops
    short of the end (a tree path never repeats a key): every repeat that stops it
    short is refused, and nothing is locked or reordered."""
    from fastkv.scheduler import CacheManager

    if not native:
        monkeypatch.setattr(rt, "_match_path", None)
    mgr = CacheManager(CacheConfig(block_size=4, num_device_blocks=16), clock=lambda: 0.0)
    keys = [i.to_bytes(32, "big") for i in range(3)]
    mgr.match("a", keys, 13)
    mgr.allocate("a", num_tokens=12)
    mgr.commit("a", num_computed_tokens=12)
    mgr.finish("a")
    tree = mgr.tree
    path = [tree._index[k] for k in keys]
    order = [n.key for n in tree.device_lru]
    hashes = keys + [i.to_bytes(32, "big") for i in tail]
    with pytest.raises(ValueError, match=r"^block_hashes: a hash appears twice"):
        mgr.match("b", hashes, num_tokens)
    assert [n.ref for n in path] == [0, 0, 0] and not mgr.is_active("b")
    assert [n.key for n in tree.device_lru] == order
    # The same keys, all matched: a full hit, accepted without a check of its own.
    hit = mgr.match("c", keys, 13)
    assert hit.num_hits == 3 and [n.ref for n in path] == [1, 1, 1]


def test_native_match_gives_back_its_locks_when_unlisting_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = RadixTree()
    keys = [i.to_bytes(32, "big") for i in range(3)]
    path, _ = tree.insert(tree.root, keys, [0, 1, 2])
    tree.unlock(path)
    tree._device_parked.add(path[2])  # parked: the general case, through _unlist
    tree.device_lru.pop(path[2])

    def fail(node: object) -> None:
        raise RuntimeError("unlist failed")

    monkeypatch.setattr(RadixTree, "_unlist", lambda self, node: fail(node))
    before = list(tree.device_lru)
    with pytest.raises(RuntimeError, match="unlist failed"):
        tree.match_and_lock(keys, 3)
    assert [n.ref for n in path] == [0, 0, 0]
    assert sorted(map(id, tree.device_lru)) == sorted(map(id, before))


def test_a_digest_key_is_held_inline_and_found_by_any_equal_bytes() -> None:
    key = bytes(range(32))
    before = sys.getrefcount(key)
    node = rt.TreeNode(key, None, 1)
    assert sys.getrefcount(key) == before  # no reference kept: the bytes live in the node
    assert node.key == key and type(node.key) is bytes
    assert repr(node) == f"TreeNode({key!r}, DEVICE, dev=1, host=-1, ref=1)"
    index = _native().NodeIndex()
    index[key] = node
    assert index.get(bytes(range(32))) is node and bytes(range(32)) in index
    assert index.get(bytes(range(1, 33))) is None
    assert index.items() == [(key, node)]
    short = b"k" * 31  # any other key is held by reference
    other = rt.TreeNode(short, None, 2)
    assert other.key is short
    index.add(other)
    assert index.get(b"k" * 31) is other and len(index) == 2
    del index[key]
    assert index.get(key) is None and len(index) == 1
    # A node holds no per-key object: its size is the header, the fields and 32 bytes.
    assert _native().NODE_SIZE <= 128


def test_hits_saturate_and_lists_have_one_byte_ids() -> None:
    node = rt.TreeNode(b"k", None, 3)
    node.hits = 2**32 - 2
    node.hits += 1
    node.hits += 1  # a counter that has reached the top stays there
    assert node.hits == 2**32 - 1
    lists = [_native().LRUList(0) for _ in range(200)]
    lists[7][node] = None
    assert node in lists[7] and all(node not in lst for lst in lists[8:])
    with pytest.raises(ValueError, match="another list"):
        lists[8][node] = None
    del lists  # ids are given back: lists can be made up to the bound again
    more = []
    with pytest.raises(RuntimeError, match="255 lists exist"):
        while len(more) < 300:
            more.append(_native().LRUList(1))
    assert 200 < len(more) <= 255  # a few may belong to trees still alive elsewhere
    more[0][node] = None
    assert node in more[0]
    more[0].pop(node)


def test_digest_keys_and_equal_bytes_subclasses_find_each_other() -> None:
    class Digest(bytes):
        pass

    index = _native().NodeIndex()
    plain, sub = bytes(range(32)), Digest(bytes(range(1, 33)))
    a, b = rt.TreeNode(plain, None, 1), rt.TreeNode(sub, None, 2)
    index.add(a)
    index.add(b)
    assert index.get(Digest(plain)) is a  # a subclass probe finds the inline key
    assert index.get(bytes(range(1, 33))) is b  # a plain probe finds the subclass key
    assert b.key is sub and a.key == plain
    with pytest.raises(ValueError, match="indexed already"):
        index.add(rt.TreeNode(Digest(plain), None, 3))
    del index[Digest(plain)]
    assert plain not in index and len(index) == 1


def test_a_node_added_during_a_grow_goes_where_the_move_has_not_reached() -> None:
    """Issue 27: while the index grows, a key lives in one array only: the old one
    until the move reaches its bucket, the new one after. Keys added mid-grow
    whose buckets the move has not reached go to the old array (they once all went
    to the new one, a page fault per key in its untouched pages), every key stays
    found, and once the grow ends every key is in the new array."""
    index = _native().NodeIndex()
    nodes = [rt.TreeNode(i.to_bytes(32, "big"), None, 1) for i in range(5_000)]
    added_to_old = 0
    for i, node in enumerate(nodes):
        growing = index.growing()
        index.add(node)
        added_to_old += growing and index._array_of(node.key) == 1
        if index.growing():
            assert all(index.get(n.key) is n for n in nodes[: i + 1 : 7])
    assert added_to_old > 0
    while index.growing():  # each operation moves a few buckets
        del index[nodes[-1].key]
        index.add(nodes[-1])
    assert {index._array_of(n.key) for n in nodes} == {0}
    assert all(index.get(n.key) is n for n in nodes)


def test_node_index_stays_right_while_a_large_grow_gives_pages_back() -> None:
    # 40,000 nodes: the grow from 32,768 buckets (256 KiB) releases the emptied
    # pages of the old array as it moves them, and lookups read them as empty.
    index = _native().NodeIndex()
    nodes = [rt.TreeNode(i.to_bytes(32, "big"), None, 1) for i in range(40_000)]
    grew = False
    for i, node in enumerate(nodes):
        index.add(node)
        grew |= index.growing()
        if i % 997 == 0:  # mid-grow: every node so far is found
            assert all(index.get(n.key) is n for n in nodes[: i + 1 : 13])
    assert grew and len(index) == 40_000
    assert all(index.get(n.key) is n for n in nodes)
    assert sorted(map(id, index.values())) == sorted(map(id, nodes))
    for node in nodes[::2]:
        del index[node.key]
    assert len(index) == 20_000 and all(index.get(n.key) is n for n in nodes[1::2])


@pytest.mark.skipif(not HAVE_NATIVE, reason="the C extension is not built")
def test_append_ids_appends_int32_ids_or_nothing() -> None:
    """A request's table takes the ids an allocation hands out in one pass; a bad
    id is refused by position, value and bound, and nothing is appended."""
    append_ids = _native().append_ids
    table = array("i", [3])
    append_ids(table, [4, 2**31 - 1, -1])
    assert table.tolist() == [3, 4, 2**31 - 1, -1]
    with pytest.raises(
        OverflowError, match=r"ids\[1\]: block id 2147483648 is out of range \[-1, 2147483647\]"
    ):
        append_ids(table, [5, 2**31])
    with pytest.raises(TypeError, match=r"ids\[0\]: a block id must be an int, got str"):
        append_ids(table, ["7"])
    with pytest.raises(TypeError, match=r"array\('i'\)"):
        append_ids(array("q"), [1])
    assert table.tolist() == [3, 4, 2**31 - 1, -1]


@pytest.mark.skipif(not HAVE_NATIVE, reason="the C extension is not built")
def test_make_path_reads_an_int32_table_as_a_list() -> None:
    """make_path takes a request's int32 table as it is, with the same bound."""
    tree = RadixTree()
    keys = [i.to_bytes(32, "big") for i in range(3)]
    path, _ = tree.insert(tree.root, keys, array("i", [7, 8, 9]))
    assert [n.device_block for n in path] == [7, 8, 9]
    with pytest.raises(
        OverflowError, match=r"device_block: -2 is out of range \[-1, 2147483647\]"
    ):
        tree.insert(tree.root, [b"\xff" * 32], array("i", [-2]))
    assert len(tree._index) == 3
