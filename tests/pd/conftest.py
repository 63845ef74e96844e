"""Each test's rig is closed after it (controllers freed, senders closed), and
the test fails if a thread it started is still running then: a PD part that
does not stop its threads on close would otherwise pile them up unnoticed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from .rig import BUILT

# Threads fastkv starts and must stop on close: the controller's copy streams, the
# sender's fence waiter, and MooncakeTransport's peer and notifier threads.
OURS = ("fastkv-", "te-peer-", "te-notify")


def _ours() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(OURS)}


@pytest.fixture(autouse=True)
def _closes_what_it_built() -> Iterator[None]:
    before = _ours()
    yield
    errors = []
    while BUILT:  # every closer runs, even after one raised
        try:
            BUILT.pop()()
        except Exception as exc:  # reported below, once the rest closed
            errors.append(exc)
    assert not errors, f"closing the test's rig raised: {errors!r}"
    end = time.monotonic() + 5.0
    while (left := _ours() - before) and time.monotonic() < end:
        time.sleep(0.01)
    assert not left, (
        f"threads still running after the test closed its rig: {sorted(t.name for t in left)}"
    )
