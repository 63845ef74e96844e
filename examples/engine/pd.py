"""The engine with prefill/decode disaggregation over Mooncake Transfer Engine (TCP):
every request is prefilled on a P instance and decodes on a D instance.

Processes: one worker process per rank of each instance (the engine's own
`Worker`: its CacheController and model shard, plus a `PDSender` on P or a
`PDReceiver` on D, each on its own `MooncakeTransport` endpoint), and this process,
which holds both scheduler halves (P's `CacheManager` + `PrefillTransfers`, D's
`CacheManager` + `DecodeTransfers`) and carries the offers and acceptances between
them as the engines' own channel would. KV moves only between worker processes,
over TE, layer by layer as P's model writes it (`Worker.after_layer`).

Per wave of arrivals: P matches its own prefix, offers each prompt; D matches its own
prefix and reserves the tail; P runs one prefill step over every accepted prompt
(first token, KV sent per layer); D commits what every rank verified, or recomputes
the tail itself; D then decodes the rest. `fail_rate`: that share of P's sends is
aborted at a random layer (a failed P): D gets the failure notice and recomputes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import random
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from examples.engine.config import EngineConfig
from examples.engine.protocol import RequestWork, StepBatch, StepOutput, WorkerFailed
from examples.engine.rank_group import RankGroup
from examples.engine.scheduler import RunResult
from examples.engine.workload import Workload
from fastkv import CacheConfig
from fastkv.hashing import BlockHasher, namespace_root, request_root
from fastkv.pd.decode import DecodeTransfers
from fastkv.pd.messages import Acceptance
from fastkv.pd.prefill import PrefillTransfers
from fastkv.scheduler import CacheManager

HOST = "127.0.0.1"
# The engine logs every batch at INFO; its own level, MC_LOG_LEVEL, is what it
# reads (GLOG_minloglevel alone left 192 lines of it in the demo's output).
os.environ.setdefault("GLOG_minloglevel", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
SETTLE_S = 30.0


# -- the worker processes ----------------------------------------------------------


def serve(conn: Connection, config: EngineConfig, rank: int, peers: dict, role: str) -> None:
    """A P or D rank: answers ("name", args) tuples until None; an error goes back
    as a `WorkerFailed` and ends the process."""
    try:
        _serve_rank(conn, config, rank, peers, role)
    except Exception:
        with contextlib.suppress(OSError):  # the scheduler may be gone too
            conn.send(WorkerFailed(traceback.format_exc()))


def _serve_rank(conn: Connection, config: EngineConfig, rank: int, peers: dict, role: str):
    from examples.engine.worker import Worker
    from fastkv.pd.layout import KVLayout
    from fastkv.pd.mooncake_te import MooncakeTransport
    from fastkv.pd.receiver import PDReceiver
    from fastkv.pd.sender import PDSender

    group = RankGroup(rank, config.tp_size, peers, config.wait_timeout)
    worker = Worker(config, rank, group)
    layout = KVLayout.of_controller(worker.ctrl, tp_rank=rank, tp_size=config.tp_size)
    transport = MooncakeTransport(HOST, write_timeout_s=5.0)
    end: Any = PDSender(transport, layout) if role == "p" else PDReceiver(transport, layout)
    conn.send((transport.address, layout))
    while (msg := conn.recv()) is not None:
        name, args = msg
        if name == "connect":  # P: the D ranks this rank serves
            for address, d_layout in args:
                end.connect(address, d_layout)
            conn.send(None)
        elif name == "expect":  # D
            for acc, p_size in args:
                end.expect(acc, p_size)
            conn.send(None)
        elif name == "poll":  # D: reports; forget what D's scheduler let go
            for epoch, tid in args:
                end.forget(epoch, tid)
            conn.send(end.poll())
        elif name == "prefill":  # P
            conn.send(_prefill(worker, end, *args))
        else:  # "step": a plain step (D's decode or recompute)
            conn.send(worker.step(args))
    worker.finish()
    transport.close()
    worker.close()


def _prefill(worker: Any, sender: Any, batch: StepBatch, plans: list, fail: dict) -> tuple:
    """One prefill step with its sends: layer L goes to D once the model wrote it;
    a send in `fail` is aborted at its layer (a failed P). Returns the step's
    output, every send's report once settled, and when the transfer ran."""
    for plan in plans:
        sender.start(plan)
    times: dict[str, float] = {}
    sent0 = sender.bytes_sent

    def hook(layer: int) -> None:
        for (epoch, tid), at in fail.items():
            if at == layer:
                sender.abort(epoch, tid)
        times.setdefault("first", time.perf_counter())
        sender.after_layer(layer)

    worker.after_layer = hook
    try:
        out: StepOutput = worker.step(batch)
    finally:
        worker.after_layer = None
    times["forward_end"] = time.perf_counter()
    reports: list = []
    deadline = time.monotonic() + SETTLE_S
    while len(reports) < len(plans) and time.monotonic() < deadline:
        reports += sender.poll()
        time.sleep(0.0005)
    times["settled"] = time.perf_counter()
    return out, reports, times, sender.bytes_sent - sent0


@dataclass
class Instance:
    """One instance's worker processes, as its scheduler talks to them."""

    config: EngineConfig
    role: str
    procs: list = field(default_factory=list)
    conns: list = field(default_factory=list)
    hello: list = field(default_factory=list)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        mesh = RankGroup.mesh(self.config.tp_size)
        pipes = [ctx.Pipe() for _ in range(self.config.tp_size)]
        for r, (_, child) in enumerate(pipes):
            proc = ctx.Process(
                target=serve, args=(child, self.config, r, mesh[r], self.role), daemon=True
            )
            proc.start()
            self.procs.append(proc)
        for _, child in pipes:
            child.close()
        for ends in mesh:
            for sock in ends.values():
                sock.close()
        self.conns = [parent for parent, _ in pipes]
        self.hello = [self._recv(r) for r in range(len(self.conns))]

    def _recv(self, rank: int) -> Any:
        try:
            reply = self.conns[rank].recv()
        except EOFError:
            raise RuntimeError(f"{self.role} rank {rank}: the worker exited") from None
        if isinstance(reply, WorkerFailed):
            raise RuntimeError(f"{self.role} rank {rank} failed:\n{reply.error}")
        return reply

    def ask_each(self, messages: list[Any]) -> list[Any]:
        for c, m in zip(self.conns, messages, strict=True):
            c.send(m)
        return [self._recv(r) for r in range(len(self.conns))]

    def ask(self, message: Any) -> list[Any]:
        return self.ask_each([message] * len(self.conns))

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


# -- the two scheduler halves and the channel between them -------------------------


@dataclass
class PDStats:
    transfers: int = 0
    received: int = 0
    recomputed: int = 0
    aborted_on_p: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    d_prefix_hit_tokens: int = 0
    p_prefix_hit_tokens: int = 0
    transfer_s: float = 0.0
    overlapped_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def overlap_frac(self) -> float:
        return self.overlapped_s / self.transfer_s if self.transfer_s else 0.0


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_new: int
    offered_at: float
    generated: list[int] = field(default_factory=list)
    logits: bytes = b""
    table: list[int] = field(default_factory=list)
    accepted: bool = False


class PDEngine:
    """Serves a workload with P prefilling and D decoding (see the module doc)."""

    def __init__(
        self,
        config: EngineConfig,
        p_tp: int,
        d_tp: int,
        fail_rate: float = 0.0,
        seed: int = 0,
        local_d: bool = False,
    ) -> None:
        """`local_d`: no P at all; D prefills every prompt itself (what PD saves D:
        the same run's time to first token without disaggregation)."""
        base = dataclasses.replace(config, fail_rate=0.0, num_host_blocks=0)
        self.p_cfg = dataclasses.replace(base, tp_size=p_tp)
        self.d_cfg = dataclasses.replace(base, tp_size=d_tp)
        self.fail_rate = fail_rate
        self.rng = random.Random(seed)
        self.bs = config.block_size
        self.stats = PDStats()
        self.local_d = local_d

    def _manager(self, cfg: EngineConfig) -> CacheManager:
        return CacheManager(
            CacheConfig(
                block_size=cfg.block_size,
                num_device_blocks=cfg.num_device_blocks,
                kv_dtype=cfg.kv_dtype,
                model_id="tiny-transformer",
            )
        )

    def run(self, workload: Workload) -> RunResult:
        self.p, self.d = Instance(self.p_cfg, "p"), Instance(self.d_cfg, "d")
        try:
            if not self.local_d:
                self.p.start()
            self.d.start()
            return self._serve(workload)
        finally:
            self.p.close()
            self.d.close()

    def _serve(self, workload: Workload) -> RunResult:
        d_tp = self.d_cfg.tp_size
        d_ranks = self.d.hello  # (address, layout) per D rank
        self.p_mgr, self.d_mgr = self._manager(self.p_cfg), self._manager(self.d_cfg)
        self.d_side = DecodeTransfers(
            self.d_mgr,
            layout_digest=d_ranks[0][1].digest(),
            num_ranks=d_tp,
            timeout_s=SETTLE_S,
            fence_grace_s=10.0,
        )
        if not self.local_d:
            self._connect(d_ranks)
        self.live: set[tuple[int, int]] = set()  # transfers D's receivers expect
        self.d_root = request_root(namespace_root(self.d_mgr.config.namespace_key()))
        result = RunResult(self.d_cfg, "cpu", {}, {}, 0.0, 0)
        start, step = time.perf_counter(), 0
        while not workload.done():
            arrivals = workload.arrivals(step)
            if not arrivals:
                step += 1
                continue
            result.prompt_tokens += sum(len(a.tokens) for a in arrivals)
            if self.local_d:
                reqs = [
                    _Req(a.request_id, list(a.tokens), a.max_new_tokens, time.perf_counter())
                    for a in arrivals
                ]
                for r in reqs:
                    hit = self.d_mgr.add_request(r.rid, r.prompt)
                    self.stats.d_prefix_hit_tokens += hit.num_device_hits * self.bs
                self._recompute_on_d(reqs, result)
            else:
                reqs = self._prefill_on_p(arrivals, result)
                self._land_on_d(reqs, result)
            step = self._decode_on_d(reqs, result, workload, step)
        result.seconds = time.perf_counter() - start
        result.steps = step
        self.d_side.check_invariants()
        if not self.local_d:
            self.p_side.check_invariants()
        return result

    def _connect(self, d_ranks: list) -> None:
        p_tp, d_tp = self.p_cfg.tp_size, self.d_cfg.tp_size
        self.p.ask_each(
            [
                ("connect", [d_ranks[r] for r in range(d_tp) if r * p_tp // d_tp == rank])
                for rank in range(p_tp)
            ]
        )
        self.p_side = PrefillTransfers(
            self.p_mgr, layout_digest=self.p.hello[0][1].digest(), num_ranks=p_tp
        )

    def _prefill_on_p(self, arrivals: list, result: RunResult) -> list[_Req]:
        works, plans, fail, reqs = [], [], {}, []
        for a in arrivals:
            r = _Req(a.request_id, list(a.tokens), a.max_new_tokens, time.perf_counter())
            hit = self.p_mgr.add_request(r.rid, r.prompt)
            assert self.p_mgr.allocate(r.rid, num_tokens=len(r.prompt)), "P's pool is full"
            cached = self.p_mgr.block_table(r.rid).num_cached_tokens
            self.stats.p_prefix_hit_tokens += hit.num_device_hits * self.bs
            offer = self.p_side.offer(r.rid, len(r.prompt))
            hashes = BlockHasher(self.bs, self.d_root).append(r.prompt)
            answer = self.d_side.accept(offer, hashes)
            if isinstance(answer, Acceptance):
                r.accepted = True
                self.live.add((answer.epoch, answer.transfer_id))
                self.d.ask(("expect", [(answer, self.p_cfg.tp_size)]))
                self.stats.d_prefix_hit_tokens += answer.num_prefix_blocks * self.bs
            if self.p_side.on_answer(answer):
                plan = self.p_side.plan(r.rid)
                plans.append(plan)
                self.stats.transfers += 1
                self.stats.blocks_sent += len(plan.src_block_ids)
                if self.rng.random() < self.fail_rate:
                    layer = self.rng.randrange(self.p_cfg.model.num_layers)
                    fail[(plan.epoch, plan.transfer_id)] = layer
                    self.stats.aborted_on_p += 1
            r.table = list(self.p_mgr.block_table(r.rid).block_ids)
            works.append(RequestWork(r.rid, r.prompt[cached:], cached, r.table))
            result.computed_prompt_tokens += len(r.prompt) - cached
            reqs.append(r)
        replies = self.p.ask(("prefill", (StepBatch(0, works), plans, fail)))
        out: StepOutput = replies[0][0]
        for _, reports, times, sent in replies:
            self.p_side.on_reports(reports)
            self.stats.bytes_sent += sent
            if plans and "first" in times:
                span = times["settled"] - times["first"]
                self.stats.transfer_s += span
                self.stats.overlapped_s += min(span, times["forward_end"] - times["first"])
        for r in reqs:
            self.p_mgr.commit(r.rid, num_computed_tokens=len(r.prompt))
            self.p_side.release(r.rid)
            r.generated.append(out.outputs[r.rid].next_token)
            r.logits = out.outputs[r.rid].logits
        return reqs

    def _land_on_d(self, reqs: list[_Req], result: RunResult) -> None:
        """D's scheduler loop until every request's transfer ended; a failed one is
        recomputed on D (its first token must then equal P's)."""
        waiting = {r.rid: r for r in reqs if r.accepted}
        for r in reqs:
            if not r.accepted:  # D refused (no room): D computes it as any prompt
                self.d_mgr.add_request(r.rid, r.prompt)
        recompute = [r for r in reqs if not r.accepted]
        deadline = time.monotonic() + SETTLE_S + 15.0
        while waiting and time.monotonic() < deadline:
            forget = [key for key in self.live if not self.d_side.is_live(*key)]
            self.live.difference_update(forget)
            reports = [rep for reps in self.d.ask(("poll", forget)) for rep in reps]
            for o in self.d_side.on_reports(reports) + self.d_side.tick():
                r = waiting.pop(str(o.request_id))
                if o.success:
                    self.stats.received += 1
                    self.stats.ttft_s.append(time.perf_counter() - r.offered_at)
                else:
                    recompute.append(r)
            time.sleep(0.001)
        assert not waiting, f"no outcome for {sorted(waiting)}"
        if recompute:
            self._recompute_on_d(recompute, result)

    def _recompute_on_d(self, reqs: list[_Req], result: RunResult) -> None:
        works = []
        for r in reqs:
            start = self.d_mgr.block_table(r.rid).num_cached_tokens
            assert self.d_mgr.allocate(r.rid, num_tokens=len(r.prompt))
            table = list(self.d_mgr.block_table(r.rid).block_ids)
            works.append(RequestWork(r.rid, r.prompt[start:], start, table))
            result.recomputed_tokens += len(r.prompt) - start
        out: StepOutput = self.d.ask(("step", StepBatch(0, works)))[0]
        for r in reqs:
            self.d_mgr.commit(r.rid, num_computed_tokens=len(r.prompt))
            token = out.outputs[r.rid].next_token
            if not r.generated:  # no P: D's own first token
                r.generated.append(token)
                r.logits = out.outputs[r.rid].logits
            elif token != r.generated[0]:
                result.rank_mismatches.append(f"{r.rid}: D's recomputed first token differs")
            self.stats.recomputed += 1
            self.stats.ttft_s.append(time.perf_counter() - r.offered_at)

    def _decode_on_d(
        self, reqs: list[_Req], result: RunResult, workload: Workload, step: int
    ) -> int:
        for r in reqs:
            assert self.d_mgr.allocate(r.rid, num_tokens=len(r.prompt) + r.max_new)
            r.table = list(self.d_mgr.block_table(r.rid).block_ids)
        running = [r for r in reqs if len(r.generated) < r.max_new]
        while running:
            works = [
                RequestWork(
                    r.rid, [r.generated[-1]], len(r.prompt) + len(r.generated) - 1, r.table
                )
                for r in running
            ]
            outs = self.d.ask(("step", StepBatch(step, works)))
            if any(o.outputs != outs[0].outputs for o in outs[1:]):
                result.rank_mismatches.append(f"step {step}: D's ranks disagree")
            for r in running:
                o = outs[0].outputs[r.rid]
                r.generated.append(o.next_token)
                r.logits = o.logits
            running = [r for r in running if len(r.generated) < r.max_new]
            step += 1
        for r in reqs:
            self.d_mgr.finish(r.rid)
            result.outputs[r.rid] = r.generated
            result.last_logits[r.rid] = r.logits
            workload.finished(r.rid, r.generated, step)
        return step + 1
