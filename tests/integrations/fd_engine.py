"""A FastDeploy-shaped engine in one process: ResourceManagerV1's cache-manager call
sequences (resource_manager_v1.py, notes §2) and a model runner over one
FastDeployCacheController per tensor-parallel rank (real CPU tensors, real
results channel).

The "model" writes known bytes: the KV of token p on (layer, tensor, rank) is a
digest of the token prefix up to p, so the bytes every position must hold are
known. Each step, before writing, every request reads (and checks) every position
before the ones it computes, on every layer and rank: device hits, swapped-in
host hits and earlier steps' tokens alike. Its next token is derived from the
bytes it read, so garbage KV would also change the outputs.

The runner follows fastkv's one runner contract: `wait_for_layer` raising
SwapInFailedError (or `finish_step` returning failed blocks) means the requests
reading those blocks emit no token this step; the scheduler has rewound them by
the next schedule.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fd_standins import (
    AttentionBackend,
    BatchRequest,
    FDCacheConfig,
    FDConfig,
    ModelConfig,
    ParallelConfig,
    Request,
    RequestStatus,
    ScheduledDecodeTask,
    ScheduledPreemptTask,
    get_request_block_hasher,
)

from fastkv.integrations.fastdeploy import (
    FastDeployCacheController,
    FastDeployCacheManager,
    SwapInFailedError,
)
from fastkv.worker.faults import FaultInjector

BS = 4  # tokens per block
LAYERS = 2
KV_HEADS = 2  # per rank
HEAD_DIM = 4
VOCAB = 1000
WAIT_S = 20.0


class KVMismatch(AssertionError):
    """A position read back holds other bytes than the ones written for it."""


def prefix_digests(tokens: list[int], cache: list[bytes]) -> list[bytes]:
    """d[p] = sha256(d[p-1] || token p): one digest per token prefix (extends
    `cache` in place; tokens only ever grow)."""
    for p in range(len(cache), len(tokens)):
        parent = cache[p - 1] if p else b"prefix"
        cache.append(hashlib.sha256(parent + tokens[p].to_bytes(4, "little")).digest())
    return cache


def token_kv(digest: bytes, layer: int, tensor: int, rank: int, nbytes: int) -> bytes:
    return hashlib.shake_128(digest + bytes((layer, tensor, rank))).digest(nbytes)


@dataclass
class Rank:
    """One tensor-parallel rank: its controller and byte views of its tensors."""

    worker: FastDeployCacheController
    views: list[np.ndarray]  # per cache tensor: uint8 [blocks, heads, bs, dim * 2]

    @property
    def rank(self) -> int:
        return self.worker.rank


def slot_views(caches: list[Any]) -> list[np.ndarray]:
    views = []
    for t in caches:
        blocks, heads, bs, dim = t.shape
        nbytes = blocks * heads * bs * dim * t.element_size()
        raw = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
        views.append(np.ctypeslib.as_array(raw).reshape(blocks, heads, bs, -1))
    return views


@dataclass
class EngineLog:
    """What happened, for the tests' assertions."""

    batches: list[BatchRequest] = field(default_factory=list)
    matches: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    preempted: list[tuple[str, list[str], int]] = field(default_factory=list)
    """(victim, running ids before, victim's num_computed_tokens at request_finish)"""
    failed_steps: list[set[str]] = field(default_factory=list)
    reads_checked: int = 0
    decode_growths: int = 0
    finished: list[str] = field(default_factory=list)


class Engine:
    """ResourceManagerV1 + runner, scheduling and stepping until every request ends.

    Args:
        cache_manager: the scheduler adapter under test.
        ranks: one per tensor-parallel rank.
        max_num_seqs, max_num_batched_tokens: batch limits (chunked prefill when a
            prompt exceeds the token budget).
        enc_dec_block_num: blocks added per decode growth.
        decode_reserve: admission also keeps this many blocks per running request.
    """

    def __init__(
        self,
        cache_manager: FastDeployCacheManager,
        ranks: list[Rank],
        *,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 64,
        enc_dec_block_num: int = 1,
        decode_reserve: int = 0,
        fd_metrics: Any | None = None,
    ) -> None:
        self.cm = cache_manager
        self.fd_metrics = fd_metrics
        self.ranks = ranks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enc_dec_block_num = enc_dec_block_num
        self.decode_reserve = decode_reserve
        self.prefix_caching = cache_manager.enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.log = EngineLog()
        self.outputs: dict[str, list[int]] = {}
        self.step_hooks: list[Callable[[int, BatchRequest], None]] = []
        self.after_schedule: list[Callable[[int], None]] = []
        self._prefilled: set[str] = set()  # the runner's slots in decode
        self._digests: dict[str, list[bytes]] = {}
        self._nbytes = [v.shape[1] * v.shape[3] for v in ranks[0].views]
        self.step = 0
        self.worker_stats: list[dict[str, Any]] = []

    # -- ResourceManagerV1 ---------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.set_block_hasher(get_request_block_hasher(BS))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> BatchRequest:
        cm = self.cm
        batch = BatchRequest()
        budget = self.max_num_batched_tokens
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_computed_tokens >= req.need_prefill_tokens:  # decode
                if len(req.block_tables) * BS - req.num_total_tokens <= 1:
                    n = self.enc_dec_block_num
                    if not cm.can_allocate_gpu_blocks(n) and not self._trigger_preempt(
                        req, n, preempted, batch
                    ):
                        break
                    req.block_tables.extend(cm.allocate_gpu_blocks(req, n))
                    self.log.decode_growths += 1
                    batch.add_request(
                        ScheduledDecodeTask(
                            req.idx,
                            req.request_id,
                            req.pop_cache_swap_metadata(),
                            req.pop_cache_evict_metadata(),
                            list(req.block_tables),
                        )
                    )
                budget -= 1
                i += 1
                continue
            new = min(req.need_prefill_tokens - req.num_computed_tokens, budget)
            n = self._new_block_nums(req, new)
            if n > 0:
                if not cm.can_allocate_gpu_blocks(n) and not self._trigger_preempt(
                    req, n, preempted, batch
                ):
                    break
                req.block_tables.extend(cm.allocate_gpu_blocks(req, n))
            batch.add_request(self._prefill_task(req, new))
            req.num_computed_tokens += new
            budget -= new
            i += 1
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            if req.status == RequestStatus.PREEMPTED:
                req.need_prefill_tokens = req.num_total_tokens
            if self.prefix_caching:
                self._get_prefix_cached_blocks(req)
            new = min(req.need_prefill_tokens - req.num_computed_tokens, budget)
            if new <= 0:
                self._free_blocks(req)
                break
            n = self._new_block_nums(req, new)
            if cm.can_allocate_gpu_blocks(n + self.decode_reserve * len(self.running)):
                req.block_tables.extend(cm.allocate_gpu_blocks(req, n))
                self.waiting.popleft()
                self.running.append(req)
                batch.add_request(self._prefill_task(req, new))
                req.num_computed_tokens += new
                req.status = RequestStatus.RUNNING
                budget -= new
            else:
                self._free_blocks(req)
                break
        if len(batch) > 0:
            evict = cm.issue_pending_backup_to_batch_request()
            if evict:
                batch.append_evict_metadata([evict])
        cm.check_and_add_pending_backup()
        for victim in preempted:  # the worker acknowledged: back to the queue's head
            victim.has_been_preempted_before = True
            self.waiting.appendleft(victim)
        return batch

    def _get_prefix_cached_blocks(self, req: Request) -> None:
        self.cm.match_prefix(req, skip_storage=True)
        mr = req.match_result
        matched = mr.total_matched_blocks * BS
        req.metrics.gpu_cache_token_num = mr.matched_device_nums * BS
        req.metrics.cpu_cache_token_num = mr.matched_host_nums * BS
        req.cache_info = [mr.matched_device_nums, 0]
        req.block_tables = list(mr.device_block_ids)
        req.num_cached_tokens = matched
        req.num_computed_tokens = (
            matched - BS if matched == req.need_prefill_tokens else matched
        )
        if self.fd_metrics is not None and not req.has_been_preempted_before:
            self.fd_metrics.prefix_cache_token_num.inc(req.num_computed_tokens)
            self.fd_metrics.prefix_gpu_cache_token_num.inc(req.metrics.gpu_cache_token_num)
            self.fd_metrics.prefix_cpu_cache_token_num.inc(req.metrics.cpu_cache_token_num)
        self.log.matches.setdefault(req.request_id, []).append(
            (mr.matched_device_nums, mr.matched_host_nums)
        )

    def _trigger_preempt(
        self, req: Request, n: int, preempted: list[Request], batch: BatchRequest
    ) -> bool:
        while self.running and not self.cm.can_allocate_gpu_blocks(n):
            before = [r.request_id for r in self.running]
            victim = self.running.pop()  # LIFO
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            self.log.preempted.append((victim.request_id, before, victim.num_computed_tokens))
            self._free_blocks(victim)
            victim.num_cached_blocks = 0
            self._prefilled.discard(victim.request_id)
            batch.add_request(
                ScheduledPreemptTask(
                    victim.idx,
                    victim.request_id,
                    victim.pop_cache_swap_metadata(),
                    victim.pop_cache_evict_metadata(),
                )
            )
            preempted.append(victim)
            if victim is req:
                return False
        return self.cm.can_allocate_gpu_blocks(n)

    def _free_blocks(self, req: Request) -> None:
        self.cm.request_finish(req)
        req.block_tables = []

    def _new_block_nums(self, req: Request, new: int) -> int:
        return math.ceil((req.num_computed_tokens + new) / BS) - len(req.block_tables)

    @staticmethod
    def _prefill_task(req: Request, new: int) -> Request:
        req.prefill_start_index = req.num_computed_tokens
        req.prefill_end_index = req.num_computed_tokens + new
        return req

    def finish_requests(self, ids: Iterable[str]) -> None:
        for rid in ids:
            req = self.requests[rid]
            self.running.remove(req)
            req.status = RequestStatus.FINISHED
            self.cm.write_cache_to_storage(req)
            self._free_blocks(req)
            self._prefilled.discard(rid)
            self.outputs[rid] = list(req.output_token_ids)
            self.log.finished.append(rid)

    # -- the model runner ------------------------------------------------------

    def execute(self, batch: BatchRequest) -> None:
        counters = [
            r.worker.submit_swap_tasks(batch.cache_evict_metadata, batch.cache_swap_metadata)
            for r in self.ranks
        ]
        work: list[tuple[Request, int, int, bool]] = []  # request, start, end, samples
        in_batch = set()
        for task in batch:
            if isinstance(task, Request):
                in_batch.add(task.request_id)
                end = task.prefill_end_index
                work.append(
                    (task, task.prefill_start_index, end, end == task.need_prefill_tokens)
                )
        for req in self.running:
            rid = req.request_id
            if rid in self._prefilled and rid not in in_batch:
                work.append((req, req.num_total_tokens - 1, req.num_total_tokens, True))
        affected: set[str] = set()
        for layer in range(LAYERS):
            for counter in counters:
                if counter is None:
                    continue
                try:
                    counter.wait_for_layer(layer, timeout=WAIT_S)
                except SwapInFailedError as e:
                    affected |= self._readers(work, e.device_block_ids)
            for req, start, end, _ in work:
                if req.request_id in affected:
                    continue
                for rank in self.ranks:
                    self._attend(req, start, end, layer, rank)
        for rank in self.ranks:
            failed = rank.worker.finish_step(WAIT_S, wait_evictions=True)
            affected |= self._readers(work, failed)
        if affected:
            self.log.failed_steps.append(affected)
        done = []
        for req, _, end, samples in work:
            rid = req.request_id
            if rid in affected or not samples:
                continue
            token = self._sample(req, end)
            req.output_token_ids.append(token)
            req.num_computed_tokens = req.num_total_tokens - 1
            self._prefilled.add(rid)
            if len(req.output_token_ids) >= req.max_tokens:
                done.append(rid)
        self.finish_requests(done)

    @staticmethod
    def _readers(
        work: list[tuple[Request, int, int, bool]], blocks: frozenset[int]
    ) -> set[str]:
        return {req.request_id for req, *_ in work if blocks.intersection(req.block_tables)}

    def _sample(self, req: Request, end: int) -> int:
        """The next token, from the KV bytes of every position so far (rank 0, layer
        0, K): whatever the cache served, the same prefix gives the same token."""
        h = hashlib.sha256()
        view = self.ranks[0].views[0]
        for p in range(end):
            h.update(view[req.block_tables[p // BS], :, p % BS, :].tobytes())
        return int.from_bytes(h.digest()[:4], "little") % VOCAB

    def _attend(self, req: Request, start: int, end: int, layer: int, rank: Rank) -> None:
        tokens = req.prompt_token_ids + req.output_token_ids
        digests = prefix_digests(tokens, self._digests.setdefault(req.request_id, []))
        table = req.block_tables
        if len(table) * BS < end:
            raise AssertionError(f"{req.request_id}: {len(table)} blocks for {end} tokens")
        for t, view in enumerate(rank.views[layer * 2 : layer * 2 + 2]):
            tensor = layer * 2 + t
            nbytes = self._nbytes[tensor]
            for p in range(start):  # reads: every earlier position, checked
                got = view[table[p // BS], :, p % BS, :].tobytes()
                if got != token_kv(digests[p], layer, t, rank.rank, nbytes):
                    raise KVMismatch(
                        f"step {self.step}: {req.request_id} position {p} (block "
                        f"{table[p // BS]}) layer {layer} tensor {t} rank {rank.rank}"
                    )
                self.log.reads_checked += 1
            for p in range(start, end):  # writes
                kv = token_kv(digests[p], layer, t, rank.rank, nbytes)
                view[table[p // BS], :, p % BS, :] = np.frombuffer(kv, np.uint8).reshape(
                    view.shape[1], -1
                )

    # -- the loop ---------------------------------------------------------------

    def run(
        self, arrivals: dict[int, list[Request]], max_steps: int = 400
    ) -> dict[str, list[int]]:
        """Step until every request (arriving at its step) has finished."""
        total = len(self.log.finished) + sum(len(v) for v in arrivals.values())
        while len(self.log.finished) < total:
            if self.step >= max_steps:
                raise AssertionError(
                    f"not done after {max_steps} steps: running "
                    f"{[r.request_id for r in self.running]}, waiting "
                    f"{[r.request_id for r in self.waiting]}"
                )
            for req in arrivals.get(self.step, ()):
                self.add_request(req)
            batch = self.schedule()
            for hook in self.after_schedule:
                hook(self.step)
            self.log.batches.append(batch)
            for hook in self.step_hooks:
                hook(self.step, batch)
            self.execute(batch)
            self.cm.manager.check_invariants()
            self.step += 1
        return self.outputs

    def drain(self) -> None:
        """Every result reported and applied; nothing left active or in flight."""
        for rank in self.ranks:
            rank.worker.finish_step(WAIT_S, wait_evictions=True)
        self.cm.poll_results()
        mgr = self.cm.manager
        mgr.check_invariants()
        stats = mgr.get_stats()
        assert stats.active_requests == 0, stats
        assert stats.inflight_transfers == 0, (stats, self.cm.results.missing())

    def close(self) -> None:
        self.worker_stats = [rank.worker.get_stats() for rank in self.ranks]
        for rank in self.ranks:
            rank.worker.free_cache()
        self.cm.close()


def make_engine(
    channel: str,
    *,
    device_blocks: int,
    host_blocks: int = 0,
    write_policy: str = "write_back",
    threshold: int = 2,
    tp: int = 1,
    fail_rates: tuple[float, ...] = (),
    prefix_caching: bool = True,
    registry: Any | None = None,
    swap_in_retries: int = 0,
    **engine_kw: Any,
) -> Engine:
    """An engine of stand-ins around the real adapters. `swap_in_retries` is 0 by
    default: the flows exercise the runner's failed-load path; the worker's retry
    has its own tests."""
    fd_config = FDConfig(
        FDCacheConfig(
            block_size=BS,
            total_block_num=device_blocks,
            num_cpu_blocks=host_blocks,
            enable_prefix_caching=prefix_caching,
            write_policy=write_policy,
            write_through_threshold=threshold,
        ),
        ModelConfig(num_hidden_layers=LAYERS),
        ParallelConfig(tensor_parallel_size=tp),
    )
    cm = FastDeployCacheManager(fd_config, channel_name=channel, registry=registry)
    ranks = []
    for r in range(tp):
        worker = FastDeployCacheController(
            fd_config,
            r,
            r,
            channel_name=channel,
            fail_rate=fail_rates[r] if r < len(fail_rates) else 0.0,
            swap_in_retries=swap_in_retries,
        )
        caches = worker.initialize_kv_cache(
            AttentionBackend(KV_HEADS, HEAD_DIM, BS), device_blocks
        )
        ranks.append(Rank(worker, slot_views(caches)))
    return Engine(cm, ranks, **engine_kw)


def fail_copies_of_step(engine: Engine, step: int, rank: int) -> None:
    """Make every copy `rank` launches at `step` fail (fault injection)."""

    def hook(s: int, batch: BatchRequest) -> None:
        ctrl = engine.ranks[rank].worker.controller
        ctrl.faults = FaultInjector(1.0 if s == step else 0.0)

    engine.step_hooks.append(hook)


def prompt(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, VOCAB, length)]
