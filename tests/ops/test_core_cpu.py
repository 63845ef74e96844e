"""The CPU core through its C ABI (ctypes): exactness, coalescing, threads,
concurrency, validation before any copy, host allocation."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
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


def _cache(rng, kind, layers=3, ndev=48, nhost=64, pinned_alloc=False, **shape):
    nbytes = host_bytes_needed(
        kind, layers, nhost, **(shape or {"heads": 2, "tokens": 4, "head_dim": 8})
    )
    if pinned_alloc:
        ptr = core.host_alloc(nbytes)
        buf = HostBuffer.at(ptr, nbytes)
        buf.keepalive = ptr
    else:
        buf = HostBuffer.numpy(nbytes)
    cache = make_cache(rng, kind, layers, ndev, nhost, buf, **shape)
    return cache, buf, nbytes


def _free(buf: HostBuffer, nbytes: int) -> None:
    if isinstance(buf.keepalive, int):
        core.host_free(buf.keepalive, nbytes, pinned=False)


def _check(cache, dev_expected, host_expected):
    for s in range(len(cache.device)):
        assert_bytes_equal(cache.device[s], dev_expected[s], f"device segment {s}")
        assert_bytes_equal(cache.host[s], host_expected[s], f"host segment {s}")


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_is_bit_exact(kind: str, threads: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cache, buf, nbytes = _cache(rng, kind, layers=4, pinned_alloc=seed == 1)
    try:
        layers = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False).tolist())
        selected = [s for layer in layers for s in range(*cache.layer_slice(layer).indices(99))]
        segs = [cache.segments()[s] for s in selected]
        n = 13
        src_dev = random_ids(rng, n, cache.num_device_blocks)
        host_ids = random_ids(rng, n, cache.num_host_blocks)
        original = {s: cache.device[s][src_dev].copy() for s in selected}

        dev_exp, host_exp = expected_after_swap(cache, src_dev, host_ids, False, selected)
        core.swap_cpu(segs, 48, 64, src_dev, host_ids, D2H, threads)
        _check(cache, dev_exp, host_exp)

        # Back into other device blocks: what arrives must be the original bytes.
        dst_dev = random_ids(rng, n, cache.num_device_blocks)
        dev_exp, host_exp = expected_after_swap(cache, dst_dev, host_ids, True, selected)
        core.swap_cpu(segs, 48, 64, dst_dev, host_ids, H2D, threads)
        _check(cache, dev_exp, host_exp)
        for s in selected:
            assert_bytes_equal(cache.device[s][dst_dev], original[s], f"round trip segment {s}")
    finally:
        _free(buf, nbytes)


@pytest.mark.parametrize("direction", [H2D, D2H])
@pytest.mark.parametrize(
    "pattern", ["one_run", "runs_and_singles", "scattered", "reverse", "shared_src"]
)
def test_coalesced_and_scattered_ids_match_numpy(direction, pattern: str) -> None:
    rng = np.random.default_rng(7)
    cache, _buf, _ = _cache(rng, "fp16", layers=2, ndev=96, nhost=128)
    h2d = direction == H2D
    if pattern == "one_run":
        dev = np.arange(10, 60, dtype=np.int64)
        host = np.arange(70, 120, dtype=np.int64)
    elif pattern == "runs_and_singles":
        dev = np.r_[np.arange(0, 20), [50], np.arange(30, 40), [91, 93]].astype(np.int64)
        host = np.r_[np.arange(100, 120), [3], np.arange(60, 70), [5, 6]].astype(np.int64)
    elif pattern == "scattered":
        dev = random_ids(rng, 40, 96)
        host = random_ids(rng, 40, 128)
    elif pattern == "reverse":
        dev = np.arange(40, 0, -1, dtype=np.int64)
        host = np.arange(80, 40, -1, dtype=np.int64)
    else:
        # One source block copied to many destinations is legal.
        dst = random_ids(rng, 8, 96 if h2d else 128)
        src = np.full(8, 5, dtype=np.int64)
        dev, host = (dst, src) if h2d else (src, dst)
    selected = list(range(len(cache.device)))
    dev_exp, host_exp = expected_after_swap(cache, dev, host, h2d, selected)
    core.swap_cpu(cache.segments(), 96, 128, dev, host, direction, 2)
    _check(cache, dev_exp, host_exp)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("misalign", [0, 4, 12])
def test_large_calls_use_streaming_parts_exactly(threads: int, misalign: int) -> None:
    """Above 4 MiB per call the core streams with non-temporal stores and splits
    runs between threads; odd block sizes and 4-byte-aligned bases exercise the
    unaligned heads and tails of that path."""
    rng = np.random.default_rng(threads * 10 + misalign)
    block_bytes = 4 * 16411  # 64 KiB + 44 bytes: no power-of-two alignment
    ndev, nhost = 96, 100
    dev_raw = rng.integers(0, 256, ndev * block_bytes + 64, dtype=np.uint8)
    host_raw = rng.integers(0, 256, nhost * block_bytes + 64, dtype=np.uint8)
    dev = dev_raw[misalign : misalign + ndev * block_bytes].reshape(ndev, block_bytes)
    host = host_raw[misalign : misalign + nhost * block_bytes].reshape(nhost, block_bytes)
    seg = [(dev.ctypes.data, host.ctypes.data, block_bytes)]
    guards = [
        (raw, raw[:misalign].copy(), raw[misalign + n * block_bytes :].copy(), n)
        for raw, n in ((dev_raw, ndev), (host_raw, nhost))
    ]
    # A long run (split between threads) followed by scattered blocks.
    d_ids = np.r_[np.arange(0, 40), random_ids(rng, 40, 56) + 40].astype(np.int64)
    h_ids = np.r_[np.arange(50, 90), random_ids(rng, 40, 50)].astype(np.int64)
    for direction in (D2H, H2D):
        exp_dev, exp_host = dev.copy(), host.copy()
        if direction == D2H:
            exp_host[h_ids] = dev[d_ids]
        else:
            exp_dev[d_ids] = host[h_ids]
        core.swap_cpu(seg, ndev, nhost, d_ids, h_ids, direction, threads)
        assert_bytes_equal(dev, exp_dev, "device")
        assert_bytes_equal(host, exp_host, "host")
    # Bytes just outside the regions are untouched.
    for raw, head, tail, n in guards:
        assert_bytes_equal(raw[:misalign], head, "bytes before the region")
        assert_bytes_equal(raw[misalign + n * block_bytes :], tail, "bytes after the region")


@pytest.mark.parametrize("source_blocks", [64, 50_000])
@pytest.mark.parametrize("direction", [H2D, D2H])
def test_small_blocks_copied_in_source_order_give_the_same_result(
    source_blocks: int, direction
) -> None:
    """Small-block calls are reordered by source address (counting sort for a
    small id range, comparison sort for a large one); repeated sources included."""
    rng = np.random.default_rng(source_blocks)
    h2d = direction == H2D
    block = 256
    n_dst = 64
    src_arr = rng.integers(0, 256, (source_blocks, block), dtype=np.uint8)
    dst_arr = rng.integers(0, 256, (n_dst, block), dtype=np.uint8)
    dst_ids = rng.permutation(n_dst)[:48].astype(np.int64)
    src_ids = rng.integers(0, source_blocks, 48).astype(np.int64)  # repeats allowed
    src_ids[:5] = src_ids[5]
    dev, host = (dst_arr, src_arr) if h2d else (src_arr, dst_arr)
    d_ids, h_ids = (dst_ids, src_ids) if h2d else (src_ids, dst_ids)
    expected = dst_arr.copy()
    expected[dst_ids] = src_arr[src_ids]
    core.swap_cpu(
        [(dev.ctypes.data, host.ctypes.data, block)],
        len(dev),
        len(host),
        d_ids,
        h_ids,
        direction,
    )
    assert_bytes_equal(dst_arr, expected, "destination")


def test_randomized_sequence_matches_reference_model() -> None:
    rng = np.random.default_rng(2024)
    cache, _buf, _ = _cache(rng, "uint8", layers=3, ndev=40, nhost=50)
    for _ in range(60):
        h2d = bool(rng.integers(0, 2))
        n = int(rng.integers(0, 30))
        dev = random_ids(rng, n, 40, consecutive=bool(rng.integers(0, 2)))
        host = random_ids(rng, n, 50, consecutive=bool(rng.integers(0, 2)))
        layers = rng.choice(3, size=int(rng.integers(1, 4)), replace=False)
        selected = sorted(s for layer in layers for s in range(layer * 4, layer * 4 + 4))
        segs = [cache.segments()[s] for s in selected]
        dev_exp, host_exp = expected_after_swap(cache, dev, host, h2d, selected)
        core.swap_cpu(segs, 40, 50, dev, host, H2D if h2d else D2H, int(rng.integers(0, 4)))
        _check(cache, dev_exp, host_exp)


@pytest.mark.parametrize("threads", [0, 1, 2, 4])
def test_two_threads_swapping_different_blocks_concurrently(threads: int) -> None:
    """The worker runs H2D and D2H on two threads at once; both must finish with
    exact results (no lost parts, no deadlock in the shared pool)."""
    rng = np.random.default_rng(threads)
    block = 64 << 10
    ndev, nhost = 128, 128
    dev = rng.integers(0, 256, (ndev, block), dtype=np.uint8)
    host = rng.integers(0, 256, (nhost, block), dtype=np.uint8)
    seg = core.make_segments([(dev.ctypes.data, host.ctypes.data, block)])
    # Thread A: evicts even device blocks to host 0..63; thread B: loads host
    # 64..127 into odd device blocks. Disjoint sources and destinations.
    a_dev = np.arange(0, ndev, 2, dtype=np.int64)
    a_host = rng.permutation(64).astype(np.int64)
    b_dev = np.arange(1, ndev, 2, dtype=np.int64)
    b_host = (64 + rng.permutation(64)).astype(np.int64)
    exp_dev, exp_host = dev.copy(), host.copy()
    exp_host[a_host] = dev[a_dev]
    exp_dev[b_dev] = host[b_host]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(d, h, direction):
        try:
            barrier.wait()
            for _ in range(20):
                core.swap_cpu(seg, ndev, nhost, d, h, direction, threads)
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    workers = [
        threading.Thread(target=run, args=(a_dev, a_host, D2H)),
        threading.Thread(target=run, args=(b_dev, b_host, H2D)),
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "concurrent swaps did not finish"
    assert not errors, errors
    assert_bytes_equal(dev, exp_dev, "device")
    assert_bytes_equal(host, exp_host, "host")


def test_empty_id_list_is_a_no_op() -> None:
    rng = np.random.default_rng(3)
    cache, _buf, _ = _cache(rng, "bf16", layers=1)
    before_dev, before_host = snapshot(cache.device), snapshot(cache.host)
    core.swap_cpu(cache.segments(), 48, 64, [], [], D2H)
    _check(cache, before_dev, before_host)


# ---------------------------------------------------------------- validation


def _bad_cases():
    """(name, kwargs overrides, expected message fragment). Base call is a valid
    D2H of 2 blocks over 2 segments of 16-block device / 32-block host regions."""
    return [
        (
            "device id too large",
            {"device_ids": [1, 16]},
            "device_ids[1]=16 out of range [0, 16)",
        ),
        ("device id negative", {"device_ids": [-1, 2]}, "device_ids[0]=-1 out of range"),
        ("host id too large", {"host_ids": [3, 900]}, "host_ids[1]=900 out of range [0, 32)"),
        ("host id negative", {"host_ids": [-5, 2]}, "host_ids[0]=-5 out of range"),
        (
            "duplicate host destination",
            {"host_ids": [7, 7]},
            "host_ids[1]: duplicate destination 7",
        ),
        (
            "duplicate device destination",
            {"direction": H2D, "device_ids": [4, 4]},
            "device_ids[1]: duplicate destination 4",
        ),
        (
            "length mismatch",
            {"host_ids": [1, 2, 3]},
            "host_ids: length 3 != device_ids length 2",
        ),
        (
            "float ids",
            {"device_ids": np.array([1.0, 2.0])},
            "device_ids: expected a 1-D integer",
        ),
        ("2-D ids", {"host_ids": np.array([[1, 2]])}, "host_ids: expected a 1-D integer"),
        ("direction 2", {"direction": 2}, "direction: 2 is neither"),
        ("direction -1", {"direction": -1}, "direction: -1 is neither"),
        ("negative threads", {"num_threads": -1}, "num_threads: -1 out of range"),
        ("too many threads", {"num_threads": 100000}, "num_threads: 100000 out of range"),
        (
            "negative device blocks",
            {"num_device_blocks": -1},
            "num_device_blocks: -1 is negative",
        ),
        ("negative host blocks", {"num_host_blocks": -3}, "num_host_blocks: -3 is negative"),
        ("no segments", {"segments": []}, "num_segments: 0 out of range"),
        ("block bytes 0", {"seg1": {"block_bytes": 0}}, "segments[1].block_bytes: 0 is not"),
        ("block bytes odd", {"seg1": {"block_bytes": 6}}, "segments[1].block_bytes: 6 is not"),
        (
            "block bytes negative",
            {"seg0": {"block_bytes": -64}},
            "segments[0].block_bytes: -64",
        ),
        ("null device base", {"seg1": {"device_base": 0}}, "segments[1].device_base: NULL"),
        ("null host base", {"seg0": {"host_base": 0}}, "segments[0].host_base: NULL"),
        ("misaligned device base", {"seg1": {"device_base_add": 2}}, "is not 4-byte aligned"),
        ("misaligned host base", {"seg0": {"host_base_add": 1}}, "is not 4-byte aligned"),
        (
            "overlapping destinations",
            {"seg1": {"host_base_from_seg0": 64 * 10}},
            "host region overlaps the host region of segments[0]",
        ),
        (
            "destination overlaps a source",
            {"seg1": {"host_base_is_device0": True}},
            "overlaps the device region of segments[0]",
        ),
        ("region overflow", {"num_host_blocks": 2**62}, "overflow the address space"),
    ]


@pytest.mark.parametrize("swap", ["cpu", "cuda"])
@pytest.mark.parametrize(
    ("name", "change", "message"), _bad_cases(), ids=[c[0] for c in _bad_cases()]
)
def test_bad_input_raises_naming_the_argument_and_touches_nothing(
    swap: str, name: str, change: dict, message: str
) -> None:
    """Both entry points validate on the host before any copy, so this runs (for
    the CUDA entry point too) on machines without a GPU."""
    rng = np.random.default_rng(11)
    block = 64
    dev = [rng.integers(0, 256, (16, block), dtype=np.uint8) for _ in range(2)]
    host = [rng.integers(0, 256, (32, block), dtype=np.uint8) for _ in range(2)]
    before = snapshot(dev + host)
    segs = [[d.ctypes.data, h.ctypes.data, block] for d, h in zip(dev, host, strict=True)]
    for s in (0, 1):
        for key, value in change.get(f"seg{s}", {}).items():
            if key == "device_base_add":
                segs[s][0] += value
            elif key == "host_base_add":
                segs[s][1] += value
            elif key == "host_base_from_seg0":
                segs[s][1] = segs[0][1] + value
            elif key == "host_base_is_device0":
                segs[s][1] = segs[0][0]
            else:
                segs[s][["device_base", "host_base", "block_bytes"].index(key)] = value
    args = {
        "segments": [tuple(s) for s in segs],
        "num_device_blocks": 16,
        "num_host_blocks": 32,
        "device_ids": [3, 9],
        "host_ids": [20, 4],
        "direction": D2H,
    }
    args.update({k: v for k, v in change.items() if not k.startswith("seg") or k == "segments"})
    threads = args.pop("num_threads", 2)
    if swap == "cpu":
        call = lambda: core.swap_cpu(**args, num_threads=threads)  # noqa: E731
    else:
        if "num_threads" in change:
            pytest.skip("num_threads is a CPU-path argument")
        call = lambda: core.swap_cuda(**args, stream=0)  # noqa: E731
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)
    for i, (a, b) in enumerate(zip(dev + host, before, strict=True)):
        assert_bytes_equal(a, b, f"array {i} after rejected call ({name})")


def test_c_abi_rejects_null_arrays_and_negative_counts() -> None:
    """Inputs the Python wrapper cannot produce, straight through the C ABI."""
    lib = core._lib
    dev = np.zeros((4, 16), np.uint8)
    host = np.zeros((4, 16), np.uint8)
    segs = core.make_segments([(dev.ctypes.data, host.ctypes.data, 16)])
    ids = np.array([0, 1], np.int64)
    cases = [
        ((None, 1, 4, 4, ids.ctypes.data, ids.ctypes.data, 2, 1, 1), "segments: NULL"),
        ((segs, 1, 4, 4, None, ids.ctypes.data, 2, 1, 1), "device_ids: NULL"),
        ((segs, 1, 4, 4, ids.ctypes.data, None, 2, 1, 1), "host_ids: NULL"),
        ((segs, 1, 4, 4, ids.ctypes.data, ids.ctypes.data, -2, 1, 1), "num_ids: -2"),
        ((segs, -1, 4, 4, ids.ctypes.data, ids.ctypes.data, 2, 1, 1), "num_segments: -1"),
    ]
    for argv, message in cases:
        assert lib.fkv_swap_cpu(*argv) == 1
        assert message in lib.fkv_last_error().decode()
        assert lib.fkv_swap_cuda(*argv[:-1], None) == 1
        assert message in lib.fkv_last_error().decode()
    assert not dev.any() and not host.any()


def test_errors_are_per_thread() -> None:
    """Each thread reads its own last error (two stream threads fail independently)."""
    dev = np.zeros((4, 16), np.uint8)
    host = np.zeros((4, 16), np.uint8)
    segs = core.make_segments([(dev.ctypes.data, host.ctypes.data, 16)])
    messages: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def fail(tag: str, d: int) -> None:
        dev_ids = np.array([d], np.int64)
        host_ids = np.array([0], np.int64)
        barrier.wait()
        rc = core._lib.fkv_swap_cpu(
            segs, 1, 4, 4, dev_ids.ctypes.data, host_ids.ctypes.data, 1, 1, 1
        )
        # Both threads have failed before either reads its message.
        barrier.wait(timeout=30)
        messages[tag] = f"rc={rc} " + core._lib.fkv_last_error().decode()

    threads = [threading.Thread(target=fail, args=(t, d)) for t, d in (("a", 7), ("b", 9))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert messages["a"].startswith("rc=1 device_ids[0]=7 out of range")
    assert messages["b"].startswith("rc=1 device_ids[0]=9 out of range")


# ---------------------------------------------------------------- host memory


@pytest.mark.parametrize("nbytes", [4096, 3 << 20, (64 << 20) + 123])
def test_host_alloc_is_zeroed_aligned_bound_and_freeable(nbytes: int) -> None:
    ptr = core.host_alloc(nbytes, numa_node=0)
    try:
        assert ptr % (2 << 20 if nbytes >= 2 << 20 else 4096) == 0
        buf = HostBuffer.at(ptr, nbytes)
        assert not buf.array[::4096].any() and buf.array[-1] == 0
        buf.array[:] = 0xAB
        assert core.numa_node_of(ptr) == 0
        assert core.numa_node_of(ptr + nbytes - 1) == 0
    finally:
        core.host_free(ptr, nbytes, pinned=False)


def test_host_alloc_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bytes: must be > 0"):
        core.host_alloc(0)
    with pytest.raises(ValueError, match="numa_node: 4096 out of range"):
        core.host_alloc(4096, numa_node=4096)
    with pytest.raises(ValueError, match="numa_node: -2 out of range"):
        core.host_alloc(4096, numa_node=-2)
    offline = max(os.sysconf("SC_NPROCESSORS_CONF"), 64) + 1
    with pytest.raises(ValueError, match=f"numa_node: {offline} is not an online NUMA node"):
        core.host_alloc(4096, numa_node=offline)


@pytest.mark.skipif(core.cuda_device_count() > 0, reason="checks the no-GPU failure mode")
def test_pinned_alloc_without_gpu_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match=r"cudaHostRegister|built without CUDA"):
        core.host_alloc(1 << 20, pin=True)


def test_host_free_checks_what_it_frees() -> None:
    ptr = core.host_alloc(1 << 20)
    with pytest.raises(ValueError, match="bytes: 4096 does not match the allocation's 1048576"):
        core.host_free(ptr, 4096, pinned=False)
    with pytest.raises(ValueError, match="pinned: 1 does not match"):
        core.host_free(ptr, 1 << 20, pinned=True)
    with pytest.raises(ValueError, match="was not returned by fkv_host_alloc"):
        core.host_free(ptr + 4096, 1 << 20, pinned=False)
    # Still mapped after the rejected frees.
    HostBuffer.at(ptr, 1 << 20).array[:] = 1
    core.host_free(ptr, 1 << 20, pinned=False)
    with pytest.raises(ValueError, match="or was freed"):
        core.host_free(ptr, 1 << 20, pinned=False)


# ---------------------------------------------------------------- process-level


def _run_python(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_default_threads_follow_affinity_and_env() -> None:
    code = (
        "import os; os.sched_setaffinity(0, {0}); "
        "from fastkv.ops import core; print(core.default_num_threads())"
    )
    assert _run_python(code) == "1"
    code = "from fastkv.ops import core; print(core.default_num_threads())"
    assert _run_python(code, {"FASTKV_NUM_THREADS": "5"}) == "5"
    expected = min(len(os.sched_getaffinity(0)), 8)
    env = {k: v for k, v in os.environ.items() if k != "FASTKV_NUM_THREADS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert proc.stdout.strip() == str(expected)


def test_swaps_work_in_a_child_forked_after_the_pool_started() -> None:
    code = """
import os, numpy as np
from fastkv.ops import core
block = 1 << 20
dev = np.random.default_rng(0).integers(0, 256, (16, block), dtype=np.uint8)
host = np.zeros((16, block), np.uint8)
segs = [(dev.ctypes.data, host.ctypes.data, block)]
ids = np.arange(16, dtype=np.int64)
core.swap_cpu(segs, 16, 16, ids, ids[::-1].copy(), 1, 4)   # starts the pool's workers
pid = os.fork()
if pid == 0:
    ok = False
    try:
        host[:] = 0
        core.swap_cpu(segs, 16, 16, ids, ids, 1, 4)
        ok = np.array_equal(host, dev)
    finally:
        os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    assert _run_python(code) == "0"


def test_ctypes_binding_exposes_the_documented_abi() -> None:
    assert core._lib.fkv_abi_version() == core.ABI_VERSION
    assert ctypes.sizeof(core.Segment) == 32
    assert core.MIN_ACCESS_BYTES == 4


def test_a_host_region_past_the_end_of_its_allocation_is_refused() -> None:
    """An overstated num_host_blocks would copy past a host_alloc allocation; the
    registry of live allocations catches it before any byte moves."""
    device = np.random.default_rng(0).integers(0, 256, 8 * 4096, dtype=np.uint8)
    host = core.host_alloc(2 * 4096)
    try:
        segment = [(device.ctypes.data, host, 4096)]
        with pytest.raises(ValueError, match=r"num_host_blocks: 1048576 .* run past the end"):
            core.swap_cpu(segment, 8, 1 << 20, [0], [1 << 19], core.Direction.D2H)
        core.swap_cpu(segment, 8, 2, [3], [1], core.Direction.D2H)  # within it: fine
        copied = np.ctypeslib.as_array((ctypes.c_uint8 * 4096).from_address(host + 4096))
        np.testing.assert_array_equal(copied, device[3 * 4096 : 4 * 4096])
    finally:
        core.host_free(host, 2 * 4096, False)


def test_a_cpu_layout_ignores_per_layer_waits_and_checks_their_shape() -> None:
    """Layout.swap's wait_events (fkv_layout_swap_ordered): a CPU layout copies
    synchronously and ignores them; their count must match layers x waits_per_layer
    and the bounds are checked before anything is copied."""
    layers, bs, n = 3, 64, 8
    dev = [np.zeros(n * bs, np.uint8) for _ in range(layers)]
    host = [np.arange(n * bs, dtype=np.uint32).astype(np.uint8) + k for k in range(layers)]
    segs = [(d.ctypes.data, h.ctypes.data, bs) for d, h in zip(dev, host, strict=True)]
    layout = core.Layout(segs, 1, n, n)
    ids_d, ids_h = np.array([1, 4], np.int64), np.array([2, 7], np.int64)
    try:
        waits = (ctypes.c_void_p * (layers * 2))()
        layout.swap(ids_d, ids_h, core.Direction.H2D, wait_events=waits, waits_per_layer=2)
        for k in range(layers):
            got = dev[k].reshape(n, bs)[[1, 4]]
            assert np.array_equal(got, host[k].reshape(n, bs)[[2, 7]])
            dev[k][:] = 0
        with pytest.raises(ValueError, match=r"wait_events: 5 entries, expected .* 3 \* 2"):
            layout.swap(
                ids_d,
                ids_h,
                core.Direction.H2D,
                wait_events=(ctypes.c_void_p * 5)(),
                waits_per_layer=2,
            )
        big = 1025
        with pytest.raises(ValueError, match=r"waits_per_layer: 1025 out of range \[0, 1024\]"):
            layout.swap(
                ids_d,
                ids_h,
                core.Direction.H2D,
                wait_events=(ctypes.c_void_p * (layers * big))(),
                waits_per_layer=big,
            )
        with pytest.raises(ValueError, match="wait_events: NULL with waits_per_layer=2"):
            layout.swap(ids_d, ids_h, core.Direction.H2D, waits_per_layer=2)
        assert all(not d.any() for d in dev)  # the refused calls copied nothing
    finally:
        layout.close()


@pytest.mark.parametrize(("kind", "heads", "tokens"), [("bf16", 2, 4), ("uint8", 1, 1)])
@pytest.mark.parametrize("via", ["swap_cpu", "layout"])
def test_a_host_block_is_its_tensors_device_blocks_back_to_back(
    kind: str, heads: int, tokens: int, via: str
) -> None:
    """The host tier's layout: after a swap-out, host block h is ONE contiguous
    region whose bytes are the concatenation of every tensor's device block, in
    tensor order (what storage stores and checksums). uint8 with 1 head and 1
    token: 8-byte K/V blocks and 4-byte fp8 scale blocks, so tensor prefixes are
    only 4-byte aligned. A swap-in restores every device block from it."""
    rng = np.random.default_rng(41)
    layers, ndev, nhost = 3, 12, 10
    nbytes = host_bytes_needed(kind, layers, nhost, heads, tokens, 8)
    host = HostBuffer.numpy(nbytes)
    cache = make_cache(rng, kind, layers, ndev, nhost, host, heads, tokens, 8)
    sizes = [d[0].nbytes for d in cache.device]
    assert cache.host_stride == sum(sizes) and nbytes == nhost * sum(sizes)
    assert [p - host.ptr for p in cache.host_ptrs] == list(np.cumsum([0, *sizes[:-1]]))
    dev_ids = np.array([7, 0, 11, 3, 4], np.int64)
    host_ids = np.array([9, 2, 0, 5, 6], np.int64)  # a run of two (3,4 -> 5,6)
    segs = cache.segments()
    layout = (
        core.Layout(segs, cache.tensors_per_layer, ndev, nhost) if via == "layout" else None
    )
    if layout is None:
        core.swap_cpu(segs, ndev, nhost, dev_ids, host_ids, D2H)
    else:
        layout.swap(dev_ids, host_ids, D2H)
    tier = host.array[:nbytes].reshape(nhost, -1)
    for d, h in zip(dev_ids, host_ids, strict=True):
        want = b"".join(dev[d].tobytes() for dev in cache.device)
        assert tier[h].tobytes() == want, (d, h)
    originals = [dev.copy() for dev in cache.device]
    for dev in cache.device:
        dev[:] = 0
    back = np.array([1, 2, 5, 6, 8], np.int64)
    if layout is None:
        core.swap_cpu(segs, ndev, nhost, back, host_ids, H2D)
    else:
        layout.swap(back, host_ids, H2D)
        layout.close()
    for s, dev in enumerate(cache.device):
        assert_bytes_equal(dev[back], originals[s][dev_ids], f"segment {s}")


def _tier_segments(tier: int, dev: np.ndarray, sizes: list[int], stride: int) -> list:
    prefix = np.cumsum([0, *sizes[:-1]])
    return [
        (dev.ctypes.data + int(p) * 64, tier + int(p), bb, stride)
        for p, bb in zip(prefix, sizes, strict=True)
    ]


def test_a_host_stride_that_runs_past_the_allocation_is_refused() -> None:
    """The registry check of a strided region uses its span, (n - 1) * stride +
    block_bytes: one host block too many is refused naming the stride, what the
    region needs and what the allocation has left, and nothing is copied."""
    sizes = [64, 64, 16]
    stride = sum(sizes)
    dev = np.random.default_rng(3).integers(0, 256, 64 * stride, dtype=np.uint8)
    tier = core.host_alloc(4 * stride)
    try:
        segs = _tier_segments(tier, dev, sizes, stride)
        view = np.ctypeslib.as_array((ctypes.c_uint8 * (4 * stride)).from_address(tier))
        view[:] = 0
        with pytest.raises(ValueError) as info:
            core.swap_cpu(segs, 64, 5, [0], [4], D2H)
        msg = str(info.value)
        assert "num_host_blocks: 5 blocks of 64 bytes, host_stride 144 apart" in msg
        assert "at segments[0].host_base run past the end" in msg
        assert f"({4 * stride + 64} bytes needed, {4 * stride} left there)" in msg
        assert not view.any()
        core.swap_cpu(segs, 64, 4, [0], [3], D2H)  # the last block that fits: fine
        assert view[3 * stride : 3 * stride + 64].tobytes() == dev[:64].tobytes()
    finally:
        core.host_free(tier, 4 * stride, False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"stride1": 60},
            "segments[1].host_stride: 60 is not a multiple of 4 at least block_bytes 64",
        ),
        ({"stride1": 146}, "segments[1].host_stride: 146 is not a multiple of 4"),
        (
            {"stride1": 148},
            "segments[1].host_stride: 148 differs from host_stride 144 of segments[0]",
        ),
        (
            {"shift1": -4},
            "segments[1].host_base: host region overlaps the host region of segments[0]",
        ),
        (
            {"shift2": 4},
            "segments[2].host_base: host region overlaps the host region of "
            "segments[0] (its block 0 ends at",
        ),
    ],
)
def test_interleaved_host_regions_must_tile_one_stride(change: dict, message: str) -> None:
    """Interleaved host regions are destinations side by side in every host block:
    a shared stride, block 0s that do not overlap and fit one stride. Each
    violation is refused before any byte moves, naming the field and its bound."""
    sizes = [64, 64, 16]
    stride = sum(sizes)
    dev = np.random.default_rng(4).integers(0, 256, 8 * stride, dtype=np.uint8)
    host = HostBuffer.numpy(4 * stride + 64)
    segs = [list(s) for s in _tier_segments(host.ptr, dev, sizes, stride)]
    for key, value in change.items():
        field, s = key[:-1], int(key[-1])
        if field == "stride":
            segs[s][3] = value
        else:
            segs[s][1] += value
    with pytest.raises(ValueError, match=re.escape(message)):
        core.swap_cpu([tuple(s) for s in segs], 8, 4, [0, 1], [2, 3], D2H)
    assert not host.array.any()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ((16, 32, 64, (1 << 64) + 128), r"segments\[0\]\.host_stride: 18446744073709551744 "),
        ((16, 32, (1 << 64) + 64), r"segments\[0\]\.block_bytes: 18446744073709551680 "),
        (((1 << 64) + 16, 32, 64), r"segments\[0\]\.device_base: 18446744073709551632 "),
        ((16, -32, 64), r"segments\[0\]\.host_base: -32 is outside \[0, "),
    ],
)
def test_a_segment_value_that_does_not_fit_its_field_is_refused(entry, message) -> None:
    """ctypes wraps an int too large for its field: a host_stride of 2**64 + 128
    became a valid 128. make_segments refuses it, naming the field and value."""
    with pytest.raises(ValueError, match=message):
        core.make_segments([entry])
