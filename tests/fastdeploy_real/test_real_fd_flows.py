"""FastDeploy's own scheduler, batches and token processor over fastkv, flow by flow.

Every flow ends with `Engine.check_clean()`: zero KV positions read back wrong,
every request finished with the tokens its prompt determines, no leaked block
(fastkv's invariants, pools full after reset_cache).
"""

from __future__ import annotations

from typing import Any

import pytest
from real_fd_config import BLOCK_SIZE
from real_fd_engine import Engine
from real_fd_model import prompt

BS = BLOCK_SIZE


def test_install_replaced_fastdeploy_classes(installed: list[str]) -> None:
    import fastdeploy.cache_manager.v1 as v1

    from fastkv.integrations.fastdeploy import CacheController, CacheManager

    assert v1.CacheManager is CacheManager and v1.CacheController is CacheController
    assert "fastdeploy.cache_manager.v1.cache_manager.CacheManager" in installed or (
        v1.cache_manager.CacheManager is CacheManager
    )


def test_checker_sees_wrong_kv(make_engine: Any) -> None:
    """The net itself: KV bytes changed behind the cache's back are read back as
    mismatches, and check_clean fails on them."""
    engine = make_engine(num_gpu_blocks=24)
    shared = prompt(1, 3 * BS)
    engine.add_request("a", shared + prompt(2, 5), max_tokens=4)
    engine.run()
    engine.runners[0].views[1][:] ^= 0x5A  # layer 0's value cache, every block
    engine.add_request("b", shared + prompt(3, 6), max_tokens=4)
    engine.run()
    assert engine.mismatches() >= 3 * BS
    with pytest.raises(AssertionError, match="KV positions wrong"):
        engine.check_clean()


def test_admission_device_hits(make_engine: Any) -> None:
    """A second request sharing a 3-block prefix is admitted with those blocks as
    device hits and reads them."""
    engine = make_engine(num_gpu_blocks=24)
    shared = prompt(1, 3 * BS)
    engine.add_request("a", shared + prompt(2, 5), max_tokens=4)
    engine.run()
    engine.add_request("b", shared + prompt(3, 6), max_tokens=4)
    engine.run()
    assert engine.log.cached_tokens == {"a": 0, "b": 3 * BS}
    engine.check_clean()


def test_chunked_prefill_and_decode_growth(make_engine: Any) -> None:
    """Prompts longer than the token budget prefill in chunks; decodes grow their
    tables by enc_dec_block_num blocks."""
    engine = make_engine(num_gpu_blocks=24, max_num_batched_tokens=16, max_model_len=64)
    engine.add_request("long", prompt(4, 40), max_tokens=20)
    engine.add_request("short", prompt(5, 9), max_tokens=30)
    engine.run()
    assert engine.log.chunked_prefills >= 2
    assert engine.log.decode_growths >= 2
    engine.check_clean()


def test_fully_cached_prompt(make_engine: Any) -> None:
    """A prompt whose every block is cached: FastDeploy recomputes its last block
    (num_computed_tokens = matched - block_size) and the KV it reads is right."""
    engine = make_engine(num_gpu_blocks=24)
    p = prompt(6, 4 * BS)
    engine.add_request("first", p, max_tokens=3)
    engine.run()
    engine.add_request("again", p, max_tokens=3)
    engine.run()
    assert engine.log.cached_tokens["again"] >= 3 * BS
    engine.check_clean()


def test_preemption_and_readmission(make_engine: Any) -> None:
    """Too few device blocks for every decode: ResourceManagerV1 preempts the last
    decoding request, the token processor reschedules it, it is admitted again
    (with its own cached blocks as hits) and finishes with the right tokens."""
    engine = make_engine(num_gpu_blocks=12, max_model_len=64, max_num_seqs=3)
    for i in range(3):
        engine.add_request(f"r{i}", prompt(10 + i, 14), max_tokens=30)
    engine.run()
    assert engine.log.preempt_tasks >= 1
    engine.check_clean()


def cycle_through_host(engine: Engine, tag: str, *, prefixes: int = 3, seed: int = 20) -> None:
    """Each shared prefix is served twice (its second use is a device hit, which
    write-through backs up), pushed out of the device tier by fillers, then served
    again: from the host tier where a copy is there."""
    shared = [prompt(seed + i, 3 * BS) for i in range(prefixes)]
    for rnd in range(2):
        for i, p in enumerate(shared):
            engine.add_request(f"{tag}{i}-{rnd}", p + prompt(seed * 7 + 10 * rnd + i, 3), 4)
            engine.run()
    for i in range(3):
        engine.add_request(f"{tag}fill{i}", prompt(seed * 11 + i, 5 * BS), 4)
        engine.run()
    engine.settle()
    for i, p in enumerate(shared):
        engine.add_request(f"{tag}{i}-back", p + prompt(seed * 13 + i, 5), 4)
        engine.run()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_host_swap_in(make_engine: Any, policy: str) -> None:
    """Prefixes pushed out of a small device tier come back from the host tier
    (a swap-in in the batch, waited per layer) with the right bytes."""
    engine = make_engine(
        num_gpu_blocks=12,
        num_cpu_blocks=16,
        write_policy=policy,
        write_through_threshold=1,
        max_num_seqs=2,
    )
    cycle_through_host(engine, "h")
    assert engine.log.swap_in_steps >= 1, engine.log
    assert any(host for _, host in engine.log.hits.values()), engine.log.hits
    engine.check_clean()


def test_admission_device_and_host_hits(make_engine: Any) -> None:
    """One admission with device hits and host hits together: the device part of a
    prefix is still cached while its tail was evicted to host."""
    engine = make_engine(
        num_gpu_blocks=12,
        num_cpu_blocks=16,
        write_policy="write_back",
        max_num_seqs=1,
        max_model_len=80,
        max_num_batched_tokens=80,
    )
    base = prompt(50, 2 * BS)
    engine.add_request("base", base + prompt(51, 3 * BS), 2)
    engine.run()
    engine.add_request("keep", base + prompt(52, 2), 2)  # touches the shared head
    engine.run()
    engine.add_request("fill", prompt(53, 9 * BS), 2)  # 10 blocks: evicts the tail
    engine.run()
    engine.settle()  # the evictions' results are in: their host copies can hit
    engine.add_request("both", base + prompt(51, 3 * BS) + prompt(54, 3), 2)
    engine.run()
    device, host = engine.log.hits["both"]
    assert device > 0 and host > 0, engine.log.hits
    engine.check_clean()


def test_tensor_parallel_two_ranks(make_engine: Any) -> None:
    """TP=2: two stand-in runners, one controller per rank, one results channel;
    host swap-ins and evictions run on both ranks' tensors."""
    engine = make_engine(
        num_gpu_blocks=12,
        num_cpu_blocks=16,
        tensor_parallel_size=2,
        write_policy="write_back",
        max_num_seqs=2,
    )
    cycle_through_host(engine, "t", seed=30)
    assert len(engine.runners) == 2
    assert engine.log.swap_in_steps >= 1, engine.log
    engine.check_clean()


def test_prefix_caching_off(make_engine: Any) -> None:
    """enable_prefix_caching=False: nothing hits, everything still right and
    freed."""
    engine = make_engine(num_gpu_blocks=16, enable_prefix_caching=False, max_num_seqs=3)
    p = prompt(40, 2 * BS + 3)
    for i in range(4):
        engine.add_request(f"n{i}", p, max_tokens=12)
    engine.run()
    assert set(engine.log.cached_tokens.values()) == {0}
    engine.check_clean()


def test_abort_one_request(make_engine: Any) -> None:
    """A client abort (`add_abort_req_ids`) of one decoding request: the scheduler
    sends an abort task, the runner answers PREEMPTED_TOKEN_ID, the token
    processor recycles it; the others finish right and nothing leaks."""
    engine = make_engine(num_gpu_blocks=24, max_num_seqs=3)
    for i in range(3):
        engine.add_request(f"k{i}", prompt(110 + i, 2 * BS + i), 30)
    k1 = engine.rm.requests["k1"]
    engine.step_until(lambda: len(k1.output_token_ids) >= 2)  # decoding
    engine.rm.add_abort_req_ids(["k1"])
    engine.run()
    assert engine.log.abort_tasks == 1
    assert engine.results.by_id["k1"].error == "Aborted"
    engine.check_clean(aborted=frozenset({"k1"}))
