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
