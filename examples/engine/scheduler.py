"""The engine's scheduler process: batching, the CacheManager, and the per-step
exchange with the worker process (StepBatch with CacheSwapMetadata one way,
StepOutput with TransferResults the other). Never imports paddle.

Per step: decode one token for every running request, admit waiting requests
(match their cached prefix, allocate blocks for the rest), take the swaps the
cache manager planned, run the step on the worker, then apply its transfer results
before committing the blocks the step computed, so a failed swap-in is rolled back
before anything is built on top of it.

Tensor parallelism: one worker process per rank, every one sent the same StepBatch
(the cache decisions are made once, here; block hashes carry no rank). Each rank
reports its own TransferResults; they are combined with fastkv.tp.RankResults, and
only combined results (every rank reported; good only if every rank's copy was)
are applied. The ranks' outputs must agree bit for bit.

Metrics: given a fastkv.metrics.CacheMetrics, the scheduler exports its
CacheManager's stats, the latest stats each rank sent with its StepOutput (label
tp_rank), and the duration of every transfer the ranks timed.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from examples.engine.config import MODEL_ID, EngineConfig
from examples.engine.protocol import (
    RequestWork,
    StepBatch,
    StepOutput,
    TransferTiming,
    WorkerDone,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)
from examples.engine.rank_group import RankGroup
from examples.engine.workload import Prompt, Workload
from fastkv.config import CacheConfig, StorageConfig
from fastkv.hashing import BlockHasher, namespace_root
from fastkv.scheduler import CacheManager, CacheStats
from fastkv.tp import RankResults

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from fastkv.metrics import CacheMetrics

# How long the other ranks get to report their own error once one rank failed.
_FAILURE_GRACE_S = 5.0


@dataclass(slots=True)
class _Request:
    prompt: Prompt
    hasher: BlockHasher
    tokens: list[int]
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose KV is in the cache
    cached_tokens: int = 0  # prompt positions served from the cache
    matched: bool = False
    table: list[int] = field(default_factory=list)
    hits: tuple[int, int] = (0, 0)  # device and host hit tokens at admission
    logits: bytes = b""

    @property
    def id(self) -> str:
        return self.prompt.request_id


@dataclass(slots=True)
class StepRecord:
    step: int
    device_hit_tokens: int  # cumulative
    host_hit_tokens: int  # cumulative
    computed_prompt_tokens: int  # cumulative


@dataclass(slots=True)
class RunResult:
    """One engine run: per-request outputs and what the cache did."""

    config: EngineConfig
    device: str
    outputs: dict[str, list[int]]
    last_logits: dict[str, bytes]
    seconds: float
    steps: int
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    recomputed_tokens: int = 0
    rollbacks: int = 0
    checksum_mismatches: list[str] = field(default_factory=list)
    rank_mismatches: list[str] = field(default_factory=list)  # ranks' outputs differ
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> reason
    history: list[StepRecord] = field(default_factory=list)
    worker: WorkerStats | None = None  # every rank's, combined (see combine_ranks)
    workers: list[WorkerStats] = field(default_factory=list)  # per rank
    cache: CacheStats | None = None

    @property
    def saved_frac(self) -> float:
        if not self.prompt_tokens:
            return 0.0
        return 1.0 - self.computed_prompt_tokens / self.prompt_tokens


def combine_ranks(stats: Sequence[WorkerStats]) -> WorkerStats:
    """The engine's totals over its ranks: bytes, cache sizes, failures and waits
    add up; transfers, blocks and checksummed reads are the same transfers and
    blocks on every rank (each moves its share of a block), so the most any rank
    counted."""
    if not stats:
        raise ValueError("stats: need at least one rank's")

    def most(name: str) -> int:
        return max(getattr(s, name) for s in stats)

    def total(name: str) -> int:
        return sum(getattr(s, name) for s in stats)

    return WorkerStats(
        device_to_host_transfers=most("device_to_host_transfers"),
        host_to_device_transfers=most("host_to_device_transfers"),
        device_to_host_blocks=most("device_to_host_blocks"),
        host_to_device_blocks=most("host_to_device_blocks"),
        device_to_host_bytes=total("device_to_host_bytes"),
        host_to_device_bytes=total("host_to_device_bytes"),
        failed_transfers=total("failed_transfers"),
        inflight_transfers=total("inflight_transfers"),
        ordering_waits=total("ordering_waits"),
        device_cache_bytes=total("device_cache_bytes"),
        host_cache_bytes=total("host_cache_bytes"),
        numa_node=stats[0].numa_node,
        storage_blocks_read=most("storage_blocks_read"),
        storage_blocks_written=most("storage_blocks_written"),
        checksums_verified=most("checksums_verified"),
    )


class _LockedManager:
    """What CacheMetrics.watch_scheduler needs of the manager, with `get_stats`
    taken under the scheduler's lock: the metrics server scrapes from its own
    thread while the step loop changes the manager."""

    def __init__(self, manager: CacheManager, lock: threading.RLock) -> None:
        self._manager = manager
        self._lock = lock

    def get_stats(self) -> CacheStats:
        with self._lock:
            return self._manager.get_stats()

    def add_transfer_listener(self, listener: Any) -> None:
        self._manager.add_transfer_listener(listener)


class EngineScheduler:
    """Runs a workload to completion against `config.tp_size` worker processes.

    Args:
        config: engine settings.
        on_step: called after every step with (finished requests, total requests).
        metrics: where to export the engine's metrics (scheduler families from
            the CacheManager, worker families per rank); None for none. The
            caller serves its registry (fastkv.metrics.serve_metrics); one
            CacheMetrics watches one scheduler.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_step: Callable[[int, int], None] | None = None,
        metrics: CacheMetrics | None = None,
    ) -> None:
        self.config = config
        self.on_step = on_step
        cache_config = CacheConfig(
            block_size=config.block_size,
            num_device_blocks=config.num_device_blocks,
            num_host_blocks=config.num_host_blocks if config.enable_cache else 0,
            write_policy=config.write_policy,
            model_id=MODEL_ID,
            kv_dtype=config.kv_dtype,
            tp_size=config.tp_size,  # results are applied once combined over the ranks
            # Steps take tens of milliseconds here: a request waits a few for disk.
            storage=StorageConfig(
                write_policy=config.storage_write_policy,
                wait_s=2.0,
                timeout_s=config.wait_timeout,
            )
            if config.has_storage
            else None,
        )
        self.mgr = CacheManager(cache_config)
        self.root = namespace_root(cache_config.namespace_key())
        self.procs: list[BaseProcess] = []  # the worker of each rank, while running
        self._lock = threading.RLock()  # the manager and the rank stats, against scrapes
        self._rank_stats: dict[int, WorkerStats] = {}
        self._metrics = metrics
        if metrics is not None:
            metrics.watch_scheduler(_LockedManager(self.mgr, self._lock))
            metrics.watch_workers(self.rank_stats)

    def rank_stats(self) -> dict[int, WorkerStats]:
        """The latest stats each rank reported (every step, and at shutdown)."""
        with self._lock:
            return dict(self._rank_stats)

    def run(self, workload: Workload) -> RunResult:
        """Serve `workload` to completion.

        Raises:
            RuntimeError: a worker rank failed or exited (the message has each
                rank's error); every worker process is stopped.
            TimeoutError: a rank did not answer within the bound.
        """
        ctx = mp.get_context("spawn")
        from examples.engine.worker import serve  # the children import paddle, not us

        tp = self.config.tp_size
        mesh = RankGroup.mesh(tp)
        pipes = [ctx.Pipe() for _ in range(tp)]
        conns = [parent for parent, _ in pipes]
        self.procs = [
            ctx.Process(target=serve, args=(pipes[r][1], self.config, r, mesh[r]), daemon=True)
            for r in range(tp)
        ]
        try:
            for proc in self.procs:
                proc.start()
        finally:
            # Only the ranks hold these now: a rank's exit then closes its ends.
            for _, child in pipes:
                child.close()
            for ends in mesh:
                for sock in ends.values():
                    sock.close()
        try:
            readies = self._recv_all(conns)
            assert all(isinstance(r, WorkerReady) for r in readies)
            with self._lock:
                self._rank_stats = {r: ready.stats for r, ready in enumerate(readies)}  # type: ignore[union-attr]
            result = self._loop(conns, workload, readies[0].device)  # type: ignore[union-attr]
            self._send_all(conns, None)
            done = self._recv_all(conns)
            for rank, message in enumerate(done):
                assert isinstance(message, WorkerDone)
                self._observe(rank, message.stats, message.timings)
            result.workers = [m.stats for m in done]  # type: ignore[union-attr]
            result.worker = combine_ranks(result.workers)
            result.cache = self.mgr.get_stats()
            for proc in self.procs:
                proc.join(timeout=30)
            return result
        finally:
            for proc in self.procs:
                if proc.is_alive():  # an error on our side: do not wait for the worker
                    proc.kill()
                    proc.join(timeout=5)
            for conn in conns:
                conn.close()

    # -- the step loop --------------------------------------------------------

    def _loop(self, conns: list[Connection], workload: Workload, device: str) -> RunResult:
        cfg = self.config
        bs = cfg.block_size
        result = RunResult(cfg, device, {}, {}, 0.0, 0)
        waiting: list[_Request] = []
        running: list[_Request] = []
        combined = RankResults(cfg.tp_size)
        step = 0
        start = time.perf_counter()
        # Past the last request, until every transfer's result is in: the pools
        # settle and every copy's duration is reported.
        while not (workload.done() and not waiting and not running and not self.mgr.busy):
            with self._lock:
                for prompt in workload.arrivals(step):
                    hasher = BlockHasher(bs, self.root)
                    hasher.append(prompt.tokens)
                    waiting.append(_Request(prompt, hasher, list(prompt.tokens)))
                    result.prompt_tokens += len(prompt.tokens)
                works = [self._decode_work(r) for r in running]
                self._admit(waiting, running, works, result, workload, step)
                tasks = self.mgr.take_swap_metadata()
            moves = (tasks.evict, tasks.swap_in, tasks.storage_load, tasks.storage_store)
            idle = not works and all(m is None for m in moves) and not tasks.lookups
            if idle and not self.mgr.busy:
                step += 1  # nothing to run until the next arrival
                continue
            self._send_all(conns, StepBatch(step, works, *moves, tasks.lookups))
            outputs = self._recv_all(conns)
            assert all(isinstance(o, StepOutput) and o.step == step for o in outputs)
            output: StepOutput = outputs[0]  # type: ignore[assignment]
            result.rank_mismatches += _disagreements(outputs)  # type: ignore[arg-type]
            with self._lock:
                ready = []
                for rank, out in enumerate(outputs):
                    ready += combined.add(rank, out.results)  # type: ignore[union-attr]
                    self._observe(rank, out.stats, out.timings)  # type: ignore[union-attr]
                    result.checksum_mismatches += out.checksum_mismatches  # type: ignore[union-attr]
                result.rollbacks += len(self.mgr.apply_results(ready))
                for work in works:
                    self._absorb(work, output, running, workload, result, step)
            result.history.append(
                StepRecord(
                    step,
                    result.device_hit_tokens,
                    result.host_hit_tokens,
                    result.computed_prompt_tokens,
                )
            )
            result.steps += 1
            step += 1
            if self.on_step is not None:
                self.on_step(len(result.outputs), workload.total_requests)
        result.seconds = time.perf_counter() - start
        return result

    def _decode_work(self, r: _Request) -> RequestWork:
        position = len(r.tokens) - 1  # the last generated token, not yet in the cache
        return RequestWork(
            r.id, [r.tokens[-1]], position, r.table, record=self._completed(r, position + 1)
        )

    def _admit(
        self,
        waiting: list[_Request],
        running: list[_Request],
        works: list[RequestWork],
        result: RunResult,
        workload: Workload,
        step: int,
    ) -> None:
        cfg = self.config
        bs = cfg.block_size
        budget = cfg.max_step_tokens
        while waiting and len(running) < cfg.max_running:
            r = waiting[0]
            prompt_len = len(r.prompt.tokens)
            if not r.matched:
                r.matched = True
                hashes = r.hasher.hashes if cfg.enable_cache else []
                hit = self.mgr.match(r.id, hashes, prompt_len)  # leaves the last token
                r.cached_tokens = hit.num_cached_tokens
                r.hits = (hit.num_device_hits * bs, hit.num_host_hits * bs)
                result.device_hit_tokens += r.hits[0]
                result.host_hit_tokens += r.hits[1]
            new_tokens = prompt_len - r.cached_tokens
            if new_tokens > budget and works:
                return  # the next step has room
            try:  # the whole request: prompt and every token it may generate
                alloc = self.mgr.allocate(r.id, num_tokens=prompt_len + r.prompt.max_new_tokens)
            except ValueError as e:  # larger than the whole device pool
                waiting.pop(0)
                self.mgr.abort(r.id)
                result.rejected[r.id] = (
                    f"{prompt_len:,} prompt + {r.prompt.max_new_tokens} new tokens: {e}"
                )
                result.prompt_tokens -= prompt_len
                result.device_hit_tokens -= r.hits[0]
                result.host_hit_tokens -= r.hits[1]
                result.outputs[r.id] = []
                workload.finished(r.id, [], step)
                continue
            if not alloc:  # blocks being freed, or held by running requests, or disk
                return  # the step's swaps and finishing requests free them: retry then
            # The manager's table is the only truth: its blocks and how many of its
            # leading positions the cache provides (storage hits found meanwhile too).
            table = self.mgr.block_table(r.id)
            if table.num_cached_tokens > r.cached_tokens:  # found in storage meanwhile
                found = table.num_cached_tokens - r.cached_tokens
                r.cached_tokens = table.num_cached_tokens
                result.storage_hit_tokens += found
                new_tokens -= found
            waiting.pop(0)
            r.table = list(table.block_ids)
            running.append(r)
            budget -= new_tokens
            cached_blocks = r.cached_tokens // bs
            works.append(
                RequestWork(
                    r.id,
                    r.prompt.tokens[r.cached_tokens :],
                    r.cached_tokens,
                    r.table,
                    all_tokens=r.prompt.tokens,
                    verify=list(enumerate(r.hasher.hashes[:cached_blocks])),
                    record=self._completed(r, prompt_len),
                )
            )
            result.computed_prompt_tokens += new_tokens

    def _completed(self, r: _Request, computed_after: int) -> list[tuple[int, bytes]]:
        """Blocks a step completes when positions up to `computed_after` hold KV."""
        first = max(r.computed, r.cached_tokens) // self.config.block_size
        last = computed_after // self.config.block_size
        return [(p, r.hasher.hashes[p]) for p in range(first, last)]

    def _absorb(
        self,
        work: RequestWork,
        output: StepOutput,
        running: list[_Request],
        workload: Workload,
        result: RunResult,
        step: int,
    ) -> None:
        r = next(x for x in running if x.id == work.request_id)
        out = output.outputs[r.id]
        if out.recomputed_from >= 0:
            extra = work.start - out.recomputed_from
            result.recomputed_tokens += extra
            result.computed_prompt_tokens += extra
        r.computed = work.start + len(work.tokens)
        r.logits = out.logits
        if self.config.enable_cache:
            self.mgr.commit(r.id, num_computed_tokens=r.computed)
        r.generated.append(out.next_token)
        if len(r.generated) >= r.prompt.max_new_tokens:
            running.remove(r)
            self.mgr.finish(r.id)
            result.outputs[r.id] = r.generated
            result.last_logits[r.id] = r.logits
            workload.finished(r.id, r.generated, step)
        else:
            r.tokens.append(out.next_token)
            completed = r.hasher.append([out.next_token])
            if completed and self.config.enable_cache:
                self.mgr.append_hashes(r.id, completed)

    def _observe(self, rank: int, stats: WorkerStats, timings: list[TransferTiming]) -> None:
        with self._lock:
            self._rank_stats[rank] = stats
        if self._metrics is not None:
            for t in timings:
                self._metrics.observe_transfer(rank, t.src, t.dst, t.seconds)

    def _send_all(self, conns: list[Connection], message: object) -> None:
        for rank, conn in enumerate(conns):
            try:
                conn.send(message)
            except OSError as e:  # its end is closed: the rank exited
                self._recv_all(conns)  # raises with every rank's error, if they said
                raise RuntimeError(f"rank {rank}: the worker process is gone ({e})") from e

    def _recv_all(self, conns: list[Connection], timeout: float = 600.0) -> list[object]:
        """One message from every rank, bounded. A rank that failed or exited makes
        it wait a little for the others' errors too, then raise with all of them
        (the first rank to fail is usually the cause, its peers report losing it)."""
        deadline = time.monotonic() + timeout
        answers: dict[int, object] = {}
        failures: dict[int, str] = {}
        pending = set(range(len(conns)))
        while pending:
            now = time.monotonic()
            if failures:
                deadline = min(deadline, now + _FAILURE_GRACE_S)
            if now >= deadline:
                break
            wait(
                [conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                timeout=min(0.5, deadline - now),
            )
            for rank in sorted(pending):
                message = self._poll_rank(rank, conns[rank])
                if message is None:
                    continue
                pending.discard(rank)
                if isinstance(message, WorkerFailed):
                    failures[rank] = message.error
                else:
                    answers[rank] = message
        if failures:
            raise RuntimeError(
                "worker rank(s) failed:\n"
                + "\n".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
            )
        if pending:
            raise TimeoutError(f"no answer from rank(s) {sorted(pending)} in {timeout:.0f} s")
        return [answers[r] for r in range(len(conns))]

    def _poll_rank(self, rank: int, conn: Connection) -> object | None:
        """The rank's message if one is there; a WorkerFailed if its process exited
        without one; None while it is alive and silent."""
        try:
            message = conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            message = None
        if message is None and not self.procs[rank].is_alive():
            message = WorkerFailed(
                f"the worker process exited (code {self.procs[rank].exitcode})"
            )
        return message


def _disagreements(outputs: Sequence[StepOutput]) -> list[str]:
    """Requests whose next token, logits or recomputation differ between ranks:
    after the all-gathers every rank computes the same rows."""
    first = outputs[0]
    out = []
    for rank, other in enumerate(outputs[1:], start=1):
        for rid, mine in first.outputs.items():
            theirs = other.outputs.get(rid)
            if theirs != mine:
                out.append(f"step {first.step} {rid}: rank {rank} differs from rank 0")
    return out
