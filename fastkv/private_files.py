"""Opening directories and files that only this process's user can reach.

The results channel (its runtime directory, lock and key files), the disk storage
backend (its cache directory and the files in it) and the storage key file hold
what another local user must neither read, change nor redirect. All of them open
it here, one way:

- never through a symbolic link: O_NOFOLLOW, and a file inside a directory is
  opened relative to the directory's descriptor, so no component of the path can
  be swapped between the check and the use;
- a directory only through a path no other user can redirect (`check_path`): every
  component above it, and every link met on the way, belongs to root or this user,
  and none of those directories lets others add or rename entries unless it is
  sticky (so another user's link or directory in a grandparent is refused, while
  root's links, such as /var/run, stay usable);
- checked on the open descriptor (fstat), never by path: the right kind
  (directory, regular file), owned by this user, none of the permission bits the
  caller forbids and, where asked, a single hard link;
- refused, never repaired, when a check fails; only once every check has passed
  is a mode narrowed (a directory to 0700; a file to the mode the caller asks).

A refusal raises `NotPrivate`, whose message completes "<path>: ..." (such as "it
is owned by uid 65534, not this process's uid 0"); each caller puts its own name,
exception type and advice around it. Standard library only: storage, the lowest
package, imports it, so it imports nothing from fastkv.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

DIR_MODE = 0o700
FILE_MODE = 0o600
OTHERS = 0o077
"""Every permission bit of group and others."""

StrPath = str | os.PathLike[str]
_SYMLINK = "it is a symbolic link (none is followed)"
_GRANTS = (  # group/other bits: what they let others do to a file, to a directory
    (0o044, "read it", "list it"),
    (0o022, "change it", "add or replace files in it"),
    (0o011, "run it", "reach files in it"),
)


class NotPrivate(PermissionError):
    """A directory or file someone else could read, change or redirect; the
    message says why and completes "<path>: ..."."""


MAX_LINKS = 40
"""Symbolic links `check_path` follows in one path (the kernel's own limit)."""


def check_path(path: StrPath, *, uid: int | None = None) -> None:
    """Check that no user but root and `uid` can redirect `path`: every directory
    above it and every symbolic link met while resolving those directories must be
    owned by root or `uid`, and a directory that group or others can write must be
    sticky (no one else can then rename or replace what `uid` or root owns in it).
    The last component is not checked here (`open_dir` and `open_file` open it
    without following a link and check it on the descriptor).

    Args:
        path: the path to check; a relative one is taken from the working directory.
        uid: the user besides root who may own the components; default this
            process's effective uid.

    Raises:
        NotPrivate: a component or link fails the rule; the message names it.
        OSError: a component is missing or cannot be read (as os.lstat), or more
            than MAX_LINKS links are met (ELOOP).
    """
    uid = os.geteuid() if uid is None else uid
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    todo = [part for part in parent.split("/") if part][::-1]  # a stack: next at the end
    current, links = "/", 0
    _check_component(current, os.lstat(current), uid)
    while todo:
        part = todo.pop()
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        nxt = os.path.join(current, part)
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            _check_component(nxt, st, uid)
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, f"more than {MAX_LINKS} symbolic links", nxt)
            target = os.readlink(nxt)
            if target.startswith("/"):
                current = "/"
            todo += [p for p in target.split("/") if p][::-1]
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "a component of the path", nxt)
        _check_component(nxt, st, uid)
        current = nxt


def _check_component(name: str, st: os.stat_result, uid: int) -> None:
    """One directory or link on the way to a private directory (see `check_path`)."""
    kind = "symbolic link" if stat.S_ISLNK(st.st_mode) else "directory"
    if st.st_uid not in (0, uid):
        raise NotPrivate(
            f"the {kind} {name} on its path is owned by uid {st.st_uid}, neither root "
            f"nor uid {uid} (that user could redirect the path)"
        )
    if kind == "directory" and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise NotPrivate(
            f"the directory {name} on its path (mode {stat.S_IMODE(st.st_mode):#o}) "
            "lets others rename or replace its entries (writable, not sticky)"
        )


def open_dir(path: StrPath, *, uid: int | None = None, forbidden: int = OTHERS) -> int:
    """Make `path` (mode 0700) if it is missing and open it, once `check_path`
    passed for it (no other user can redirect the path to it).

    Args:
        path: the directory; its parent must exist.
        uid: the owner it must have; default this process's effective uid.
        forbidden: permission bits that refuse it; default any bit of group or
            others (storage, whose files are 0600 themselves, forbids only their
            write bits).

    Returns:
        An O_DIRECTORY descriptor of it (the caller closes it); the directory's
        mode is 0700 by then.

    Raises:
        NotPrivate: it is a symbolic link or not a directory, has another owner or
            a forbidden permission bit; or a component above it fails `check_path`.
        OSError: it cannot be made or opened (e.g. its parent does not exist).
    """
    check_path(path, uid=uid)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivate(
                _SYMLINK if os.path.islink(path) else "it is not a directory"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        _check_owner_and_mode(st, uid, forbidden, is_dir=True)
        if stat.S_IMODE(st.st_mode) != DIR_MODE:  # made under a strict umask, or ours
            os.fchmod(fd, DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(
    path: StrPath,
    flags: int,
    *,
    dir_fd: int | None = None,
    uid: int | None = None,
    forbidden: int = OTHERS,
    single_link: bool = False,
    set_mode: int | None = None,
) -> int:
    """Open the regular file `path` (relative to `dir_fd` when given), never through
    a symbolic link, and check it is private.

    Args:
        path, flags: as `os.open` (O_NOFOLLOW and O_CLOEXEC are added); a file
            O_CREAT makes gets mode 0600 (less the umask).
        dir_fd: the open directory `path` is relative to.
        uid: the owner it must have; default this process's effective uid.
        forbidden: permission bits that refuse it; default any bit of group or
            others.
        single_link: refuse a file with more than one hard link (it would be
            reachable, and changeable, under another name elsewhere).
        set_mode: once the checks pass, set the file's mode to this one.

    Returns:
        The descriptor (the caller closes it).

    Raises:
        NotPrivate: it is a symbolic link or not a regular file, has another
            owner, a forbidden permission bit or (with `single_link`) a second link.
        OSError: as `os.open` (FileNotFoundError without O_CREAT).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivate(_SYMLINK) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotPrivate("it is not a regular file")
        _check_owner_and_mode(st, uid, forbidden, is_dir=False)
        if single_link and st.st_nlink != 1:
            raise NotPrivate(f"it has {st.st_nlink} hard links (it is also elsewhere)")
        if set_mode is not None and stat.S_IMODE(st.st_mode) != set_mode:
            os.fchmod(fd, set_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owner_and_mode(
    st: os.stat_result, uid: int | None, forbidden: int, *, is_dir: bool
) -> None:
    uid = os.geteuid() if uid is None else uid
    if st.st_uid != uid:
        raise NotPrivate(f"it is owned by uid {st.st_uid}, not this process's uid {uid}")
    others = st.st_mode & forbidden
    if others:
        can = ", ".join(d if is_dir else f for bits, f, d in _GRANTS if others & bits)
        raise NotPrivate(f"mode {stat.S_IMODE(st.st_mode):#o} lets others in (they can {can})")


__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "MAX_LINKS",
    "OTHERS",
    "NotPrivate",
    "check_path",
    "open_dir",
    "open_file",
]
