"""The disk backend's directory: a private one, opened and locked safely.

The directory must be owned by the process's effective uid and writable by no one
else; it is opened once with O_DIRECTORY | O_NOFOLLOW, and every file in it
relative to it, never through a symlink, only a regular file of this uid with one
link, made 0600 (fastkv.private_files' checks). The LOCK file holds the owning
backend's flock and pid. Also here: whether the filesystem takes O_DIRECT, and the
check of the metadata file (`fastkv-storage.json`) against the backend's layout.
Used by `fastkv.storage.local_disk` only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import secrets
from pathlib import Path

from fastkv import private_files

ALIGN = 4096  # O_DIRECT's unit: addresses, lengths and offsets in the file
LOCK_FILE = "LOCK"
FILE_MODE = 0o600


class StorageDirectoryLocked(RuntimeError):
    """Another backend (in this or another process) has the directory open."""


class StorageDirectoryUnsafe(ValueError):
    """The directory (or a file in it) could be read, changed or redirected by
    someone else: another owner, writable by others, a symlink, a hard link."""


def check_meta_matches(path: Path, raw: bytes, meta: dict) -> frozenset[int] | None:
    """The key ids the directory's metadata records (None: written before they
    were); raises ValueError saying how it differs from `meta`."""
    try:
        have = json.loads(raw)
    except ValueError as e:
        raise ValueError(
            f"directory: {path} is not valid JSON ({e}); use another directory"
        ) from None
    if not isinstance(have, dict):
        raise ValueError(
            f"directory: {path} holds a JSON {type(have).__name__}, not fastkv storage "
            "metadata (an object); use another directory"
        )
    if have.get("format") != meta["format"]:
        raise ValueError(
            f"directory: {path.parent} was written by fastkv storage format "
            f"{have.get('format')!r}, this backend reads format {meta['format']} only "
            "(the block header changed); use another directory or empty this one"
        )
    for field in ("slot_bytes", "segment_lengths"):
        if have.get(field) != meta[field]:
            raise ValueError(
                f"directory: {path.parent} holds blocks of another layout ({field} "
                f"{have.get(field)!r}, this backend needs {meta[field]!r}); use another "
                "directory"
            )
    extra = sorted(set(have) - set(meta) - {"key_ids"})
    if extra:
        raise ValueError(f"directory: {path} has unknown fields {extra}; use another directory")
    if "key_ids" not in have:
        return None
    ids = have["key_ids"]
    if not isinstance(ids, list) or not all(type(k) is int and 0 < k < 2**32 for k in ids):
        raise ValueError(
            f"directory: {path} field key_ids must be a list of key ids (ints in "
            f"[1, 2**32)), got {ids!r}; use another directory"
        )
    return frozenset(ids)


def open_private_directory(directory: Path) -> int:
    """Create `directory` (0700) if missing and open it without following a symlink.

    Raises:
        StorageDirectoryUnsafe: it is a symlink, not a directory, owned by another
            uid, or writable by group or others.
        OSError: it cannot be created or opened.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        return private_files.open_dir(directory, forbidden=0o022)
    except private_files.NotPrivate as e:
        raise StorageDirectoryUnsafe(
            f"directory: {directory}: {e}; the cache directory must be private: give "
            "the real path of a directory of this user's that no one else can write"
        ) from None


def open_file(dir_fd: int, directory: Path, name: str, flags: int, direct: bool = False) -> int:
    """Open `name` in the directory: never through a symlink, only a regular file of
    this uid with one link, made 0600.

    Raises:
        StorageDirectoryUnsafe: a symlink, another kind of file, another owner or a
            second hard link.
        OSError: as os.open (FileNotFoundError without O_CREAT).
    """
    if direct:
        flags |= os.O_DIRECT
    try:
        return private_files.open_file(
            name, flags, dir_fd=dir_fd, forbidden=0, single_link=True, set_mode=FILE_MODE
        )
    except private_files.NotPrivate as e:
        raise StorageDirectoryUnsafe(f"directory: {directory / name}: {e}") from None


def lock_directory(dir_fd: int, directory: Path, read_only: bool = False) -> int:
    """Lock the directory exclusively (its LOCK file; read-only, where no LOCK file
    can be made, the directory itself) and write this pid into LOCK.

    Raises:
        StorageDirectoryLocked: another backend holds it.
    """
    if read_only:
        try:
            fd = open_file(dir_fd, directory, LOCK_FILE, os.O_RDONLY)
        except FileNotFoundError:
            fd = os.dup(dir_fd)
    else:
        fd = open_file(dir_fd, directory, LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        except OSError:  # read-only: the directory itself is the lock
            holder = "unknown"
        os.close(fd)
        raise StorageDirectoryLocked(
            f"directory: {directory} is in use by another fastkv storage backend "
            f"(pid {holder}); give each process its own directory"
        ) from None
    if not read_only:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def probe_direct(dir_fd: int, directory: Path) -> bool:
    """Whether this filesystem takes O_DIRECT writes of aligned pages (probed on a
    file created exclusively under a name no one can have planted)."""
    name = f".direct-probe-{os.getpid()}-{secrets.token_hex(8)}"
    buf = mmap.mmap(-1, ALIGN)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(name, flags, FILE_MODE, dir_fd=dir_fd)
    except OSError:
        buf.close()
        return False
    try:
        return os.pwritev(fd, [buf], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        buf.close()
