"""FastDeploy's prefill/decode disaggregation served by fastkv's PD path (worker side).

One `PDWorker` per rank, made by `FastDeployCacheController.attach_pd` once the cache
exists: a `PDSender` on a P rank, a `PDReceiver` on a D rank, over the rank's
transport. FastDeploy's declared names and handler shape:

    send_to_node(PDTransferMetadata) -> AsyncTaskHandler             (P rank)
        extra_params["fastkv_pd"]: the send plan (`fd_pd.plan_fields`) and D's rank
        handshakes; block_ids: P's source blocks. The send goes layer by layer from
        `after_layer(L)` (the runner's one added line, after layer L's attention
        wrote it); the handler completes when this rank's writes settled and its
        notices went out (result: the RankReport), or fails with the reason.
    wait_for_transfer_from_node(PDTransferMetadata) -> AsyncTaskHandler  (D rank)
        extra_params["fastkv_pd"]: the acceptance (`fd_pd.acceptance_fields`) and
        P's rank count; completes once P's notice verified (result) or with the
        reason it did not (error).

`poll()` (the controller's reporter thread calls it) settles handlers and hands
every RankReport to `report_to` (the scheduler's `FastDeployCacheManager.pd_reports`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fastkv.integrations.fd_pd import FIELD, acceptance_from, plan_from
from fastkv.metadata import Epoch
from fastkv.pd.layout import KVLayout
from fastkv.pd.messages import RankReport
from fastkv.pd.receiver import PDReceiver
from fastkv.pd.sender import PDSender

log = logging.getLogger(__name__)


class _Handler:
    """FastDeploy's `AsyncTaskHandler` shape, where FastDeploy is not importable."""

    def __init__(self) -> None:
        self.is_completed = False
        self.result: Any = None
        self.error: str | None = None
        self._event = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def set_result(self, result: Any) -> None:
        self.result, self.is_completed = result, True
        self._event.set()

    def set_error(self, error: str) -> None:
        self.error, self.is_completed = error, True
        self._event.set()


def new_handler() -> Any:
    try:
        from fastdeploy.cache_manager.v1.metadata import AsyncTaskHandler
    except ImportError:
        return _Handler()
    return AsyncTaskHandler()


_MORE = {"chunk": ", blocks, last", "abort": "", "forget": ""}


def _ids_shaped(arg: object, n: int) -> bool:
    """(epoch, transfer id[, blocks >= 0, last]) of ints (and a bool)."""
    if not (isinstance(arg, tuple) and len(arg) == n):
        return False
    ints = arg[:3]
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)
    return ok and (n == 2 or isinstance(arg[3], bool))


def _fields(metadata: Any, key: str) -> dict[str, Any]:
    extra = getattr(metadata, "extra_params", None)
    mine = extra.get(FIELD) if isinstance(extra, dict) else None
    if not isinstance(mine, dict) or key not in mine:
        raise ValueError(
            f"metadata.extra_params[{FIELD!r}][{key!r}]: missing ({metadata!r:.120})"
        )
    return mine


class PDWorker:
    """A rank's PD half (one lock: the reporter thread polls, the scheduler's tasks
    and the runner's hook arrive on others; the hook takes only the sender's).

    Args:
        layout: the rank's `KVLayout`.
        transport: the rank's `PDTransport`.
        role: "prefill" (a sender) or "decode" (a receiver).
        report_to: gets every RankReport (the scheduler's `pd_reports`).
        checksums: see `PDSender` / `PDReceiver`.
        fences: the sender's fence source (`PDSender`; default: none on host
            memory, CUDA events on Paddle's current stream on a GPU).
    """

    def __init__(
        self,
        layout: KVLayout,
        transport: Any,
        *,
        role: str,
        report_to: Callable[[list[RankReport]], None],
        checksums: bool = True,
        fences: Any = None,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
        self.role = role
        self.layout = layout
        self.transport = transport
        self._report_to = report_to
        self.sender = (
            PDSender(transport, layout, checksums=checksums, fences=fences)
            if role == "prefill"
            else None
        )
        self.receiver = (
            PDReceiver(transport, layout, checksums=checksums) if role == "decode" else None
        )
        self._handlers: dict[tuple[Epoch, int], Any] = {}
        self._connected: set[int] = set()
        self._lock = threading.Lock()

    def handshake(self) -> tuple[str, KVLayout]:
        return self.transport.address, self.layout

    def send_to_node(self, metadata: Any) -> Any:
        """P: start this rank's part of a send (see the module docstring). A send
        that cannot start fails its handler and is reported failed at once (P's
        scheduler then settles it without waiting for its deadline)."""
        handler = new_handler()
        if self.sender is None:
            handler.set_error("send_to_node: this rank is not a prefill rank")
            return handler
        plan = None
        try:
            mine = _fields(metadata, "plan")
            plan = plan_from(mine["plan"])
            with self._lock:
                self._connect(plan.num_d_ranks, mine.get("handshakes", ()))
                self.sender.start(plan, chunked=bool(mine.get("chunked", False)))
                self._handlers[(plan.epoch, plan.transfer_id)] = handler
        except (ValueError, KeyError, TypeError) as e:
            handler.set_error(f"send_to_node: {e}")
            if plan is not None:
                rank = self.layout.tp_rank
                reason = f"send_to_node: {e}"
                self._report_to([RankReport(plan.transfer_id, plan.epoch, rank, False, reason)])
        return handler

    def _connect(self, num_d_ranks: int, handshakes: Any) -> None:
        """Pair with the D ranks this P rank serves (d % p == 0: k of them)."""
        assert self.sender is not None
        k = num_d_ranks // self.layout.tp_size
        mine = range(self.layout.tp_rank * k, (self.layout.tp_rank + 1) * k)
        for address, d_layout in handshakes:
            if d_layout.tp_rank in mine and d_layout.tp_rank not in self._connected:
                self.sender.connect(address, d_layout)
                self._connected.add(d_layout.tp_rank)

    def wait_for_transfer_from_node(self, metadata: Any) -> Any:
        """D: expect P's notice for this rank (see the module docstring)."""
        handler = new_handler()
        if self.receiver is None:
            handler.set_error("wait_for_transfer_from_node: this rank is not a decode rank")
            return handler
        try:
            mine = _fields(metadata, "acceptance")
            acc = acceptance_from(mine.get("request_id"), mine["acceptance"])
            with self._lock:
                self.receiver.expect(acc, int(mine["acceptance"]["num_p_ranks"]))
                self._handlers[(acc.epoch, acc.transfer_id)] = handler
        except (ValueError, KeyError, TypeError) as e:
            handler.set_error(f"wait_for_transfer_from_node: {e}")
        return handler

    def forget(self, epoch: Epoch, transfer_id: int) -> None:
        """D: the scheduler is done with the transfer (late notices are dropped)."""
        with self._lock:
            if self.receiver is not None:
                self.receiver.forget(epoch, transfer_id)
            handler = self._handlers.pop((epoch, transfer_id), None)
        if handler is not None and not handler.is_completed:
            handler.set_error("the transfer ended without this rank's notice")

    def chunk(self, epoch: Epoch, transfer_id: int, num_blocks: int, last: bool) -> None:
        """P: the coming step writes a chunk of a chunked send (`PDSender.chunk`). A
        chunk the sender refuses stops the send: it settles failed, and D
        recomputes."""
        if self.sender is None:
            raise ValueError("chunk: this rank is not a prefill rank")
        try:
            self.sender.chunk(epoch, transfer_id, num_blocks, last=last)
        except ValueError as e:
            log.error("fastkv PD rank %d: %s", self.layout.tp_rank, e)
            self.sender.abort(epoch, transfer_id)

    def run_tasks(self, tasks: list[tuple[str, Any]]) -> list[Any]:
        """The scheduler's tasks for this rank, in order (`fd_pd_tasks`: what rides
        the step's batch on P and the drained tasks on D). Returns the handlers of
        the sends and expectations started.

        Raises:
            ValueError: a task of the other role, or of no known kind (none runs)."""
        self.check_tasks(tasks)
        out = []
        for kind, arg in tasks:
            if kind == "forget":
                self.forget(*arg)
            elif kind == "chunk":
                self.chunk(*arg)
            elif kind == "abort":
                assert self.sender is not None
                self.sender.abort(*arg)
            elif kind == "send":
                out.append(self.send_to_node(arg))
            else:
                out.append(self.wait_for_transfer_from_node(arg))
        return out

    def check_tasks(self, tasks: list[tuple[str, Any]]) -> None:
        """ValueError unless every task is one of this role's kinds with its
        argument's shape (`fd_pd_tasks`): the whole list is checked before any of
        it runs."""
        kinds = ("send", "chunk", "abort") if self.role == "prefill" else ("expect", "forget")
        for i, task in enumerate(tasks):
            if not (isinstance(task, tuple) and len(task) == 2 and task[0] in kinds):
                raise ValueError(
                    f"tasks[{i}]: {task!r:.80} is not a {self.role} rank's task {kinds}"
                )
            kind, arg = task
            if kind in ("send", "expect"):
                _fields(arg, "plan" if kind == "send" else "acceptance")
            elif not _ids_shaped(arg, 4 if kind == "chunk" else 2):
                raise ValueError(f"tasks[{i}]: {kind} takes (epoch, transfer id{_MORE[kind]})")

    def after_layer(self, layer: int, stream: int | None = None) -> None:
        """The runner's per-layer hook: layer `layer` of this step is written, or,
        on a GPU, its kernel was launched on `stream` (None: Paddle's current
        stream): the sender's writes wait for that (`PDSender.after_layer`)."""
        if self.sender is not None:
            self.sender.after_layer(layer, stream)

    def poll(self) -> int:
        """Settle what settled: handlers completed, reports handed on."""
        with self._lock:
            half = self.sender if self.sender is not None else self.receiver
            assert half is not None
            reports = half.poll()
            done = []
            for r in reports:
                handler = self._handlers.get((r.epoch, r.transfer_id))
                if handler is not None:
                    if self.sender is not None:
                        del self._handlers[(r.epoch, r.transfer_id)]
                    done.append((handler, r))
        for handler, r in done:
            if r.ok:
                handler.set_result(r)
            else:
                handler.set_error(r.reason or "failed")
        if reports:
            self._report_to(reports)
        return len(reports)

    @property
    def num_open(self) -> int:
        """Sends (P) or expected transfers (D) not settled or forgotten."""
        if self.sender is not None:
            return self.sender.num_sends
        assert self.receiver is not None
        return self.receiver.num_expected

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop serving this layout and close the transport, which lets go of every
        region registered in it; call it before the KV tensors are freed (the
        controller's `free_gpu_cache` does). P: every send starts no more writes
        and its writes, which read the KV, are waited on; each settles as usual
        (D told, the scheduler sent its report). D: every expected transfer is
        forgotten (the scheduler fences its blocks); with the regions gone, a
        late write from P is refused by the transport instead of landing in
        freed memory.

        Waits at most `timeout_s` in all; None: the transport's own bound on a
        write (`release_bound_s`: the engine's timeout, 30 s by default), which
        every write ends within, capped at an hour. Returns True when no write of
        this rank reads or writes the KV any more; False (logged) when one still
        may: the tensors must then outlive it (call again before freeing them)."""
        if timeout_s is None:  # capped: a bound past it answers False, not raises
            timeout_s = min(float(getattr(self.transport, "release_bound_s", 30.0)), 3600.0)
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s: {timeout_s!r} must be in (0, 3600] s")
        end = time.monotonic() + timeout_s
        if self.sender is not None:
            self.sender.abort_all("the KV cache was freed on P")
            # no write starts from now on, pending fences or not; the notices of
            # the sends settling below go out only while the time lasts
            self.sender.close(notify_until=end)
            # nor any more chunks of writes handed over: what is inside the
            # engine ends sooner (those writes fail; D fences by its grace)
            stop_writes = getattr(self.transport, "stop_writes", None)
            if stop_writes is not None:
                stop_writes()
            while True:
                self.poll()
                if not self.sender.num_sends or time.monotonic() >= end:
                    break
                time.sleep(0.002)
        else:
            assert self.receiver is not None
            for epoch, transfer_id in self.receiver.expected():
                self.forget(epoch, transfer_id)
        released = self.transport.close(max(1e-3, end - time.monotonic()))
        if not released:
            log.error(
                "fastkv PD rank %d: writes still inside the transport after %.1f s; "
                "the KV tensors must not be freed yet",
                self.layout.tp_rank,
                timeout_s,
            )
        return released


__all__ = ["PDWorker", "new_handler"]
