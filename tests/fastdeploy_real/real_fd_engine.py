"""FastDeploy's engine loop in one process, on its real objects.

Real: `ResourceManagerV1` (its `schedule()`, preemption, abort, `finish_requests`),
`Request`s with the v1 block hasher the engine sets, `BatchRequest` (its merge and
pickling), the `TokenProcessor` (its `_process_batch_output()` finishes requests,
reschedules preempted ones and recycles aborted ones), and the cache classes
`fastdeploy.cache_manager.v1` holds once fastkv is installed. Stood in for: the
model runner (`real_fd_runner`, one per rank) and the CUDA op that hands the
sampled tokens to the token processor (here they are written into its
`output_tokens` tensor in the op's layout: [signal, batch, token of slot 0, ...]).

One engine step: `schedule()`; a non-empty batch goes pickled to every rank; every
rank runs one forward; rank 0's tokens go through the token processor; its
`finish_requests_async` work is waited for. This is one of the interleavings the
threaded engine allows.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from real_fd_model import EOS, expected_continuation
from real_fd_runner import StandInRunner

from fastkv.integrations.fastdeploy import FastDeployCacheManager

MAX_BSZ = 512  # token_processor.MAX_BSZ: the output op's layout
SETTLE_S = 20.0


@dataclass
class Outcome:
    """What the clients got for one request."""

    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    error: str | None = None


class Results:
    """Stands in for the scheduler's `put_results` (the client side)."""

    def __init__(self) -> None:
        self.by_id: dict[str, Outcome] = {}

    def put_results(self, results: list[Any]) -> None:
        for r in results:
            out = self.by_id.setdefault(r.request_id, Outcome())
            out.tokens += list(r.outputs.token_ids)
            out.finished = out.finished or bool(r.finished)
            if r.error_msg:
                out.error = r.error_msg


@dataclass
class AllocationSpy:
    """Wraps the cache manager's `can_allocate_gpu_blocks` / `allocate_gpu_blocks`
    on the instance ResourceManagerV1 calls: a yes for n blocks followed by an
    allocation of at most n that returns fewer is recorded."""

    yes_then_short: list[tuple[str, int, int, int]] = field(default_factory=list)
    asked: int = 0
    allocations: int = 0
    _last_yes: int | None = None

    def install(self, cache_manager: Any) -> None:
        can, allocate = cache_manager.can_allocate_gpu_blocks, cache_manager.allocate_gpu_blocks

        def can_allocate_gpu_blocks(num_blocks: int) -> bool:
            answer = can(num_blocks)
            self.asked += 1
            self._last_yes = num_blocks if answer else None
            return answer

        def allocate_gpu_blocks(request: Any, num_blocks: int) -> list[int]:
            got = allocate(request, num_blocks)
            self.allocations += 1
            yes, self._last_yes = self._last_yes, None
            if yes is not None and num_blocks <= yes and len(got) != num_blocks:
                self.yes_then_short.append((request.request_id, yes, num_blocks, len(got)))
            return got

        cache_manager.can_allocate_gpu_blocks = can_allocate_gpu_blocks
        cache_manager.allocate_gpu_blocks = allocate_gpu_blocks


@dataclass
class StepLog:
    steps: int = 0
    batches: int = 0
    preempt_tasks: int = 0
    abort_tasks: int = 0
    chunked_prefills: int = 0  # prefill tasks that did not reach the sequence's end
    decode_growths: int = 0
    swap_in_steps: int = 0
    evict_steps: int = 0
    crowded_steps: int = 0  # eviction sent, host tier full, copies in flight: one step
    cached_tokens: dict[str, int] = field(default_factory=dict)  # at first admission
    hits: dict[str, tuple[int, int]] = field(default_factory=dict)  # (device, host) tokens


class Engine:
    """ResourceManagerV1 + TokenProcessor + stand-in runners over one FDConfig.

    Args:
        fd_config: from `real_fd_config.build_fd_config`.
        fail_rate: the controllers' injected copy-failure fraction.
        mtp_layers: MTP layers the runners' controllers also make caches for.
        spec_tokens: the runners decode speculatively with this many drafts per
            step (the config must have `speculative_tokens` as many); the token
            processor then reads the speculative output layout.
        runner_change: the runners make docs/fastdeploy.md's change for failed loads.
        runners: builds the ranks' runners from the FDConfig instead (after the
            cache manager, which binds the results channel, exists): ranks in
            another process (`real_fd_procs.RemoteRunner`), initialized there.
    """

    def __init__(
        self,
        fd_config: Any,
        *,
        fail_rate: float = 0.0,
        mtp_layers: int = 0,
        runner_change: bool = False,
        spec_tokens: int = 0,
        runners: Any = None,
    ) -> None:
        from fastdeploy.cache_manager.v1.cache_utils import get_request_block_hasher
        from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
        from fastdeploy.output.token_processor import TokenProcessor

        self.fd_config = fd_config
        pc, sc = fd_config.parallel_config, fd_config.scheduler_config
        self.rm = ResourceManagerV1(
            sc.max_num_seqs,
            fd_config,
            pc.tensor_parallel_size,
            sc.splitwise_role,
            pc.local_data_parallel_id,
        )
        self.cache_manager = self.rm.cache_manager
        assert isinstance(self.cache_manager, FastDeployCacheManager), (
            f"ResourceManagerV1 built {type(self.cache_manager)}: fastkv is not installed"
        )
        if runners is not None:
            self.runners = runners(fd_config)
        else:
            self.runners = [
                StandInRunner(
                    fd_config, rank, mtp_layers=mtp_layers, runner_change=runner_change
                )
                for rank in range(pc.tensor_parallel_size)
            ]
            for runner in self.runners:
                runner.spec_tokens = spec_tokens
                runner.cache_controller.fail_rate = fail_rate
                runner.initialize_kv_cache()
        self.results = Results()
        self.token_processor = TokenProcessor(fd_config, self.results, None, None)
        self.token_processor.set_resource_manager(self.rm)
        self.block_hasher = get_request_block_hasher(
            block_size=fd_config.cache_config.block_size
        )
        self.expected: dict[str, list[int]] = {}
        self.log = StepLog()

    # -- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any:
        """As the engine's `_fetch_request`: a Request with the v1 block hasher,
        handed to `ResourceManagerV1.add_request`."""
        from fastdeploy.engine.request import Request
        from fastdeploy.engine.sampling_params import SamplingParams

        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            prompt_token_ids_len=len(prompt),
            eos_token_ids=[EOS],
            sampling_params=SamplingParams(max_tokens=max_tokens),
        )
        now = time.time()  # what the API server and input processor stamp
        m = request.metrics
        m.arrival_time = m.preprocess_start_time = m.preprocess_end_time = now
        m.scheduler_recv_req_time = m.engine_get_req_time = now
        request.set_block_hasher(self.block_hasher)
        self.expected[request_id] = expected_continuation(prompt, max_tokens)
        self.rm.add_request(request)
        return request

    # -- the loop ---------------------------------------------------------------------

    def step(self) -> None:
        from fastdeploy.engine.request import Request, RequestType

        rm = self.rm
        batch, errors = rm.schedule()
        assert not errors, f"schedule() reported errors: {errors}"
        self.log.steps += 1
        if len(batch) > 0:
            self.log.batches += 1
            self._note(batch, Request, RequestType)
            rm.get_real_bsz()
            for task in batch:  # as the engine does before put_tasks
                if isinstance(task, Request) and not task.has_been_preempted_before:
                    task.metrics.inference_start_time = time.time()
            blob = pickle.dumps([(batch, rm.real_bsz)])  # engine_worker_queue.put_tasks
            for runner in self.runners:
                runner.receive(blob)
        tokens = [runner.execute_model() for runner in self.runners]
        for rank, other in enumerate(tokens[1:], 1):
            assert other == tokens[0], f"rank {rank} sampled {other}, rank 0 {tokens[0]}"
        self._emit(tokens[0])

    def step_until(self, done: Any, timeout: float = 30.0) -> None:
        """Step until `done()` holds. Admission waits for FastDeploy's async
        preprocessing on a thread pool, so the bound is wall-clock time: a loaded
        machine needs more steps than an idle one."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached after {timeout} s of steps")
            self.step()
            time.sleep(0.002)

    def run(self, max_steps: int = 2000) -> None:
        """Step until every request added has finished (or was aborted)."""
        for _ in range(max_steps):
            if not self.rm.requests and not self.rm.waiting:
                return
            self.step()
        raise AssertionError(
            f"not finished after {max_steps} steps: running "
            f"{[r.request_id for r in self.rm.running]}, waiting "
            f"{[r.request_id for r in self.rm.waiting]}, preempted "
            f"{sorted(self.rm.to_be_rescheduled_request_id_set)}"
        )

    def _note(self, batch: Any, request_cls: type, types: Any) -> None:
        cm = self.cache_manager
        if batch.cache_swap_metadata is not None:
            self.log.swap_in_steps += 1
        if batch.cache_evict_metadata is not None:
            self.log.evict_steps += 1
            stats = cm.get_stats()
            if cm.num_free_host_blocks == 0 and stats["inflight_transfers"] > 0:
                self.log.crowded_steps += 1
        for task in batch:
            kind = task.task_type.value
            if kind == types.PREEMPTED.value:
                self.log.preempt_tasks += 1
            elif kind == types.ABORT.value:
                self.log.abort_tasks += 1
            elif kind == types.DECODE.value:
                self.log.decode_growths += 1
            elif isinstance(task, request_cls):
                if task.prefill_end_index < task.num_total_tokens:
                    self.log.chunked_prefills += 1
                self.log.cached_tokens.setdefault(task.request_id, task.num_cached_tokens)
                m = task.metrics
                hits = (m.gpu_cache_token_num or 0, m.cpu_cache_token_num or 0)
                self.log.hits.setdefault(task.request_id, hits)

    def _emit(self, tokens: dict[int, int]) -> None:
        """Hand the step's tokens to the real token processor, as its output op
        would, and wait for the finishing it started."""
        if not tokens:
            return
        import paddle

        if self.runners[0].spec_tokens:
            self._emit_speculative(tokens)
            return
        out = np.full((MAX_BSZ + 2, 1), -1, np.int64)
        bsz = max(tokens) + 1
        out[0, 0], out[1, 0] = 0, bsz
        for idx, token in tokens.items():
            out[2 + idx, 0] = token
        tp = self.token_processor
        tp.output_tokens = paddle.to_tensor(out)
        tp._process_batch_output()
        self.rm.finish_execution_pool.submit(lambda: None).result()

    def _emit_speculative(self, tokens: dict[int, Any]) -> None:
        """The speculative output layout: [signal, batch, accept_num per slot,
        then MAX_DRAFT_TOKENS tokens per slot from 2 + SPECULATE_MAX_BSZ]."""
        import paddle
        from fastdeploy.output.token_processor import MAX_DRAFT_TOKENS, SPECULATE_MAX_BSZ

        tp = self.token_processor
        out = np.full(tp.output_tokens.shape, -1, np.int64)
        bsz = max(tokens) + 1
        out[0], out[1] = 0, bsz
        for idx, got in tokens.items():
            ids = got if isinstance(got, list) else []
            # a negative single token: PREEMPTED_TOKEN_ID answers as accept_num
            out[2 + idx] = len(ids) if isinstance(got, list) else (got if got < -1 else 0)
            base = 2 + SPECULATE_MAX_BSZ + idx * MAX_DRAFT_TOKENS
            out[base : base + len(ids)] = ids
        tp.output_tokens = paddle.to_tensor(out)
        tp._process_batch_output()
        self.rm.finish_execution_pool.submit(lambda: None).result()

    # -- after the run --------------------------------------------------------------

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait until the workers' copy results have reached the scheduler (the
        controllers report from their own threads) and nothing is in flight."""
        deadline = time.monotonic() + timeout
        cm = self.cache_manager
        while True:
            cm.poll_results()
            stats = cm.get_stats()
            if not stats["inflight_transfers"] and not stats["queued_blocks"]:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"transfers still in flight after {timeout} s: {stats}")
            time.sleep(0.01)

    def idle(self, seconds: float = 0.12) -> None:
        """The engine waits a moment with nothing to schedule: the workers'
        reporter threads deliver what finished, and the scheduler applies it."""
        time.sleep(seconds)
        self.cache_manager.poll_results()

    def mismatches(self) -> int:
        return sum(r.log.bad_positions for r in self.runners)

    def check_clean(self, aborted: frozenset[str] = frozenset()) -> None:
        """Zero KV mismatches, every request finished with the tokens its prompt
        determines (an aborted one: a prefix of them, then the abort's EOS),
        nothing leaked: fastkv's invariants hold, no request or transfer is left,
        and after `reset_cache()` both pools are full."""
        details = [m for r in self.runners for m in r.log.mismatches]
        assert self.mismatches() == 0, f"{self.mismatches()} KV positions wrong: {details[:8]}"
        for rid, want in self.expected.items():
            got = self.results.by_id.get(rid)
            assert got is not None and got.finished, f"{rid}: not finished ({got})"
            if rid in aborted and got.error is not None:
                assert got.error == "Aborted", f"{rid}: {got.error}"
                assert got.tokens[-1] == EOS and want[: len(got.tokens) - 1] == got.tokens[:-1]
                continue
            assert got.error is None, f"{rid}: {got.error}"
            assert got.tokens == want, f"{rid}: tokens {got.tokens} != {want}"
        self.check_no_leaks()

    def check_no_leaks(self) -> None:
        assert not self.rm.requests and not self.rm.running and not self.rm.waiting
        self.settle()
        cm = self.cache_manager
        cm.manager.check_invariants()
        stats = cm.get_stats()
        assert stats["active_requests"] == 0, stats
        assert stats["tracked_requests"] == 0, stats
        free, evictable = cm.num_free_device_blocks, stats["num_evictable_device_blocks"]
        assert free + evictable == cm.num_gpu_blocks, (free, evictable, cm.num_gpu_blocks)
        for runner in self.runners:
            wstats = runner.cache_controller.get_stats()
            assert wstats["transfers_without_result"] == 0, wstats
        assert cm.reset_cache() is True
        cm.manager.check_invariants()
        assert cm.num_free_device_blocks == cm.num_gpu_blocks
        assert cm.num_free_host_blocks == cm.num_cpu_blocks

    def close(self) -> None:
        """FastDeploy's teardown as far as it reaches the cache classes."""
        for runner in self.runners:
            runner.clear_cache()
            runner.cache_controller.free_cache()
        close = getattr(self.cache_manager, "close", None)
        if close is not None:
            close()
