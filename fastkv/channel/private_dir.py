"""The channel's private directory and what lives in it: names, the secret, epochs.

- **Where.** Everything lives in one private directory (`runtime_dir()`): mode 0700,
  owned by the engine's uid, opened without following symlinks; a directory owned by
  another user, reachable by others, or a symlink is refused, never repaired. The
  scheduler listens on `<name>.sock` there (AF_UNIX SOCK_SEQPACKET), holds
  `<name>.lock` (flock) while it is bound, with its pid and epoch written in it, and
  the secret may live in `<name>.key`. Another uid cannot reach the socket at all
  (the kernel refuses the path lookup), so it cannot queue, flood or read anything;
  another mount namespace does not see the path (unlike the abstract names of
  earlier versions, which are shared by every process of the network namespace).
- **Secret.** `$FASTKV_RESULTS_SECRET` (at least 16 bytes) when the engine and its
  workers share it through their environment; otherwise 32 random bytes in
  `<name>.key` (0600, made by the receiver before it binds, deleted when it closes;
  senders only read it, again at every connect).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile

from fastkv import private_files

RUNTIME_DIR_ENV = "FASTKV_RUNTIME_DIR"
SECRET_ENV = "FASTKV_RESULTS_SECRET"
MIN_SECRET_BYTES = 16
KEY_FILE_BYTES = 32
EPOCH_BYTES = 16
MAX_NAME_BYTES = 64
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_name(name: str) -> str:
    """`name` if it can name a channel: 1-64 characters of [A-Za-z0-9._-], not
    starting with a dot (it becomes file names in the private directory).

    Raises:
        ValueError: the message names the rule broken.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_BYTES:
        raise ValueError(f"name: {len(name)} characters, at most {MAX_NAME_BYTES}")
    if name.startswith(".") or not set(name) <= _NAME_CHARS:
        raise ValueError(
            f"name: {name!r} must be letters, digits, '.', '_' or '-' and not start with '.'"
        )
    return name


def runtime_dir() -> str:
    """The private directory both ends of a deployment use, the same for both as long
    as they share uid and environment:
    $FASTKV_RUNTIME_DIR, else $XDG_RUNTIME_DIR/fastkv when XDG_RUNTIME_DIR is this
    user's private directory, else /run/fastkv for root (no other user can create
    names in /run), else <tmp>/fastkv-<uid> (where another user could squat the name
    first; the channel then refuses to start and says to set $FASTKV_RUNTIME_DIR).
    """
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return explicit
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if (
            st is not None
            and st.st_uid == uid
            and stat.S_ISDIR(st.st_mode)
            and not st.st_mode & 0o077
        ):
            return os.path.join(xdg, "fastkv")
    if uid == 0:
        try:
            st = os.stat("/run")
        except OSError:
            st = None
        if (
            st is not None
            and stat.S_ISDIR(st.st_mode)
            and st.st_uid == 0
            and not st.st_mode & 0o022
            and os.access("/run", os.W_OK)
        ):
            return "/run/fastkv"
    return os.path.join(tempfile.gettempdir(), f"fastkv-{uid}")


def _refuse(path: str, why: str) -> PermissionError:
    return PermissionError(
        errno.EACCES,
        f"results channel directory {path!r}: {why}; refusing it (another user could "
        f"read, forge or block results). Set ${RUNTIME_DIR_ENV} to a directory only "
        "this user can reach, the same for the engine and its workers",
    )


def open_private_dir(path: str) -> int:
    """Make (mode 0700) or open the channel directory `path`; return an O_DIRECTORY
    fd of it. No other user may be able to redirect the path to it: every directory
    and symbolic link above it must be owned by root or this uid, and a directory
    others can write must be sticky (`private_files.check_path`).

    Raises:
        PermissionError: `path` is a symlink, owned by another uid, or reachable by
            group or others; or a component above it is unsafe. The message says which.
        OSError: it cannot be made (e.g. the parent does not exist).
    """
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"runtime_dir: must be an absolute path, got {path!r}")
    try:
        return private_files.open_dir(path, uid=os.getuid())
    except private_files.NotPrivate as e:
        raise _refuse(path, str(e)) from None


def socket_address(dir_fd: int, filename: str) -> str:
    """A socket address for `filename` in the directory `dir_fd` (resolved through
    the fd itself: no path to swap, no sun_path length limit)."""
    return f"/proc/self/fd/{dir_fd}/{filename}"


def open_private_file(dir_fd: int, filename: str, flags: int, what: str) -> int:
    """Open `filename` in the directory `dir_fd` (never through a symlink; O_CREAT
    makes it 0600) and check it is a regular file of this uid no one else can reach.

    Raises:
        PermissionError: it is not; the message names `what` and says why.
        OSError: as `os.open` (FileNotFoundError without O_CREAT).
    """
    try:
        return private_files.open_file(filename, flags, dir_fd=dir_fd, uid=os.getuid())
    except private_files.NotPrivate as e:
        raise PermissionError(
            errno.EACCES,
            f"results channel {what}: {e}; it must be a regular file of uid "
            f"{os.getuid()} with mode 0600",
        ) from None


def env_secret() -> bytes | None:
    """$FASTKV_RESULTS_SECRET as bytes, or None when it is not set.

    Raises:
        ValueError: it is shorter than MIN_SECRET_BYTES.
    """
    env = os.environ.get(SECRET_ENV)
    if not env:
        return None
    raw = env.encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{SECRET_ENV}: {len(raw)} bytes, at least {MIN_SECRET_BYTES} are needed"
        )
    return raw


def load_secret(dir_fd: int, name: str, *, create: bool = False) -> bytes:
    """The deployment secret: $FASTKV_RESULTS_SECRET, else `<name>.key` in the private
    directory; with `create` (the receiver, holding the lock) it is made if missing:
    32 random bytes, 0600, complete before it appears under its name.

    Raises:
        ValueError: the variable is shorter than MIN_SECRET_BYTES.
        FileNotFoundError: no key file and not `create` (no receiver bound yet).
        PermissionError: the key file is not this user's private regular file.
    """
    env = env_secret()
    if env is not None:
        return env
    key_name = f"{name}.key"
    what = f"key file {key_name!r}"
    try:
        fd = open_private_file(dir_fd, key_name, os.O_RDONLY, what)
    except FileNotFoundError:
        if not create:
            raise
        _make_key_file(dir_fd, key_name)
        fd = open_private_file(dir_fd, key_name, os.O_RDONLY, what)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if size != KEY_FILE_BYTES or len(data) != KEY_FILE_BYTES:
        raise PermissionError(
            errno.EACCES,
            f"results channel key file {key_name!r}: {len(data)} bytes, expected "
            f"{KEY_FILE_BYTES}; delete it (both ends make a new one)",
        )
    return data


def _make_key_file(dir_fd: int, key_name: str) -> None:
    """Make `key_name`: KEY_FILE_BYTES random bytes, 0600, written under a fresh name
    no one can have planted and linked into place only when complete. One a
    receiver killed mid-way left there stands."""
    tmp = f".{key_name}.{os.getpid()}.{secrets.token_hex(8)}"
    wfd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        os.fchmod(wfd, 0o600)
        os.write(wfd, secrets.token_bytes(KEY_FILE_BYTES))
        os.close(wfd)
        wfd = -1
        with contextlib.suppress(FileExistsError):
            os.link(tmp, key_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        if wfd >= 0:
            os.close(wfd)
        os.unlink(tmp, dir_fd=dir_fd)


def read_epoch(dir_fd: int, name: str) -> bytes | None:
    """The epoch of the receiver bound to `name`, from its lock file (None: no
    receiver has written one).

    Raises:
        PermissionError: the lock file is not this user's private regular file.
    """
    try:
        fd = open_private_file(dir_fd, f"{name}.lock", os.O_RDONLY, f"lock file {name}.lock")
    except FileNotFoundError:
        return None
    try:
        fields = os.read(fd, 128).split()
    finally:
        os.close(fd)
    try:
        epoch = bytes.fromhex(fields[1].decode())
    except (IndexError, ValueError, UnicodeDecodeError):
        return None
    return epoch if len(epoch) == EPOCH_BYTES else None


__all__ = [
    "EPOCH_BYTES",
    "KEY_FILE_BYTES",
    "MAX_NAME_BYTES",
    "MIN_SECRET_BYTES",
    "RUNTIME_DIR_ENV",
    "SECRET_ENV",
    "check_name",
    "env_secret",
    "load_secret",
    "open_private_dir",
    "open_private_file",
    "read_epoch",
    "runtime_dir",
    "socket_address",
]
