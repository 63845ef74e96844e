"""`MooncakeTransport` over a real Mooncake Transfer Engine on TCP loopback, each
scenario in its own private network namespace (tests/pd/te_cases.py), two
processes where the scenario needs them. Nothing here is skipped: without Mooncake
or `unshare` these tests fail, as the Mooncake Store tests do."""

from __future__ import annotations

from pathlib import Path

import pytest
from netns_case import run_in_netns

from .transport_contract import CHECKS

HERE = Path(__file__).resolve().parent


def run_case(case: str, tmp_path: Path) -> dict:
    return run_in_netns(HERE / "te_cases.py", [case, str(tmp_path)], tmp_path)


@pytest.fixture(scope="module")
def contract_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_case("contract", tmp_path_factory.mktemp("contract"))


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_mooncake_transport_keeps_the_transport_contract(
    check: str, contract_results: dict
) -> None:
    assert contract_results[check] == "ok", contract_results[check]


def test_bytes_arrive_exactly_in_another_process_with_the_notice(tmp_path: Path) -> None:
    out = run_case("bytes_two_process", tmp_path)
    assert out["state"] == "DONE"
    assert out["exact"], "the receiver's memory differs from what was sent"
    payload = (b"sent\x00" + bytes(range(256))).hex()
    assert out["notices"] == [[out["sender"], payload]]
    # a piece past the receiver's region: the receiver refused it, nothing landed past it
    assert out["past_state"] == "FAILED"
    assert out["inside_ok"]


def test_killing_the_receiver_fails_the_batch_promptly(tmp_path: Path) -> None:
    out = run_case("receiver_killed", tmp_path)
    assert out["stalled"] == "PENDING"  # the kill came mid-batch
    assert out["state"] == "FAILED"
    assert out["settle_after_kill_s"] < 2.0
    # a later write to the dead peer is refused or fails, promptly
    assert out["later"] == "FAILED" or out["later"].startswith("TransportError")
    assert out["later_s"] < 5.0  # about 1 s here: the engine's admission timeout


def test_a_frozen_receiver_fails_the_write_once_the_engine_let_go_of_it(
    tmp_path: Path,
) -> None:
    """A handle that settled lets P's notice tell D that no byte can land any more,
    so it must not settle while its batch is still inside the engine."""
    out = run_case("receiver_frozen", tmp_path)
    # write_timeout_s=1.0 passed, but the batch is still in the engine: not settled
    assert out["at_deadline"] == "PENDING"
    # the engine's own timeout (MC_TRANSFER_TIMEOUT=5) ends it; slack for a loaded machine
    assert out["state"] == "FAILED"
    assert 4.5 <= out["failed_after_s"] < 9.0
    assert "no answer within 0.5 s" in out["notify"]
    assert out["notify_s"] < 2.0
    assert out["state_later"] == "FAILED"  # a handle settles once
    # close() returns in bound, saying a write is still inside the engine, which
    # stays PENDING (its bytes may land); a later close sees the engine let go
    assert out["stuck_before_close"] == "PENDING"
    assert out["released"] is False and out["stuck_after_close"] == "PENDING"
    assert out["close_s"] < 2.0
    assert out["released_later"] is True and out["stuck_later"] == "FAILED"
    assert out["regions_later"] == []


def test_killing_the_sender_mid_transfer_leaves_the_receiver_no_notice(tmp_path: Path) -> None:
    out = run_case("sender_killed", tmp_path)
    assert out["first"] == {"round": 0, "state": "DONE"} and out["landed"]
    assert out["notices"] == []  # only the receiver's own deadline ends its wait
    assert out["again"] == "DONE" and out["again_exact"]
    assert out["fresh"] == [[out["other"], b"fresh".hex()]]


def test_listening_addresses_are_reported_and_strict_mode_refuses_a_wildcard(
    tmp_path: Path,
) -> None:
    out = run_case("listen", tmp_path)
    port = out["address"].rsplit(":", 1)[1]
    assert any(a.endswith(":" + port) for a in out["listening"]), out
    if out["wildcard"]:  # Mooncake 0.3.13 binds 0.0.0.0 whatever host it is given
        assert "wildcard" in out["strict"] and "require_private_listen" in out["strict"]
    else:
        assert out["strict"] == "started"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"host": ""}, ["host"]),
        ({"host": "10.0.0.1:80"}, ["host", "10.0.0.1:80"]),
        ({"host": "127.0.0.1", "write_timeout_s": 0}, ["write_timeout_s", "0"]),
        ({"host": "127.0.0.1", "write_timeout_s": float("nan")}, ["write_timeout_s"]),
        ({"host": "127.0.0.1", "protocol": "udp"}, ["protocol", "udp"]),
        ({"host": "127.0.0.1", "max_pieces_in_flight": 0}, ["max_pieces_in_flight", "0"]),
        ({"host": "127.0.0.1", "max_pieces_in_flight": 1.5}, ["max_pieces_in_flight"]),
    ],
)
def test_bad_options_are_refused_before_the_engine_starts(kwargs: dict, words: list) -> None:
    from fastkv.pd.mooncake_te import MooncakeTransport
    from fastkv.pd.transport import TransportError

    with pytest.raises(TransportError) as err:
        MooncakeTransport(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_close_with_no_timeout_works_when_the_engines_timeout_is_past_an_hour(
    tmp_path: Path,
) -> None:
    """`close()` waits `release_bound_s` by default; a bound past the longest
    timeout a call takes (an hour) must cap the wait, not make close raise."""
    out = run_case("long_engine_timeout", tmp_path)
    assert out["bound"] == 7201.0
    assert out["closed"] is True
    assert out["strict"] == "started" or "require_private_listen" in out["strict"], out


def test_a_notice_queued_when_close_runs_raises_transport_error(tmp_path: Path) -> None:
    """close drops the notices still queued for the notifier threads; a `notify`
    waiting on one raises TransportError as its contract says, not the pool's
    CancelledError (which a sender's settle would not catch, losing the reports
    of every other send it settled in that poll)."""
    out = run_case("notify_racing_close", tmp_path)
    want = ["TransportError"] * 3 + ["connect TransportError"]
    assert out["errors"] == sorted(want), out
    assert out["closed"] is True
