"""Errors that explain themselves (issue 15 item 6): a directory of another format,
another layout or foreign metadata is refused with a message saying what differs;
a slot file deleted under a running backend stops acknowledging puts, loudly."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
from storage_helpers import LAYOUTS, HostMemory, make_keys, statuses

from fastkv.storage import BlockLayout, deadline_after
from fastkv.storage.local_disk import DATA_FILE, META_FILE, LocalDiskBackend

LAYOUT = LAYOUTS["odd"]


def open_backend(path: Path, layout: BlockLayout = LAYOUT) -> LocalDiskBackend:
    return LocalDiskBackend(path, layout, capacity_blocks=4)


def rewrite_meta(path: Path, **changes: object) -> None:
    meta = json.loads((path / META_FILE).read_text())
    meta.update(changes)
    (path / META_FILE).write_text(json.dumps(meta))


def test_another_format_version_is_named(tmp_path: Path) -> None:
    open_backend(tmp_path).close()
    rewrite_meta(tmp_path, format=1)  # same slot geometry, an older block header
    with pytest.raises(ValueError, match=r"storage format 1, this backend reads format 2"):
        open_backend(tmp_path)


def test_another_layout_names_the_field_that_differs(tmp_path: Path) -> None:
    a = BlockLayout((4096, 4096))
    b = BlockLayout((8192,))  # the same slot size, other segments
    open_backend(tmp_path, a).close()
    with pytest.raises(
        ValueError, match=r"segment_lengths \[4096, 4096\], this backend needs \[8192\]"
    ):
        open_backend(tmp_path, b)
    with pytest.raises(ValueError, match=r"slot_bytes 12288, this backend needs"):
        open_backend(tmp_path, LAYOUTS["bf16"])


@pytest.mark.parametrize(
    "raw, match",
    [
        ("[1, 2]", "holds a JSON list, not fastkv storage metadata"),
        ('"x"', "holds a JSON str"),
        ("{not json", "is not valid JSON"),
    ],
)
def test_foreign_metadata_is_a_clear_error(tmp_path: Path, raw: str, match: str) -> None:
    open_backend(tmp_path).close()
    (tmp_path / META_FILE).write_text(raw)
    with pytest.raises(ValueError, match=match):
        open_backend(tmp_path)


def test_deleted_slot_file_stops_acknowledging_puts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = HostMemory(LAYOUT, 4)
    want = host.fill(0, seed=0)
    keys = make_keys(3)
    with open_backend(tmp_path) as backend:
        assert statuses(backend.put_from(keys[:1], [host.segments(0)], deadline_after(10))) == [
            "OK"
        ]
        (tmp_path / DATA_FILE).unlink()
        with caplog.at_level(logging.ERROR, logger="fastkv.storage.local_disk"):
            res = backend.put_from(keys[1:], [host.segments(0)] * 2, deadline_after(10))
            again = backend.put_from(keys[1:2], [host.segments(0)], deadline_after(10))
        assert statuses(res) == ["FAILED", "FAILED"] and statuses(again) == ["FAILED"]
        assert "was deleted while open" in res[0].reason
        assert caplog.text.count("was deleted while open") == 1  # said once, loudly
        # what it holds still verifies and is served
        assert statuses(backend.get_into(keys[:1], [host.segments(1)], 1e12)) == ["OK"]
        assert host.read(1) == want
        assert backend.stats().put_failures == 3


def test_a_slot_file_deleted_while_a_put_writes_fails_that_put(tmp_path: Path) -> None:
    """The slot file is checked after the writes, not before: a file deleted while
    a put's block was moving (into a file no later process finds) fails that put."""
    host = HostMemory(LAYOUT, 1)
    host.fill(0, seed=0)
    backend = LocalDiskBackend(tmp_path, LAYOUT, capacity_blocks=4, io_delay_s=0.5)
    with backend:
        out: list = []
        put = threading.Thread(
            target=lambda: out.append(
                backend.put_from(make_keys(1), [host.segments(0)], deadline_after(10))
            )
        )
        put.start()
        time.sleep(0.1)  # the put is in its injected delay, before the write
        (tmp_path / DATA_FILE).unlink()
        put.join(10)
        assert statuses(out[0]) == ["FAILED"] and "was deleted while open" in out[0][0].reason
        assert backend.stats().stored_blocks == 0 and backend.stats().put_failures == 1


def test_replaced_slot_file_stops_acknowledging_puts(tmp_path: Path) -> None:
    host = HostMemory(LAYOUT, 1)
    host.fill(0, seed=0)
    with open_backend(tmp_path) as backend:
        (tmp_path / DATA_FILE).rename(tmp_path / "moved-away")
        (tmp_path / DATA_FILE).write_bytes(b"")
        res = backend.put_from(make_keys(1), [host.segments(0)], deadline_after(10))
        assert statuses(res) == ["FAILED"] and "was replaced" in res[0].reason
