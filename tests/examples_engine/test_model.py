"""The demo transformer is batch-invariant: a token's logits do not depend on the
other rows of its step, nor on how much of its prefix was read from the cache."""

from __future__ import annotations

import random

import numpy as np
import paddle
import pytest

from examples.engine.config import ModelConfig
from examples.engine.model import SeqRows, TinyTransformer

BS = 16


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(ModelConfig())


def caches(dtype: str, blocks: int = 128):
    shape = [blocks, 2, BS, 64]
    return [
        (paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype)) for _ in range(3)
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", range(4))
def test_cached_prefix_and_batching_give_bitwise_identical_logits(
    model: TinyTransformer, dtype: str, seed: int
) -> None:
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    n = r.randint(2, 200)
    cut = r.randint(1, n - 1)
    tokens = rng.integers(0, 4096, n).tolist()
    alone = model.forward([SeqRows(tokens, 0, list(range(13)))], caches(dtype), BS)

    kv = caches(dtype)
    model.forward([SeqRows(tokens[:cut], 0, list(range(20, 33)))], kv, BS)  # the prefix
    others = [
        SeqRows(
            rng.integers(0, 4096, r.randint(1, 40)).tolist(),
            0,
            [40 + 3 * i + j for j in range(3)],
        )
        for i in range(r.randint(1, 3))
    ]
    batch = [*others, SeqRows(tokens[cut:], cut, list(range(20, 33)))]
    r.shuffle(batch)
    logits = model.forward(batch, kv, BS)
    mine = next(i for i, s in enumerate(batch) if s.start == cut)
    np.testing.assert_array_equal(logits[mine], alone[0])


def test_weights_come_from_the_seed() -> None:
    a = TinyTransformer(ModelConfig(seed=3))
    b = TinyTransformer(ModelConfig(seed=3))
    c = TinyTransformer(ModelConfig(seed=4))
    seq = [SeqRows([1, 2, 3], 0, [0])]
    np.testing.assert_array_equal(
        a.forward(seq, caches("float32", 2), BS), b.forward(seq, caches("float32", 2), BS)
    )
    assert not np.array_equal(
        a.forward(seq, caches("float32", 2), BS), c.forward(seq, caches("float32", 2), BS)
    )


def test_wait_for_layer_is_called_before_each_layer(model: TinyTransformer) -> None:
    calls: list[int] = []
    model.forward([SeqRows([5, 6], 0, [0])], caches("float32", 2), BS, calls.append)
    assert calls == [0, 1, 2]


def test_head_shards_all_gathered_give_the_unsharded_bits() -> None:
    """Two ranks, each with half the heads and its own KV cache, exchanging their
    attention outputs every layer, produce exactly the single rank's logits and
    each keeps exactly its heads of the single rank's KV."""
    import threading

    config = ModelConfig()
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 4096, 37).tolist()
    rest = rng.integers(0, 4096, 20).tolist()
    whole = TinyTransformer(config)
    kv = caches("bfloat16")
    whole.forward([SeqRows(prefix, 0, list(range(4)))], kv, BS)
    expected = whole.forward([SeqRows(rest, 37, list(range(4)))], kv, BS)

    tp = 2
    barrier = threading.Barrier(tp, timeout=30)
    slots: list[object] = [None] * tp
    logits: list[object] = [None] * tp
    shard_kv = [
        [
            (
                paddle.zeros([128, 1, BS, 64], "bfloat16"),
                paddle.zeros([128, 1, BS, 64], "bfloat16"),
            )
            for _ in range(3)
        ]
        for _ in range(tp)
    ]

    def rank(r: int) -> None:
        model = TinyTransformer(config, tp_rank=r, tp_size=tp)

        def gather(local: paddle.Tensor) -> paddle.Tensor:
            slots[r] = local.numpy()
            barrier.wait()
            full = np.concatenate(slots, axis=1)
            barrier.wait()  # everyone has read before the next layer writes
            return paddle.to_tensor(full)

        try:
            model.forward([SeqRows(prefix, 0, list(range(4)))], shard_kv[r], BS, None, gather)
            logits[r] = model.forward(
                [SeqRows(rest, 37, list(range(4)))], shard_kv[r], BS, None, gather
            )
        except Exception as e:
            barrier.abort()  # the other rank stops waiting
            logits[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank hung"
    for r in range(tp):
        assert not isinstance(logits[r], Exception), logits[r]
        np.testing.assert_array_equal(logits[r], expected)
        for layer in range(3):
            for whole_t, shard_t in zip(kv[layer], shard_kv[r][layer], strict=True):
                np.testing.assert_array_equal(
                    shard_t[:4].astype("float32").numpy(),
                    whole_t[:4, r : r + 1].astype("float32").numpy(),
                )


def test_a_shard_needs_a_gather_and_a_valid_rank() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        TinyTransformer(ModelConfig(), tp_size=3)
    with pytest.raises(ValueError, match="tp_rank"):
        TinyTransformer(ModelConfig(), tp_rank=2, tp_size=2)
    shard = TinyTransformer(ModelConfig(), tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="gather_heads"):
        shard.forward([SeqRows([1, 2], 0, [0])], caches("float32", 2), BS)
