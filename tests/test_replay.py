"""Trace replay through the real CacheManager: prefix-hit semantics, every write
policy with a host tier, and the command-line tool."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from fastkv import CacheConfig, StorageConfig
from tools.trace_replay import (
    DiskStorage,
    MemoryStorage,
    TraceRequest,
    load_trace,
    replay,
    synthetic_trace,
)

TRACE = synthetic_trace(num_requests=400, seed=1)
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def lru_prefix_hits(trace: list[TraceRequest], capacity: int) -> int:
    """A reference: exact LRU over blocks, a block counting only when every block
    before it in the request hits, the request's blocks touched deepest first."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for request in trace:
        for h in request.hash_ids:
            if h not in lru:
                break
            hits += 1
        for h in reversed(request.hash_ids):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits


@pytest.mark.parametrize("capacity", [300, 1000, 5000])
def test_device_only_replay_matches_an_exact_lru_reference(capacity: int) -> None:
    result = replay(TRACE, CacheConfig(block_size=512, num_device_blocks=capacity))
    assert result.stats.device_hit_blocks == lru_prefix_hits(TRACE, capacity)
    assert result.host_hit_rate == 0
    assert result.blocks == sum(len(r.hash_ids) for r in TRACE)


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_a_host_tier_adds_hits_under_every_policy(policy: str) -> None:
    device_only = replay(TRACE, CacheConfig(block_size=512, num_device_blocks=300))
    tiered = replay(
        TRACE,
        CacheConfig(
            block_size=512, num_device_blocks=300, num_host_blocks=2000, write_policy=policy
        ),
    )
    s = tiered.stats
    assert s.host_hit_blocks > 0 and s.host_to_device_blocks > 0
    assert tiered.hit_rate > device_only.hit_rate
    assert (
        tiered.hit_rate
        <= replay(TRACE, CacheConfig(block_size=512, num_device_blocks=10_000)).hit_rate
    )  # never more than an unbounded cache
    assert s.inflight_transfers == 0 and s.active_requests == 0
    if policy == "write_back":
        assert s.backups == 0 and s.device_to_host_blocks > 0
    else:
        assert s.backups > 0


def test_a_request_larger_than_the_device_pool_raises() -> None:
    big = [TraceRequest(0, 512 * 10, 1, list(range(10)))]
    with pytest.raises(ValueError, match="device blocks"):
        replay(big, CacheConfig(block_size=512, num_device_blocks=5))


def test_load_trace_sorts_and_names_bad_lines(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [0]}\n'
    )
    assert [r.timestamp for r in load_trace(path)] == [1, 5]
    path.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        load_trace(path)


def test_replay_tool_prints_json(capsys) -> None:
    import runpy
    import sys

    argv = sys.argv
    sys.argv = [
        "replay_trace.py",
        "synthetic",
        "--device-blocks",
        "500",
        "--host-blocks",
        "1000",
        "--json",
        "--no-progress",
    ]
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(TOOLS / "replay_trace.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert exit_info.value.code == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "requests",
        "blocks",
        "hit_rate",
        "device_hit_rate",
        "host_hit_rate",
        "seconds",
        "us_per_block",
    ):
        assert key in out
    assert out["hit_rate"] == pytest.approx(out["device_hit_rate"] + out["host_hit_rate"])


def _tiered_config(write_policy: str = "write_through") -> CacheConfig:
    return CacheConfig(
        block_size=512,
        num_device_blocks=300,
        num_host_blocks=500,
        storage=StorageConfig(write_policy=write_policy),
    )


@pytest.mark.parametrize("write_policy", ["write_through", "on_host_eviction"])
def test_a_disk_tier_replays_as_the_memory_tier_and_reads_every_block_back(
    tmp_path: Path, write_policy: str
) -> None:
    """The local-disk backend behind the trace: the same hits, block for block, as
    the in-memory tier, and every block loaded from disk is the one stored (the
    backend verified it; its payload is its key's)."""
    config = _tiered_config(write_policy)
    memory = replay(TRACE, config, storage=MemoryStorage(2000))
    disk = DiskStorage(tmp_path / "disk", 2000, config.num_host_blocks)
    try:
        result = replay(TRACE, config, storage=disk)
        stats = disk.backend.stats()
    finally:
        disk.close()
    assert memory.stats.storage_hit_blocks > 0  # the trace exercises the tier
    for field in ("device_hit_blocks", "host_hit_blocks", "storage_hit_blocks"):
        assert getattr(result.stats, field) == getattr(memory.stats, field), field
    assert result.hit_rate == memory.hit_rate
    assert result.stats.storage == memory.stats.storage  # lookups, loads, writes
    # Every block the backend served was checked against its key; the loads that
    # made the hits are among them (a load's blocks past a failed one are not hits).
    ok_reads = stats.gets - stats.misses - stats.get_failures - stats.timeouts
    assert disk.mismatched == 0 and stats.corrupt == 0
    assert disk.verified == ok_reads >= result.stats.storage_hit_blocks
    assert stats.put_failures == 0 and stats.puts > 0


def test_a_second_disk_replay_starts_warm(tmp_path: Path) -> None:
    config = _tiered_config()
    first = DiskStorage(tmp_path / "disk", 2000, config.num_host_blocks)
    try:
        cold = replay(TRACE, config, storage=first)
    finally:
        first.close()
    second = DiskStorage(tmp_path / "disk", 2000, config.num_host_blocks)
    try:
        warm = replay(TRACE, config, storage=second)
    finally:
        second.close()
    assert warm.stats.storage_hit_blocks > cold.stats.storage_hit_blocks
    assert second.mismatched == 0 and second.verified >= warm.stats.storage_hit_blocks


def test_replay_tool_runs_a_disk_tier(tmp_path: Path, capsys) -> None:
    from tools.replay_trace import main

    argv = ["synthetic", "--device-blocks", "500", "--host-blocks", "1000"]
    argv += ["--storage-blocks", "5000", "--no-progress", "--json"]
    assert main(argv) == 0
    memory = json.loads(capsys.readouterr().out)
    assert main([*argv, "--storage-dir", str(tmp_path / "disk")]) == 0
    disk = json.loads(capsys.readouterr().out)
    assert memory["storage_hit_rate"] > 0
    for key in ("hit_rate", "storage_hit_rate", "storage_writes"):
        assert disk[key] == memory[key], key
