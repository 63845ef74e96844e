"""Replay of a Mooncake-format trace through the real CacheManager.

Each hash id of a trace line is one cacheable block. Requests run one at a time in
timestamp order; a simulated worker completes every transfer at once. A block is a
hit only when every block before it in the request is a hit (prefix semantics),
which is exactly what `CacheManager.match` returns.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastkv.config import CacheConfig
from fastkv.metadata import TransferResult
from fastkv.scheduler.cache_manager import AllocStatus, CacheManager, CacheStats

TRACE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace, sorted by timestamp.

    Raises:
        ValueError: a line is not valid JSON or lacks a field; the message gives
            the file and line number.
    """
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(
                    TraceRequest(
                        int(row["timestamp"]),
                        int(row["input_length"]),
                        int(row["output_length"]),
                        [int(h) for h in row["hash_ids"]],
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace line ({e})") from None
    requests.sort(key=lambda r: r.timestamp)
    return requests


def synthetic_trace(num_requests: int = 3000, seed: int = 0) -> list[TraceRequest]:
    """A multi-turn chat workload shaped like the Mooncake conversation trace:
    shared system prompts, conversations whose history grows turn by turn, and
    one-off documents that are never reused."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system_prompts = [fresh(rng.randint(1, 6)) for _ in range(8)]
    conversations: list[list[int]] = []
    out = []
    for t in range(num_requests):
        if conversations and rng.random() < 0.6:
            i = rng.randrange(len(conversations))
            conversations[i] = conversations[i] + fresh(rng.randint(1, 4))
            ids = conversations[i]
            if len(ids) > 200:
                conversations.pop(i)
        else:
            ids = rng.choice(system_prompts) + fresh(rng.randint(1, 30))
            conversations.append(ids)
        out.append(TraceRequest(t * 100, len(ids) * TRACE_BLOCK_SIZE, 300, list(ids)))
    return out


@dataclass(frozen=True, slots=True)
class ReplayResult:
    requests: int
    blocks: int
    seconds: float
    stats: CacheStats

    @property
    def hit_rate(self) -> float:
        return self.stats.hit_rate

    @property
    def device_hit_rate(self) -> float:
        return self.stats.device_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.stats.host_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def us_per_block(self) -> float:
        return self.seconds * 1e6 / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        s = self.stats
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "hit_rate": self.hit_rate,
            "device_hit_rate": self.device_hit_rate,
            "host_hit_rate": self.host_hit_rate,
            "seconds": self.seconds,
            "us_per_block": self.us_per_block,
            "device_evictions": s.device_evictions,
            "host_evictions": s.host_evictions,
            "device_to_host_blocks": s.device_to_host_blocks,
            "host_to_device_blocks": s.host_to_device_blocks,
            "backups": s.backups,
        }


def replay(
    trace: Sequence[TraceRequest],
    config: CacheConfig,
    on_request: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Run `trace` through a fresh CacheManager.

    Args:
        trace: requests in the order to serve them.
        config: the cache under test; its block size is nominal (a trace block
            stands for 512 tokens whatever it says).
        on_request: called after each request with its index (progress display);
            None keeps the loop free of it.

    Raises:
        ValueError: a request needs more blocks than the device pool holds.
    """
    mgr = CacheManager(config)
    take, apply = mgr.take_swap_metadata, mgr.apply_results

    def complete_transfers() -> None:
        tasks = take()
        done = [
            TransferResult(meta.transfer_id, True)
            for meta in (tasks.evict, tasks.swap_in)
            if meta is not None
        ]
        if done:
            apply(done)

    bs = config.block_size
    blocks = 0
    start = time.perf_counter()
    for i, request in enumerate(trace):
        hashes = request.hash_ids
        blocks += len(hashes)
        # Every id is a cacheable block (the trace's partial last block too, as in
        # its reference hit rates), so the prompt is its blocks plus one token: the
        # rule that a prompt's last token is computed then hides no block.
        hit = mgr.match(i, hashes, len(hashes) * bs + 1)
        need = len(hashes) - hit.num_hits
        while not (alloc := mgr.allocate(i, need)):
            if alloc.status is AllocStatus.NO_SPACE:  # one request at a time: never
                raise RuntimeError(f"request {i}: no blocks free and none being freed")
            complete_transfers()
        if mgr.num_queued_blocks:  # the step: its swap-ins land before the commit
            complete_transfers()
        mgr.commit(i, len(hashes) * bs)
        if mgr.num_queued_blocks:  # backups the commit planned
            complete_transfers()
        mgr.finish(i)
        if on_request is not None:
            on_request(i)
    seconds = time.perf_counter() - start
    return ReplayResult(len(trace), blocks, seconds, mgr.get_stats())
