"""Process-stable, namespaced, chained hashes of full token blocks.

    root      = SHA256(b"fastkv/namespace\\0" + namespace)
    request   = root, or SHA256(root + b"\\x01" + request_key) with a LoRA id or salt
    digest[i] = SHA256(digest[i-1] || tokens of block i as little-endian uint32
                       [|| extra_i || uint32 len(extra_i)])

Equal token prefixes under the same namespace give equal digests in every process
(Python's `hash()` is never involved), a block's digest commits to every block
before it, and only full blocks are hashed.

Tokens (one definition, enforced by both loops): a 1-D numpy array of any integer
dtype and byte order, another buffer of integers (`array.array`), or a sequence of
ints; every token id in [0, 2**32). Booleans, floats, `bytes`, `bytearray` and `str`
are refused with TypeError, an id out of range with ValueError, and the whole input
is checked, the partial tail included. The per-block loop runs in the
`fastkv._chain_hash` C extension when it is built and in `_chain_py` otherwise; the
two accept and refuse the same inputs and produce identical bytes.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping, Sequence

import numpy as np

from fastkv.config import MAX_BLOCK_SIZE, check_int
from fastkv.metadata import DIGEST_BYTES, BlockHash

try:
    from fastkv._chain_hash import chain as _chain_native
except ImportError:  # built by `make install`; the pure-Python path is equivalent
    _chain_native = None

ExtraKey = bytes | str | int | Sequence["ExtraKey"]
Tokens = Sequence[int] | np.ndarray


def namespace_root(namespace: str) -> BlockHash:
    """The parent digest of block 0 for every request in `namespace`."""
    return BlockHash(hashlib.sha256(b"fastkv/namespace\0" + namespace.encode()).digest())


def request_root(root: BlockHash, request_key: ExtraKey | None = None) -> BlockHash:
    """Fold a request-wide key (LoRA adapter id, cache salt) into the chain root.

    Requests with different keys share no block hash, so they never share KV.
    """
    if request_key is None:
        return root
    return BlockHash(hashlib.sha256(root + b"\x01" + encode_extra_key(request_key)).digest())


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
    checked but not hashed.

    Args:
        parent: digest of the block before `tokens[0]` (or a request root).
        tokens: token ids (see the module docstring for what is accepted).
        block_size: tokens per block, in [1, 2**20].
        extra_keys: optional extra key per block index (multimodal hashes, ...),
            indexed from `first_block`; keys of blocks this call does not hash
            (earlier blocks, the partial tail) play no part. `BlockHasher` keeps
            keys across calls and never loses one.
        first_block: the block index of `tokens[0]` within its request.

    Raises:
        TypeError: `tokens` is not an integer sequence or array, or an extra key
            has an unsupported type.
        ValueError: a token id is out of range, `parent` is not a digest, or
            `block_size` is out of range.
    """
    check_block_size(block_size)
    tokens = _token_input(tokens)
    num_blocks = len(tokens) // block_size
    extras = None
    if extra_keys:
        extras = [
            encode_extra_key(extra_keys[first_block + i])
            if first_block + i in extra_keys
            else None
            for i in range(num_blocks)
        ]
    return _chain(parent, tokens, block_size, num_blocks, extras)


def check_block_size(block_size: object) -> None:
    """The bound CacheConfig puts on block_size, for hashers made without one."""
    check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)


def _chain(
    parent: bytes,
    tokens: Tokens,
    block_size: int,
    num_blocks: int,
    extras: list[bytes | None] | None,
) -> list[BlockHash]:
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
    """The reference loop: what `fastkv._chain_hash.chain` computes, in Python."""
    if len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent: must be {DIGEST_BYTES} bytes, got {len(parent)}")
    words = _token_words(tokens)
    if num_blocks * block_size > len(words):
        raise ValueError("num_blocks: more blocks than full blocks of tokens")
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


def _token_words(tokens: object) -> np.ndarray:
    """Every token of `tokens` as an int64 array, checked against the definition in
    the module docstring: the pure-Python loop's check (the C loop enforces the same
    rules item by item)."""
    tokens = _token_input(tokens)
    if isinstance(tokens, np.ndarray):
        words = tokens
        if words.size and (words.min() < 0 or words.max() >= 2**32):
            raise ValueError("tokens: a token id is outside [0, 2**32)")
        return words.astype(np.int64, copy=False)
    values = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool):
            raise TypeError(f"tokens: position {i}: booleans are not token ids")
        try:
            v = operator.index(t)  # refuses floats, strings, numpy bools
        except TypeError:
            raise TypeError(
                f"tokens: position {i}: expected an int, got {type(t).__name__}"
            ) from None
        if not 0 <= v < 2**32:
            raise ValueError("tokens: a token id is outside [0, 2**32)")
        values.append(v)
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _token_input(tokens: object) -> np.ndarray | Sequence[int]:
    """The container check shared by both loops (O(1), items are checked by the
    loops): a 1-D integer array in native byte order, or a list, tuple or range."""
    if isinstance(tokens, (list, tuple, range)):
        return tokens
    if isinstance(tokens, (bytes, bytearray, str)):
        raise TypeError(
            f"tokens: expected integer token ids, got {type(tokens).__name__} (text, not ids)"
        )
    if isinstance(tokens, np.ndarray) or _is_buffer(tokens):
        words = np.asarray(tokens)
        if words.ndim != 1 or words.dtype.kind not in "iu":
            raise TypeError(
                f"tokens: expected a 1-D integer array, got {words.dtype} {words.shape}"
            )
        if not words.dtype.isnative:
            words = words.astype(words.dtype.newbyteorder("="))
        return np.ascontiguousarray(words)
    if isinstance(tokens, Sequence):
        return list(tokens)
    raise TypeError(f"tokens: expected a sequence of ints, got {type(tokens).__name__}")


def _is_buffer(obj: object) -> bool:
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


class BlockHasher:
    """Incremental block hashes of one request: appending tokens hashes only the
    blocks they complete.

    Extra keys (multimodal hashes) belong to a block index and stay with it until
    the block is hashed, however many appends that takes; a key can be given again
    (the same value is a no-op), but a different key for a block, or a key for a
    block already hashed without it, is refused.

    Args:
        block_size: tokens per block, in [1, 2**20].
        root: `namespace_root(...)`, optionally through `request_root(...)`.

    Raises:
        ValueError: `block_size` out of range or `root` not a digest.
    """

    __slots__ = ("_keys", "_pending", "_root", "block_size", "hashes")

    def __init__(self, block_size: int, root: BlockHash) -> None:
        check_block_size(block_size)
        if not isinstance(root, bytes) or len(root) != DIGEST_BYTES:
            raise ValueError(f"root: must be {DIGEST_BYTES} bytes, got {root!r:.40}")
        self.block_size = block_size
        self.hashes: list[BlockHash] = []
        self._root = root
        self._pending: list[int] = []  # tokens of the partial block
        self._keys: dict[int, bytes] = {}  # block index -> encoded extra key

    def append(
        self, tokens: Tokens, extra_keys: Mapping[int, ExtraKey] | None = None
    ) -> list[BlockHash]:
        """Add tokens; return the digests of the blocks they complete.

        Args:
            tokens: the request's next token ids.
            extra_keys: extra key per absolute block index within the request; a
                key for a block that is still partial (or not started) is kept
                until that block is hashed.

        Raises:
            TypeError, ValueError: bad tokens or keys; nothing is added.
        """
        keys = self._merge_keys(extra_keys) if extra_keys else self._keys
        tokens = _token_input(tokens)
        if self._pending:
            if isinstance(tokens, np.ndarray):  # int64 keeps every id, bad ones too
                tokens = np.concatenate(
                    (np.asarray(self._pending, np.int64), tokens.astype(np.int64))
                )
            else:
                tokens = self._pending + list(tokens)
        first = len(self.hashes)
        num_blocks = len(tokens) // self.block_size
        extras = [keys.get(first + i) for i in range(num_blocks)] if keys else None
        parent = self.hashes[-1] if self.hashes else self._root
        # Checks every token, the partial tail included, before anything changes.
        new = _chain(parent, tokens, self.block_size, num_blocks, extras)
        rest = tokens[num_blocks * self.block_size :]
        self.hashes.extend(new)
        self._pending = rest.tolist() if isinstance(rest, np.ndarray) else list(rest)
        self._keys = keys
        return new

    def _merge_keys(self, extra_keys: Mapping[int, ExtraKey]) -> dict[int, bytes]:
        merged = dict(self._keys)
        for index, key in extra_keys.items():
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
                raise ValueError(f"extra_keys: block index {index!r} is not an int >= 0")
            index = int(index)
            encoded = encode_extra_key(key)
            known = merged.get(index)
            if known == encoded:
                continue
            if known is not None:
                raise ValueError(f"extra_keys[{index}]: block {index} already has another key")
            if index < len(self.hashes):
                raise ValueError(
                    f"extra_keys[{index}]: block {index} was hashed without this key "
                    f"({len(self.hashes)} blocks hashed); give a block's key no later "
                    "than the append that completes it"
                )
            merged[index] = encoded
        return merged

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size + len(self._pending)
