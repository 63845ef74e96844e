"""A small deterministic decoder-only transformer whose attention runs on the
paged KV cache of a fastkv CacheController.

Batch-invariant on Paddle's CPU kernels, so runs with and without the cache can be
compared bitwise: a token's hidden states, KV and logits do not depend on how many
other rows share a step, nor on how much of its prefix came from the cache. The
property is empirical (tests/engine/test_model.py checks it); three measures give
it:
- Every tensor of rows is padded to a multiple of `ROW_TILE` rows. Paddle's CPU
  matrix kernel treats ragged row tails differently, and elementwise kernels
  round differently in their scalar tail loop than in their vector body.
- RMSNorm divides by `sqrt`, which is correctly rounded everywhere, instead of
  using `rsqrt`, whose vector and scalar versions differ in the last bit.
- Attention runs in float64. A query row sees the same keys with and without the
  cache but a different number of masked ones, and in float32 the softmax sum and
  the product with V change with that length; in float64 they were measured not
  to, and the result rounds to the same float32.
GPU kernels give no such guarantee: there the demo's verdict still needs equal
tokens but falls back to its 1e-5 logits tolerance.

Tensor parallelism: rank r of `tp_size` projects and attends over its share of
the heads only (column slices of the Q, K and V weights; its KV cache holds
`num_kv_heads / tp_size` heads), then the ranks all-gather their attention outputs
so every rank goes on with the whole activation; the output projection, the MLP
and the logits are replicated. On Paddle's CPU kernels a column slice of a
product equals the product by the sliced weight bit for bit, and each head's
attention is computed alone, so every tp_size gives the same bits (also
empirical; the engine tests check it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import paddle

from examples.engine.config import ModelConfig

ROW_TILE = 16


@dataclass(slots=True)
class SeqRows:
    """One request's rows in a forward pass."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]


def matmul(x: paddle.Tensor, w: paddle.Tensor, transpose_y: bool = False) -> paddle.Tensor:
    """`x @ w` over the last two dims, with the rows of `x` padded to ROW_TILE."""
    rows = x.shape[-2]
    pad = -rows % ROW_TILE
    if pad:
        shape = [*x.shape[:-2], pad, x.shape[-1]]
        x = paddle.concat([x, paddle.zeros(shape, dtype=x.dtype)], axis=-2)
    out = paddle.matmul(x, w, transpose_y=transpose_y)
    return out[..., :rows, :] if pad else out


class TinyTransformer:
    """Random weights from `config.seed`; RMSNorm, rotary positions, grouped-query
    attention, gated SiLU MLP; float32 compute, KV stored in the cache's dtype.

    Args:
        config: sizes and seed.
        device: Paddle place string for the weights ("cpu", "gpu:0").
        tp_rank, tp_size: this rank's share of the heads (see the module docstring);
            every rank draws the same weights from the seed and keeps its slices.

    Raises:
        ValueError: tp_size does not divide the head counts, or tp_rank is out of
            range.
    """

    def __init__(
        self, config: ModelConfig, device: str = "cpu", tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        c = config
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size: must be an int >= 1, got {tp_size!r}")
        if c.num_heads % tp_size or c.num_kv_heads % tp_size:
            raise ValueError(
                f"tp_size: {tp_size} must divide num_heads ({c.num_heads}) and "
                f"num_kv_heads ({c.num_kv_heads})"
            )
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int):
            raise ValueError(f"tp_rank: must be an int in [0, {tp_size}), got {tp_rank!r}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: must be an int in [0, {tp_size}), got {tp_rank!r}")
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_heads = c.num_heads // tp_size  # this rank's
        self.num_kv_heads = c.num_kv_heads // tp_size
        rng = np.random.RandomState(c.seed)

        def param(*shape: int, scale: float) -> paddle.Tensor:
            return paddle.to_tensor(
                (rng.standard_normal(shape) * scale).astype(np.float32), place=device
            )

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def heads(weight: paddle.Tensor, share: int) -> paddle.Tensor:
            """This rank's columns (its heads) of a projection `[hidden, heads *
            head_dim]`, as a tensor of their own."""
            if tp_size == 1:
                return weight
            cols = weight.numpy()[:, tp_rank * share : (tp_rank + 1) * share]
            return paddle.to_tensor(np.ascontiguousarray(cols), place=device)

        q_share, kv_share = q_dim // tp_size, kv_dim // tp_size
        self.embed = param(c.vocab_size, c.hidden, scale=1.0)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "wq": heads(param(c.hidden, q_dim, scale=1 / math.sqrt(c.hidden)), q_share),
                    "wk": heads(
                        param(c.hidden, kv_dim, scale=1 / math.sqrt(c.hidden)), kv_share
                    ),
                    "wv": heads(
                        param(c.hidden, kv_dim, scale=1 / math.sqrt(c.hidden)), kv_share
                    ),
                    "wo": param(q_dim, c.hidden, scale=1 / math.sqrt(q_dim)),
                    "wg": param(c.hidden, c.ffn, scale=1 / math.sqrt(c.hidden)),
                    "wu": param(c.hidden, c.ffn, scale=1 / math.sqrt(c.hidden)),
                    "wd": param(c.ffn, c.hidden, scale=1 / math.sqrt(c.ffn)),
                    "norm1": param(c.hidden, scale=0.1) + 1.0,
                    "norm2": param(c.hidden, scale=0.1) + 1.0,
                }
            )
        self.final_norm = param(c.hidden, scale=0.1) + 1.0
        self.lm_head = param(c.hidden, c.vocab_size, scale=1 / math.sqrt(c.hidden))
        inv_freq = 1.0 / c.rope_base ** (np.arange(0, c.head_dim, 2) / c.head_dim)
        angles = np.outer(np.arange(c.max_positions), inv_freq)
        self.cos = paddle.to_tensor(np.cos(angles).astype(np.float32), place=device)
        self.sin = paddle.to_tensor(np.sin(angles).astype(np.float32), place=device)
        self.device = device

    def forward(
        self,
        seqs: Sequence[SeqRows],
        kv_caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        block_size: int,
        wait_for_layer: Callable[[int], None] | None = None,
        gather_heads: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Compute and store KV for every sequence's tokens, and return the logits
        of each sequence's last token, `[len(seqs), vocab]` float32.

        Args:
            seqs: the rows of this step, per request.
            kv_caches: (K, V) cache tensors per layer, `[blocks, kv_heads,
                block_size, head_dim]` (this rank's KV heads).
            block_size: tokens per block.
            wait_for_layer: called before layer L touches the cache (the swap-in's
                per-layer wait).
            gather_heads: with tp_size > 1, called once per layer with this rank's
                attention output `[rows, heads * head_dim]` (its heads); returns
                every rank's, concatenated in rank order `[rows, num_heads *
                head_dim]`: the all-gather between the ranks.
            after_layer: called once layer L's K and V of every sequence are in the
                cache (prefill/decode disaggregation sends them from there).

        Raises:
            ValueError: tp_size > 1 without `gather_heads`.
        """
        if self.tp_size > 1 and gather_heads is None:
            raise ValueError(
                f"gather_heads: required with tp_size {self.tp_size} (this rank holds "
                f"{self.num_heads} of {self.config.num_heads} heads)"
            )
        c = self.config
        ids = [t for s in seqs for t in s.tokens]
        positions = np.concatenate(
            [np.arange(s.start, s.start + len(s.tokens)) for s in seqs]
        ).astype(np.int64)
        pad = -len(ids) % ROW_TILE  # filler rows, see the module docstring
        ids += [0] * pad
        positions = np.concatenate([positions, np.zeros(pad, np.int64)])
        pos = paddle.to_tensor(positions, place=self.device)
        x = paddle.index_select(self.embed, paddle.to_tensor(ids, place=self.device), axis=0)
        cos = paddle.index_select(self.cos, pos, axis=0)
        sin = paddle.index_select(self.sin, pos, axis=0)
        for layer, w in enumerate(self.layers):
            h = _rms_norm(x, w["norm1"])
            q = matmul(h, w["wq"]).reshape([-1, self.num_heads, c.head_dim])
            k = matmul(h, w["wk"]).reshape([-1, self.num_kv_heads, c.head_dim])
            v = matmul(h, w["wv"]).reshape([-1, self.num_kv_heads, c.head_dim])
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            if wait_for_layer is not None:
                wait_for_layer(layer)
            k_cache, v_cache = kv_caches[layer]
            outs = []
            row = 0
            for s in seqs:
                n = len(s.tokens)
                _write_kv(k_cache, k[row : row + n], s, block_size)
                _write_kv(v_cache, v[row : row + n], s, block_size)
                outs.append(self._attend(q[row : row + n], k_cache, v_cache, s, block_size))
                row += n
            if after_layer is not None:
                after_layer(layer)
            if pad:
                outs.append(paddle.zeros([pad, self.num_heads * c.head_dim], dtype=x.dtype))
            attention = paddle.concat(outs, axis=0)
            if gather_heads is not None and self.tp_size > 1:
                attention = gather_heads(attention)
            x = x + matmul(attention, w["wo"])
            h = _rms_norm(x, w["norm2"])
            gate = paddle.nn.functional.silu(matmul(h, w["wg"]))
            x = x + matmul(gate * matmul(h, w["wu"]), w["wd"])
        ends = np.cumsum([len(s.tokens) for s in seqs]) - 1
        ends = np.concatenate([ends, np.full(-len(ends) % ROW_TILE, ends[-1])])
        last = paddle.index_select(x, paddle.to_tensor(ends, place=self.device), axis=0)
        logits = matmul(_rms_norm(last, self.final_norm), self.lm_head)
        return logits.numpy()[: len(seqs)]

    def _attend(
        self,
        q: paddle.Tensor,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        s: SeqRows,
        block_size: int,
    ) -> paddle.Tensor:
        """Causal attention of the rows `q` (positions s.start..) over every key of
        the sequence so far, read back from the paged cache."""
        c = self.config
        n = q.shape[0]
        end = s.start + n
        blocks = paddle.to_tensor(
            list(s.block_table[: -(-end // block_size)]), dtype="int64", place=self.device
        )
        keys = _gather(k_cache, blocks, end)  # [kv_heads, end, head_dim], float64
        values = _gather(v_cache, blocks, end)
        group = self.num_heads // self.num_kv_heads
        keys = paddle.repeat_interleave(keys, group, axis=0)
        values = paddle.repeat_interleave(values, group, axis=0)
        qh = q.transpose([1, 0, 2]).astype("float64")  # [heads, n, head_dim]
        scores = matmul(qh, keys, transpose_y=True) * (1.0 / math.sqrt(c.head_dim))
        key_pos = np.arange(end)[None, :]
        query_pos = np.arange(s.start, end)[:, None]
        mask = np.where(key_pos <= query_pos, 0.0, -np.inf)
        scores = scores + paddle.to_tensor(mask, place=self.device)
        probs = paddle.nn.functional.softmax(scores, axis=-1)
        out = matmul(probs, values).astype("float32")  # [heads, n, head_dim]
        return out.transpose([1, 0, 2]).reshape([n, self.num_heads * c.head_dim])


def _rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float = 1e-6) -> paddle.Tensor:
    return x / paddle.sqrt((x * x).mean(axis=-1, keepdim=True) + eps) * weight


def _rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _write_kv(cache: paddle.Tensor, kv: paddle.Tensor, s: SeqRows, block_size: int) -> None:
    """Store rows `kv` ([n, kv_heads, head_dim], positions s.start..) in the cache."""
    values = kv.transpose([1, 0, 2]).astype(cache.dtype)  # [kv_heads, n, head_dim]
    end = s.start + kv.shape[0]
    pos = s.start
    while pos < end:
        index, offset = divmod(pos, block_size)
        stop = min(end, (index + 1) * block_size)
        cache[s.block_table[index], :, offset : offset + stop - pos, :] = values[
            :, pos - s.start : stop - s.start, :
        ]
        pos = stop


def _gather(cache: paddle.Tensor, blocks: paddle.Tensor, length: int) -> paddle.Tensor:
    """Positions 0..length-1 of one sequence as float64 `[kv_heads, length, head_dim]`."""
    picked = paddle.index_select(cache, blocks, axis=0)  # [nblk, kv_heads, bs, head_dim]
    nblk, heads, bs, dim = picked.shape
    flat = picked.transpose([1, 0, 2, 3]).reshape([heads, nblk * bs, dim])
    return flat[:, :length, :].astype("float64")
