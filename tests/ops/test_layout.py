"""Layouts on the CPU core: the segment table is validated once at creation, a
transfer validates only its ids and copies exactly the layers it names."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from fastkv.ops import core

from .layout import (
    KINDS,
    HostBuffer,
    assert_bytes_equal,
    expected_after_swap,
    host_bytes_needed,
    make_cache,
    random_ids,
    snapshot,
)

H2D, D2H = core.Direction.H2D, core.Direction.D2H


def _cache(seed: int, kind: str = "bf16", layers: int = 4, ndev: int = 32, nhost: int = 40):
    rng = np.random.default_rng(seed)
    buf = HostBuffer.numpy(host_bytes_needed(kind, layers, nhost, 2, 4, 8))
    return make_cache(rng, kind, layers, ndev, nhost, buf), buf


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("seed", [0, 1])
def test_layer_ranges_copy_exactly_their_layers(kind: str, seed: int) -> None:
    cache, _buf = _cache(seed, kind)
    tpl = cache.tensors_per_layer
    layout = core.Layout(cache.segments(), tpl, 32, 40)
    rng = np.random.default_rng(seed)
    d = random_ids(rng, 9, 32)
    h = random_ids(rng, 9, 40)
    for first, count, direction in [(1, 2, D2H), (0, 4, D2H), (3, 1, H2D), (0, 1, H2D)]:
        selected = list(range(first * tpl, (first + count) * tpl))
        dev_exp, host_exp = expected_after_swap(cache, d, h, direction == H2D, selected)
        layout.swap(d, h, direction, first, count)
        for s in range(len(cache.device)):
            assert_bytes_equal(cache.device[s], dev_exp[s], f"device {s}")
            assert_bytes_equal(cache.host[s], host_exp[s], f"host {s}")
    layout.close()


def test_creation_validates_the_segments_once() -> None:
    cache, _buf = _cache(2)
    segs = cache.segments()
    with pytest.raises(ValueError, match="segments_per_layer: 3 does not divide"):
        core.Layout(segs, 3, 32, 40)
    overlapping = [segs[0], (segs[1][0], segs[0][1], segs[1][2]), *segs[2:]]
    # Used both ways, a layout refuses any overlap (each side is a destination once).
    with pytest.raises(ValueError, match=r"segments\[1\].host_base: host region overlaps"):
        core.Layout(overlapping, 2, 32, 40)
    with pytest.raises(ValueError, match=r"segments\[0\].block_bytes: 6 is not"):
        core.Layout([(segs[0][0], segs[0][1], 6)], 1, 32, 40)
    with pytest.raises(ValueError, match="cuda_device: -2"):
        core.Layout(segs, 2, 32, 40, device=-2)


def test_bad_ids_and_ranges_are_refused_before_any_byte_moves() -> None:
    cache, _buf = _cache(3, "uint8")
    layout = core.Layout(cache.segments(), 4, 32, 40)
    before = snapshot(cache.device) + snapshot(cache.host)
    cases = [
        (dict(device_ids=[1, 32], host_ids=[0, 1]), r"device_ids\[1\]=32 out of range"),
        (dict(device_ids=[1, 2], host_ids=[0, 0]), r"host_ids\[1\]: duplicate destination 0"),
        (dict(first_layer=4), r"first_layer: 4 out of range \[0, 4\)"),
        (
            dict(first_layer=2, num_layers=3),
            r"num_layers: 3 out of range \[1, 2\] from layer 2",
        ),
        (dict(direction=2), "direction: 2 is neither"),
        (dict(num_threads=-1), r"num_threads: -1 out of range"),
        (dict(host_ids=[0]), "host_ids: length 1 != device_ids length 2"),
    ]
    for change, message in cases:
        args = dict(device_ids=[1, 2], host_ids=[0, 1], direction=D2H)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            layout.swap(
                np.asarray(args.pop("device_ids"), np.int64),
                np.asarray(args.pop("host_ids"), np.int64),
                **args,
            )
    for a, b in zip(before, snapshot(cache.device) + snapshot(cache.host), strict=True):
        assert_bytes_equal(a, b, "after a refused call")


def test_events_are_accepted_and_ignored_on_the_cpu() -> None:
    cache, _buf = _cache(4)
    layout = core.Layout(cache.segments(), 2, 32, 40)
    events = (ctypes.c_void_p * 4)()
    d, h = np.array([5, 6], np.int64), np.array([7, 8], np.int64)
    layout.swap(d, h, D2H, 0, 4, 0, events)
    for s in range(len(cache.device)):
        assert_bytes_equal(cache.host[s][[7, 8]], cache.device[s][[5, 6]], f"segment {s}")
    empty = np.zeros(0, np.int64)
    layout.swap(empty, empty, H2D)  # nothing to do is not an error


def test_two_threads_share_a_layout() -> None:
    cache, _buf = _cache(5, layers=2, ndev=64, nhost=64)
    layout = core.Layout(cache.segments(), 2, 64, 64)
    dev0, host0 = snapshot(cache.device), snapshot(cache.host)
    a = np.arange(0, 32, dtype=np.int64)
    b = np.arange(32, 64, dtype=np.int64)
    errors: list[BaseException] = []

    def run(direction, d, h):
        try:
            for _ in range(50):
                layout.swap(d, h, direction)
        except BaseException as e:  # reported by the assert below
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(D2H, a, a)),  # device 0..31 -> host 0..31
        threading.Thread(target=run, args=(H2D, b, b)),  # host 32..63 -> device 32..63
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for s in range(len(cache.device)):
        assert_bytes_equal(cache.host[s][:32], dev0[s][:32], f"host {s}")
        assert_bytes_equal(cache.device[s][32:], host0[s][32:], f"device {s}")
