"""The stand-in model's arithmetic: what KV every position must hold, and the next
token, both functions of the token prefix only.

Position p of a sequence has the digest d[p] = sha256(d[p-1] || token p). Its KV on
(layer, role, tensor-parallel rank) is `shake_128(d[p] || layer, role, rank)`
stretched to the bytes one position takes in one cache tensor (all of the rank's
heads). The token sampled after position p is drawn from d[p]; a sequence ends
with EOS once it has `max_tokens` outputs. So two requests sharing a prefix share
its KV bytes (prefix caching can serve them), and any byte read back that differs
from these is a wrong-KV defect, whoever made it.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

EOS = 2
FIRST_TOKEN = 3  # tokens the model samples: [FIRST_TOKEN, VOCAB)
VOCAB = 1000


def prompt(seed: int, length: int) -> list[int]:
    """A reproducible prompt of `length` tokens the model could have sampled."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(length)]


def next_digest(parent: bytes | None, token: int) -> bytes:
    """The digest of a prefix extended by `token` (parent None: the first token)."""
    seed = parent if parent is not None else b"fastkv-fd-real"
    return hashlib.sha256(seed + int(token).to_bytes(8, "little", signed=True)).digest()


def sampled_token(digest: bytes) -> int:
    """The token the model samples after the position with this digest."""
    return FIRST_TOKEN + int.from_bytes(digest[:4], "little") % (VOCAB - FIRST_TOKEN)


def expected_continuation(prompt: list[int], max_tokens: int) -> list[int]:
    """The outputs a request must end with: `max_tokens` tokens, the last EOS."""
    digest = None
    for token in prompt:
        digest = next_digest(digest, token)
    out: list[int] = []
    while len(out) < max_tokens:
        assert digest is not None
        token = EOS if len(out) == max_tokens - 1 else sampled_token(digest)
        out.append(token)
        digest = next_digest(digest, token)
    return out


class Sequence:
    """One request's tokens on a worker, with their digests and the KV bytes each
    position must hold (computed once per position, extended as tokens come).

    Args:
        num_layers: model layers.
        num_roles: cache tensors per layer (key, value).
        rank: tensor-parallel rank (part of every KV value).
        shape: (heads, bytes per head) of one position in one cache tensor.
    """

    def __init__(self, num_layers: int, num_roles: int, rank: int, shape: tuple[int, int]):
        self.num_layers = num_layers
        self.num_roles = num_roles
        self.rank = rank
        self.shape = shape
        self.tokens: list[int] = []
        self.digests: list[bytes] = []
        self._kv = np.empty((0, num_layers, num_roles, *shape), np.uint8)

    def set_tokens(self, tokens: list[int]) -> None:
        """Take the sequence as the scheduler sent it (a prefix of it may already
        be known: digests are kept for the common part)."""
        keep, common = 0, min(len(self.tokens), len(tokens))
        while keep < common and self.tokens[keep] == tokens[keep]:
            keep += 1
        self.tokens = list(tokens)
        del self.digests[keep:]
        self._kv = self._kv[:keep]
        self._extend()

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self._extend()

    def kv(self, positions: np.ndarray, layer: int, role: int) -> np.ndarray:
        """The bytes positions must hold in (layer, role): [n, heads, bytes]."""
        return self._kv[positions, layer, role]

    def next_token(self, max_tokens: int, num_outputs: int) -> int:
        """The token sampled after the last position, given `num_outputs` so far."""
        return EOS if num_outputs + 1 >= max_tokens else sampled_token(self.digests[-1])

    def _extend(self) -> None:
        start = len(self.digests)
        if start == len(self.tokens):
            return
        heads, nbytes = self.shape
        per = heads * nbytes
        shape = (len(self.tokens) - start, self.num_layers, self.num_roles, heads, nbytes)
        rows = np.empty(shape, np.uint8)
        parent = self.digests[-1] if self.digests else None
        for i, token in enumerate(self.tokens[start:]):
            parent = next_digest(parent, token)
            self.digests.append(parent)
            for layer in range(self.num_layers):
                for role in range(self.num_roles):
                    key = parent + bytes((layer, role, self.rank))
                    raw = hashlib.shake_128(key).digest(per)
                    rows[i, layer, role] = np.frombuffer(raw, np.uint8).reshape(heads, nbytes)
        self._kv = np.concatenate([self._kv, rows])
