"""H1 on the CPU: releasing a layout never hangs its caller. On CUDA the release
is a cudaFree, which waits for every stream of the device; here a release that
blocks stands in for it (the CPU core's own release returns at once)."""

from __future__ import annotations

import gc
import logging
import threading

import numpy as np

from fastkv.ops import core


def _layout() -> tuple[core.Layout, list[np.ndarray]]:
    dev = np.zeros((4, 64), np.uint8)
    host = np.zeros((4, 64), np.uint8)
    layout = core.Layout([(dev.ctypes.data, host.ctypes.data, 64)], 1, 4, 4, device=-1)
    return layout, [dev, host]


class BlockedRelease:
    """A release that returns once `gate` opens (a cudaFree behind a stuck stream)."""

    def __init__(self, real) -> None:
        self.real = real
        self.gate = threading.Event()
        self.released = threading.Event()

    def __call__(self, handle: int) -> None:
        self.gate.wait(30)
        self.real(handle)
        self.released.set()


def test_closing_behind_a_stuck_release_returns_and_says_what_it_waits_for(caplog) -> None:
    layout, _keep = _layout()
    blocked = layout._destroy = BlockedRelease(layout._destroy)
    with caplog.at_level(logging.ERROR, logger="fastkv.ops.core"):
        assert layout.close(timeout=0.1) is False
    assert "cudaFree waits for all work on the device" in caplog.text
    assert "the CPU" in caplog.text
    assert layout.close(timeout=0.1) is True  # already handed over: nothing more to do
    blocked.gate.set()
    assert blocked.released.wait(10)  # the release completes in the background


def test_a_layout_dropped_by_the_collector_never_blocks_it() -> None:
    layout, _keep = _layout()
    blocked = layout._destroy = BlockedRelease(layout._destroy)
    finalized = threading.Event()

    def drop() -> None:
        nonlocal layout
        del layout
        gc.collect()
        finalized.set()

    thread = threading.Thread(target=drop)
    thread.start()
    assert finalized.wait(10)  # the finalizer queued the release and went on
    assert not blocked.released.is_set()
    blocked.gate.set()
    assert blocked.released.wait(10)
    thread.join(10)


def test_an_idle_layout_closes_at_once() -> None:
    layout, _keep = _layout()
    assert layout.close(timeout=5) is True
