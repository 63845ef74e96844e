"""The CUDA staging ring's rules (H2), checked on the CPU.

`fkv_staging_ring.h` holds the claim/grow/release logic the CUDA launcher runs;
ring_harness.cc runs the same Ring over scripted events, allocations that fail
or block, and a virtual clock (one millisecond per poll), so the ordering and
the bounds are exact and nothing here depends on timing.
"""

from __future__ import annotations

import ctypes

import pytest

from .native_harness import build_harness

SLOTS_PER_CHUNK, MAX_SLOTS = 64, 1024


@pytest.fixture(scope="module")
def ring(tmp_path_factory) -> ctypes.CDLL:
    return build_harness(tmp_path_factory.mktemp("ring"), "ring_harness.cc")


def counters(n: int) -> ctypes.Array:
    return (ctypes.c_int64 * n)()


def test_a_full_ring_grows_without_holding_its_lock(ring) -> None:
    out = counters(4)
    assert ring.ring_grows_outside_its_lock(out) == 0
    allocs, under_lock, slots, grows = out
    assert (allocs, under_lock) == (1, 0)
    assert (slots, grows) == (2 * SLOTS_PER_CHUNK, 1)


def test_claims_and_releases_go_on_while_another_thread_grows(ring) -> None:
    """The grower is held inside its allocation (cudaMalloc may synchronize the
    device); meanwhile a slot is released and claimed again by another thread."""
    out = counters(2)
    rc = ring.ring_claims_proceed_while_it_grows(out)
    assert rc == 0, {1: "claim failed", 2: "wrong slot", 3: "claim waited for the grow"}.get(rc)
    allocs, grown_index = out
    assert allocs == 1  # the claiming thread did not grow too
    assert grown_index == SLOTS_PER_CHUNK  # the grower got the new chunk's first slot


@pytest.mark.parametrize("growth", ["fails", "at_the_limit"])
def test_a_transfer_waits_one_deadline_for_all_its_slots(ring, growth: str) -> None:
    out = counters(3)
    msg = ctypes.create_string_buffer(512)
    rc = ring.ring_one_deadline_per_transfer(int(growth == "fails"), out, msg, len(msg))
    assert rc == 0, rc
    first_ms, failed_ms, allocs = out
    assert first_ms == 60  # the first slot freed by its readers at 60 ms
    assert failed_ms == 100  # the transfer's deadline, not 60 + 100
    text = msg.value.decode()
    assert "staging ring of device 3" in text and "after 100 ms" in text
    assert "FASTKV_CUDA_STAGING_TIMEOUT_MS" in text
    if growth == "fails":
        assert allocs == 2  # once per claim (memory may be freed meanwhile), not per poll
        assert "growing it failed: cudaMalloc(staging ring): out of memory" in text
        assert f"all {SLOTS_PER_CHUNK} slots" in text
    else:
        assert allocs == 0
        assert "(at its size limit)" in text and f"all {MAX_SLOTS} slots" in text


def test_a_slot_is_reused_only_after_its_readers_finish(ring) -> None:
    out = counters(1)
    assert ring.ring_reuses_a_slot_only_after_its_readers(out) == 0
    assert out[0] == 7
