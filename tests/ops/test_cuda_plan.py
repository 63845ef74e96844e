"""The CUDA kernel's index mapping and launch planning, checked on the CPU.

`fkv_cuda_plan.h` holds the mapping the kernel and its launchers use; the harness
(mapping_harness.cc) compiles it for the host with the core's own validation and
plays whole grids — every CTA's grid-stride chunks, every thread's unrolled
elements — on host memory. Random block sizes, base alignments, id sets (scattered
and runs), segment counts (up to 800), grid sizes, copy-engine thresholds, staging
slot sizes and descriptor groups are compared byte for byte with a plain numpy copy,
so CI catches mapping bugs without a GPU. The harness also counts the writes to every
destination byte: a call passes only if each byte of its destination blocks is written
exactly once and nothing else is written (a byte written twice with the right value
would pass a comparison of results), and planted mutants check that it catches bugs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fastkv.ops import core

from .native_harness import build_harness

NEVER = 2**63 - 1
KIB = 1024
H2D, D2H = int(core.Direction.H2D), int(core.Direction.D2H)


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> ctypes.CDLL:
    lib = build_harness(tmp_path_factory.mktemp("plan"), "mapping_harness.cc")
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    seg_ptr = ctypes.POINTER(core.Segment)
    lib.sim_swap_cuda.argtypes = [seg_ptr, i32, i64, i64, p, p, i64, i32, i64, i32, i64, i32, p]
    lib.sim_layout_swap.argtypes = [
        seg_ptr,
        i32,
        i32,
        i64,
        i64,
        p,
        p,
        i64,
        i32,
        i32,
        i32,
        i32,
        i64,
        i32,
        i64,
        p,
    ]
    lib.sim_set_mutant.argtypes = [i32]
    lib.sim_set_evict_launch_bytes.argtypes = [i64]
    lib.sim_div.argtypes = [i64, i64, ctypes.POINTER(i32)]
    lib.sim_div.restype = i64
    lib.sim_memcpy_min_run.argtypes = [i64, i64]
    lib.sim_memcpy_min_run.restype = i64
    lib.sim_locate.argtypes = [p, i32, i64, i64, i64, p, p, i32, p]
    return lib


DEFAULT_EVICT_LAUNCH_BYTES = 2 << 20  # the core's default (fkv_cuda_plan.h)


@pytest.fixture
def evict_bound(harness):
    """Sets the simulated launcher's evict-launch bound; restores the default."""
    yield harness.sim_set_evict_launch_bytes
    harness.sim_set_evict_launch_bytes(DEFAULT_EVICT_LAUNCH_BYTES)


class Regions:
    """Device and host regions of random bytes with random base misalignment."""

    def __init__(
        self,
        rng: np.random.Generator,
        block_sizes: list[int],
        ndev: int,
        nhost: int,
        aligned: bool = False,
        shift: int | None = None,
        interleaved: bool = True,
    ):
        # interleaved: the host tier's layout, host block b one contiguous region of
        # S = sum(block_sizes) bytes holding every segment's part at its prefix sum
        # (bases only as aligned as those sums); else a host region per segment.
        self.block_sizes = block_sizes
        self.ndev, self.nhost = ndev, nhost
        self.dev: list[np.ndarray] = []
        self.host: list[np.ndarray] = []
        self._keep: list[np.ndarray] = []
        if shift is None:
            # Bases 4-, 8- or 16-byte aligned (16 where asked, as allocators give),
            # or `shift` bytes past 16-byte alignment, every base alike.
            shift = 0 if aligned else int(rng.choice([0, 4, 8, 12]))
        self.host_stride = sum(block_sizes) if interleaved else 0
        sides = [(ndev, self.dev)] + ([] if interleaved else [(nhost, self.host)])
        for bb in block_sizes:
            for n, out in sides:
                out.append(self._array(rng, n, bb, shift))
        if interleaved:
            tier = self._array(rng, nhost, self.host_stride, shift)
            prefix = 0
            for bb in block_sizes:
                self.host.append(tier[:, prefix : prefix + bb])
                prefix += bb

    def _array(self, rng: np.random.Generator, n: int, bb: int, shift: int) -> np.ndarray:
        raw = np.empty(n * bb + 64, np.uint8)
        off = (-raw.ctypes.data) % 16 + shift
        view = raw[off : off + n * bb].reshape(n, bb)
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        self._keep.append(raw)
        return view

    def segments(self) -> ctypes.Array:
        return core.make_segments(
            [
                (d.ctypes.data, h.ctypes.data, bb, self.host_stride or bb)
                for d, h, bb in zip(self.dev, self.host, self.block_sizes, strict=True)
            ]
        )

    def expected(self, dev_ids, host_ids, h2d: bool, selected) -> tuple[list, list]:
        dev = [d.copy() for d in self.dev]
        host = [h.copy() for h in self.host]
        for s in selected:
            if h2d:
                dev[s][dev_ids] = self.host[s][host_ids]
            else:
                host[s][host_ids] = self.dev[s][dev_ids]
        return dev, host

    def check(self, expected: tuple[list, list], what: str) -> None:
        for s, (d, e) in enumerate(zip(self.dev, expected[0], strict=True)):
            assert np.array_equal(d, e), f"{what}: device segment {s} differs"
        for s, (h, e) in enumerate(zip(self.host, expected[1], strict=True)):
            assert np.array_equal(h, e), f"{what}: host segment {s} differs"


def random_block_size(rng: np.random.Generator) -> int:
    kind = rng.integers(0, 4)
    if kind == 0:
        return 4 * int(rng.integers(1, 64))  # tiny, often not 16-byte multiples
    if kind == 1:
        return 16 * int(rng.integers(1, 1100))  # up to ~17 KiB: one or two chunks
    if kind == 2:
        return 4 * int(rng.integers(4000, 13000))  # odd multiples of 4 over 16 KiB
    return int(rng.choice([4096, 8192, 16384, 32768, 65536]))


def random_ids(rng: np.random.Generator, n: int, ndev: int, nhost: int):
    """Scattered ids with a consecutive run mixed in (coalesced by the planner)."""
    n = min(n, ndev, nhost)
    run = int(rng.integers(0, n + 1))
    d_start = int(rng.integers(0, ndev - run + 1))
    h_start = int(rng.integers(0, nhost - run + 1))
    d_run = np.arange(d_start, d_start + run)
    h_run = np.arange(h_start, h_start + run)
    d_rest = rng.permutation(np.setdiff1d(np.arange(ndev), d_run))[: n - run]
    h_rest = rng.permutation(np.setdiff1d(np.arange(nhost), h_run))[: n - run]
    cut = int(rng.integers(0, n - run + 1))
    d = np.r_[d_rest[:cut], d_run, d_rest[cut:]].astype(np.int64)
    h = np.r_[h_rest[:cut], h_run, h_rest[cut:]].astype(np.int64)
    return d, h


def random_memcpy_min(rng: np.random.Generator, block_sizes: list[int]) -> int:
    kind = rng.integers(0, 4)
    if kind == 0:
        return NEVER  # kernel only
    if kind == 1:
        return 0  # copy engine only
    return int(rng.choice(block_sizes)) * int(rng.integers(1, 6))  # mixed


@pytest.mark.parametrize("seed", range(60))
def test_swap_cuda_plan_matches_a_plain_copy(harness, evict_bound, seed: int) -> None:
    rng = np.random.default_rng(seed)
    nsegs = int(rng.integers(700, 820)) if seed % 15 == 0 else int(rng.integers(1, 9))
    small = nsegs > 100
    sizes = [4 * int(rng.integers(1, 40)) if small else random_block_size(rng)] * nsegs
    if not small:
        sizes = [random_block_size(rng) for _ in range(nsegs)]
    ndev, nhost = int(rng.integers(4, 100)), int(rng.integers(4, 100))
    regions = Regions(rng, sizes, ndev, nhost, interleaved=seed % 2 == 0)
    d, h = random_ids(rng, int(rng.integers(1, 100)), ndev, nhost)
    direction = int(rng.integers(0, 2))
    memcpy_min = random_memcpy_min(rng, sizes)
    grid = int(rng.integers(1, 40))
    slot_bytes = int(rng.choice([1000, 1024, 4096, 64 << 10]))
    max_group = int(rng.choice([0, 1, 3, 7]))
    evict_bound(int(rng.choice([0, 16 << 10, 64 << 10, 2 << 20])))  # evictions: cut launches
    expected = regions.expected(d, h, direction == H2D, range(nsegs))
    totals = (ctypes.c_int64 * 7)()
    rc = harness.sim_swap_cuda(
        regions.segments(),
        nsegs,
        ndev,
        nhost,
        d.ctypes.data,
        h.ctypes.data,
        d.size,
        direction,
        memcpy_min,
        grid,
        slot_bytes,
        max_group,
        totals,
    )
    assert rc == 0, (rc, core._lib.fkv_last_error())
    regions.check(expected, f"seed {seed}")
    kernel_bytes, memcpy_bytes, _, misaligned, _, _, _ = list(totals)
    # Every byte moved exactly once, by the kernel or by the copy engine.
    assert kernel_bytes + memcpy_bytes == d.size * sum(sizes)
    assert misaligned == 0
    if memcpy_min == NEVER:
        assert memcpy_bytes == 0
    if memcpy_min == 0:
        assert kernel_bytes == 0


@pytest.mark.parametrize("seed", range(40))
def test_layout_plan_matches_a_plain_copy(harness, seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    per_layer = int(rng.choice([1, 2, 4]))
    layers = int(rng.integers(1, 6)) if seed % 10 else 200  # 200 layers x per_layer segments
    nsegs = per_layer * layers
    sizes = [random_block_size(rng) for _ in range(per_layer)] * layers
    if nsegs > 100:
        sizes = [4 * int(rng.integers(1, 64)) for _ in range(per_layer)] * layers
    ndev, nhost = int(rng.integers(4, 160)), int(rng.integers(4, 160))
    regions = Regions(rng, sizes, ndev, nhost)
    d, h = random_ids(rng, int(rng.integers(0, 160)), ndev, nhost)
    direction = int(rng.integers(0, 2))
    first = int(rng.integers(0, layers))
    count = int(rng.integers(1, layers - first + 1))
    memcpy_min = random_memcpy_min(rng, sizes)
    # Small and odd slot sizes: several slots per call, and padding that must fit.
    slot_bytes = int(rng.choice([256, 1000, 1024, 1500, 64 << 10]))
    selected = range(first * per_layer, (first + count) * per_layer)
    expected = regions.expected(d, h, direction == H2D, selected)
    totals = (ctypes.c_int64 * 7)()
    grid = int(rng.integers(1, 33))
    # Layer events (per-layer launches) or none (one launch when every layer moves).
    has_events = int(rng.integers(0, 2))
    rc = harness.sim_layout_swap(
        regions.segments(),
        nsegs,
        per_layer,
        ndev,
        nhost,
        d.ctypes.data,
        h.ctypes.data,
        d.size,
        direction,
        first,
        count,
        has_events,
        memcpy_min,
        grid,
        slot_bytes,
        totals,
    )
    assert rc == 0, (rc, core._lib.fkv_last_error())
    regions.check(expected, f"seed {seed}")
    assert totals[0] + totals[1] == d.size * sum(sizes[s] for s in selected)
    assert totals[3] == 0


WRITTEN_TWICE, MISSED_OR_STRAY = -5, -6  # the harness's exactly-once verdicts


def layout_call(harness, regions: Regions, per_layer: int, d, h, direction: int, **kw):
    """sim_layout_swap over every layer of `regions` (first/num layers, has_events,
    memcpy_min, grid and slot_bytes from kw); returns (rc, totals)."""
    nsegs = len(regions.block_sizes)
    totals = (ctypes.c_int64 * 7)()
    rc = harness.sim_layout_swap(
        regions.segments(),
        nsegs,
        per_layer,
        regions.ndev,
        regions.nhost,
        d.ctypes.data,
        h.ctypes.data,
        d.size,
        direction,
        kw.get("first", 0),
        kw.get("layers", nsegs // per_layer),
        kw.get("has_events", 0),
        kw.get("memcpy_min", NEVER),
        kw.get("grid", 16),
        kw.get("slot_bytes", 64 << 10),
        totals,
    )
    return rc, list(totals)


@pytest.mark.parametrize("seed", range(30))
def test_one_launch_eviction_writes_every_destination_byte_once(
    harness, evict_bound, seed: int
) -> None:
    """The path every eviction takes when nothing records between layers: one launch
    per staged slot over the whole segment table (chunk prefixes across layers). Each
    destination byte is written exactly once with the right value, and the same call
    with layer events (per-layer launches) makes `layers` times as many launches."""
    rng = np.random.default_rng(3000 + seed)
    per_layer = int(rng.choice([2, 4]))  # K and V, or K and V with fp8 scale blocks
    layers = 80 if seed % 6 == 0 else int(rng.integers(2, 7))
    # Small blocks keep 80 layers in memory.
    kv = 16 * int(rng.integers(1, 128)) if layers == 80 else random_block_size(rng)
    layer_sizes = [kv, kv] + [int(rng.choice([4, 16, 32]))] * (per_layer - 2)
    sizes = layer_sizes * layers
    ndev, nhost = int(rng.integers(4, 120)), int(rng.integers(4, 120))
    regions = Regions(rng, sizes, ndev, nhost)
    d, h = random_ids(rng, int(rng.integers(1, 120)), ndev, nhost)
    direction = D2H if seed % 5 else H2D
    kw = {
        "memcpy_min": random_memcpy_min(rng, layer_sizes),
        "grid": int(rng.integers(1, 33)),
        "slot_bytes": int(rng.choice([256, 1000, 1500, 64 << 10])),  # several slots too
    }
    expected = regions.expected(d, h, direction == H2D, range(len(sizes)))
    evict_bound(0)  # launches not cut, so that they can be counted (cut: the next test)
    rc, one = layout_call(harness, regions, per_layer, d, h, direction, has_events=0, **kw)
    assert rc == 0, (rc, core._lib.fkv_last_error())
    regions.check(expected, f"seed {seed}, one launch")
    assert one[0] + one[1] == d.size * sum(sizes) and one[3] == 0
    rc, per = layout_call(harness, regions, per_layer, d, h, direction, has_events=1, **kw)
    assert rc == 0, (rc, core._lib.fkv_last_error())
    regions.check(expected, f"seed {seed}, per layer")
    assert per[:2] == one[:2]  # the same bytes by kernel and by copy engine
    assert per[2] == layers * one[2], (per[2], one[2])


@pytest.mark.parametrize("seed", range(24))
def test_one_launch_eviction_bounded_launches_write_every_byte_once(
    harness, evict_bound, seed: int
) -> None:
    """Issue 26 item 2: an eviction is cut into launches of at most the evict-launch
    bound (in 16 KiB chunks, at least one per CTA), so its CTAs give their SMs back
    between launches. The cut launches write every destination byte exactly once,
    none moves more than the bound, and loads are not cut."""
    rng = np.random.default_rng(5000 + seed)
    per_layer = int(rng.choice([2, 4]))
    layers = int(rng.integers(2, 9))
    kv = random_block_size(rng)
    layer_sizes = [kv, kv] + [int(rng.choice([4, 16, 32]))] * (per_layer - 2)
    sizes = layer_sizes * layers
    ndev, nhost = int(rng.integers(8, 100)), int(rng.integers(8, 100))
    regions = Regions(rng, sizes, ndev, nhost)
    d, h = random_ids(rng, int(rng.integers(1, 100)), ndev, nhost)
    grid = int(rng.integers(1, 33))
    bound = int(rng.choice([1, 16 << 10, 100 << 10, 256 << 10, 2 << 20]))
    kw = {
        "memcpy_min": random_memcpy_min(rng, layer_sizes),
        "grid": grid,
        "slot_bytes": int(rng.choice([1000, 64 << 10])),
        "has_events": int(rng.integers(0, 2)),
    }
    max_bytes = max(bound // (16 * KIB), grid) * 16 * KIB
    for direction in (D2H, H2D):
        expected = regions.expected(d, h, direction == H2D, range(len(sizes)))
        evict_bound(0)
        rc, whole = layout_call(harness, regions, per_layer, d, h, direction, **kw)
        assert rc == 0, (rc, core._lib.fkv_last_error())
        evict_bound(bound)
        rc, cut = layout_call(harness, regions, per_layer, d, h, direction, **kw)
        assert rc == 0, (rc, core._lib.fkv_last_error())
        regions.check(expected, f"seed {seed}, direction {direction}")
        assert cut[:2] == whole[:2]  # the same bytes, by kernel and by copy engine
        if direction == H2D:
            assert cut[2] == whole[2]  # loads are not cut
            continue
        assert cut[6] <= max_bytes, (cut[6], max_bytes)
        # As few launches as the bound allows: every launch but the last of a slot
        # holds a full bound of chunks with work (never more launches than chunks).
        assert cut[2] >= whole[2] and cut[2] >= -(-cut[0] // max_bytes)
        if whole[6] > max_bytes:
            assert cut[2] > whole[2]


@pytest.mark.parametrize(
    ("mutant", "verdicts"),
    [
        (1, (WRITTEN_TWICE,)),  # every slot's launch reads the first slot's ids
        (2, (WRITTEN_TWICE,)),  # run lengths dropped: copy-engine blocks moved twice
        (3, (MISSED_OR_STRAY,)),  # the launch sized by the first layer only
        (4, (MISSED_OR_STRAY,)),  # a bounded eviction leaves out its last launch
        (5, (WRITTEN_TWICE,)),  # each bounded launch after the first starts a chunk early
    ],
)
def test_one_launch_harness_catches_planted_mutants(
    harness, evict_bound, mutant: int, verdicts
) -> None:
    """Each planted bug of the one-launch path fails the exactly-once check; mutant 2
    writes the right bytes (twice), so a comparison of results alone would pass."""
    rng = np.random.default_rng(99)
    per_layer, layers, bb = 2, 4, 4096
    regions = Regions(rng, [bb, 40 * KIB] * layers, 32, 40)
    d = np.array([0, 1, 2, 3, 4, 10, 7, 20], np.int64)  # a run of 5, then scattered ids
    h = np.array([5, 6, 7, 8, 9, 1, 30, 2], np.int64)
    # The run of 40 KiB blocks goes to the copy engine; 4 ids per staging slot.
    kw = {"memcpy_min": 3 * 40 * KIB, "grid": 5, "slot_bytes": 128}
    evict_bound(16 * KIB)  # launches of 5 chunks (one per CTA): ~20 per slot
    expected = regions.expected(d, h, False, range(2 * layers))
    rc, _ = layout_call(harness, regions, per_layer, d, h, D2H, **kw)
    assert rc == 0, rc
    regions.check(expected, "without a mutant")
    harness.sim_set_mutant(mutant)
    try:
        rc, _ = layout_call(harness, regions, per_layer, d, h, D2H, **kw)
    finally:
        harness.sim_set_mutant(0)
    assert rc in verdicts, rc
    if mutant == 2:
        regions.check(expected, "right bytes, written twice")


EDGES = [0, 1, 3, 16, 2048, 4095, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**32 + 7, 2**33 + 5]


@pytest.mark.parametrize("a", [*EDGES, NEVER])
def test_divisions_take_32_bits_only_where_both_values_fit(harness, a: int) -> None:
    """The kernel's divisions (gather elements, chunk ids, next chunk, copy-engine
    threshold) take the 32-bit path exactly where dividend and divisor are below
    2**32, and give the 64-bit quotient on both sides of that edge: a 32-bit path
    taken for values just over it would truncate them."""
    for b in [e for e in EDGES if e > 0]:
        fast = ctypes.c_int32(-1)
        q = harness.sim_div(a, b, ctypes.byref(fast))
        assert q == a // b, (a, b, q)
        assert fast.value == int(a < 2**32 and b < 2**32), (a, b, fast.value)
        if a > 0:
            assert harness.sim_memcpy_min_run(a, b) == -(-a // b), (a, b)


def locate(harness, raw: np.ndarray, nseg: int, count: int, g: int, k: int, d, h, h2d: int):
    """(dst, src, chunk bytes, vector width, ids in the chunk) of element k of chunk g."""
    out = (ctypes.c_uint64 * 5)()
    rc = harness.sim_locate(
        raw.ctypes.data, nseg, count, g, k, d.ctypes.data, h.ctypes.data, h2d, out
    )
    assert rc == 0, rc
    return tuple(out)


def test_vector_width_follows_the_alignment_of_both_sides(harness) -> None:
    """16-byte accesses only where both bases and the block size allow them."""
    cases = [
        ((0, 0, 4096, 4096), 16),
        ((8, 0, 4096, 4096), 8),
        ((0, 4, 4096, 4096), 4),
        ((0, 0, 4104, 4104), 8),
        ((0, 0, 4096, 4096 + 8200), 8),  # an interleaved tier whose block is 8-aligned
        ((0, 0, 4096, 4096 + 4100), 4),
    ]
    ids = np.array([3], np.int64)
    for (dev_shift, host_shift, bb, stride), vec in cases:
        seg = np.array([1 << 40 | dev_shift, 1 << 41 | host_shift, bb, stride], np.int64)
        dst, src, _, width, _ = locate(harness, seg, 1, 1, 0, 0, ids, ids, 0)
        assert width == vec, (dev_shift, host_shift, bb, stride)
        assert dst % vec == 0 and src % vec == 0
        assert dst == (1 << 41 | host_shift) + 3 * stride


def test_offsets_beyond_4_gib_are_computed_in_64_bits(harness) -> None:
    """Block ids times block sizes far past 2**32, for both sides, every chunk of a
    multi-chunk block and every block of a gather chunk, on made-up base addresses
    (nothing is dereferenced)."""
    bb = [40 * 1024 + 4, 8192, 4]  # three segments: multi-chunk, 2 ids/chunk, 4096 ids/chunk
    nseg = len(bb)
    stride = 1 << 16  # host blocks of an interleaved tier (its S, 16-aligned) and a gap
    raw = np.zeros(4 * nseg, np.int64)
    bases = [
        (0x7F0000000000 + s * (1 << 36), 0x100000000000 + s * (1 << 38)) for s in range(nseg)
    ]
    for s, (dev, host) in enumerate(bases):
        raw[4 * s : 4 * s + 4] = (dev, host, bb[s], stride)
    count = 3
    dev_ids = np.array([(1 << 21) + 5, 7, (1 << 22) - 1], np.int64)  # x 40 KiB: > 64 GiB
    host_ids = np.array([(1 << 23) + 1, (1 << 20) * 3, 11], np.int64)

    def expect(s: int, i: int, off: int, h2d: int) -> tuple[int, int]:
        dev = bases[s][0] + int(dev_ids[i]) * bb[s] + off
        host = bases[s][1] + int(host_ids[i]) * stride + off
        return (dev, host) if h2d else (host, dev)

    for h2d in (0, 1):
        # Segment 0: one 16 KiB piece of one block per chunk, elements consecutive.
        for i in range(count):
            for c in range(3):
                g = i * 3 + c
                dst, src, nbytes, vec, ids = locate(
                    harness, raw, nseg, count, g, 1, dev_ids, host_ids, h2d
                )
                assert ids == 1 and nbytes == min(16384, bb[0] - c * 16384)
                assert (dst, src) == expect(0, i, c * 16384 + vec, h2d), (i, c, h2d)
        # Segment 1: ids 0-1 in chunk 9, id 2 in chunk 10; chunk 11 is empty.
        for g, first, n in ((9, 0, 2), (10, 2, 1)):
            per_block = bb[1] // 16
            for j in range(n):
                for e in (0, per_block - 1):
                    dst, src, nbytes, vec, ids = locate(
                        harness, raw, nseg, count, g, j * per_block + e, dev_ids, host_ids, h2d
                    )
                    assert (ids, nbytes, vec) == (n, n * bb[1], 16)
                    assert (dst, src) == expect(1, first + j, e * 16, h2d), (g, j, e, h2d)
        assert locate(harness, raw, nseg, count, 11, 0, dev_ids, host_ids, h2d)[4] == 0
        # Segment 2: every id's 4-byte block in chunk 12, then two empty chunks.
        for j in range(count):
            dst, src, nbytes, vec, ids = locate(
                harness, raw, nseg, count, 12, j, dev_ids, host_ids, h2d
            )
            assert (ids, nbytes, vec) == (3, 12, 4)
            assert (dst, src) == expect(2, j, 0, h2d)
        for g in (13, 14):
            assert locate(harness, raw, nseg, count, g, 0, dev_ids, host_ids, h2d)[4] == 0


def plan_steps(
    harness, sizes: list[int], n: int, grid: int = 16, shift: int = 0
) -> tuple[int, int]:
    """(the busiest CTA's dependent load steps, its chunk lookups) for one layer's
    H2D load of n scattered ids through the layout launcher's plan, every base
    `shift` bytes past 16-byte alignment."""
    rng = np.random.default_rng(7)
    # A host region per segment: the model counts steps of bases `shift` past
    # alignment, not the prefix sums of an interleaved tier.
    regions = Regions(rng, sizes, n, n, shift=shift, interleaved=False)
    d = rng.permutation(n).astype(np.int64)
    h = rng.permutation(n).astype(np.int64)
    totals = (ctypes.c_int64 * 7)()
    rc = harness.sim_layout_swap(
        regions.segments(),
        len(sizes),
        len(sizes),
        n,
        n,
        d.ctypes.data,
        h.ctypes.data,
        n,
        H2D,
        0,
        1,
        1,
        NEVER,
        grid,
        64 << 10,
        totals,
    )
    assert rc == 0, (rc, core._lib.fkv_last_error())
    regions.check(regions.expected(d, h, True, range(len(sizes))), "latency model")
    return totals[4], totals[5]


@pytest.mark.parametrize("scale_bytes", [4, 16, 32])
def test_fp8_scale_blocks_add_little_to_a_loads_round_trips(harness, scale_bytes: int) -> None:
    """P3: fp8 K and V blocks of 16 KiB with a 4- to 32-byte scale block each. A
    CTA's unrolled loads are in flight together, so its steps are its round trips
    over PCIe: with a chunk per scale block the busiest CTA made twice the trips of
    KV alone (half the rate); sharing chunks keeps scales under 10% on top."""
    n = 2000
    kv, _ = plan_steps(harness, [16384, 16384], n)
    with_scales, lookups = plan_steps(harness, [16384, 16384, scale_bytes, scale_bytes], n)
    assert kv == 2 * n // 16  # one step per 16 KiB block, spread over 16 CTAs
    assert with_scales <= 1.1 * kv, (with_scales, kv)
    # The empty chunk numbers of the scale segments are jumped over, not walked.
    assert lookups <= kv + 2 + 2, lookups


def test_small_blocks_keep_a_ctas_loads_in_flight(harness) -> None:
    """P4: the same bytes in 4 KiB or 8 KiB blocks take no more round trips than in
    16 KiB blocks (a chunk per 4 KiB block left 3/4 of a CTA's loads unused)."""
    total = 8 << 20  # 2,048 ids of 4 KiB: one staging slot, one launch
    at16k, _ = plan_steps(harness, [16384], total // 16384)
    for bb in (4096, 8192):
        steps, _ = plan_steps(harness, [bb], total // bb)
        assert steps <= at16k, (bb, steps, at16k)


@pytest.mark.parametrize("bb", [4096, 16384, 8200])
def test_narrow_vectors_keep_as_many_bytes_in_flight(harness, bb: int) -> None:
    """Issue 26 item 5: a layout only 8- or 4-byte aligned moves its bytes in as many
    dependent steps as a 16-byte aligned one (the unroll grows as the vector
    narrows: 64 bytes in flight per thread); with one unroll of 4 for every width,
    4-byte accesses took four times the round trips (64 KiB in flight, half of
    PCIe Gen5's bandwidth-delay product)."""
    n = (8 << 20) // bb
    wide, _ = plan_steps(harness, [bb], n, shift=0)
    for shift in (8, 4):
        narrow, _ = plan_steps(harness, [bb], n, shift=shift)
        assert narrow == wide, (bb, shift, narrow, wide)
