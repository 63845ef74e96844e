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


# -- a step's load ordered after a same-step eviction (fkv_layout_launch.h) ------

LOAD_COUNTS = (
    "native_calls",
    "validations",
    "slot_claims",
    "uploads",
    "ring_slots",
    "ring_grows",
    "chunk_allocs",
    "stream_waits",
    "failed_layer",
)


def evict_then_load(ring, one_call: bool, layers: int, ids: int, fail_at: int = -1) -> dict:
    out = counters(len(LOAD_COUNTS))
    rc = ring.evict_then_load(int(one_call), layers, ids, fail_at, out)
    assert rc == 0, {
        2: "the transfer's outcome",
        3: "a layer copied before the eviction's layer 0",
        4: "a layer's event completed before the eviction's same layer",
        5: "a layer not copied once the eviction's same layer was",
        6: "a layer's event pending after its copy",
        7: "the next layer's event completed early",
        8: "work left on the stream",
        9: "a slot still claimed after every copy finished",
        10: "the ring grew again",
    }.get(rc, rc)
    return dict(zip(LOAD_COUNTS, out, strict=True))


def test_evict_then_load_of_80_layers_is_one_validation_and_one_slot_set(ring) -> None:
    """Issue 26, item 1. A load into blocks a same-step eviction still reads is
    ordered after it per layer. As one fkv_layout_swap per layer (the controller's
    old path) it took 80 validations and 80 slots live at once, more than the ring's
    first 64: the first such step grew the ring on the engine thread. As one
    fkv_layout_swap_ordered with the eviction's events as per-layer waits: one call,
    one validation, one slot, no growth, and each layer still copies only after
    the eviction's same layer (the harness checks the order)."""
    before = evict_then_load(ring, one_call=False, layers=80, ids=32)
    after = evict_then_load(ring, one_call=True, layers=80, ids=32)
    assert before == {
        "native_calls": 160,  # a stream wait and a one-layer swap per layer
        "validations": 80,
        "slot_claims": 80,
        "uploads": 80,
        "ring_slots": 2 * SLOTS_PER_CHUNK,
        "ring_grows": 1,
        "chunk_allocs": 1,
        "stream_waits": 80,
        "failed_layer": -1,
    }
    assert after == {
        "native_calls": 1,
        "validations": 1,
        "slot_claims": 1,
        "uploads": 1,
        "ring_slots": SLOTS_PER_CHUNK,
        "ring_grows": 0,
        "chunk_allocs": 0,
        "stream_waits": 80,  # the same per-layer ordering, from inside the call
        "failed_layer": -1,
    }


def test_evict_then_load_stages_its_ids_once_whatever_the_layer_count(ring) -> None:
    """9,000 ids take 3 slots (about 4,000 ids to a slot), once for all 80 layers."""
    counts = evict_then_load(ring, one_call=True, layers=80, ids=9000)
    assert (counts["validations"], counts["slot_claims"], counts["ring_grows"]) == (1, 3, 0)


def test_evict_then_load_failing_mid_way_keeps_the_later_layers_ordered(ring) -> None:
    """Layer 5's launch fails: layers 0-4 copied in order; the events of layers 5
    and on are still recorded (nobody hangs), each behind the eviction's same layer
    (the harness checks none completes early); its slot is released."""
    counts = evict_then_load(ring, one_call=True, layers=80, ids=32, fail_at=5)
    assert counts["failed_layer"] == 5
    assert counts["stream_waits"] == 81  # layer 5's wait enqueued again after the failure
    assert (counts["slot_claims"], counts["ring_grows"]) == (1, 0)


def test_evict_then_load_with_several_copies_to_wait_for(ring) -> None:
    """Three copies per layer to wait for, one of them already finished (NULL):
    80 layers x 2 waits, and each layer copies once both are done."""
    out = counters(2)
    assert ring.evict_then_load_with_several_waits(80, out) == 0
    assert list(out) == [160, 80]
