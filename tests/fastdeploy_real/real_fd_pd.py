"""Two FastDeploy instances, prefill (P) and decode (D), in one process, on their real
objects, with fastkv's PD path between them.

Real: each instance's `ResourceManagerV1` in its splitwise role (its
`preallocate_resource_in_p` / `preallocate_resource_in_d` / `add_request_in_p` /
`add_prefilled_request` / `pre_recycle_resource`, wrapped by fastkv's `install()`),
`Request` and `RequestOutput` across FastDeploy's own splitwise framing
(`SplitwiseConnector._serialize_message` / `_deserialize_message`: pickle protocol 5,
`to_dict` / `from_dict`), P's `TokenProcessor` (its `_recycle_resources` waits on
`get_finished_req`, then `send_first_token`), the attention backends and the cache
classes fastkv installs. Stood in for: the ZMQ sockets (the test carries each
message's frames), the engine-worker queue's finished list (`fd_pd.FinishedQueue`),
the engine loops (`PDPair.serve` makes their PD calls in the order
`common_engine.py` makes them, ~949-1070 on P, ~2075-2190 on D), and the model
runners (`real_fd_runner`, which call `after_layer` once each layer is written).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from real_fd_engine import Engine
from real_fd_model import expected_continuation

from fastkv.integrations.fd_pd import FinishedQueue, PDSettings

FIRST_TOKEN_WAIT_S = 20.0


def frames(msg_type: str, payload: Any) -> tuple[str, Any]:
    """`payload` through FastDeploy's splitwise framing, as the peer reads it."""
    from fastdeploy.splitwise.splitwise_connector import SplitwiseConnector

    out = SplitwiseConnector._serialize_message(None, msg_type, payload)  # type: ignore[arg-type]
    return SplitwiseConnector._deserialize_message(None, [b"identity", *out])  # type: ignore[arg-type]


def dispatch(engine: Engine) -> None:
    """The engine loop's `drain_pending_prefetches()`: each task's metadata pickled
    onto the engine-worker queue, read by every rank's `prefetch_from_storage`."""
    import pickle

    for task in engine.cache_manager.drain_pending_prefetches():
        blob = pickle.dumps(task.metadata)
        for runner in engine.runners:
            runner.receive_storage(blob)


class PolledFinishedQueue(FinishedQueue):
    """P's engine-worker finished list, read by P's token processor while FastDeploy's
    engine loop (another thread there) keeps polling the cache manager, so the
    ranks' reports that arrived over the results channel are applied: each read
    polls first (this harness runs both on one thread)."""

    def __init__(self, poll: Any) -> None:
        super().__init__()
        self._poll = poll

    def get_finished_req(self) -> list[list[Any]]:
        self._poll()
        return super().get_finished_req()


class FirstTokens:
    """P's `split_connector` as its token processor uses it: `send_first_token`."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_first_token(self, prefill_msg: Any, tasks_list: Any) -> None:
        tasks = tasks_list if isinstance(tasks_list, list) else [tasks_list]
        self.sent.extend(tasks)


@dataclass
class Served:
    """What became of one PD request."""

    request_id: str
    asks: int = 0  # "prefill" messages P sent D (1 + retries after error_msg)
    dest_block_ids: list[int] = field(default_factory=list)
    first_token_error: str | None = None


class PDPair:
    """A P engine and a D engine (`real_fd_engine.Engine`) with fastkv's PD attached.

    Args:
        p, d: engines built with splitwise_role "prefill" / "decode".
        transports: (P rank transports, D rank transports).
        settings: keywords for both sides' `PDSettings` (deadlines, secret).
    """

    def __init__(
        self,
        p: Engine,
        d: Engine,
        transports: tuple[list[Any], list[Any]],
        **settings: Any,
    ) -> None:
        self.p, self.d = p, d
        self.finished = PolledFinishedQueue(p.cache_manager.poll_results)
        self.first_tokens = FirstTokens()
        tp = p.token_processor
        tp.engine_worker_queue = self.finished
        tp.split_connector = self.first_tokens
        # No report_to: each rank's RankReports ride its results channel to its
        # engine's cache manager, applied by the manager's result polling.
        p_workers = [
            r.cache_controller.attach_pd(t, role="prefill")
            for r, t in zip(p.runners, transports[0], strict=True)
        ]
        d_workers = [
            r.cache_controller.attach_pd(t, role="decode")
            for r, t in zip(d.runners, transports[1], strict=True)
        ]
        digest = p_workers[0].layout.digest()
        p.cache_manager.attach_pd(
            role="prefill",
            settings=PDSettings(digest, num_ranks=len(p_workers), node_id="P", **settings),
            finished_queue=self.finished,
        )
        d.cache_manager.attach_pd(
            role="decode",
            settings=PDSettings(
                d_workers[0].layout.digest(),
                num_ranks=len(d_workers),
                handshakes=tuple(w.handshake() for w in d_workers),
                node_id="D",
                **settings,
            ),
        )
        self.p_workers, self.d_workers = p_workers, d_workers

    # -- the engines' PD calls ----------------------------------------------------------

    def request(self, request_id: str, prompt: list[int], max_tokens: int) -> Any:
        """A P request as P's engine has it after `_fetch_request`."""
        from fastdeploy.engine.request import Request
        from fastdeploy.engine.sampling_params import SamplingParams
        from real_fd_model import EOS

        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            prompt_token_ids_len=len(prompt),
            eos_token_ids=[EOS],
            sampling_params=SamplingParams(max_tokens=max_tokens),
            disaggregate_info={
                "role": "prefill",
                "decode_ip": "d",
                "decode_connector_port": 1,
                "prefill_ip": "p",
                "prefill_connector_port": 2,
            },
        )
        now = time.time()
        m = req.metrics
        m.arrival_time = m.preprocess_start_time = m.preprocess_end_time = now
        m.scheduler_recv_req_time = m.engine_get_req_time = now
        req.set_block_hasher(self.p.block_hasher)
        self.d.expected[request_id] = expected_continuation(prompt, max_tokens)
        return req

    def ask_d(self, req: Any) -> dict[str, Any]:
        """P's send_splitwise_tasks -> D's preallocate_resource_in_d and
        send_cache_info_to_prefill -> P's cache_sync handling: the info P got."""
        from fastdeploy.engine.request import Request

        req.disaggregate_info["role"] = "decode"
        _, payload = frames("prefill", [req])
        req.disaggregate_info["role"] = "prefill"
        dreq = Request.from_dict(payload[0])
        dreq.set_block_hasher(self.d.block_hasher)
        if self.d.rm.preallocate_resource_in_d(dreq):
            info = {
                "request_id": dreq.request_id,
                "dest_block_ids": dreq.disaggregate_info["block_tables"],
            }
        else:
            info = {"request_id": dreq.request_id, "error_msg": "Not enough resources"}
        dispatch(self.d)  # D's ranks expect the notices (the drained tasks)
        _, sync = frames("cache_sync", [info])
        self.p.cache_manager.pd_cache_info(sync)  # what P put for its messager
        return sync[0]

    def start(self, req: Any, *, retries: int = 0) -> Served:
        """P's admission of one request (PREFILL_CONTINUOUS_REQUEST_DECODE_RESOURCES:
        ask D again after an error_msg, at most `retries` times)."""
        served = Served(req.request_id)
        assert self.p.rm.preallocate_resource_in_p(req), "P has no room"
        while True:
            served.asks += 1
            info = self.ask_d(req)
            if "error_msg" not in info:
                served.dest_block_ids = info["dest_block_ids"]  # DestBlockIds
                break
            if served.asks > retries:
                served.first_token_error = info["error_msg"]
                self.p.rm.pre_recycle_resource(req.request_id)
                return served
        # P's ranks start the send with the batch of the step that prefills it.
        self.p.rm.add_request_in_p([req])
        return served

    def prefill(self, served: list[Served]) -> None:
        """Step P until each started request's first token (or error) was sent."""
        want = {s.request_id for s in served if s.first_token_error is None}
        deadline = time.monotonic() + FIRST_TOKEN_WAIT_S
        while want - {o.request_id for o in self.first_tokens.sent}:
            assert time.monotonic() < deadline, "P sent no first token"
            self.p.step()

    def deliver_first_tokens(self, served: list[Served]) -> None:
        """D's `_process_prefilled_requests` for the first tokens P sent."""
        from fastdeploy.engine.request import RequestOutput

        _, payload = frames("decode", self.first_tokens.sent)
        self.first_tokens.sent = []
        by_id = {s.request_id: s for s in served}
        for d in payload:
            out = RequestOutput.from_dict(d)
            out.finished = False
            rid = out.request_id
            if rid not in self.d.rm.requests:
                continue  # D is done with it (FastDeploy's engine keeps it waiting)
            if out.error_code != 200:
                by_id[rid].first_token_error = out.error_msg
                self.d.rm.pre_recycle_resource(rid)
                self.d.results.put_results([out])
                continue
            self.d.token_processor.tokens_counter[rid] = 1
            self.d.results.put_results([out])
            self.d.rm.add_prefilled_request(out)

    def pump(self) -> None:
        """One engine-loop iteration's drained tasks of both sides, over the
        engine-worker queue to every rank (D's PD tasks ride them; P's ride the
        steps' batches)."""
        dispatch(self.p)
        dispatch(self.d)

    def decode(self, timeout: float = 60.0) -> None:
        """Step D until every request is done."""
        deadline = time.monotonic() + timeout
        while self.d.rm.requests or self.d.rm.waiting:
            self.pump()
            assert time.monotonic() < deadline, (
                f"D not done: {list(self.d.rm.requests)} running "
                f"{[r.request_id for r in self.d.rm.running]}"
            )
            self.d.step()
            time.sleep(0.002)

    def serve(
        self, requests: list[tuple[str, list[int], int]], *, retries: int = 0
    ) -> list[Served]:
        served = [self.start(self.request(*r), retries=retries) for r in requests]
        self.prefill(served)
        self.deliver_first_tokens(served)
        self.decode()
        return served

    # -- checks ---------------------------------------------------------------------

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until neither side holds a PD send, transfer or receiving block."""
        deadline = time.monotonic() + timeout
        while True:
            for engine in (self.p, self.d):
                engine.cache_manager.poll_results()
            self.pump()
            busy = [
                *(w.num_open for w in self.p_workers + self.d_workers),
                self.d.cache_manager.manager.num_receiving_blocks,
                len(self.p.cache_manager.pd._sends),
                len(self.d.cache_manager.pd._accepted),
            ]
            if not any(busy):
                return
            assert time.monotonic() < deadline, f"PD still busy: {busy}"
            time.sleep(0.01)

    def check_no_leaks(self) -> None:
        self.wait_idle()
        for engine in (self.p, self.d):
            engine.cache_manager.pd.check_idle()
            engine.check_no_leaks()
