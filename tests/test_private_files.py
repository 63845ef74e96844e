"""The one private-directory and private-file check the results channel and storage
share: refused (never repaired) when a symlink, another kind of file, another
owner, a forbidden permission bit or a second hard link; narrowed to 0700 / the
asked mode only once every check passed. Through their callers:
tests/storage/test_disk_private.py, test_block_auth.py, tests/channel/."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fastkv.private_files import NotPrivate, open_dir, open_file


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_directory_is_made_private_or_refused(tmp_path: Path) -> None:
    made = tmp_path / "made"
    os.close(open_dir(made))
    assert mode_of(made) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(NotPrivate, match=r"mode 0o755 lets others in \(they can list it"):
        open_dir(loose)
    assert mode_of(loose) == 0o755  # refused, not repaired
    os.close(open_dir(loose, forbidden=0o022))  # storage's rule: only writes refused
    assert mode_of(loose) == 0o700
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(NotPrivate, match="symbolic link"):
        open_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotPrivate, match="not a directory"):
        open_dir(tmp_path / "file")
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(made, 65534, 65534)
        with pytest.raises(NotPrivate, match="owned by uid 65534, not this process's uid"):
            open_dir(made)
    with pytest.raises(FileNotFoundError):
        open_dir(tmp_path / "absent" / "dir")  # the parent must exist


def test_a_file_is_opened_relative_to_its_directory_and_checked(tmp_path: Path) -> None:
    dir_fd = open_dir(tmp_path / "d")
    try:
        fd = open_file("new", os.O_RDWR | os.O_CREAT, dir_fd=dir_fd)
        os.close(fd)
        assert mode_of(tmp_path / "d" / "new") & 0o077 == 0
        with pytest.raises(FileNotFoundError):
            open_file("absent", os.O_RDONLY, dir_fd=dir_fd)
        (tmp_path / "d" / "new").chmod(0o640)
        with pytest.raises(NotPrivate, match=r"mode 0o640 lets others in \(they can read it\)"):
            open_file("new", os.O_RDONLY, dir_fd=dir_fd)
        os.close(open_file("new", os.O_RDONLY, dir_fd=dir_fd, forbidden=0, set_mode=0o600))
        assert mode_of(tmp_path / "d" / "new") == 0o600
        victim = tmp_path / "victim"
        victim.write_text("precious")
        (tmp_path / "d" / "link").symlink_to(victim)
        with pytest.raises(NotPrivate, match="symbolic link"):
            open_file("link", os.O_RDWR | os.O_CREAT, dir_fd=dir_fd)
        os.link(victim, tmp_path / "d" / "hard")
        victim.chmod(0o600)
        os.close(open_file("hard", os.O_RDONLY, dir_fd=dir_fd))
        with pytest.raises(NotPrivate, match="2 hard links"):
            open_file("hard", os.O_RDONLY, dir_fd=dir_fd, single_link=True)
        os.mkfifo("fifo", 0o600, dir_fd=dir_fd)
        with pytest.raises(NotPrivate, match="not a regular file"):
            open_file("fifo", os.O_RDONLY | os.O_NONBLOCK, dir_fd=dir_fd)
        assert victim.read_text() == "precious"
    finally:
        os.close(dir_fd)
