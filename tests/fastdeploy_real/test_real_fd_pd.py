"""FastDeploy's disaggregated prefill/decode on its real ResourceManagerV1s, served by
fastkv's PD path (`real_fd_pd.PDPair`): P and D instances, each with its stand-in
runners checking every KV position they read, per layer; fastkv's in-process transport
between the ranks (Mooncake TE: `test_real_fd_pd_te.py`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from real_fd_config import build_fd_config
from real_fd_engine import Engine
from real_fd_pd import PDPair

import fastkv.integrations.fastdeploy as fkv_fd
from fastkv.pd.inproc import InProcFabric

BS = 8
PROMPT_A = list(range(100, 100 + 3 * BS + 3))  # 4 blocks, the last partial
SYSTEM = list(range(300, 300 + 2 * BS))  # a shared system prompt of 2 blocks


@pytest.fixture
def make_pair(
    installed: list[str], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., PDPair]]:
    """A P engine and a D engine over fresh FDConfigs (each its own results
    channel), their ranks on one in-process fabric."""
    engines: list[Engine] = []

    def engine(role: str, **config: Any) -> Engine:
        name = f"fd-pd-{role}-{os.getpid()}-{os.urandom(4).hex()}"
        monkeypatch.setenv(fkv_fd.CHANNEL_ENV, name)
        config.setdefault("num_gpu_blocks", 24)
        e = Engine(build_fd_config(model_dir, splitwise_role=role, **config))
        engines.append(e)
        return e

    def make(
        *,
        tp: int = 1,
        p_config: dict[str, Any] | None = None,
        d_config: dict[str, Any] | None = None,
        fabric: InProcFabric | None = None,
        **settings: Any,
    ) -> PDPair:
        p = engine("prefill", tensor_parallel_size=tp, **(p_config or {}))
        d = engine("decode", tensor_parallel_size=tp, **(d_config or {}))
        fab = fabric or InProcFabric()
        transports = (
            [fab.endpoint(f"p{r}") for r in range(tp)],
            [fab.endpoint(f"d{r}") for r in range(tp)],
        )
        settings.setdefault("deployment_secret", b"s" * 32)
        return PDPair(p, d, transports, **settings)

    yield make
    for e in engines:
        e.close()


def positions_checked(engine: Engine) -> int:
    return sum(r.log.positions_checked for r in engine.runners)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_request_prefilled_on_p_decodes_on_d_with_its_kv(make_pair: Any, tp: int) -> None:
    pair = make_pair(tp=tp)
    prompt_b = list(range(500, 500 + 2 * BS + 5))
    served = pair.serve([("a", PROMPT_A, 6), ("b", prompt_b, 4)])
    assert [s.first_token_error for s in served] == [None, None]
    # D read every prompt position of both requests from what P wrote, per layer.
    assert pair.d.mismatches() == 0
    assert positions_checked(pair.d) >= tp * (len(PROMPT_A) + len(prompt_b)) * 2
    assert [len(s.dest_block_ids) for s in served] == [4, 3]
    assert all(b >= 0 for s in served for b in s.dest_block_ids)
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()
    assert pair.p.cache_manager.pd.counters["sends_finished"] == 2


def test_d_reuses_its_own_prefix_and_p_sends_only_the_tail(make_pair: Any) -> None:
    pair = make_pair()
    first = SYSTEM + list(range(700, 700 + BS + 2))
    second = SYSTEM + list(range(800, 800 + BS + 4))
    pair.serve([("first", first, 3)])
    sent_before = sum(w.sender.bytes_sent for w in pair.p_workers)
    (served,) = pair.serve([("second", second, 5)])
    # FastDeploy's convention: -1 for each block D holds, then the blocks P writes.
    assert served.dest_block_ids[:2] == [-1, -1]
    assert all(b >= 0 for b in served.dest_block_ids[2:])
    assert len(served.dest_block_ids) == 4
    sent = sum(w.sender.bytes_sent for w in pair.p_workers) - sent_before
    per_block = sent // 2  # two blocks of the tail
    assert sent == 2 * per_block and per_block > 0
    assert pair.d.cache_manager.pd.counters["prefix_blocks"] == 2
    assert pair.d.mismatches() == 0
    pair.wait_idle()
    pair.d.check_clean()
    pair.check_no_leaks()
