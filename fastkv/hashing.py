"""Process-stable, namespaced, chained hashes of full token blocks.

    root      = SHA256(b"fastkv/namespace\\0" + namespace)
    request   = root, or SHA256(root + b"\\x01" + request_key) with a LoRA id or salt
    digest[i] = SHA256(digest[i-1] || tokens of block i as little-endian uint32
                       [|| extra_i || uint32 len(extra_i)])

Equal token prefixes under the same namespace give equal digests in every process
(Python's `hash()` is never involved), a block's digest commits to every block
before it, and only full blocks are hashed. The per-block loop runs in the
`fastkv._chain_hash` C extension when it is built and in `_chain_py` otherwise; the
two produce identical bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

try:
    from fastkv._chain_hash import chain as _chain_native
except ImportError:  # built by `make install`; the pure-Python path is equivalent
    _chain_native = None

BlockHash = bytes
ExtraKey = bytes | str | int | Sequence["ExtraKey"]
Tokens = Sequence[int] | np.ndarray

DIGEST_BYTES = 32


def namespace_root(namespace: str) -> BlockHash:
    """The parent digest of block 0 for every request in `namespace`."""
    return hashlib.sha256(b"fastkv/namespace\0" + namespace.encode()).digest()


def request_root(root: BlockHash, request_key: ExtraKey | None = None) -> BlockHash:
    """Fold a request-wide key (LoRA adapter id, cache salt) into the chain root.

    Requests with different keys share no block hash, so they never share KV.
    """
    if request_key is None:
        return root
    return hashlib.sha256(root + b"\x01" + encode_extra_key(request_key)).digest()


def encode_extra_key(key: ExtraKey) -> bytes:
    """Canonical bytes of an extra key: type-tagged and length-prefixed."""
    if isinstance(key, bytes):
        return b"b" + len(key).to_bytes(4, "little") + key
    if isinstance(key, str):
        raw = key.encode()
        return b"s" + len(raw).to_bytes(4, "little") + raw
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        try:
            return b"i" + int(key).to_bytes(16, "little", signed=True)
        except OverflowError:
            raise ValueError(f"extra key: int {key} does not fit in 128 bits") from None
    if isinstance(key, (list, tuple)):
        parts = [encode_extra_key(k) for k in key]
        return b"l" + len(parts).to_bytes(4, "little") + b"".join(parts)
    raise TypeError(f"extra key: unsupported type {type(key).__name__}")


def hash_blocks(
    parent: BlockHash,
    tokens: Tokens,
    block_size: int,
    extra_keys: Mapping[int, ExtraKey] | None = None,
    first_block: int = 0,
) -> list[BlockHash]:
    """Chained digests of every full block of `tokens`; a trailing partial block is
    ignored.

    Args:
        parent: digest of the block before `tokens[0]` (or a request root).
        tokens: token ids in [0, 2**32), as a sequence or an integer array.
        block_size: tokens per block.
        extra_keys: optional extra key per block index (multimodal hashes, ...),
            indexed from `first_block`.
        first_block: the block index of `tokens[0]` within its request.

    Raises:
        ValueError: a token id is out of range or `parent` is not a digest.
    """
    num_blocks = len(tokens) // block_size
    extras = None
    if extra_keys:
        extras = [
            encode_extra_key(extra_keys[first_block + i])
            if first_block + i in extra_keys
            else None
            for i in range(num_blocks)
        ]
    if _chain_native is not None:
        return _chain_native(parent, tokens, block_size, num_blocks, extras)
    return _chain_py(parent, tokens, block_size, num_blocks, extras)


def _chain_py(
    parent: bytes,
    tokens: Tokens,
    block_size: int,
    num_blocks: int,
    extras: list[bytes | None] | None,
) -> list[BlockHash]:
    if len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent: must be {DIGEST_BYTES} bytes, got {len(parent)}")
    words = np.asarray(tokens[: num_blocks * block_size])
    _check_token_array(words)
    data = memoryview(words.astype("<u4", copy=False).tobytes())
    step = block_size * 4
    digests = []
    for b in range(num_blocks):
        h = hashlib.sha256(parent)
        h.update(data[b * step : (b + 1) * step])
        if extras is not None and extras[b] is not None:
            h.update(extras[b])
            h.update(len(extras[b]).to_bytes(4, "little"))
        parent = h.digest()
        digests.append(parent)
    return digests


def _check_token_array(words: np.ndarray) -> None:
    if not words.size:
        return
    if words.dtype.kind == "O":  # Python ints too large for any numpy integer type
        if not all(isinstance(t, int) for t in words.tolist()):
            raise TypeError("tokens: expected integers")
    elif words.dtype.kind not in "iu":
        raise TypeError(f"tokens: expected integers, got {words.dtype}")
    if words.min() < 0 or words.max() >= 2**32:
        raise ValueError("tokens: a token id is outside [0, 2**32)")


class BlockHasher:
    """Incremental block hashes of one request: appending tokens hashes only the
    blocks they complete.

    Args:
        block_size: tokens per block.
        root: `namespace_root(...)`, optionally through `request_root(...)`.
    """

    __slots__ = ("_pending", "_root", "block_size", "hashes")

    def __init__(self, block_size: int, root: BlockHash) -> None:
        if len(root) != DIGEST_BYTES:
            raise ValueError(f"root: must be {DIGEST_BYTES} bytes, got {len(root)}")
        self.block_size = block_size
        self.hashes: list[BlockHash] = []
        self._root = root
        self._pending: list[int] = []

    def append(
        self, tokens: Tokens, extra_keys: Mapping[int, ExtraKey] | None = None
    ) -> list[BlockHash]:
        """Add tokens; return the digests of the blocks they complete.

        `extra_keys` is indexed by absolute block index within the request.
        """
        if self._pending:
            more = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
            tokens = self._pending + more
        parent = self.hashes[-1] if self.hashes else self._root
        new = hash_blocks(parent, tokens, self.block_size, extra_keys, len(self.hashes))
        rest = tokens[len(new) * self.block_size :]
        rest = rest.tolist() if isinstance(rest, np.ndarray) else list(rest)
        _check_token_array(np.asarray(rest))  # the partial block is not hashed yet
        self.hashes.extend(new)
        self._pending = rest
        return new

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + len(self._pending)
