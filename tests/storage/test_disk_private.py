"""The cache directory is private and cannot be redirected (issue 15 item 3): another
user's directory, one writable by others, or a symlink anywhere inside is refused;
nothing outside the directory is ever written; directory 0700 and files 0600
whatever the umask. Other users are real: uid 65534 through `setpriv`."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, HostMemory, make_keys, statuses

from fastkv.storage import deadline_after
from fastkv.storage.disk_dir import LOCK_FILE
from fastkv.storage.local_disk import (
    DATA_FILE,
    META_FILE,
    LocalDiskBackend,
    StorageDirectoryUnsafe,
)

LAYOUT = LAYOUTS["odd"]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=30)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user can create entries in, like /tmp (sticky, 1777)."""
    path = Path(tempfile.mkdtemp(prefix="fastkv-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def open_backend(path: Path) -> LocalDiskBackend:
    return LocalDiskBackend(path, LAYOUT, capacity_blocks=4)


def victim(tmp_path: Path, name: str) -> tuple[Path, bytes]:
    """A file outside the cache directory that must never change."""
    path = tmp_path / f"victim-{name}"
    content = f"precious {name}\n".encode() * 100
    path.write_bytes(content)
    return path, content


def test_directory_made_by_another_user_is_refused(shared: Path) -> None:
    squat = shared / "cache"
    assert as_nobody("mkdir", "-m", "700", str(squat)).returncode == 0
    with pytest.raises(StorageDirectoryUnsafe, match="owned by uid 65534"):
        open_backend(squat)
    # ... or a symlink another user planted where the cache directory should be
    target = shared / "theirs"
    assert as_nobody("mkdir", str(target)).returncode == 0
    assert as_nobody("ln", "-s", str(target), str(shared / "cache2")).returncode == 0
    with pytest.raises(StorageDirectoryUnsafe, match="symbolic link"):
        open_backend(shared / "cache2")
    assert os.listdir(target) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_directory_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(StorageDirectoryUnsafe, match=f"mode {mode:#o}"):
        open_backend(cache)
    assert os.listdir(cache) == []  # refused before anything was created


@pytest.mark.parametrize("name", [LOCK_FILE, DATA_FILE, META_FILE])
def test_no_symlink_inside_is_followed(tmp_path: Path, name: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if name != META_FILE:  # the metadata must exist for the others to be reached
        open_backend(cache).close()
        (cache / name).unlink()
    target, content = victim(tmp_path, name)
    (cache / name).symlink_to(target)
    with pytest.raises(StorageDirectoryUnsafe, match="symbolic link"):
        open_backend(cache)
    assert target.read_bytes() == content


def test_planted_temporary_and_probe_names_are_never_written(tmp_path: Path) -> None:
    """The names fastkv once used for its temporary metadata and O_DIRECT probe files
    are predictable; symlinks planted there are left alone (new names, O_EXCL)."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    targets = []
    for name in ("fastkv-storage.tmp", f".direct-probe-{os.getpid()}"):
        target, content = victim(tmp_path, name)
        (cache / name).symlink_to(target)
        targets.append((target, content))
    with open_backend(cache) as backend:
        host = HostMemory(LAYOUT, 1)
        host.fill(0, seed=0)
        ok = backend.put_from(make_keys(1), [host.segments(0)], deadline_after(10))
        assert statuses(ok) == ["OK"]
    for target, content in targets:
        assert target.read_bytes() == content
    assert sorted(p.name for p in cache.iterdir() if not p.is_symlink()) == sorted(
        [LOCK_FILE, DATA_FILE, META_FILE]
    )


def test_a_slot_file_hard_linked_elsewhere_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    open_backend(cache).close()
    target, content = victim(tmp_path, "hardlink")
    (cache / DATA_FILE).unlink()
    os.link(target, cache / DATA_FILE)
    with pytest.raises(StorageDirectoryUnsafe, match="2 hard links"):
        open_backend(cache)
    assert target.read_bytes() == content


def test_private_modes_whatever_the_umask(shared: Path) -> None:
    old = os.umask(0o022)
    try:
        cache = shared / "root-cache"
        with open_backend(cache) as backend:
            host = HostMemory(LAYOUT, 1)
            host.fill(0, seed=0)
            assert backend.put_from(make_keys(1), [host.segments(0)], 1e12)[0].ok
        # an existing directory of ours whose modes were too open is made private
        loose = shared / "loose"
        open_backend(loose).close()
        for f in loose.iterdir():
            f.chmod(0o644)
        loose.chmod(0o755)
        open_backend(loose).close()
    finally:
        os.umask(old)
    for d in (cache, loose):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    # another user reads nothing: not the directory, not the slot file
    assert as_nobody("ls", str(cache)).returncode != 0
    assert as_nobody("cat", str(cache / DATA_FILE)).returncode != 0
    # even were the directory opened up, the files themselves are 0600
    cache.chmod(0o755)
    assert as_nobody("cat", str(cache / DATA_FILE)).returncode != 0


def test_another_users_link_or_directory_above_the_cache_is_refused(
    shared: Path, tmp_path: Path
) -> None:
    """Issue 25 item 10: every component of the path is checked, not only the cache
    directory and its parent: another user's link or directory in a grandparent
    would let that user point root's cache at any directory it likes."""
    theirs = shared / "theirs"
    assert as_nobody("mkdir", "-m", "755", str(theirs)).returncode == 0
    aimed_at = tmp_path / "aimed-at"  # root's directory the link points to
    aimed_at.mkdir(mode=0o755)
    assert as_nobody("ln", "-s", str(aimed_at), str(theirs / "link")).returncode == 0
    with pytest.raises(StorageDirectoryUnsafe, match=f"{theirs} on its path is owned by uid"):
        open_backend(theirs / "link" / "cache")
    assert os.listdir(aimed_at) == []  # nothing adopted, chmodded or written there
    (theirs / "mine").mkdir(mode=0o755)  # root's, but inside theirs: renamable by them
    with pytest.raises(StorageDirectoryUnsafe, match="owned by uid 65534"):
        open_backend(theirs / "mine" / "cache")
    loose = tmp_path / "loose"  # writable by others, not sticky
    (loose / "sub").mkdir(parents=True)
    loose.chmod(0o777)
    with pytest.raises(StorageDirectoryUnsafe, match="rename or replace"):
        open_backend(loose / "sub" / "cache")
    assert os.listdir(loose / "sub") == []
    (shared / "roots-link").symlink_to(aimed_at)  # root's links stay usable
    open_backend(shared / "roots-link" / "cache").close()
    assert os.listdir(aimed_at) == ["cache"]
