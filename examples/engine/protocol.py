"""Messages between the engine's scheduler and worker processes (picklable, no
paddle). The swap metadata travels as fastkv.metadata types.

With tensor parallelism the scheduler sends every rank the same StepBatch and gets
one StepOutput from each: its own TransferResults, its own stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastkv.metadata import (
    CacheLevel,
    CacheSwapMetadata,
    StorageLookup,
    TransferResult,
)
from fastkv.worker.stats import ControllerStats


@dataclass(slots=True)
class RequestWork:
    """One request's share of a step: compute KV for `tokens` at positions
    `start .. start + len(tokens)` and predict the next token.

    Attributes:
        request_id: the engine's id.
        tokens: the token ids to compute.
        start: position of tokens[0]; positions before it are read from the cache.
        block_table: device blocks of positions 0.. (block_size tokens each).
        all_tokens: every token from position 0, for recomputing cached positions
            if this step's swap-in fails (prefill steps); else empty.
        verify: (position, block hash) of cached blocks this step reads: their
            bytes must match the checksum recorded when the block was written.
        record: (position, block hash) of blocks this step completes: record
            their checksum.
    """

    request_id: str
    tokens: list[int]
    start: int
    block_table: list[int]
    all_tokens: list[int] = field(default_factory=list)
    verify: list[tuple[int, bytes]] = field(default_factory=list)
    record: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class StepBatch:
    step: int
    requests: list[RequestWork]
    evict: CacheSwapMetadata | None = None
    swap_in: CacheSwapMetadata | None = None
    storage_load: CacheSwapMetadata | None = None
    storage_store: CacheSwapMetadata | None = None
    lookups: tuple[StorageLookup, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    next_token: int
    logits: bytes  # float32 logits of the last position, raw bytes
    recomputed_from: int = -1  # a failed swap-in made the worker recompute from here


@dataclass(frozen=True, slots=True)
class WorkerStats(ControllerStats):
    """One rank's worker stats: its CacheController's, and the KV checksums it
    verified."""

    checksums_verified: int = 0


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """One transfer as the worker's CacheController timed it (launch to result)."""

    src: CacheLevel
    dst: CacheLevel
    num_blocks: int
    seconds: float
    success: bool


@dataclass(slots=True)
class StepOutput:
    step: int
    outputs: dict[str, RequestOutput]
    results: list[TransferResult]
    checksum_mismatches: list[str]
    seconds: float
    stats: WorkerStats
    timings: list[TransferTiming] = field(default_factory=list)


@dataclass(slots=True)
class WorkerReady:
    rank: int
    device: str
    kv_bytes_per_block: int  # this rank's share
    stats: WorkerStats


@dataclass(slots=True)
class WorkerDone:
    """Sent once at shutdown, after every copy has finished."""

    stats: WorkerStats
    timings: list[TransferTiming] = field(default_factory=list)


@dataclass(slots=True)
class WorkerFailed:
    """Sent instead of an answer when the worker hit an error; it then exits."""

    error: str
