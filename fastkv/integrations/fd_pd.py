"""FastDeploy's prefill/decode disaggregation served by fastkv's PD path (scheduler side).

With `--splitwise-role prefill|decode`, `FastDeployCacheManager.attach_pd(...)` gives
the manager one `FastDeployPD`: fastkv's `PrefillTransfers` (P) or `DecodeTransfers`
(D) over the manager's `CacheManager`, driven from FastDeploy's own calls and
messages. `install()` wraps four `ResourceManagerV1` methods (`patch_resource_manager`);
each wrapper does nothing more than the original on a manager without PD.

What travels where (no channel of fastkv's own between P and D):

    P preallocate_resource_in_p ─► update_cache_blocks: offer (pins the request);
        request.disaggregate_info["fastkv_pd"] = the offer's fields
    P send_splitwise_tasks ─────── "prefill" message (the Request, with that field) ─►
    D preallocate_resource_in_d: allocate_gpu_blocks matches D's own prefix and
        reserves the tail only (DecodeTransfers.accept); disaggregate_info
        ["block_tables"] becomes DestBlockIds: -1 per block D holds, then the tail's
        ids, with the acceptance's public fields attached
    D send_cache_info_to_prefill ── "cache_sync" {request_id, dest_block_ids} ──► P
    P: the cache infos FastDeploy puts for its messager (put_cache_info) go to
        FastDeployCacheManager.pd_cache_info: the acceptance becomes a send plan,
        one PDTransferMetadata per P rank, with the batch of the step that
        prefills the request (fd_pd_tasks -> send_to_node, chunk by chunk)
    P ranks write each layer into D's blocks (worker side, fd_pd_worker), then
        notice D; their RankReports come back (pd_reports); once every rank settled,
        [[request_id, "finished" | reason]] goes to put_finished_req, where P's
        token processor waits (a send past its deadline is reported failed: P never
        waits forever)
    D ranks verify (wait_for_transfer_from_node handlers) -> pd_reports: commit
    D add_prefilled_request: held until the transfer's outcome was applied

D's policy for a transfer that fails, passes its deadline or is fenced: the request
recomputes its prompt on D (its own prefix stays; the tail is computed by D as for any
prompt; P's first token is dropped and D samples its own). A request aborted on D
(`pre_recycle_resource`) is finished at once; its receiving tail is freed once fenced.

Notice keys: with a deployment secret (`attach_pd(deployment_secret=...)`, the same
on P and D) the acceptance travels without its key and each side derives it; without
one, the key rides the cache_sync message, which FastDeploy sends over plain ZMQ.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastkv.integrations import fd_pd_tasks as pd_tasks
from fastkv.integrations.fd_views import prompt_digests
from fastkv.metadata import Epoch
from fastkv.pd.decode import DecodeTransfers, Outcome
from fastkv.pd.messages import Acceptance, Offer, RankReport, Rejection, SendPlan
from fastkv.pd.prefill import PrefillTransfers

log = logging.getLogger(__name__)

FIELD = "fastkv_pd"
"""The key fastkv adds to `Request.disaggregate_info` and to PDTransferMetadata's
`extra_params`."""

ROLES = ("prefill", "decode")


class DestBlockIds(list):  # type: ignore[type-arg]
    """D's `dest_block_ids` as the cache_sync message carries them: FastDeploy's
    convention of -1 for each block D already holds (its own prefix), then the ids of
    the blocks P writes; `fastkv` holds the acceptance's fields (`acceptance_fields`).
    A list, so FastDeploy code that reads dest_block_ids reads a list; it pickles with
    its attribute."""

    fastkv: dict[str, Any]

    def __init__(self, ids: Iterable[int] = (), fastkv: dict[str, Any] | None = None) -> None:
        super().__init__(ids)
        self.fastkv = dict(fastkv or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (DestBlockIds, (list(self), self.fastkv))


def acceptance_fields(acc: Acceptance) -> dict[str, Any]:
    return {
        "transfer_id": acc.transfer_id,
        "epoch": int(acc.epoch),
        "num_tokens": acc.num_tokens,
        "num_prefix_blocks": acc.num_prefix_blocks,
        "block_ids": list(acc.block_ids),
        "secret": acc.secret,
        "timeout_s": acc.timeout_s,
        "num_d_ranks": acc.num_d_ranks,
    }


def acceptance_from(request_id: Hashable, f: dict[str, Any]) -> Acceptance:
    """The acceptance `acceptance_fields` wrote (ValueError naming a bad field)."""
    try:
        return Acceptance(
            request_id,
            int(f["transfer_id"]),
            Epoch(int(f["epoch"])),
            int(f["num_tokens"]),
            int(f["num_prefix_blocks"]),
            tuple(int(b) for b in f["block_ids"]),
            bytes(f["secret"]),
            float(f["timeout_s"]),
            int(f["num_d_ranks"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"dest_block_ids.fastkv: not an acceptance ({e!r})") from e


def plan_fields(plan: SendPlan) -> dict[str, Any]:
    return {
        "transfer_id": plan.transfer_id,
        "epoch": int(plan.epoch),
        "secret": plan.secret,
        "src_block_ids": list(plan.src_block_ids),
        "dst_block_ids": list(plan.dst_block_ids),
        "num_d_ranks": plan.num_d_ranks,
        "timeout_s": plan.timeout_s,
    }


def plan_from(f: dict[str, Any]) -> SendPlan:
    return SendPlan(
        int(f["transfer_id"]),
        Epoch(int(f["epoch"])),
        bytes(f["secret"]),
        tuple(f["src_block_ids"]),
        tuple(f["dst_block_ids"]),
        int(f["num_d_ranks"]),
        float(f["timeout_s"]),
    )


@dataclass(slots=True)
class _Metadata:
    """FastDeploy's `PDTransferMetadata` shape, where FastDeploy is not importable."""

    source_node_id: str = ""
    target_node_id: str = ""
    block_ids: list[int] = field(default_factory=list)
    layer_num: int = 0
    timeout: float = 30.0
    extra_params: dict[str, Any] = field(default_factory=dict)


def transfer_metadata(**kw: Any) -> Any:
    """A FastDeploy `PDTransferMetadata` (fastkv's stand-in of the same fields when
    FastDeploy is not importable)."""
    try:
        from fastdeploy.cache_manager.v1.metadata import PDTransferMetadata
    except ImportError:
        return _Metadata(**kw)
    return PDTransferMetadata(**kw)


@dataclass(slots=True)
class _Chunks:
    """P: an accepted send, announced to the ranks chunk by chunk with the steps
    that prefill its request (`FastDeployPD.on_batch`)."""

    meta: Any  # the PDTransferMetadata of send_to_node
    epoch: Epoch
    transfer_id: int
    prefix: int  # blocks D holds (not sent)
    total: int  # blocks sent
    started: bool = False
    sent: int = 0  # blocks announced so far


def _is_prefill(task: Any) -> bool:
    kind = getattr(task, "task_type", None)
    return getattr(kind, "name", kind) == "PREFILL" or str(kind).endswith("PREFILL")


@dataclass(frozen=True, slots=True)
class PDSettings:
    """What both roles are built with (`FastDeployCacheManager.attach_pd`).

    Args:
        layout_digest: every rank's `KVLayout.digest()` (equal on P and D).
        num_ranks: this instance's tensor-parallel size.
        handshakes: D only: per D rank, `PDReceiver.handshake()` (address, layout);
            they ride the acceptance so P's ranks connect on their first send.
        deployment_secret: the same on P and D, or None (see the module docstring).
        timeout_s: D: how long a transfer may take from acceptance.
        fence_grace_s: D: after the deadline, until no write can land.
        answer_timeout_s / send_timeout_s: P: see `PrefillTransfers`.
        node_id: this instance's name in PDTransferMetadata.
    """

    layout_digest: bytes
    num_ranks: int = 1
    handshakes: tuple[tuple[str, Any], ...] = ()
    deployment_secret: bytes | None = None
    timeout_s: float = 30.0
    fence_grace_s: float = 5.0
    answer_timeout_s: float = 30.0
    send_timeout_s: float = 60.0
    node_id: str = ""


class FastDeployPD:
    """One instance's PD state, over `FastDeployCacheManager` (called under its lock).

    Args:
        cm: the cache manager (its `manager` and `_book`).
        role: "prefill" or "decode".
        settings: `PDSettings`.
        finished_queue: P only: an object with FastDeploy's `put_finished_req`
            (the engine-worker queue P's token processor reads).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        cm: Any,
        *,
        role: str,
        settings: PDSettings,
        finished_queue: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {role!r}")
        if role == "prefill" and not callable(
            getattr(finished_queue, "put_finished_req", None)
        ):
            raise ValueError("finished_queue: P needs an object with put_finished_req")
        if role == "decode" and len(settings.handshakes) != settings.num_ranks:
            raise ValueError(
                f"settings.handshakes: {len(settings.handshakes)}, need one per D rank "
                f"({settings.num_ranks})"
            )
        self.cm = cm
        self.role = role
        self.settings = settings
        self._finished = finished_queue
        # Per rank: tasks that ride the next step's batch (P's sends and chunks),
        # and tasks that need no step (the engine loop drains them).
        self._tasks: dict[int, list[Any]] = {r: [] for r in range(settings.num_ranks)}
        self._drained: dict[int, list[Any]] = {r: [] for r in range(settings.num_ranks)}
        # Per route (step or not), per rank: tasks numbered so far (exactly once).
        self._counts: dict[bool, dict[int, int]] = {True: {}, False: {}}
        self.p: PrefillTransfers | None = None
        self.d: DecodeTransfers | None = None
        s = settings
        if role == "prefill":
            self.p = PrefillTransfers(
                cm.manager,
                layout_digest=s.layout_digest,
                num_ranks=s.num_ranks,
                answer_timeout_s=s.answer_timeout_s,
                send_timeout_s=s.send_timeout_s,
                deployment_secret=s.deployment_secret,
                clock=clock,
            )
        else:
            self.d = DecodeTransfers(
                cm.manager,
                layout_digest=s.layout_digest,
                num_ranks=s.num_ranks,
                timeout_s=s.timeout_s,
                fence_grace_s=s.fence_grace_s,
                deployment_secret=s.deployment_secret,
                clock=clock,
            )
        # P: accepted sends whose last chunk has not gone out with a step yet.
        self._chunks: dict[Hashable, _Chunks] = {}
        # P: offered request -> {rank: ok} once accepted; results not posted yet.
        self._sends: dict[Hashable, dict[int, tuple[bool, str]]] = {}
        self._send_ids: dict[tuple[Epoch, int], Hashable] = {}
        # D: accepted requests' acceptances, outcomes, held first tokens.
        self._accepted: dict[Hashable, Acceptance] = {}
        self._rejected: dict[Hashable, str] = {}
        self._outcomes: dict[Hashable, Outcome] = {}
        self._held: dict[Hashable, Any] = {}
        self._self_recompute: set[Hashable] = set()
        self._requests: dict[Hashable, Any] = {}
        self._live: set[tuple[Epoch, int]] = set()
        self.counters: dict[str, int] = {
            "offers": 0,
            "sends_finished": 0,
            "sends_failed": 0,
            "accepted": 0,
            "rejected": 0,
            "committed": 0,
            "recomputed": 0,
            "aborted": 0,
            "prefix_blocks": 0,
        }

    # -- P ------------------------------------------------------------------------

    def offer(self, request: Any) -> bool:
        """Pin an allocated P request and put the offer's fields on its
        disaggregate_info (they travel to D with the "prefill" message). False when
        the request is not a PD one or is pinned already."""
        info = getattr(request, "disaggregate_info", None)
        rid = request.request_id
        assert self.p is not None
        if not isinstance(info, dict) or self.p.is_pinned(rid):
            return False
        if not self.cm.manager.is_active(rid):
            return False
        offer = self.p.offer(rid, len(request.prompt_token_ids))
        info[FIELD] = {
            "layout_digest": offer.layout_digest,
            "num_p_ranks": offer.num_p_ranks,
            "num_tokens": offer.num_tokens,
        }
        self._sends[rid] = {}
        self.counters["offers"] += 1
        return True

    def cache_info(self, infos: Iterable[dict[str, Any]]) -> None:
        """P: the dicts FastDeploy puts for its messager (`put_cache_info`). D's
        cache_sync answers are applied (an acceptance becomes one send task per P
        rank; an error_msg unpins, and P is pinned again for its next ask); P's own
        src-block infos carry nothing fastkv needs and are ignored.

        Raises:
            ValueError: an info that is not a dict, or dest_block_ids whose fastkv
                fields are not an acceptance; nothing is applied then."""
        answers: list[tuple[Hashable, Acceptance | str, list[Any]]] = []
        for i, info in enumerate(infos):
            if not isinstance(info, dict):
                raise ValueError(f"infos[{i}]: expected a dict, got {info!r:.80}")
            rid = info.get("request_id")
            dest = info.get("dest_block_ids")
            if rid not in self._sends:
                continue
            if "error_msg" in info:
                answers.append((rid, str(info["error_msg"]), []))
            elif isinstance(dest, DestBlockIds):
                hs = list(dest.fastkv.get("handshakes", ()))
                answers.append((rid, acceptance_from(rid, dest.fastkv), hs))
        assert self.p is not None
        for rid, answer, handshakes in answers:
            if isinstance(answer, str):
                self.p.on_answer(Rejection(rid, answer))
                self._reoffer(rid)
            else:
                self._answer(rid, answer, handshakes)

    def _reoffer(self, rid: Hashable) -> None:
        """FastDeploy asks D again after an error_msg: pin again for that answer."""
        assert self.p is not None
        request = self.cm._book.request_of(rid)
        if request is not None and self.cm.manager.is_active(rid) and not self.p.is_pinned(rid):
            self.p.offer(rid, len(request.prompt_token_ids))

    def _answer(self, rid: Hashable, acc: Acceptance, handshakes: list[Any]) -> None:
        assert self.p is not None
        if not self.p.on_answer(acc):
            self._reoffer(rid)
            return
        plan = self.p.plan(rid)
        self._send_ids[(plan.epoch, plan.transfer_id)] = rid
        extra = {
            FIELD: {
                "plan": plan_fields(plan),
                "request_id": rid,
                "handshakes": handshakes,
                "chunked": True,
            }
        }
        meta = transfer_metadata(
            source_node_id=self.settings.node_id,
            target_node_id="",
            block_ids=list(plan.src_block_ids),
            layer_num=0,
            timeout=plan.timeout_s,
            extra_params=extra,
        )
        self._chunks[rid] = _Chunks(
            meta, plan.epoch, plan.transfer_id, acc.num_prefix_blocks, len(plan.src_block_ids)
        )

    def on_batch(self, batch: Iterable[Any], block_size: int) -> None:
        """P: the tasks of the step `batch` is (its ranks read them before the step
        runs, `fd_pd_tasks`): for each accepted send whose request this step
        prefills, the send's start (its first step) and the chunk the step writes;
        a send accepted after its prefill ran whole goes with any step (its blocks
        are final and pinned)."""
        prefilled = {}
        for task in batch:
            rid = getattr(task, "request_id", None)
            end = getattr(task, "prefill_end_index", None)
            if rid in self._chunks and isinstance(end, int) and _is_prefill(task):
                prefilled[rid] = (
                    min(end, len(task.prompt_token_ids)) >= len(task.prompt_token_ids),
                    end,
                )
        for rid, c in list(self._chunks.items()):
            if rid in prefilled:
                last, end = prefilled[rid]
            else:
                request = self.cm._book.request_of(rid)
                done = getattr(request, "num_computed_tokens", 0) or 0
                if request is None or done < len(request.prompt_token_ids) or not batch:
                    continue
                last, end = True, done
            blocks = c.total if last else max(0, min(c.total, end // block_size - c.prefix))
            if blocks < c.sent:
                continue
            if not c.started:
                self._to_ranks(None, ("send", c.meta))
                c.started = True
            self._to_ranks(None, ("chunk", (c.epoch, c.transfer_id, blocks, last)))
            c.sent = blocks
            if last:
                del self._chunks[rid]

    def on_reports(self, reports: Iterable[RankReport]) -> None:
        """P ranks' or D ranks' reports (their PDSender/PDReceiver polls)."""
        reports = list(reports)
        if self.p is not None:
            for r in reports:
                rid = self._send_ids.get((r.epoch, r.transfer_id))
                if rid is not None and rid in self._sends:
                    self._sends[rid].setdefault(r.rank, (r.ok, r.reason))
            self.p.on_reports(reports)
            self._post_settled()
        else:
            assert self.d is not None
            self._apply(self.d.on_reports(reports))

    def tick(self) -> None:
        """Deadlines (called at every poll of the manager)."""
        if self.p is not None:
            self.p.tick()
            self._post_settled()
        else:
            assert self.d is not None
            self._apply(self.d.tick())

    def _post_settled(self) -> None:
        """Report every send no longer pinned where P's token processor waits."""
        assert self.p is not None
        done = []
        for rid, ranks in self._sends.items():
            if self.p.is_pinned(rid):
                continue
            failed = [
                why or f"rank {rank} failed" for rank, (ok, why) in ranks.items() if not ok
            ]
            if len(ranks) < self.settings.num_ranks and not failed:
                failed = ["the send passed its deadline or D refused it"]
            done.append([rid, "finished" if not failed else "; ".join(failed)])
        if not done:
            return
        for rid, status in done:
            del self._sends[rid]
            self._chunks.pop(rid, None)  # settled (deadline, refusal): nothing to send
            self.counters["sends_finished" if status == "finished" else "sends_failed"] += 1
        for key in [k for k, rid in self._send_ids.items() if rid not in self._sends]:
            del self._send_ids[key]
        self._finished.put_finished_req(done)

    def defer_finish(self, rid: Hashable) -> bool:
        """P: `request_finish` of a pinned request: an offer D has not accepted is
        withdrawn (nothing was sent; False: finish now); a send is finished once it
        settles (True)."""
        if self.p is None or not self.p.is_pinned(rid):
            return False
        if self.p.withdraw(rid):
            self._sends.pop(rid, None)
            self._chunks.pop(rid, None)
            return False
        self.p.release(rid)
        c = self._chunks.pop(rid, None)
        if c is not None and not c.started:
            # Accepted but never prefilled: the ranks start and stop the send at
            # once, so it settles failed and D hears so (and fences) now.
            for task in (("send", c.meta), ("abort", (c.epoch, c.transfer_id))):
                self._to_ranks(None, task, step=False)
        return True

    # -- D ------------------------------------------------------------------------

    def is_pd_request(self, request: Any) -> bool:
        info = getattr(request, "disaggregate_info", None)
        return (
            self.d is not None
            and isinstance(info, dict)
            and isinstance(info.get(FIELD), dict)
            and not self.cm.manager.is_active(request.request_id)
        )

    def accept(self, request: Any) -> list[int]:
        """D: match D's own prefix, reserve the tail. Returns the request's table as
        FastDeploy's runner will read it (prefix, then the tail), or [] when refused
        (`rejection`)."""
        assert self.d is not None
        rid = request.request_id
        f = request.disaggregate_info[FIELD]
        offer = Offer(
            rid, int(f["num_tokens"]), bytes(f["layout_digest"]), int(f["num_p_ranks"])
        )
        _, hashes = prompt_digests(request, self.cm.config.block_size)
        answer = self.d.accept(offer, hashes)
        if isinstance(answer, Rejection):
            self._rejected[rid] = answer.reason
            self.counters["rejected"] += 1
            return []
        self._accepted[rid] = answer
        self._requests[rid] = request  # tracked by the book once its KV is there
        self._live.add((answer.epoch, answer.transfer_id))
        self.counters["accepted"] += 1
        self.counters["prefix_blocks"] += answer.num_prefix_blocks
        acc = {**acceptance_fields(answer), "num_p_ranks": offer.num_p_ranks}
        for rank in range(self.settings.num_ranks):
            self._to_ranks(
                rank,
                (
                    "expect",
                    transfer_metadata(
                        source_node_id="",
                        target_node_id=self.settings.node_id,
                        block_ids=list(answer.block_ids),
                        layer_num=0,
                        timeout=answer.timeout_s,
                        extra_params={FIELD: {"acceptance": acc, "request_id": rid}},
                    ),
                ),
            )
        prefix = list(self.cm.manager.block_table(rid).block_ids)
        return prefix + list(answer.block_ids)

    def take_rejection(self, rid: Hashable) -> str | None:
        return self._rejected.pop(rid, None)

    def dest_block_ids(self, rid: Hashable) -> DestBlockIds | None:
        """D's answer for the cache_sync message (None: not a fastkv transfer)."""
        acc = self._accepted.get(rid)
        if acc is None:
            return None
        fields = acceptance_fields(acc.public() if self.settings.deployment_secret else acc)
        fields["handshakes"] = list(self.settings.handshakes)
        ids = [-1] * acc.num_prefix_blocks + list(acc.block_ids)
        return DestBlockIds(ids, fields)

    def _apply(self, outcomes: Iterable[Outcome]) -> None:
        assert self.d is not None
        for o in outcomes:
            if o.request_id in self._accepted:
                self._outcomes[o.request_id] = o
                del self._accepted[o.request_id]
                # From here its table covers what it computes (received or not).
                self.cm._book.track(self._requests.pop(o.request_id))
                self.counters["committed" if o.success else "recomputed"] += 1
        for key in [k for k in self._live if not self.d.is_live(*k)]:
            self._live.discard(key)
            self._to_ranks(None, ("forget", key))

    def hold(self, request_output: Any) -> bool:
        """D: P's first token arrived. True: fastkv keeps it (until the transfer's
        outcome is in, `ready`) or drops it (the request recomputes without it);
        False: apply it now (no fastkv transfer, or it committed)."""
        rid = request_output.request_id
        if rid in self._self_recompute:
            return True  # D samples its own first token
        if rid in self._accepted or (rid in self._outcomes and not self._outcomes[rid].success):
            self._held[rid] = request_output
            return True
        self._outcomes.pop(rid, None)
        return False

    def ready(self) -> list[tuple[Any, Outcome]]:
        """D: (P's first token or None, outcome) to apply now: committed transfers
        whose token is here, and every failed one (without P's token, the request
        recomputes and samples its own; a token of P arriving later is dropped)."""
        out = []
        for rid, o in list(self._outcomes.items()):
            if o.success and rid not in self._held:
                continue  # applied when P's first token comes (hold: False)
            del self._outcomes[rid]
            output = self._held.pop(rid, None)
            if output is None:
                self._self_recompute.add(rid)
            out.append((output, o))
        return out

    def table(self, rid: Hashable) -> list[int]:
        return list(self.cm.manager.block_table(rid).block_ids)

    def abort(self, rid: Hashable) -> bool:
        """D: the request goes (request_finish). True when fastkv finished it here."""
        if self.d is None:
            return False
        self._held.pop(rid, None)
        self._outcomes.pop(rid, None)
        self._self_recompute.discard(rid)
        self._requests.pop(rid, None)
        if rid in self._accepted and self.cm.manager.is_active(rid):
            del self._accepted[rid]
            self.d.abort(rid)
            self.counters["aborted"] += 1
            self._apply(())
            return True
        return False

    # -- both -----------------------------------------------------------------------

    def _to_ranks(self, rank: int | None, task: Any, *, step: bool = True) -> None:
        queues = self._tasks if step and self.p is not None else self._drained
        for r, queue in queues.items():
            if rank is None or r == rank:
                queue.append(task)

    def take_tasks(self, *, step: bool) -> dict[int, list[tuple[str, Any]]]:
        """Every rank's tasks since the last call (`fd_pd_tasks` lists the kinds),
        in order, ranks with none left out: those for the step's batch (`step`:
        P's sends and chunks) or those the engine loop drains (the rest)."""
        queues = self._tasks if step else self._drained
        out = {r: list(q) for r, q in queues.items() if q}
        for q in queues.values():
            q.clear()
        return out

    def carry_counts(self, old: FastDeployPD) -> None:
        """Go on with `old`'s counters, task numbers and tasks not sent yet (a cache
        reset rebuilds the PD half; the ranks' counts of the tasks they ran go on,
        and a D rank's pending forget still reaches it)."""
        self.counters = old.counters
        self._counts = old._counts
        self._tasks, self._drained = old._tasks, old._drained

    def take_entries(self, *, step: bool) -> list[str]:
        """`take_tasks` as numbered entries for FastDeploy's metadata (`fd_pd_tasks`),
        each rank's count on that route carried on."""
        return pd_tasks.encode(self.take_tasks(step=step), self._counts[step])

    def check_idle(self) -> None:
        """Nothing held: no send, no transfer, no held token (AssertionError)."""
        if self.p is not None:
            self.p.check_invariants()
            assert not self._sends, self._sends
        if self.d is not None:
            self.d.check_invariants()
            assert not (self._accepted or self._held or self._outcomes), (
                self._accepted,
                self._held,
                self._outcomes,
            )
            assert self.cm.manager.num_receiving_blocks == 0


# -- ResourceManagerV1 -----------------------------------------------------------------

_patched: dict[str, Any] = {}


def _pd_of(rm: Any) -> FastDeployPD | None:
    return getattr(getattr(rm, "cache_manager", None), "pd", None)


def _preallocate_resource_in_p(self: Any, request: Any) -> bool:
    ok = _patched["preallocate_resource_in_p"](self, request)
    if ok and _pd_of(self) is not None:
        self.cache_manager.pd_offer(request)  # update_cache_blocks did, with caching on
    return ok


def _preallocate_resource_in_d(self: Any, request: Any) -> bool:
    ok = _patched["preallocate_resource_in_d"](self, request)
    cm = self.cache_manager
    if not ok or _pd_of(self) is None:
        return ok
    why = cm.pd_rejection(request.request_id)
    if why is not None:  # the engine answers "Not enough resources"; P asks again
        log.warning("fastkv PD: D refused %r: %s", request.request_id, why)
        self.pre_recycle_resource(request.request_id)
        return False
    dest = cm.pd_dest_block_ids(request.request_id)
    if dest is not None:
        request.disaggregate_info["block_tables"] = dest
    return ok


def _add_prefilled_request(self: Any, request_output: Any) -> None:
    if _pd_of(self) is not None and self.cache_manager.pd_hold(request_output):
        return
    _patched["add_prefilled_request"](self, request_output)


def _schedule(self: Any) -> Any:
    pd = _pd_of(self)
    if pd is not None and pd.role == "decode":
        _apply_outcomes(self, _patched["add_prefilled_request"])
    out = _patched["schedule"](self)
    if pd is not None and pd.role == "prefill":
        self.cache_manager.pd_batch(out[0])  # the step's sends and chunks ride it
    return out


_WRAPPERS = {
    "preallocate_resource_in_p": _preallocate_resource_in_p,
    "preallocate_resource_in_d": _preallocate_resource_in_d,
    "add_prefilled_request": _add_prefilled_request,
    "schedule": _schedule,
}


def patch_resource_manager(cls: Any) -> None:
    """Wrap ResourceManagerV1's four PD methods (idempotent; undone by
    `unpatch_resource_manager`). On a manager without `attach_pd` each wrapper is
    the original call."""
    if _patched:
        return
    _patched["cls"] = cls
    for name, wrapper in _WRAPPERS.items():
        original = getattr(cls, name)
        _patched[name] = original
        setattr(cls, name, functools.wraps(original)(wrapper))


def _apply_outcomes(rm: Any, add_prefilled: Callable[[Any, Any], None]) -> None:
    """D: held first tokens of committed transfers go to running; a failed transfer
    recomputes on D (module docstring)."""
    for output, outcome in rm.cache_manager.pd_ready():
        if outcome.success:
            add_prefilled(rm, output)
        else:
            _recompute(rm, outcome, output)


def _recompute(rm: Any, outcome: Outcome, output: Any) -> None:
    """The request computes the rest of its prompt on D from its own prefix (the
    receiving tail is gone); with P's first token (already the client's) it goes on
    from that token, as `add_prefilled_request` would, else it samples its own."""
    from fastdeploy.engine.request import RequestStatus

    rid = outcome.request_id
    with rm.lock:
        request = rm.requests.get(rid)
        if request is None:
            return
        log.warning("fastkv PD: %r recomputes on D: %s", rid, outcome.reason)
        request.block_tables = rm.cache_manager.pd_table(rid)
        prompt = len(request.prompt_token_ids)
        if output is not None:
            request.output_token_ids.append(output.outputs.token_ids[0])
        request.need_prefill_tokens = prompt + len(request.output_token_ids)
        bs = rm.config.cache_config.block_size
        request.num_computed_tokens = min(len(request.block_tables) * bs, prompt - 1)
        request.num_cached_tokens = request.num_computed_tokens
        request.status = RequestStatus.RUNNING_PREFILL
        request.metrics.decode_inference_start_time = time.time()  # as add_prefilled
        rm.tasks_list[request.idx] = request
        rm.running.append(request)


def unpatch_resource_manager() -> None:
    cls = _patched.pop("cls", None)
    for name, fn in _patched.items():
        setattr(cls, name, fn)
    _patched.clear()


class FinishedQueue:
    """FastDeploy's `get_finished_req` / `put_finished_req` pair in one process
    (the engine-worker queue's finished list), for tests and single-process use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[list[Any]] = []

    def put_finished_req(self, items: list[list[Any]]) -> None:
        with self._lock:
            self._items.extend(items)

    def get_finished_req(self) -> list[list[Any]]:
        with self._lock:
            out, self._items = self._items, []
            return out


__all__ = [
    "FIELD",
    "DestBlockIds",
    "FastDeployPD",
    "FinishedQueue",
    "PDSettings",
    "patch_resource_manager",
    "transfer_metadata",
    "unpatch_resource_manager",
]
