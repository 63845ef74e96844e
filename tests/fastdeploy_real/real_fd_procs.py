"""The ranks of one FastDeploy instance in a process of their own, as in a deployment:
the engine (its real `ResourceManagerV1`, fastkv's scheduler half) in one process,
every rank's worker in another.

Between them only what FastDeploy carries between its engine and its workers:

- the engine-worker queue's payloads (`put_tasks`: the step's pickled
  `[(BatchRequest, real_bsz)]`; PR #7529's drained prefetch tasks: each task's
  pickled `StorageMetadata`), carried here over a `multiprocessing` pipe, the
  bytes as the queue holds them;
- "run a step" and the step's sampled tokens (the runner's forward and the output
  op that hands tokens to the token processor);
- the results channel (fastkv's own, shared memory between the processes): every
  rank's copy results and PD `RankReport`s, bound by the engine's cache manager.

Nothing else reaches a rank: the worker process holds no object of the engine's,
so a PD task can reach a rank only by riding the batch or the drained tasks. The
`state` query (logs, stats, PD counters) is the test's, never the engine's.

`RemoteRunner` stands where `real_fd_engine.Engine` keeps its `StandInRunner`s
(`Engine(..., runners=...)`), and `PDPair` attaches PD through it: the rank makes
its own transport (Mooncake TE on loopback) and answers its layout digest and
handshake, which a deployment exchanges at start-up.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CALL_TIMEOUT_S = 60.0


@dataclass
class Arrivals:
    """The PD tasks one rank ran, by the route they came on."""

    batch: list[str] = field(default_factory=list)  # kinds, off a step's batch
    drained: list[str] = field(default_factory=list)  # kinds, off the drained tasks


def _spy_routes(runner: Any, arrivals: Arrivals) -> None:
    """Note the kinds of the PD tasks the rank's controller runs and the route:
    `submit_swap_tasks` (the batch) or `prefetch_from_storage` (the drain)."""
    ctrl = runner.cache_controller
    route: list[list[str]] = [arrivals.batch]
    run_tasks = ctrl.pd.run_tasks

    def noted(tasks: list[Any]) -> Any:
        route[0].extend(kind for kind, _ in tasks)
        return run_tasks(tasks)

    ctrl.pd.run_tasks = noted
    submit, prefetch = ctrl.submit_swap_tasks, ctrl.prefetch_from_storage

    def via_batch(*args: Any, **kw: Any) -> Any:
        route[0] = arrivals.batch
        return submit(*args, **kw)

    def via_drain(*args: Any, **kw: Any) -> Any:
        route[0] = arrivals.drained
        return prefetch(*args, **kw)

    ctrl.submit_swap_tasks, ctrl.prefetch_from_storage = via_batch, via_drain


def worker_main(conn: Any, role: str, tp: int, model_dir: str, channel: str) -> None:
    """One instance's ranks (`tp` of them) in this process, serving `conn`."""
    os.environ["ENABLE_V1_KVCACHE_MANAGER"] = "1"
    import fastkv.integrations.fastdeploy as fkv_fd

    os.environ[fkv_fd.CHANNEL_ENV] = channel  # the engine's channel, as FastDeploy's env
    fkv_fd.install()
    from real_fd_config import build_fd_config
    from real_fd_runner import StandInRunner

    from fastkv.pd.mooncake_te import MooncakeTransport

    fd_config = build_fd_config(
        Path(model_dir), num_gpu_blocks=24, splitwise_role=role, tensor_parallel_size=tp
    )
    runners = [StandInRunner(fd_config, rank) for rank in range(tp)]
    for runner in runners:
        runner.initialize_kv_cache()
    transports: list[Any] = []
    arrivals = [Arrivals() for _ in runners]

    def attach(rank: int) -> tuple[Any, Any]:
        t = MooncakeTransport("127.0.0.1", write_timeout_s=5.0)
        transports.append(t)
        worker = runners[rank].cache_controller.attach_pd(t, role=role)
        _spy_routes(runners[rank], arrivals[rank])
        return worker.layout.digest(), worker.handshake()

    def state(rank: int) -> dict[str, Any]:
        r = runners[rank]
        pd = r.cache_controller.pd
        return {
            "log": r.log,
            "stats": r.cache_controller.get_stats(),
            "num_open": pd.num_open if pd is not None else 0,
            "bytes_sent": pd.sender.bytes_sent if pd is not None and pd.sender else 0,
            "bytes_received": (
                pd.receiver.bytes_received if pd is not None and pd.receiver else 0
            ),
            "arrivals": arrivals[rank],
        }

    ops = {
        "attach_pd": attach,
        "receive": lambda rank, blob: runners[rank].receive(blob),
        "receive_storage": lambda rank, blob: runners[rank].receive_storage(blob),
        "execute_model": lambda rank: runners[rank].execute_model(),
        "state": state,
    }
    conn.send(("ok", os.getpid()))
    while True:
        op, args = conn.recv()
        if op == "close":
            for runner in runners:
                runner.clear_cache()
                runner.cache_controller.free_cache()
            for t in transports:
                t.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", ops[op](*args)))
        except BaseException:  # the engine process raises it, with this traceback
            conn.send(("err", traceback.format_exc()))


class WorkerProcess:
    """The process of one instance's ranks, and the pipe standing in for the
    engine-worker queue to it."""

    def __init__(self, role: str, tp: int, model_dir: Path, channel: str) -> None:
        ctx = mp.get_context("spawn")  # the engine process has threads (and paddle)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main,
            args=(child, role, tp, str(model_dir), channel),
            name=f"fd-{role}-ranks",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.pid = self._answer()
        assert self.pid != os.getpid()

    def call(self, op: str, *args: Any) -> Any:
        self.conn.send((op, args))
        return self._answer()

    def _answer(self) -> Any:
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise AssertionError(f"the ranks' process {self.proc.pid} did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"in the ranks' process:\n{value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            self.call("close")
        self.proc.join(10)


class RemoteRunner:
    """`Engine`'s view of one rank in a `WorkerProcess`: the queue's payloads go
    there, the step's tokens come back."""

    spec_tokens = 0

    def __init__(self, proc: WorkerProcess, rank: int) -> None:
        self.proc, self.rank = proc, rank
        self.cache_controller = _RemoteController(self)

    def receive(self, blob: bytes) -> None:
        self.proc.call("receive", self.rank, blob)

    def receive_storage(self, blob: bytes) -> None:
        self.proc.call("receive_storage", self.rank, blob)

    def execute_model(self) -> dict[int, int]:
        return self.proc.call("execute_model", self.rank)

    def state(self) -> dict[str, Any]:
        return self.proc.call("state", self.rank)

    @property
    def log(self) -> Any:
        return self.state()["log"]

    def clear_cache(self) -> None:
        """The process frees its caches when it closes (`WorkerProcess.close`)."""


class _RemoteController:
    """What `Engine` and `PDPair` touch of a rank's cache controller."""

    def __init__(self, runner: RemoteRunner) -> None:
        self._runner = runner

    def get_stats(self) -> dict[str, Any]:
        return self._runner.state()["stats"]

    def free_cache(self) -> None:
        """See `RemoteRunner.clear_cache`."""

    def attach_pd(self, transport: Any, *, role: str) -> Any:
        """The rank attaches PD over a transport of its own (`transport` is None
        here); the digest and handshake come back as a deployment exchanges them."""
        assert transport is None, "the rank makes its own transport"
        digest, handshake = self._runner.proc.call("attach_pd", self._runner.rank)
        return _RemotePDWorker(self._runner, digest, handshake, role)


class _RemotePDWorker:
    def __init__(self, runner: RemoteRunner, digest: Any, handshake: Any, role: str) -> None:
        self._runner = runner
        self.layout = SimpleNamespace(digest=lambda: digest)
        self._handshake = handshake
        self.role = role

    def handshake(self) -> Any:
        return self._handshake

    @property
    def num_open(self) -> int:
        return self._runner.state()["num_open"]
