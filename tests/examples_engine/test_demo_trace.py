"""The demo on a Mooncake trace: a request larger than the device pool is refused
loudly, naming it, its length and the pool; `--trace-sessions` serves whole
multi-turn sessions of the trace (real reuse), every request of which fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.engine.demo import main, passed
from examples.engine.workload import trace_sessions
from tools.trace_replay import TraceRequest


def _req(ids: list[int], length: int | None = None) -> TraceRequest:
    return TraceRequest(0, length or 512 * len(ids), 4, ids)


def _write(path: Path, reqs: list[TraceRequest]) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": i,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": r.hash_ids,
                }
            )
            + "\n"
            for i, r in enumerate(reqs)
        )
    )
    return path


def test_trace_sessions_are_requests_that_continue_an_earlier_one() -> None:
    trace = [
        _req([0, 1, 2]),  # 0: session A
        _req([0, 3]),  # 1: alone (shares only id 0)
        _req([0, 1, 2, 4]),  # 2: continues 0
        _req([0, 5, 6]),  # 3: session B
        _req([0, 1, 7]),  # 4: continues 0 (longest held prefix: [0, 1])
        _req([0, 5, 6, 8, 9]),  # 5: continues 3
        _req([0, 10, 11]),  # 6: session C
        _req([0, 10, 11, 12]),  # 7: continues 6
    ]
    chosen, passed_over = trace_sessions(trace, 2, fits=lambda r: True)
    assert chosen == [trace[i] for i in (0, 2, 3, 4, 5)] and passed_over == 0
    big = trace[5]
    chosen, passed_over = trace_sessions(trace, 2, fits=lambda r: r is not big)
    assert chosen == [trace[i] for i in (0, 2, 4, 6, 7)] and passed_over == 1
    with pytest.raises(ValueError, match="count"):
        trace_sessions(trace, 0, fits=lambda r: True)


def test_a_trace_request_larger_than_the_device_pool_is_refused_loudly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "t.jsonl", [_req([0, 1]), _req(list(range(2, 40))), _req([0, 2])])
    code = main(
        [
            *("--trace", str(path), "--device-blocks", "32", "--tokens-per-block", "32"),
            *("--new-tokens", "4", "--no-progress", "--plot", ""),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    # 38 ids of 32 tokens = 1,216 tokens + 4 new = 77 blocks of 16
    assert "request r1: 1,216 prompt tokens + 4 new need 77 blocks, the pool holds 32" in err
    assert "1 of 3 requests" in err and "--device-blocks 77" in err


def test_trace_sessions_run_with_reuse_and_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = [
        _req([0, 1, 2]),
        _req(list(range(100, 140))),  # too large for the pool: not a session anyway
        _req([0, 1, 2, 3]),
        _req([0, 4, 5]),
        _req([0, 1, 2, 3, 6]),
        _req([0, 4, 5, 7]),
    ]
    path = _write(tmp_path / "t.jsonl", trace)
    code = main(
        [
            *("--trace", str(path), "--trace-sessions", "2", "--device-blocks", "32"),
            *("--tokens-per-block", "16", "--new-tokens", "3", "--json", "--no-progress"),
            *("--plot", ""),
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["identical_outputs"]
    assert out["requests"] == 5 and out["rejected_requests"] == 0
    assert out["device_hit_tokens"] + out["host_hit_tokens"] > 0
    assert "first 2 multi-turn sessions, 5 requests (0 sessions passed over" in out["workload"]


def test_a_refused_request_fails_the_verdict() -> None:
    good = {
        "identical_outputs": True,
        "checksums_ok": True,
        "ranks_agree": True,
        "rejected_requests": 0,
    }
    assert passed(good)
    assert not passed({**good, "rejected_requests": 1})
