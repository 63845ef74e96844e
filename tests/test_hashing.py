"""Chained block hashes: prefix semantics, incremental hashing, input types, the C loop
against the pure-Python one, namespaces and extra keys, and stability across
processes with different PYTHONHASHSEED values."""

from __future__ import annotations

import array
import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fastkv import CacheConfig, hashing
from fastkv.hashing import (
    DIGEST_BYTES,
    BlockHasher,
    _chain_py,
    encode_extra_key,
    hash_blocks,
    namespace_root,
    request_root,
)

ROOT = namespace_root(CacheConfig(block_size=4).namespace_key())
BS = 4

HAVE_NATIVE = importlib.util.find_spec("fastkv._chain_hash") is not None
needs_native = pytest.mark.skipif(
    not HAVE_NATIVE, reason="fastkv._chain_hash is not built (make install builds it)"
)


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2**32) for _ in range(n)]


def reference(parent: bytes, toks: list[int], bs: int, extras: dict[int, bytes] | None = None):
    """The documented chain, written out independently of the library:
    digest[i] = SHA256(digest[i-1] || le_u32 tokens [|| extra || le_u32 len(extra)])."""
    out = []
    for b in range(len(toks) // bs):
        data = b"".join(t.to_bytes(4, "little") for t in toks[b * bs : (b + 1) * bs])
        h = hashlib.sha256(parent + data)
        if extras and b in extras:
            h.update(extras[b] + len(extras[b]).to_bytes(4, "little"))
        parent = h.digest()
        out.append(parent)
    return out


# -- chaining and full blocks ---------------------------------------------------


def test_digests_match_the_documented_chain() -> None:
    toks = tokens(5 * BS, seed=1)
    assert hash_blocks(ROOT, toks, BS) == reference(ROOT, toks, BS)
    extra = {2: encode_extra_key("img-7")}
    assert hash_blocks(ROOT, toks, BS, {2: "img-7"}) == reference(ROOT, toks, BS, extra)


def test_namespace_root_is_sha256_of_the_tagged_namespace() -> None:
    assert namespace_root("ns") == hashlib.sha256(b"fastkv/namespace\0ns").digest()
    assert len(ROOT) == DIGEST_BYTES


@pytest.mark.parametrize("changed", range(6))
def test_changing_block_i_changes_digests_from_i_on_only(changed: int) -> None:
    toks = tokens(6 * BS, seed=2)
    base = hash_blocks(ROOT, toks, BS)
    other = list(toks)
    other[changed * BS + 1] ^= 1
    digests = hash_blocks(ROOT, other, BS)
    assert digests[:changed] == base[:changed]
    assert all(a != b for a, b in zip(digests[changed:], base[changed:], strict=True))


def test_same_block_at_another_position_hashes_differently() -> None:
    block = tokens(BS, seed=3)
    digests = hash_blocks(ROOT, block * 3, BS)
    assert len(set(digests)) == 3


@pytest.mark.parametrize("extra_tokens", range(BS))
def test_only_full_blocks_are_hashed(extra_tokens: int) -> None:
    toks = tokens(3 * BS + BS, seed=4)
    full = hash_blocks(ROOT, toks, BS)
    assert len(full) == 4
    partial = hash_blocks(ROOT, toks[: 3 * BS + extra_tokens], BS)
    assert partial == full[:3]


def test_fewer_tokens_than_a_block_hash_nothing() -> None:
    assert hash_blocks(ROOT, [], BS) == []
    assert hash_blocks(ROOT, [1, 2, 3], BS) == []


def test_first_block_continues_a_chain() -> None:
    toks = tokens(6 * BS, seed=5)
    extras = {1: "a", 4: b"b", 5: 9}
    full = hash_blocks(ROOT, toks, BS, extras)
    tail = hash_blocks(full[2], toks[3 * BS :], BS, extras, first_block=3)
    assert tail == full[3:]


def test_parent_must_be_a_digest() -> None:
    with pytest.raises(ValueError, match="parent"):
        hash_blocks(b"short", tokens(BS), BS)
    with pytest.raises(ValueError, match="root"):
        BlockHasher(BS, b"x" * 31)


# -- incremental hashing --------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("bs", [1, 3, 16])
def test_incremental_append_equals_one_shot(seed: int, bs: int) -> None:
    rng = random.Random(seed)
    toks = tokens(rng.randrange(0, 12 * bs), seed=seed)
    extras = {i: f"mm{i}" for i in range(0, len(toks) // bs, 3)}
    expected = hash_blocks(ROOT, toks, bs, extras)
    hasher = BlockHasher(bs, ROOT)
    pos = 0
    while pos < len(toks):
        n = rng.randrange(0, 2 * bs + 2)
        before = len(hasher.hashes)
        new = hasher.append(toks[pos : pos + n], extras)
        pos = min(pos + n, len(toks))
        # Exactly the blocks this chunk completed, in order.
        assert new == expected[before : pos // bs]
        assert hasher.hashes == expected[: pos // bs]
        assert hasher.num_tokens == pos
    assert hasher.hashes == expected


def test_append_of_a_partial_block_returns_nothing_until_it_completes() -> None:
    hasher = BlockHasher(BS, ROOT)
    toks = tokens(2 * BS, seed=6)
    expected = hash_blocks(ROOT, toks, BS)
    assert hasher.append(toks[:1]) == []
    assert hasher.append(toks[1 : BS - 1]) == []
    assert hasher.append([]) == []
    assert hasher.append(toks[BS - 1 : BS + 1]) == expected[:1]
    assert hasher.append(toks[BS + 1 :]) == expected[1:]


def _as_list(t: list[int]):
    return list(t)


def _as_tuple(t: list[int]):
    return tuple(t)


def _as_int64(t: list[int]):
    return np.asarray(t, dtype=np.int64)


def _as_uint32(t: list[int]):
    return np.asarray(t, dtype=np.uint32)


def _as_uint64(t: list[int]):
    return np.asarray(t, dtype=np.uint64)


def _as_array_I(t: list[int]):
    return array.array("I", t)


INPUT_TYPES = [_as_list, _as_tuple, _as_int64, _as_uint32, _as_uint64, _as_array_I]


@pytest.mark.parametrize("convert", INPUT_TYPES, ids=lambda f: f.__name__[4:])
def test_input_types_give_identical_digests(convert) -> None:
    toks = tokens(5 * BS + 2, seed=7)
    toks[:4] = [0, 1, 2**31, 2**32 - 1]  # sign-bit and top values
    expected = reference(ROOT, toks, BS)
    assert hash_blocks(ROOT, convert(toks), BS) == expected
    assert _chain_py(ROOT, convert(toks), BS, 5, None) == expected
    hasher = BlockHasher(BS, ROOT)
    for a, b in [(0, 3), (3, 3), (3, 9), (9, len(toks))]:
        hasher.append(convert(toks[a:b]))
    assert hasher.hashes == expected


# -- the C loop against the pure-Python loop ------------------------------------


@needs_native
@pytest.mark.parametrize("convert", INPUT_TYPES, ids=lambda f: f.__name__[4:])
@pytest.mark.parametrize("bs", [1, 2, 16, 64])
def test_native_chain_equals_python_chain(convert, bs: int) -> None:
    from fastkv._chain_hash import chain

    toks = tokens(7 * bs + 1, seed=bs)
    extras = [None, encode_extra_key("x"), None, encode_extra_key([1, b"2"]), b"", None, None]
    for ex in (None, extras):
        native = chain(ROOT, convert(toks), bs, 7, ex)
        assert native == _chain_py(ROOT, convert(toks), bs, 7, ex)
        assert all(len(d) == DIGEST_BYTES for d in native)


@needs_native
def test_library_uses_the_native_loop_when_built() -> None:
    from fastkv._chain_hash import chain

    assert hashing._chain_native is chain


@needs_native
@pytest.mark.parametrize(
    "dtype",
    [
        np.int32,
        np.int64,
        np.uint32,
        np.uint64,
        np.int16,
        np.uint8,
    ],
)
def test_native_and_python_accept_the_same_integer_arrays(dtype) -> None:
    from fastkv._chain_hash import chain

    toks = np.arange(2 * BS, dtype=dtype)
    assert chain(ROOT, toks, BS, 2, None) == _chain_py(ROOT, toks, BS, 2, None)


def test_python_chain_rejects_float_tokens() -> None:
    with pytest.raises((TypeError, ValueError)):
        _chain_py(ROOT, np.arange(BS, dtype=np.float64) + 0.5, BS, 1, None)


# -- namespaces, request keys, extra keys ---------------------------------------


def test_namespaces_separate_chains() -> None:
    toks = tokens(4 * BS, seed=8)
    configs = [
        CacheConfig(block_size=BS),
        CacheConfig(block_size=BS, model_id="other"),
        CacheConfig(block_size=BS, kv_dtype="float16"),
        CacheConfig(block_size=BS, tp_size=2, tp_rank=1),
        CacheConfig(block_size=BS, namespace="explicit"),
    ]
    chains = [hash_blocks(namespace_root(c.namespace_key()), toks, BS) for c in configs]
    all_digests = [d for chain in chains for d in chain]
    assert len(set(all_digests)) == len(all_digests)


def test_request_keys_separate_chains() -> None:
    toks = tokens(4 * BS, seed=9)
    assert request_root(ROOT, None) == ROOT
    keys = [None, "lora-1", "lora-2", b"lora-1", 1, ("lora-1", "salt-a"), ("lora-1", "salt-b")]
    roots = [request_root(ROOT, k) for k in keys]
    assert len(set(roots)) == len(roots)
    chains = [hash_blocks(r, toks, BS) for r in roots]
    all_digests = [d for chain in chains for d in chain]
    assert len(set(all_digests)) == len(all_digests)
    # Deterministic: the same key gives the same root.
    assert request_root(ROOT, ("lora-1", "salt-a")) == roots[5]


@pytest.mark.parametrize("block", range(5))
def test_extra_key_changes_its_block_and_later_only(block: int) -> None:
    toks = tokens(5 * BS, seed=10)
    base = hash_blocks(ROOT, toks, BS)
    with_extra = hash_blocks(ROOT, toks, BS, {block: "image:abc"})
    assert with_extra[:block] == base[:block]
    assert all(a != b for a, b in zip(with_extra[block:], base[block:], strict=True))


def test_extra_keys_are_part_of_the_block_they_index() -> None:
    toks = tokens(3 * BS, seed=11)
    a = hash_blocks(ROOT, toks, BS, {1: "x"})
    b = hash_blocks(ROOT, toks, BS, {2: "x"})
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    # An absent key, an empty key and an extra key for a block past the end.
    none = hash_blocks(ROOT, toks, BS)
    assert hash_blocks(ROOT, toks, BS, {}) == none
    assert hash_blocks(ROOT, toks, BS, {7: "past the end"}) == none
    assert hash_blocks(ROOT, toks, BS, {1: b""})[1] != none[1]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (b"1", "1"),
        ("1", 1),
        (b"1", 1),
        (1, -1),
        (0, b""),
        ("", b""),
        ("ab", ["a", "b"]),
        (["ab"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([], ""),
        ([b"a", "b"], ["a", b"b"]),
    ],
    ids=repr,
)
def test_encode_extra_key_distinguishes_types_and_structure(a, b) -> None:
    assert encode_extra_key(a) != encode_extra_key(b)
    toks = tokens(BS, seed=12)
    assert hash_blocks(ROOT, toks, BS, {0: a}) != hash_blocks(ROOT, toks, BS, {0: b})


def test_encode_extra_key_is_canonical_for_equal_values() -> None:
    assert encode_extra_key(np.int64(5)) == encode_extra_key(5)
    assert encode_extra_key(np.uint32(5)) == encode_extra_key(5)
    assert encode_extra_key(["a", 1]) == encode_extra_key(["a", 1])
    assert encode_extra_key("é") == encode_extra_key("é")


@pytest.mark.parametrize("key", [True, 1.5, None, {"a": 1}, {1}], ids=repr)
def test_encode_extra_key_rejects_unsupported_types(key) -> None:
    with pytest.raises(TypeError, match="extra key"):
        encode_extra_key(key)


# -- token range ----------------------------------------------------------------

BAD_TOKENS = [
    ("list_negative", lambda: [0, -1, 0, 0]),
    ("list_2**32", lambda: [0, 0, 2**32, 0]),
    ("list_2**64", lambda: [0, 0, 0, 2**64]),
    ("int64_negative", lambda: np.array([0, -1, 0, 0], dtype=np.int64)),
    ("int32_negative", lambda: np.array([0, -5, 0, 0], dtype=np.int32)),
    ("int64_2**32", lambda: np.array([2**32, 0, 0, 0], dtype=np.int64)),
    ("uint64_2**32", lambda: np.array([0, 0, 0, 2**32], dtype=np.uint64)),
]


@pytest.mark.parametrize(("name", "make"), BAD_TOKENS, ids=[n for n, _ in BAD_TOKENS])
def test_out_of_range_tokens_raise(name: str, make) -> None:
    with pytest.raises(ValueError, match="tokens"):
        hash_blocks(ROOT, make(), BS)
    with pytest.raises(ValueError, match="tokens"):
        _chain_py(ROOT, make(), BS, 1, None)
    hasher = BlockHasher(BS, ROOT)
    with pytest.raises(ValueError, match="tokens"):
        hasher.append(make())
    assert hasher.hashes == [] and hasher.num_tokens == 0


def test_block_hasher_rejects_bad_token_in_a_partial_block() -> None:
    hasher = BlockHasher(BS, ROOT)
    with pytest.raises(ValueError, match="tokens"):
        hasher.append([1, -1])


# -- process stability -----------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from fastkv import CacheConfig, hashing
    if sys.argv[1] == "python":
        hashing._chain_native = None
    cfg = CacheConfig(block_size=4, model_id="llama", tp_size=2, tp_rank=1)
    root = hashing.namespace_root(cfg.namespace_key())
    toks = list(range(1000, 1000 + 4 * 5)) + [7, 7]
    out = {
        "plain": hashing.hash_blocks(root, toks, 4),
        "lora": hashing.hash_blocks(hashing.request_root(root, ("lora-3", b"salt")), toks, 4),
        "extra": hashing.hash_blocks(root, np.asarray(toks), 4, {1: "img", 3: [1, b"x"]}),
    }
    h = hashing.BlockHasher(4, root)
    for i in range(0, len(toks), 3):
        h.append(toks[i : i + 3])
    out["incremental"] = h.hashes
    print(json.dumps({k: [d.hex() for d in v] for k, v in out.items()}))
    """
)


def _in_process() -> dict[str, list[str]]:
    cfg = CacheConfig(block_size=4, model_id="llama", tp_size=2, tp_rank=1)
    root = namespace_root(cfg.namespace_key())
    toks = [*range(1000, 1000 + 4 * 5), 7, 7]
    out = {
        "plain": hash_blocks(root, toks, 4),
        "lora": hash_blocks(request_root(root, ("lora-3", b"salt")), toks, 4),
        "extra": hash_blocks(root, np.asarray(toks), 4, {1: "img", 3: [1, b"x"]}),
        "incremental": hash_blocks(root, toks, 4),
    }
    return {k: [d.hex() for d in v] for k, v in out.items()}


@pytest.mark.parametrize("path", ["default", "python"])
def test_digests_are_stable_across_processes_and_hash_seeds(path: str) -> None:
    outputs = {}
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, path],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        outputs[seed] = json.loads(proc.stdout)
    expected = _in_process()
    assert len(expected["plain"]) == 5
    for seed, out in outputs.items():
        assert out == expected, f"PYTHONHASHSEED={seed} gave other digests"


# -- one definition of valid tokens, on both loops --------------------------------

TOKEN_INPUTS = [
    ("list", lambda: [1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ("tuple", lambda: (1, 2, 3, 4, 5, 6, 7, 8, 9)),
    ("range", lambda: range(100, 109)),
    ("numpy_int_items", lambda: [np.int64(1), np.uint32(2), 3, 4, 5, 6, 7, 8, 9]),
    ("int8", lambda: np.arange(9, dtype=np.int8)),
    ("uint16", lambda: np.arange(9, dtype=np.uint16)),
    ("uint32", lambda: np.arange(9, dtype=np.uint32) + 2**31),
    ("int64", lambda: np.arange(9, dtype=np.int64)),
    ("uint64", lambda: np.arange(9, dtype=np.uint64)),
    ("big_endian_uint32", lambda: (np.arange(9) + 2**31).astype(">u4")),
    ("big_endian_int64", lambda: np.arange(9).astype(">i8")),
    ("little_endian_int16", lambda: np.arange(9).astype("<i2")),
    ("strided_view", lambda: np.arange(18, dtype=np.int64)[::2]),
    ("array_I", lambda: array.array("I", range(9))),
    ("memoryview", lambda: memoryview(np.arange(9, dtype=np.uint32))),
    ("bool_list", lambda: [True, False, True, 1, 2, 3, 4, 5, 6]),
    ("bool_in_tail", lambda: [1, 2, 3, 4, 5, 6, 7, 8, True]),
    ("numpy_bool_item", lambda: [np.True_, 2, 3, 4, 5, 6, 7, 8, 9]),
    ("bool_array", lambda: np.ones(9, dtype=bool)),
    ("bytes", lambda: bytes(range(9))),
    ("bytearray", lambda: bytearray(range(9))),
    ("str", lambda: "abcdefghi"),
    ("float_list", lambda: [1.0, 2, 3, 4, 5, 6, 7, 8, 9]),
    ("float_array", lambda: np.arange(9, dtype=np.float32)),
    ("object_array", lambda: np.arange(9).astype(object)),
    ("2d_array", lambda: np.arange(8, dtype=np.int64).reshape(2, 4)),
    ("none_item", lambda: [1, 2, 3, None, 5, 6, 7, 8, 9]),
    ("negative", lambda: [1, 2, 3, 4, -1, 6, 7, 8, 9]),
    ("negative_in_tail", lambda: [1, 2, 3, 4, 5, 6, 7, 8, -1]),
    ("2**32", lambda: [1, 2, 3, 4, 5, 6, 7, 8, 2**32]),
    ("int64_2**32", lambda: np.full(9, 2**32, dtype=np.int64)),
    ("uint64_2**63", lambda: np.full(9, 2**63, dtype=np.uint64)),
    ("generator", lambda: (t for t in range(9))),
]


def _outcome(fn):
    try:
        return fn()
    except (TypeError, ValueError) as e:
        return type(e)


@needs_native
@pytest.mark.parametrize(("name", "make"), TOKEN_INPUTS, ids=[n for n, _ in TOKEN_INPUTS])
def test_native_and_python_loops_accept_and_refuse_the_same_tokens(
    name: str, make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same input gives the same digests, or the same error, whichever loop runs:
    through hash_blocks and through BlockHasher (whose partial tail is checked too)."""

    def both():
        hasher = BlockHasher(BS, ROOT)
        return hash_blocks(ROOT, make(), BS, {1: "img"}), hasher.append(make(), {1: "img"})

    native = _outcome(both)
    monkeypatch.setattr(hashing, "_chain_native", None)
    python = _outcome(both)
    assert native == python, name
    if not isinstance(native, type):  # accepted: digests of the values themselves
        values = [int(t) for t in make()]
        assert native[0] == reference(ROOT, values, BS, {1: encode_extra_key("img")})


@pytest.mark.parametrize("bad", [0, -1, 2**20 + 1, True, 1.5, "4", None], ids=repr)
def test_block_size_is_validated_like_cache_config(bad) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(bad, ROOT)
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(ROOT, tokens(8), bad)


def test_a_refused_append_leaves_the_hasher_unchanged() -> None:
    hasher = BlockHasher(BS, ROOT)
    hasher.append(tokens(BS + 2, seed=20), {1: "img"})
    before = (list(hasher.hashes), hasher.num_tokens, dict(hasher._keys), list(hasher._pending))
    for bad_tokens, keys in [
        ([1, 2, -3], None),
        ([1, 2, 3, 4, 5, True], None),
        ([1, 2], {1: "other image"}),  # block 1 already has a key
        ([1, 2], {0: "late"}),  # block 0 was hashed without a key
        ([1, 2], {-1: "x"}),
        ([1, 2], {3: 1.5}),
    ]:
        with pytest.raises((TypeError, ValueError)):
            hasher.append(bad_tokens, keys)
        after = (
            list(hasher.hashes),
            hasher.num_tokens,
            dict(hasher._keys),
            list(hasher._pending),
        )
        assert after == before


# -- extra keys stay with their block ---------------------------------------------


@pytest.mark.parametrize("split", range(1, 2 * BS))
def test_extra_key_given_while_its_block_is_partial_is_used_when_it_completes(
    split: int,
) -> None:
    """The key arrives with the first tokens of block 1 (or earlier); the block is
    completed by later appends without keys, as decode does."""
    toks = tokens(3 * BS, seed=21)
    expected = hash_blocks(ROOT, toks, BS, {1: "image-A"})
    hasher = BlockHasher(BS, ROOT)
    hasher.append(toks[:split], {1: "image-A"})
    for t in toks[split:]:
        hasher.append([t])
    assert hasher.hashes == expected
    other = BlockHasher(BS, ROOT)
    other.append(toks[:split], {1: "image-B"})
    other.append(toks[split:])
    assert other.hashes[0] == expected[0]  # block 0 has no key
    assert other.hashes[1] != expected[1] and other.hashes[2] != expected[2]


def test_extra_key_for_a_block_not_started_yet_waits_for_it() -> None:
    toks = tokens(4 * BS, seed=22)
    hasher = BlockHasher(BS, ROOT)
    hasher.append(toks[:2], {3: "img"})
    hasher.append(toks[2:])
    assert hasher.hashes == hash_blocks(ROOT, toks, BS, {3: "img"})


def test_extra_key_given_again_is_a_no_op_and_a_late_key_is_refused() -> None:
    toks = tokens(3 * BS, seed=23)
    hasher = BlockHasher(BS, ROOT)
    hasher.append(toks[: 2 * BS], {1: "img"})
    hasher.append(toks[2 * BS :], {1: "img"})  # the same key again: fine
    assert hasher.hashes == hash_blocks(ROOT, toks, BS, {1: "img"})
    with pytest.raises(ValueError, match=r"extra_keys\[0\].*hashed without"):
        hasher.append([1], {0: "img"})
    with pytest.raises(ValueError, match=r"extra_keys\[1\].*another key"):
        hasher.append([1], {1: "img-2"})
