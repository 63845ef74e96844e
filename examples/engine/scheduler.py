"""The engine's scheduler process: batching, the CacheManager, and the per-step
exchange with the worker process (StepBatch with CacheSwapMetadata one way,
StepOutput with TransferResults the other). Never imports paddle.

Per step: decode one token for every running request, admit waiting requests
(match their cached prefix, allocate blocks for the rest), take the swaps the
cache manager planned, run the step on the worker, then apply its transfer results
before committing the blocks the step computed, so a failed swap-in is rolled back
before anything is built on top of it.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from examples.engine.config import EngineConfig
from examples.engine.protocol import (
    RequestWork,
    StepBatch,
    StepOutput,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)
from examples.engine.workload import Prompt, Workload
from fastkv.config import CacheConfig
from fastkv.hashing import BlockHasher, namespace_root
from fastkv.scheduler import CacheManager


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
    recomputed_tokens: int = 0
    rollbacks: int = 0
    checksum_mismatches: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> reason
    history: list[StepRecord] = field(default_factory=list)
    worker: WorkerStats | None = None
    cache: object = None  # fastkv.scheduler.CacheStats

    @property
    def saved_frac(self) -> float:
        if not self.prompt_tokens:
            return 0.0
        return 1.0 - self.computed_prompt_tokens / self.prompt_tokens


class EngineScheduler:
    """Runs a workload to completion against a worker process.

    Args:
        config: engine settings.
        on_step: called after every step with (finished requests, total requests).
    """

    def __init__(
        self, config: EngineConfig, on_step: Callable[[int, int], None] | None = None
    ) -> None:
        self.config = config
        self.on_step = on_step
        cache_config = CacheConfig(
            block_size=config.block_size,
            num_device_blocks=config.num_device_blocks,
            num_host_blocks=config.num_host_blocks if config.enable_cache else 0,
            write_policy=config.write_policy,
            model_id="fastkv-engine-demo",
            kv_dtype=config.kv_dtype,
        )
        self.mgr = CacheManager(cache_config)
        self.root = namespace_root(cache_config.namespace_key())

    def run(self, workload: Workload) -> RunResult:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        from examples.engine.worker import serve  # the child imports paddle, not us

        proc = ctx.Process(target=serve, args=(child, self.config), daemon=True)
        proc.start()
        try:
            ready = self._recv(conn, proc)
            assert isinstance(ready, WorkerReady)
            result = self._loop(conn, proc, workload, ready.device)
            conn.send(None)
            result.worker = self._recv(conn, proc)
            result.cache = self.mgr.get_stats()
            proc.join(timeout=30)
            return result
        finally:
            if proc.is_alive():  # an error on our side: do not wait for the worker
                proc.kill()
                proc.join(timeout=5)

    # -- the step loop --------------------------------------------------------

    def _loop(self, conn: object, proc: object, workload: Workload, device: str) -> RunResult:
        cfg = self.config
        bs = cfg.block_size
        result = RunResult(cfg, device, {}, {}, 0.0, 0)
        waiting: list[_Request] = []
        running: list[_Request] = []
        step = 0
        start = time.perf_counter()
        while not (workload.done() and not waiting and not running):
            for prompt in workload.arrivals(step):
                hasher = BlockHasher(bs, self.root)
                hasher.append(prompt.tokens)
                waiting.append(_Request(prompt, hasher, list(prompt.tokens)))
                result.prompt_tokens += len(prompt.tokens)
            works = [self._decode_work(r) for r in running]
            self._admit(waiting, running, works, result, workload, step)
            tasks = self.mgr.take_swap_metadata()
            idle = not works and tasks.evict is None and tasks.swap_in is None
            if idle and not self.mgr.num_inflight_transfers:
                step += 1  # nothing to run until the next arrival
                continue
            conn.send(StepBatch(step, works, tasks.evict, tasks.swap_in))  # type: ignore[attr-defined]
            output = self._recv(conn, proc)
            assert isinstance(output, StepOutput) and output.step == step
            result.rollbacks += len(self.mgr.apply_results(output.results))
            result.checksum_mismatches += output.checksum_mismatches
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
            blocks = -(-(prompt_len + r.prompt.max_new_tokens) // bs)
            try:
                alloc = self.mgr.allocate(r.id, blocks - r.cached_tokens // bs)
            except ValueError as e:  # larger than the whole device pool
                waiting.pop(0)
                self.mgr.abort(r.id)
                result.rejected[r.id] = str(e)
                result.prompt_tokens -= prompt_len
                result.device_hit_tokens -= r.hits[0]
                result.host_hit_tokens -= r.hits[1]
                result.outputs[r.id] = []
                workload.finished(r.id, [], step)
                continue
            if not alloc:  # blocks being freed, or held by running requests
                return  # the step's swaps and finishing requests free them: retry then
            waiting.pop(0)
            r.table = table = self.mgr.block_table(r.id)
            running.append(r)
            budget -= new_tokens
            cached_blocks = r.cached_tokens // bs
            works.append(
                RequestWork(
                    r.id,
                    r.prompt.tokens[r.cached_tokens :],
                    r.cached_tokens,
                    table,
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
            self.mgr.commit(r.id, r.computed)
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

    @staticmethod
    def _recv(conn: object, proc: object, timeout: float = 600.0) -> object:
        """Next message from the worker; bounded, and fails fast if it died."""
        deadline = time.monotonic() + timeout
        while not conn.poll(0.5):  # type: ignore[attr-defined]
            if not proc.is_alive():  # type: ignore[attr-defined]
                raise RuntimeError(
                    f"the worker process exited (code {proc.exitcode})"  # type: ignore[attr-defined]
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the worker in {timeout:.0f} s")
        message = conn.recv()  # type: ignore[attr-defined]
        if isinstance(message, WorkerFailed):
            raise RuntimeError(f"the worker process failed:\n{message.error}")
        return message
