"""Keys that authenticate stored blocks, and how a deployment provides them.

A block's header carries a 128-bit tag, keyed by a secret only the deployment's own
processes hold: HMAC-SHA256 over the header (key, layout, length, sequence number,
key id) and a GMAC (a keyed universal hash, GHASH) of the payload, which is never
stored (fastkv/storage/_disk_io.c says why that is safe and fast). A reader
recomputes it; a block whose tag does not verify is a counted miss, never served.
The CRC-32C of an unauthenticated block catches accidents only: anyone who can
write the store can forge one.

Provisioning: a key file, UTF-8 text of at most 1 MiB, one secret per line as hex
(at least 32 bytes, 64 hex digits; `#` starts a comment), readable by the serving
user alone (a regular file, owned by the process's effective uid, mode 0600 or
stricter, not a symlink). Point
`FASTKV_STORAGE_KEY_FILE` at it (workers inherit it) or pass
`StorageAuth.from_file(path)` to a backend. Make one with
`python -c "import secrets; print(secrets.token_hex(32))" > keys && chmod 600 keys`.

Rotation: the first secret signs every write; every secret in the file verifies
reads. Put a new secret on the first line and keep the old one below it, restart
the workers (blocks written under the old secret stay readable); once those have
aged out, or whenever the old secret must stop being trusted, remove its line and
restart again: its blocks become misses. The disk backend keeps their slots (a key
file rolled back by mistake loses nothing) until told to give them up once with
`FASTKV_STORAGE_RECLAIM=1`, and refuses a directory whose blocks no key of the
ring verifies (fastkv.storage.disk_keys).
Each secret is known by a 32-bit key id derived from it (stored in each header),
so a reader finds the right key without trying them all.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from fastkv import private_files
from fastkv.storage import _disk_io

ENV_KEY_FILE = "FASTKV_STORAGE_KEY_FILE"
MIN_SECRET_BYTES = 32
MAX_KEY_FILE_BYTES = 1 << 20
"""A key file larger than this is refused (a few secrets and comments take a few
hundred bytes; anything this large is the wrong file)."""
_MAC_KEY_LABEL = b"fastkv/storage-block-mac/v1"
_GMAC_KEY_LABEL = b"fastkv/storage-payload-hash/v1"
_KEY_ID_LABEL = b"fastkv/storage-key-id/v1"


class StorageAuth:
    """A key ring: the first secret signs writes, all of them verify reads.

    Args:
        secrets: one or more secrets of at least 32 bytes, newest first.

    Raises:
        ValueError: no secret, a secret too short or not bytes, two secrets with the
            same key id (the same secret twice).
    """

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if (
            isinstance(secrets, (bytes, str))
            or not isinstance(secrets, Sequence)
            or not secrets
        ):
            raise ValueError("secrets: must be a non-empty sequence of bytes (newest first)")
        ids: list[int] = []
        ring = bytearray()
        for i, secret in enumerate(secrets):
            if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
                got = (
                    f"{len(secret)} bytes"
                    if isinstance(secret, bytes)
                    else type(secret).__name__
                )
                raise ValueError(
                    f"secrets[{i}]: must be bytes of length >= {MIN_SECRET_BYTES}, got {got}"
                )
            key_id = _key_id(secret)
            if key_id in ids:
                raise ValueError(
                    f"secrets[{i}]: the same secret as secrets[{ids.index(key_id)}]"
                )
            ids.append(key_id)
            ring += key_id.to_bytes(4, "little")
            ring += hmac.new(secret, _MAC_KEY_LABEL, hashlib.sha256).digest()
            gmac_key = hmac.new(secret, _GMAC_KEY_LABEL, hashlib.sha256).digest()[:16]
            ring += gmac_key + _disk_io.gmac_subkeys(gmac_key)
        assert len(ring) == _disk_io.RING_ENTRY * len(secrets)
        self.key_ids: tuple[int, ...] = tuple(ids)
        self._ring = bytes(ring)

    @property
    def ring(self) -> bytes:
        """The ring as `_disk_io` takes it: entries of a u32 key id, the 32-byte HMAC
        key, the 16-byte GMAC (AES-128) key and that key's H and mask (16 bytes
        each: E(0) and E(J0), precomputed for the native GHASH)."""
        return self._ring

    @property
    def write_key_id(self) -> int:
        return self.key_ids[0]

    def __repr__(self) -> str:  # never the secrets
        ids = ", ".join(f"{k:#010x}" for k in self.key_ids)
        return f"StorageAuth(key ids {ids})"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> StorageAuth:
        """Read a key file (see the module docstring).

        Raises:
            ValueError: the file is a symlink, not a regular file, not owned by this
                process's effective uid, readable or writable by group or others,
                larger than `MAX_KEY_FILE_BYTES`, not UTF-8 text (the message gives
                the first bad byte's offset), or holds no valid secret (the message
                names the file and line).
            OSError: it cannot be opened or read.
        """
        path = Path(path)
        try:
            fd = private_files.open_file(path, os.O_RDONLY)
        except private_files.NotPrivate as e:
            raise ValueError(
                f"key file: {path}: {e}; give a regular file only this user can read "
                "or change (chmod 600)"
            ) from None
        try:
            raw = _read_limited(fd, MAX_KEY_FILE_BYTES + 1)
        finally:
            os.close(fd)
        if len(raw) > MAX_KEY_FILE_BYTES:
            raise ValueError(
                f"key file: {path} is larger than {MAX_KEY_FILE_BYTES} bytes, the most a "
                "key file may hold (one hex secret per line): is it the right file?"
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"key file: {path} is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}): "
                "a key file holds hex secrets, one per line, not raw key bytes; write "
                'one with: python -c "import secrets; print(secrets.token_hex(32))"'
            ) from None
        return cls(_parse_key_file(path, text))

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> StorageAuth | None:
        """The ring of the file `FASTKV_STORAGE_KEY_FILE` names, or None when unset.

        Raises:
            ValueError, OSError: as `from_file`.
        """
        path = (os.environ if env is None else env).get(ENV_KEY_FILE, "")
        return cls.from_file(path) if path else None


NO_AUTH_RING = b""
"""The ring of a backend without a secret: blocks carry a CRC, no tag."""


def ring_of(auth: StorageAuth | None) -> bytes:
    return NO_AUTH_RING if auth is None else auth.ring


def _parse_key_file(path: Path, text: str) -> list[bytes]:
    """The secrets of a key file's `text`, in order (see the module docstring).

    Raises:
        ValueError: a line is not hex or too short, or there is no secret (the
            message names the file and line).
    """
    secrets: list[bytes] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            secret = bytes.fromhex(line)
        except ValueError:
            raise ValueError(f"key file: {path} line {n} is not hex") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"key file: {path} line {n} holds {len(secret)} bytes, "
                f"at least {MIN_SECRET_BYTES} needed"
            )
        secrets.append(secret)
    if not secrets:
        what = "is empty" if not text.strip() else "holds only comments and blank lines"
        raise ValueError(
            f"key file: {path} {what}: no secret (one hex secret of at least "
            f"{MIN_SECRET_BYTES} bytes per line expected)"
        )
    return secrets


def _read_limited(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes of the file open at `fd`, from its start."""
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        chunk = os.read(fd, limit - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _key_id(secret: bytes) -> int:
    key_id = int.from_bytes(
        hmac.new(secret, _KEY_ID_LABEL, hashlib.sha256).digest()[:4], "little"
    )
    return key_id or 1  # 0 means "not authenticated"


__all__ = ["ENV_KEY_FILE", "MAX_KEY_FILE_BYTES", "NO_AUTH_RING", "StorageAuth", "ring_of"]
