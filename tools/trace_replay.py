"""Replay of a Mooncake-format trace through the real CacheManager.

Each hash id of a trace line is one cacheable block. Requests run one at a time in
timestamp order; a simulated worker completes every transfer at once, and answers
storage lookups, loads and writes from a `ReplayStorage` (in memory, or the real
local-disk backend) when the cache has a storage tier. A block is a
hit only when every block before it in the request is a hit (prefix semantics),
which is exactly what `CacheManager.match` returns.
"""

from __future__ import annotations

import json
import mmap
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from fastkv.config import CacheConfig, ModelKVShape
from fastkv.metadata import CacheSwapMetadata, LookupResult, TransferResult
from fastkv.scheduler import AllocStatus, CacheManager, CacheStats

TRACE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]
    block_hashes: list[bytes] = field(init=False, repr=False, compare=False)
    """The ids as the 32-byte digests the manager takes (a trace id names one
    prefix block, so the ids' bytes are as unique as chained digests)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", [h.to_bytes(32, "big") for h in self.hash_ids])


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


@dataclass(slots=True)
class ReplayResult:
    requests: int
    blocks: int
    seconds: float
    stats: CacheStats
    storage_blocks: int = 0

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
    def storage_hit_rate(self) -> float:
        return self.stats.storage_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def storage_writes(self) -> int:
        return self.stats.storage.writes if self.stats.storage is not None else 0

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
            "storage_hit_rate": self.storage_hit_rate,
            "storage_writes": self.storage_writes,
            "seconds": self.seconds,
            "us_per_block": self.us_per_block,
            "device_evictions": s.device_evictions,
            "host_evictions": s.host_evictions,
            "device_to_host_blocks": s.device_to_host_blocks,
            "host_to_device_blocks": s.host_to_device_blocks,
            "backups": s.backups,
        }


class ReplayStorage(Protocol):
    """The storage tier as the replay's simulated worker sees it: keys are the
    trace's hash ids, host blocks the manager's host block ids."""

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys storage holds."""
        ...

    def load(self, keys: Sequence[bytes], host_ids: Sequence[int]) -> set[int]:
        """Read keys into host blocks; the positions that failed."""
        ...

    def store(self, keys: Sequence[bytes], host_ids: Sequence[int]) -> set[int]:
        """Write host blocks as keys; the positions that failed."""
        ...


class MemoryStorage:
    """A storage tier of `capacity` blocks with LRU eviction, in memory."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def lookup(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            if key not in self._keys:
                return i
        return len(keys)

    def load(self, keys: Sequence[bytes], host_ids: Sequence[int]) -> set[int]:
        failed = set()
        for i, key in enumerate(keys):
            if key in self._keys:
                self._keys.move_to_end(key)
            else:
                failed.add(i)
        return failed

    def store(self, keys: Sequence[bytes], host_ids: Sequence[int]) -> set[int]:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return set()


class DiskStorage:
    """The real local-disk backend in `directory` (capacity in blocks), with a
    small stand-in payload per block read from and written to a host buffer; a
    second replay on the same directory finds what the first stored."""

    PAYLOAD = 4096

    def __init__(self, directory: str | Path, capacity: int, num_host_blocks: int) -> None:
        from fastkv.storage import BlockLayout, StorageNamespace
        from fastkv.storage.local_disk import LocalDiskBackend

        self.backend = LocalDiskBackend(
            directory, BlockLayout((self.PAYLOAD,)), capacity_blocks=capacity
        )
        self.backend.wait_recovered(600.0)
        # The identity of a stand-in cache, as an engine would state its own: a
        # one-layer, one-head model whose blocks are the payload above.
        cache = CacheConfig(
            block_size=TRACE_BLOCK_SIZE, model_id="trace", namespace="trace-replay"
        )
        model_kv = ModelKVShape(num_layers=1, num_kv_heads=1, head_dim=1)
        self._namespace = StorageNamespace.of(cache, model_kv).digest()
        # Page-aligned, as a worker's host cache is: blocks move zero-copy (O_DIRECT
        # stages misaligned memory through a bounce buffer, one slot at a time).
        self._memory = mmap.mmap(-1, max(1, num_host_blocks) * self.PAYLOAD)
        self._host = np.frombuffer(self._memory, dtype=np.uint8).reshape(-1, self.PAYLOAD)
        self._bytes = memoryview(self._host.reshape(-1))
        self._key_objects: dict[bytes, object] = {}
        self.verified = 0
        """Blocks loaded whose payload was read back as the one stored for the key."""
        self.mismatched = 0
        """Blocks the backend answered OK whose payload is not the key's (failed)."""

    def _keys(self, keys: Sequence[bytes]) -> list[object]:
        from fastkv.storage import StorageKey

        # A trace key is already a 32-byte digest standing for its chained block
        # hash; each gets its StorageKey once, as a worker keeps its blocks' keys.
        cache, ns = self._key_objects, self._namespace
        out = []
        for key in keys:
            k = cache.get(key)
            if k is None:
                k = cache[key] = StorageKey(ns, key)
            out.append(k)
        return out

    def _segments(self, host_ids: Sequence[int]) -> list[list[tuple[int, int]]]:
        base = self._host.ctypes.data
        return [[(base + h * self.PAYLOAD, self.PAYLOAD)] for h in host_ids]

    def lookup(self, keys: Sequence[bytes]) -> int:
        found = self.backend.exists(self._keys(keys), time.monotonic() + 60)
        return next((i for i, hit in enumerate(found) if not hit), len(keys))

    def load(self, keys: Sequence[bytes], host_ids: Sequence[int]) -> set[int]:
        self._host[list(host_ids), :32] = 0  # a load that wrote nothing cannot pass below
        results = self.backend.get_into(
            self._keys(keys), self._segments(host_ids), time.monotonic() + 60
        )
        failed = {i for i, r in enumerate(results) if not r.ok}
        for i, (key, h) in enumerate(zip(keys, host_ids, strict=True)):
            if i in failed:
                continue
            at = h * self.PAYLOAD
            if self._bytes[at : at + len(key)] == key:
                self.verified += 1  # verified by the backend, and the payload is the key's
            else:
                self.mismatched += 1
                failed.add(i)
        return failed

    def store(self, keys: Sequence[bytes], host_ids: Sequence[int]) -> set[int]:
        view = self._bytes
        for key, h in zip(keys, host_ids, strict=True):
            view[h * self.PAYLOAD : h * self.PAYLOAD + len(key)] = key
        results = self.backend.put_from(
            self._keys(keys), self._segments(host_ids), time.monotonic() + 60
        )
        return {i for i, r in enumerate(results) if not r.ok}

    def close(self) -> None:
        self.backend.close()


def replay(
    trace: Sequence[TraceRequest],
    config: CacheConfig,
    on_request: Callable[[int], None] | None = None,
    storage: ReplayStorage | None = None,
    on_manager: Callable[[CacheManager], None] | None = None,
) -> ReplayResult:
    """Run `trace` through a fresh CacheManager.

    Args:
        trace: requests in the order to serve them.
        config: the cache under test; its block size is nominal (a trace block
            stands for 512 tokens whatever it says).
        on_request: called after each request with its index (progress display);
            None keeps the loop free of it.
        storage: the storage tier behind host memory when `config.storage` is set.
        on_manager: called with the fresh CacheManager before the first request
            (e.g. to attach metrics).

    Raises:
        ValueError: a request needs more blocks than the device pool holds, or
            storage and config.storage disagree.
    """
    if (storage is None) != (config.storage is None):
        raise ValueError("storage: pass a storage tier exactly when config.storage is set")
    # A frozen clock: the simulated worker answers every lookup and load at once, so
    # no storage wait may run out.
    mgr = CacheManager(config, clock=lambda: 0.0)
    if on_manager is not None:
        on_manager(mgr)
    bs = config.block_size
    blocks = 0
    start = time.perf_counter()
    for i, request in enumerate(trace):
        hashes = request.block_hashes
        blocks += len(hashes)
        # Every id is a cacheable block (the trace's partial last block too, as in
        # its reference hit rates), so the prompt is its blocks plus one token: the
        # rule that a prompt's last token is computed then hides no block.
        mgr.match(i, hashes, len(hashes) * bs + 1)
        # The table holds the trace's blocks (its one-token tail is not modelled).
        while not (alloc := mgr.allocate(i, num_tokens=len(hashes) * bs)):
            if alloc.status is AllocStatus.NO_SPACE:  # one request at a time: never
                raise RuntimeError(f"request {i}: no blocks free and none being freed")
            complete_transfers(mgr, storage)
        if mgr.num_queued_blocks:  # the step: its swap-ins land before the commit
            complete_transfers(mgr, storage)
        mgr.commit(i, num_computed_tokens=len(hashes) * bs)
        while mgr.num_queued_blocks:  # backups the commit planned, and their writes
            complete_transfers(mgr, storage)
        mgr.finish(i)
        if on_request is not None:
            on_request(i)
    seconds = time.perf_counter() - start
    return ReplayResult(len(trace), blocks, seconds, mgr.get_stats())


def complete_transfers(mgr: CacheManager, storage: ReplayStorage | None = None) -> None:
    """The simulated worker: take every queued transfer (and, given `storage`, every
    storage write, load and lookup) and report it done at once, successful unless
    the storage tier failed a block."""
    tasks = mgr.take_swap_metadata()
    done: list[TransferResult | LookupResult] = [
        TransferResult(meta.transfer_id, True)
        for meta in (tasks.evict, tasks.swap_in)
        if meta is not None
    ]
    if storage is not None:
        # Writes land before loads read (a load of a key written this step).
        if tasks.storage_store is not None:
            m = tasks.storage_store
            done.append(_storage_result(m, storage.store(m.block_hashes, m.src_block_ids)))
        if tasks.storage_load is not None:
            m = tasks.storage_load
            done.append(_storage_result(m, storage.load(m.block_hashes, m.dst_block_ids)))
        done += [
            LookupResult(q.lookup_id, storage.lookup(q.block_hashes)) for q in tasks.lookups
        ]
    if done:
        mgr.apply_results(done)


def _storage_result(meta: CacheSwapMetadata, failed: set[int]) -> TransferResult:
    if not failed:
        return TransferResult(meta.transfer_id, True)
    return TransferResult(meta.transfer_id, False, "storage", tuple(sorted(failed)))
