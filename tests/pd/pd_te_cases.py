"""Prefill/decode end to end over a real Mooncake Transfer Engine: a P instance and a
D instance, each its own OS process, run by test_pd_te.py inside a private network
namespace (the engine listens on every interface):

    unshare --net --fork python tests/pd/pd_te_cases.py CASE LOGDIR P_TP-D_TP

Each instance process holds its scheduler half (`PrefillTransfers` or
`DecodeTransfers` over its own `CacheManager`) and its worker half: per TP rank a CPU
`CacheController` with a `PDSender`/`PDReceiver` on its own `MooncakeTransport`
endpoint. P's ranks are threads: each computes its heads of a layer (the rig's
deterministic model, tests/pd/rig.py) and calls its sender's `after_layer` hook,
while P's scheduler polls on the main thread. D's ranks are polled by D's scheduler
loop. The case process is the engines' own channel: it carries the offer, the
acceptance (JSON lines on the instances' stdin/stdout) and kills an instance where
the case says so. A case prints one line `RESULT <json>`.

A request's KV is summarised as one sha256 over every layer, K and V, position and
head (the ranks' slices in head order), so P's, D's and the model's (the non-PD run)
compare bitwise whatever the TP sizes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
os.environ.setdefault("GLOG_minloglevel", "1")  # the engine logs every batch at INFO

import numpy as np  # noqa: E402
from rig import BS, HEADS, Instance, d_hashes, kv_values, make_instance  # noqa: E402

from fastkv.metadata import Epoch  # noqa: E402
from fastkv.pd.decode import DecodeTransfers  # noqa: E402
from fastkv.pd.layout import KVLayout, TensorRegion  # noqa: E402
from fastkv.pd.messages import Acceptance, Offer, Rejection  # noqa: E402
from fastkv.pd.mooncake_te import MooncakeTransport  # noqa: E402
from fastkv.pd.prefill import PrefillTransfers  # noqa: E402
from fastkv.pd.receiver import PDReceiver  # noqa: E402
from fastkv.pd.sender import PDSender  # noqa: E402

HOST = "127.0.0.1"
WRITE_TIMEOUT_S = 0.5  # below D's fence grace, as docs/pd.md asks


# -- what crosses the engines' channel -----------------------------------------


def layout_json(lay: KVLayout) -> dict:
    return dataclasses.asdict(lay)


def layout_of(d: dict) -> KVLayout:
    tensors = tuple(TensorRegion(**t) for t in d["tensors"])
    return KVLayout(**{**d, "tensors": tensors})


def offer_json(o: Offer) -> dict:
    return {**dataclasses.asdict(o), "layout_digest": o.layout_digest.hex()}


def offer_of(d: dict) -> Offer:
    return Offer(**{**d, "layout_digest": bytes.fromhex(d["layout_digest"])})


def answer_json(a: Acceptance | Rejection) -> dict:
    if isinstance(a, Rejection):
        return {"rejected": a.reason, "request_id": a.request_id}
    d = dataclasses.asdict(a)
    return {**d, "secret": a.secret.hex(), "block_ids": list(a.block_ids)}


def answer_of(d: dict) -> Acceptance | Rejection:
    if "rejected" in d:
        return Rejection(d["request_id"], d["rejected"])
    return Acceptance(
        **{
            **d,
            "epoch": Epoch(d["epoch"]),
            "secret": bytes.fromhex(d["secret"]),
            "block_ids": tuple(d["block_ids"]),
        }
    )


# -- the model, per rank ----------------------------------------------------------


def write_rank_layer(
    inst: Instance, rank: int, table: list[int], tokens: list[int], layer: int, start: int
) -> None:
    """Rank `rank` computes its heads of layer `layer` for positions [start, end)."""
    per = HEADS // inst.tp
    ctrl = inst.ctrls[rank]
    for kv in (0, 1):
        vals = kv_values(tokens, layer, kv)[:, rank * per : (rank + 1) * per]
        t = ctrl.caches[layer * 2 + kv].numpy()
        for p in range(start, len(tokens)):
            t[table[p // BS], :, p % BS, :] = vals[p]
        view = ctrl.device_blocks(layer * 2 + kv)
        view[:] = t.view(np.uint8).reshape(view.shape)


def kv_digest(inst: Instance, table: list[int], n: int, layers: int) -> str:
    h = hashlib.sha256()
    arrays = [[c.caches[i].numpy() for i in range(2 * layers)] for c in inst.ctrls]
    for i in range(2 * layers):
        for p in range(n):
            for per_rank in arrays:
                h.update(per_rank[i][table[p // BS], :, p % BS, :].tobytes())
    return h.hexdigest()


def model_digest(tokens: list[int], layers: int) -> str:
    """The non-PD run: the model's KV of every head, computed here."""
    h = hashlib.sha256()
    for layer in range(layers):
        for kv in (0, 1):
            vals = kv_values(tokens, layer, kv)
            for p in range(len(tokens)):
                h.update(vals[p].tobytes())
    return h.hexdigest()


def layer_landed(inst: Instance, table: list[int], tokens: list[int], layer: int) -> bool:
    """Whether every rank holds the model's KV of `layer` at every listed block."""
    per = HEADS // inst.tp
    for r, ctrl in enumerate(inst.ctrls):
        for kv in (0, 1):
            vals = kv_values(tokens, layer, kv)[:, r * per : (r + 1) * per]
            t = ctrl.caches[layer * 2 + kv].numpy()
            for p in range(len(tokens)):
                if table[p // BS] >= 0 and t[table[p // BS], :, p % BS, :].tobytes() != (
                    vals[p].tobytes()
                ):
                    return False
    return True


# -- the P instance ----------------------------------------------------------------


class PInstance:
    def __init__(self, tp: int, layers: int, blocks: int) -> None:
        self.inst = make_instance(tp, layers, blocks)
        self.layers = layers
        self.senders = [
            PDSender(MooncakeTransport(HOST, write_timeout_s=WRITE_TIMEOUT_S), lay)
            for lay in self.inst.layouts
        ]
        self.side = PrefillTransfers(
            self.inst.mgr,
            layout_digest=self.inst.layouts[0].digest(),
            num_ranks=tp,
            answer_timeout_s=5.0,
            send_timeout_s=10.0,
        )
        self.batch: list[tuple[str, list[int]]] = []
        self.next_layer = 0
        # P's scheduler: polls the senders each "step" while commands come in
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self.lock:
                for s in self.senders:
                    self.side.on_reports(s.poll())
                self.side.tick()
            time.sleep(0.002)

    def hello(self) -> dict:
        return {"digest": self.inst.layouts[0].digest().hex()}

    def connect(self, ranks: list[dict]) -> dict:
        p, d = self.inst.tp, len(ranks)
        for r, rank in enumerate(ranks):  # the P rank holding D rank r's first head
            self.senders[r * p // d].connect(rank["address"], layout_of(rank["layout"]))
        return {"connected": d}

    def offer(self, rid: str, tokens: list[int]) -> dict:
        mgr = self.inst.mgr
        with self.lock:
            mgr.add_request(rid, tokens)
            assert mgr.allocate(rid, num_tokens=len(tokens))
            return offer_json(self.side.offer(rid, len(tokens)))

    def start(self, items: list[dict]) -> dict:
        """Apply D's answers and start a batch: its sends, then layers by `run`."""
        started = []
        with self.lock:
            self._start(items, started)
        self.next_layer = 0
        return {"started": started}

    def _start(self, items: list[dict], started: list[str]) -> None:
        for item in items:
            if self.side.on_answer(answer_of(item["answer"])):
                plan = self.side.plan(item["rid"])
                for s in self.senders:
                    s.start(plan)
                started.append(item["rid"])
            self.batch.append((item["rid"], item["tokens"]))

    def run(self, until: int, layer_delay_s: float = 0.0) -> dict:
        """Layers [next, until) of the batch, each rank on its own thread; the
        batch's requests are released once its last layer ran."""
        tables = [(list(self.inst.mgr.block_table(rid).block_ids), t) for rid, t in self.batch]
        errors: list[str] = []

        def rank_loop(r: int) -> None:
            try:
                for layer in range(self.next_layer, until):
                    for table, tokens in tables:
                        write_rank_layer(self.inst, r, table, tokens, layer, 0)
                    self.senders[r].after_layer(layer)
                    time.sleep(layer_delay_s)
            except Exception:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(self.inst.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.next_layer = until
        digests = {}
        if until == self.layers:
            for (rid, tokens), (table, _) in zip(self.batch, tables, strict=True):
                digests[rid] = kv_digest(self.inst, table, len(tokens), self.layers)
                with self.lock:
                    self.side.release(rid)
            self.batch = []
        return {"errors": errors, "digests": digests}

    def settle(self, timeout_s: float) -> dict:
        """Wait until every send settled and nothing is pinned (the scheduler
        thread polls the senders)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self.lock:
                if not self.inst.mgr.active_request_ids() and not any(
                    s.num_sends for s in self.senders
                ):
                    break
            time.sleep(0.005)
        with self.lock:
            return self._report()

    def _report(self) -> dict:
        try:
            self.side.check_invariants()
            invariants = "ok"
        except AssertionError as exc:
            invariants = str(exc)
        return {
            "invariants": invariants,
            "active": [str(r) for r in self.inst.mgr.active_request_ids()],
            "num_sends": [s.num_sends for s in self.senders],
            "bytes_sent": [s.bytes_sent for s in self.senders],
            "layers_sent": [s.layers_sent for s in self.senders],
            "counters": dataclasses.asdict(self.side.counters),
        }


# -- the D instance ----------------------------------------------------------------


class DInstance:
    def __init__(self, tp: int, layers: int, blocks: int, timeout_s: float, grace_s: float):
        self.inst = make_instance(tp, layers, blocks)
        self.layers = layers
        self.receivers = [
            PDReceiver(MooncakeTransport(HOST, write_timeout_s=WRITE_TIMEOUT_S), lay)
            for lay in self.inst.layouts
        ]
        self.side = DecodeTransfers(
            self.inst.mgr,
            layout_digest=self.inst.layouts[0].digest(),
            num_ranks=tp,
            timeout_s=timeout_s,
            fence_grace_s=grace_s,
        )
        self.accepted: dict[str, tuple[float, Acceptance, list[int]]] = {}

    def hello(self) -> dict:
        ranks = []
        for rec in self.receivers:
            address, lay = rec.handshake()
            ranks.append({"address": address, "layout": layout_json(lay)})
        return {"digest": self.inst.layouts[0].digest().hex(), "ranks": ranks}

    def seed(self, rid: str, tokens: list[int]) -> dict:
        """D computes `tokens` itself (a prompt it served before): its own prefix."""
        mgr = self.inst.mgr
        mgr.add_request(rid, tokens)
        assert mgr.allocate(rid, num_tokens=len(tokens))
        table = list(mgr.block_table(rid).block_ids)
        for layer in range(self.layers):
            for r in range(self.inst.tp):
                write_rank_layer(self.inst, r, table, tokens, layer, 0)
        mgr.commit(rid, num_computed_tokens=len(tokens))
        mgr.finish(rid)
        return {"seeded": len(tokens)}

    def accept(self, offer: dict, tokens: list[int]) -> dict:
        o = offer_of(offer)
        answer = self.side.accept(o, d_hashes(self.inst.mgr, tokens))
        if isinstance(answer, Acceptance):
            for rec in self.receivers:
                rec.expect(answer, o.num_p_ranks)
            self.accepted[str(o.request_id)] = (time.monotonic(), answer, tokens)
        return answer_json(answer)

    def peek(self, rid: str, layer: int, timeout_s: float) -> dict:
        """Whether layer `layer` of the receiving tail holds P's KV (waits for it up
        to `timeout_s`): per-layer sending made visible. A test's look only; the
        engine never reads a receiving block."""
        _, acc, tokens = self.accepted[rid]
        table = [-1] * acc.num_prefix_blocks + list(acc.block_ids)
        end = time.monotonic() + timeout_s
        while True:
            landed = layer_landed(self.inst, table, tokens, layer)
            if landed or time.monotonic() >= end:
                return {"landed": landed}
            time.sleep(0.01)

    def run(self, timeout_s: float) -> dict:
        """D's scheduler loop until every accepted request has its outcome, was
        served (received, or recomputed on D) and every receiving block released."""
        mgr, out, released_at = self.inst.mgr, {}, None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            got = []
            for rec in self.receivers:
                got += self.side.on_reports(rec.poll())
            got += self.side.tick()
            for rec in self.receivers:
                for epoch, tid in rec.expected():
                    if not self.side.is_live(epoch, tid):
                        rec.forget(epoch, tid)
            for o in got:
                out[str(o.request_id)] = self._serve(o)
            if len(out) == len(self.accepted) and mgr.num_receiving_blocks == 0:
                released_at = time.monotonic()
                if not any(rec.num_expected for rec in self.receivers):
                    break
            time.sleep(0.005)
        t0 = min((t for t, _, _ in self.accepted.values()), default=0.0)
        try:
            self.side.check_invariants()
            invariants = "ok"
        except AssertionError as exc:
            invariants = str(exc)
        rehits = {}
        for rid, (_, _, tokens) in self.accepted.items():
            hit = mgr.add_request(f"probe-{rid}", [*tokens, 1, 2, 3])
            rehits[rid] = hit.num_device_hits
            mgr.finish(f"probe-{rid}")
        return {
            "outcomes": out,
            "released_after_s": None if released_at is None else released_at - t0,
            "invariants": invariants,
            "receiving": mgr.num_receiving_blocks,
            "expected": [rec.num_expected for rec in self.receivers],
            "active": [str(r) for r in mgr.active_request_ids()],
            "rehits": rehits,
            "counters": dataclasses.asdict(self.side.counters),
            "receivers": [dataclasses.asdict(rec.counters) for rec in self.receivers],
        }

    def _serve(self, o: Any) -> dict:
        """Received: the table as committed; failed: recompute the tail on D."""
        rid = str(o.request_id)
        t_acc, acc, tokens = self.accepted[rid]
        mgr = self.inst.mgr
        fenced = mgr.num_receiving_blocks
        if not o.success:
            start = mgr.block_table(rid).num_cached_blocks * BS
            assert mgr.allocate(rid, num_tokens=len(tokens))
            table = list(mgr.block_table(rid).block_ids)
            for layer in range(self.layers):
                for r in range(self.inst.tp):
                    write_rank_layer(self.inst, r, table, tokens, layer, start)
            mgr.commit(rid, num_computed_tokens=len(tokens))
        table = list(mgr.block_table(rid).block_ids)
        digest = kv_digest(self.inst, table, len(tokens), self.layers)
        mgr.finish(rid)
        return {
            "success": o.success,
            "reason": o.reason,
            "after_s": time.monotonic() - t_acc,
            "fenced_at_outcome": fenced,
            "tail_blocks": len(acc.block_ids),
            "prefix_blocks": acc.num_prefix_blocks,
            "digest": digest,
        }


# -- the instance processes ----------------------------------------------------------


def serve_instance(role: str, args: dict) -> None:
    obj: Any = PInstance(**args) if role == "p" else DInstance(**args)
    print(json.dumps(obj.hello()), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            reply = getattr(obj, name)(**cmd)
        except Exception:
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


class Proc:
    """An instance process; `ask` sends one command and reads its reply."""

    def __init__(self, logdir: Path, role: str, **args: Any) -> None:
        self.log = open(logdir / f"instance-{role}.log", "ab")  # noqa: SIM115 (closed in close)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--instance", role, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.hello = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"instance exited with {self.proc.wait(10)}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def ask(self, cmd: str, **args: Any) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.read()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


# -- the cases ---------------------------------------------------------------------

LAYERS = 3
PROMPTS = {
    "r0": [(i * 37 + 11) % 1000 for i in range(22)],  # D holds its first 8 tokens
    "r1": [(i * 53 + 5) % 1000 for i in range(17)],
}


def _pair(logdir: Path, p_tp: int, d_tp: int, timeout_s: float = 10.0, grace_s: float = 2.0):
    d = Proc(
        logdir, "d", tp=d_tp, layers=LAYERS, blocks=32, timeout_s=timeout_s, grace_s=grace_s
    )
    p = Proc(logdir, "p", tp=p_tp, layers=LAYERS, blocks=32)
    p.ask("connect", ranks=d.hello["ranks"])
    return p, d


def _offer_batch(p: Proc, d: Proc) -> list[dict]:
    items = []
    for rid, tokens in PROMPTS.items():
        offer = p.ask("offer", rid=rid, tokens=tokens)
        answer = d.ask("accept", offer=offer, tokens=tokens)
        items.append({"rid": rid, "tokens": tokens, "answer": answer})
    return items


def happy(logdir: Path, p_tp: int, d_tp: int) -> dict:
    """A batch of two prompts, D holding the first one's prefix; P pauses after
    layer 0 so the test sees layer 0 landed on D before layer 1 was computed."""
    p, d = _pair(logdir, p_tp, d_tp)
    try:
        d.ask("seed", rid="local", tokens=PROMPTS["r0"][:8])
        items = _offer_batch(p, d)
        p.ask("start", items=items)
        p.ask("run", until=1)
        peek0 = d.ask("peek", rid="r0", layer=0, timeout_s=5.0)["landed"]
        peek1 = d.ask("peek", rid="r0", layer=1, timeout_s=0.2)["landed"]
        ran = p.ask("run", until=LAYERS)
        d_out = d.ask("run", timeout_s=20.0)
        p_out = p.ask("settle", timeout_s=10.0)
        return {
            "answers": [i["answer"] for i in items],
            "layer0_landed_before_layer1": peek0,
            "layer1_landed_early": peek1,
            "p_digests": ran["digests"],
            "p_errors": ran["errors"],
            "model": {rid: model_digest(t, LAYERS) for rid, t in PROMPTS.items()},
            "d": d_out,
            "p": p_out,
        }
    finally:
        p.close()
        d.close()


def kill_p(logdir: Path, p_tp: int, d_tp: int) -> dict:
    """P killed after handing over layer 0 of 3: D's deadline fails the transfers,
    D recomputes, the blocks stay fenced until deadline + grace."""
    timeout_s, grace_s = 2.0, 1.0
    p, d = _pair(logdir, p_tp, d_tp, timeout_s, grace_s)
    try:
        items = _offer_batch(p, d)
        p.ask("start", items=items)
        p.ask("run", until=1)
        landed = d.ask("peek", rid="r1", layer=0, timeout_s=5.0)["landed"]
        p.kill()
        d_out = d.ask("run", timeout_s=20.0)
        return {
            "timeout_s": timeout_s,
            "grace_s": grace_s,
            "layer0_landed": landed,
            "model": {rid: model_digest(t, LAYERS) for rid, t in PROMPTS.items()},
            "d": d_out,
        }
    finally:
        p.close()
        d.close()


def kill_d(logdir: Path, p_tp: int, d_tp: int) -> dict:
    """D killed mid-batch (after layer 0 landed): P's later writes fail, its sends
    settle with failure notices that cannot go, and everything is unpinned."""
    p, d = _pair(logdir, p_tp, d_tp)
    try:
        items = _offer_batch(p, d)
        p.ask("start", items=items)
        p.ask("run", until=1)
        landed = d.ask("peek", rid="r1", layer=0, timeout_s=5.0)["landed"]
        d.kill()
        t0 = time.monotonic()
        ran = p.ask("run", until=LAYERS)
        p_out = p.ask("settle", timeout_s=20.0)
        return {
            "layer0_landed": landed,
            "p_errors": ran["errors"],
            "settled_s": time.monotonic() - t0,
            "p": p_out,
        }
    finally:
        p.close()
        d.close()


CASES = {"happy": happy, "kill_p": kill_p, "kill_d": kill_d}


def main() -> None:
    if sys.argv[1] == "--instance":
        serve_instance(sys.argv[2], json.loads(sys.argv[3]))
        sys.stdout.flush()
        os._exit(0)
    case, logdir = sys.argv[1], Path(sys.argv[2])
    p_tp, d_tp = (int(x) for x in sys.argv[3].split("-"))
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    code = 0
    try:
        print("RESULT " + json.dumps(CASES[case](logdir, p_tp, d_tp)), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        code = 1
    sys.stderr.flush()
    os._exit(code)  # the engine's threads may still wait on a dead peer


if __name__ == "__main__":
    main()
