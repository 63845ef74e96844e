"""Mooncake Store backend against a real mooncake_master (and mooncake_client storage
nodes), each scenario in its own private network namespace. Nothing here is skipped:
without Mooncake or `unshare` these tests fail, as a missing storage tier should."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns_case import run_in_netns

HERE = Path(__file__).resolve().parent


def run_case(case: str, tmp_path: Path) -> dict:
    return run_in_netns(HERE / "mooncake_cases.py", [case, str(tmp_path)], tmp_path)


def test_blocks_come_back_from_mooncake_bit_exact_through_every_tier(tmp_path: Path) -> None:
    """The real scheduler and worker, a block written to a Mooncake storage node,
    dropped from device and host, found, loaded and swapped back in: its bytes are
    checked against the bytes first computed (fp8 scales and extra layers too)."""
    out = run_case("tiered", tmp_path)
    for run in out.values():
        assert run["first"] == [0, 3] and run["again"] == [3, 3]
        assert run["storage_hits"] == 3 and run["storage_writes"] >= 3


def test_the_io_engines_calls_run_on_its_threads_and_direct_ones_on_the_pool(
    tmp_path: Path,
) -> None:
    """The staged backend through the I/O engine, which owns its deadlines: every
    Mooncake call runs on an engine thread (no hand-off to the backend's pool); a
    direct caller's still go to the pool. Bytes come back exact both ways."""
    out = run_case("io_engine_threads", tmp_path)
    assert out["stored"] == ["OK"] * 4 and out["loaded"] == ["OK"] * 4
    assert out["hits"] == [True] * 4 + [False] * 4
    assert out["exact"] == [True] * 4
    assert out["direct"] == ["OK"] * 8 and out["direct_exact"] == [True] * 4
    assert set(out["via_engine"]) == {"batch_upsert_from", "batch_is_exist", "batch_get_into"}
    for threads in out["via_engine"].values():
        assert all(t.startswith("fastkv-storage-io-") for t in threads), out["via_engine"]
    assert set(out["direct_threads"]) == {"batch_upsert_from", "batch_get_into"}
    for threads in out["direct_threads"].values():
        assert all(t.startswith("fastkv-mooncake") for t in threads), out["direct_threads"]
    assert out["overruns"] == 0 and out["closed"]


@pytest.mark.parametrize(
    "case", ["round_trip_two_process", "round_trip_one_process", "round_trip_staged"]
)
def test_round_trip_is_bit_exact(case: str, tmp_path: Path) -> None:
    out = run_case(case, tmp_path)
    assert out["put"] == ["OK"] * 8
    assert out["again"] == ["OK"] * 2  # an existing key counts as stored
    assert out["get"] == ["OK"] * 8
    assert out["exact"] == [True] * 8
    # what blocks of one segment each stored reads back into the layout's segments
    assert out["cross"] == ["OK"] * 8 and out["cross_exact"] == [True] * 8
    # another namespace or rank never hits
    assert out["exists"] == [True, True, False, False, False, False]
    assert out["probes"] == ["MISS"] * 4
    if case.endswith("staged"):  # blocks pass through the staging area, 2 per call
        assert out["unregistered"] == "" and out["unregistered_exact"]
        assert out["max_batch"] == 2
    else:  # zero-copy needs the host memory registered
        assert "register_host_memory" in out["unregistered"]
    assert out["corrupt"] == 0 and not out["breaker_open"]
    # every key asked counts once; a put Mooncake answers -705 is "already stored"
    # (this Mooncake answers 0 for an existing key: then it counts as written)
    stats = out["stats"]
    assert (stats["puts"], stats["put_failures"]) == (10, 0)
    written = 10 - stats["put_already_stored"]
    assert written in (8, 10)
    # 8 gets, 8 cross-form gets, and staged the unregistered get too
    ok_gets = 17 if case.endswith("staged") else 16
    assert stats["gets"] == ok_gets + 4 and stats["misses"] == 4
    assert stats["put_bytes"] * ok_gets == stats["get_bytes"] * written


@pytest.mark.parametrize("case", ["bad_objects", "bad_objects_staged"])
def test_objects_that_are_not_the_block_are_counted_misses(case: str, tmp_path: Path) -> None:
    out = run_case(case, tmp_path)
    assert out["raw_codes"] == [0, 0, 0, 0]
    assert out["get"] == ["MISS"] * 4, out
    reasons = out["reasons"]
    assert "short object" in reasons[0]
    assert "larger than the block" in reasons[1]
    assert "header mismatch" in reasons[2]
    assert "tag does not verify" in reasons[3]
    assert out["good"] == ["OK"] and out["good_exact"]
    assert out["corrupt"] == 4
    # a put stores the block over each of them, though every key is under a read lease
    assert out["replaced"] == ["OK"] * 4, out
    assert out["replaced_get"] == ["OK"] * 4 and all(out["replaced_exact"]), out
    assert not out["breaker_open"]  # a short object is a miss, not a transport failure


def test_pool_full_storm_every_key_stored_or_failed_in_budget(tmp_path: Path) -> None:
    out = run_case("pool_full_storm", tmp_path)
    assert out["threads_done"] == [0, 1, 2, 3]
    assert set(out["statuses"]) <= {"OK", "FAILED", "TIMEOUT"}
    assert out["ok"] + out["failed"] <= 160 and out["ok"] > 0
    assert out["retries"] > 0, "the pool never answered -200: the storm did not happen"
    assert out["max_overrun_s"] < 1.0  # no call ran on far past its deadline
    assert out["wrong"] == 0
    assert not out["breaker_open"]  # -200 is back-pressure, not a failure


@pytest.mark.parametrize("during", ["put", "get"])
def test_master_killed_then_restarted(during: str, tmp_path: Path) -> None:
    out = run_case(f"master_killed_mid_{during}", tmp_path)
    assert out["ok_before_kill"] > 0
    assert out["after_kill_failed"] > 0
    assert set(out["after_kill_statuses"]) <= {"OK", "FAILED", "TIMEOUT", "MISS"}
    # every request was reported by its deadline (the engine's poll), never later
    assert out["max_report_after_deadline_s"] < 1.0
    assert out["breaker_trips"] >= 1
    assert out["recovered_after_s"] is not None, "the breaker never closed again"
    # prompt: at most breaker_max_cooldown_s (4 s) plus one probe call (3 s deadline)
    assert out["recovered_after_s"] < 4.0 + 3.0
    assert out["probe_read"] == ["OK"] and out["probe_exact"]
    assert out["old_key_after_restart"] == ["MISS"]  # the new master lost the old index
    assert out["wrong_loads"] == 0
    assert not out["breaker_open_at_end"]


@pytest.mark.parametrize("case", ["forged", "forged_zero_copy"])
def test_forged_objects_from_another_user_are_never_stored_or_served(
    case: str, tmp_path: Path
) -> None:
    """Issue 15 item 2: uid 65534, another client of the cluster, puts objects under
    the victim's predictable keys before the victim does (a valid CRC header without
    the secret; a tag under another deployment's secret)."""
    out = run_case(case, tmp_path)
    assert out["attacker"] == "ATTACKER ['OK', 'OK', 'OK']", out
    # the victim's reads refuse the forged objects, saying why
    assert out["before"] == ["MISS"] * 4, out
    assert "not authenticated" in out["before_reasons"][0]
    assert "key this backend does not hold" in out["before_reasons"][1]
    assert out["before_reasons"][2] == "not stored"
    assert "not authenticated" in out["before_reasons"][3]
    # under the reads' lease, its put stores its own block in their place: staged,
    # by replacing them unread (upsert); zero-copy, by reading them back and
    # removing them
    assert out["first"] == ["OK", "OK", "OK"], out
    assert out["forged_puts"] == (2 if case.endswith("zero_copy") else 0), out
    # keys[3], never put by the victim, still holds the attacker's object: refused
    assert out["get"] == ["OK", "OK", "OK", "MISS"], out
    assert "not authenticated" in out["get_reasons"][3]
    assert out["served_wrong"] == 0 and out["served_right"] == 3


@pytest.mark.parametrize("case", ["forged_hot_key", "forged_hot_key_zero_copy"])
def test_a_forged_object_on_a_hot_key_is_replaced_within_one_lease(
    case: str, tmp_path: Path
) -> None:
    """Issue 25 item 11: lookups, reads and puts of the key every lease/5 kept
    Mooncake's read lease alive, so the remove of the forged object was refused
    for as long as the key was in use (puts failed 40 s straight on a 10 s lease).
    Staged, the put replaces it at once (upsert, not held up by the lease)."""
    out = run_case(case, tmp_path)
    assert out["planted"] == [0], out
    assert out["replaced_after_s"] is not None, out
    assert out["replaced_after_s"] < out["lease_s"] + 1.0, out
    assert out["served_wrong"] == 0, out
    if case.endswith("zero_copy"):
        assert out["forged_puts"] >= 1, out
    else:  # the first put replaced it
        assert out["puts"] == ["OK"] and out["forged_puts"] == 0, out


def test_storage_node_killed(tmp_path: Path) -> None:
    out = run_case("node_killed", tmp_path)
    assert out["first"] == ["FAILED", "FAILED"]
    # the dead node fails its own keys: no breaker for the whole backend
    assert out["breaker_trips"] == 0
    assert out["while_open"] == ["FAILED"]
    assert out["recovered_after_s"] is not None
    assert out["probe_read"] == ["OK"] and out["probe_exact"]
    assert out["lost_exact_or_absent"]


def test_a_dead_storage_node_fails_only_its_own_keys(tmp_path: Path) -> None:
    """Issue 15 item 5: 131 of 474 calls for keys on healthy nodes were refused
    once one node died (one breaker per backend). Now: none."""
    out = run_case("node_killed_locality", tmp_path)
    assert out["healthy"] > 0 and out["lost"] > 0, out  # both nodes held keys
    assert out["lost_reasons"] == ["Mooncake get answered -800"], out
    assert out["healthy_calls"] > 50
    assert out["healthy_refused"] == 0, out
    assert out["wrong"] == 0 and out["breaker_trips"] == 0
