"""A P instance and a D instance in one process: each its CacheManager and scheduler
half, and per TP rank a CPU CacheController with its worker half, over one
in-process fabric. The "model" writes each layer's K and V as a fixed function of
(token, position, layer, head), so what D holds can be compared bitwise with what P
computed, and a recompute on D writes the very same bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fastkv import CacheConfig
from fastkv.hashing import BlockHasher, namespace_root, request_root
from fastkv.pd.decode import DecodeTransfers, Outcome
from fastkv.pd.inproc import InProcFabric
from fastkv.pd.layout import KVLayout
from fastkv.pd.messages import Acceptance, Rejection
from fastkv.pd.prefill import PrefillTransfers
from fastkv.pd.receiver import PDReceiver
from fastkv.pd.sender import PDSender
from fastkv.scheduler import CacheManager
from fastkv.worker.cache_controller import CacheController
from fastkv.worker.cache_shape import KVCacheSpec

BS = 4
HEADS = 4
HEAD_DIM = 8
TIMEOUT = 5.0
GRACE = 2.0
# What the running test built that holds threads (controllers' copy streams,
# senders' fence waiters): conftest.py closes it, last built first, after the test.
BUILT: list[Callable[[], object]] = []


def kv_values(tokens: list[int], layer: int, kv: int) -> np.ndarray:
    """The model's K (kv=0) or V (kv=1) of one layer: [positions, heads, head_dim]."""
    pos = np.arange(len(tokens))[:, None, None]
    tok = np.asarray(tokens)[:, None, None]
    head = np.arange(HEADS)[None, :, None]
    dim = np.arange(HEAD_DIM)[None, None, :]
    raw = (tok * 131 + pos * 17 + layer * 7 + head * 5 + dim * 3 + kv) % 997
    return (raw / 64.0).astype(np.float16)


@dataclass
class Instance:
    mgr: CacheManager
    ctrls: list[CacheController]
    layouts: list[KVLayout]
    tp: int

    def write_layer(
        self, block_ids: list[int], tokens: list[int], layer: int, start: int, end: int = -1
    ) -> None:
        """Compute layer `layer` of positions [start, end) (end: the prompt's) into
        the table."""
        end = len(tokens) if end < 0 else end
        per = HEADS // self.tp
        for r, ctrl in enumerate(self.ctrls):
            for kv in (0, 1):
                vals = kv_values(tokens, layer, kv)[:, r * per : (r + 1) * per]
                t = ctrl.caches[layer * 2 + kv].numpy()  # a copy: write back below
                for p in range(start, end):
                    t[block_ids[p // BS], :, p % BS, :] = vals[p]
                view = ctrl.device_blocks(layer * 2 + kv)
                view[:] = t.view(np.uint8).reshape(view.shape)

    def check_table(self, block_ids: list[int], tokens: list[int], layers: int) -> None:
        """Bitwise: every position of the table holds the model's KV."""
        per = HEADS // self.tp
        for r, ctrl in enumerate(self.ctrls):
            for layer in range(layers):
                for kv in (0, 1):
                    vals = kv_values(tokens, layer, kv)[:, r * per : (r + 1) * per]
                    t = ctrl.caches[layer * 2 + kv].numpy()
                    for p in range(len(tokens)):
                        got = t[block_ids[p // BS], :, p % BS, :]
                        assert got.tobytes() == vals[p].tobytes(), (
                            f"rank {r} layer {layer} kv {kv} position {p} differs"
                        )


def make_instance(tp: int, layers: int, blocks: int, head_dim: int = HEAD_DIM) -> Instance:
    mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=blocks))
    ctrls, layouts = [], []
    for r in range(tp):
        spec = KVCacheSpec(
            num_layers=layers,
            num_kv_heads=HEADS // tp,
            head_dim=head_dim,
            block_size=BS,
            num_device_blocks=blocks,
            num_host_blocks=0,
            dtype="float16",
        )
        ctrl = CacheController(spec, "cpu")
        ctrls.append(ctrl)
        BUILT.append(ctrl.free_cache)
        layouts.append(KVLayout.of_controller(ctrl, tp_rank=r, tp_size=tp))
    return Instance(mgr, ctrls, layouts, tp)


def d_hashes(mgr: CacheManager, tokens: list[int]) -> list[bytes]:
    root = request_root(namespace_root(mgr.config.namespace_key()))
    return BlockHasher(BS, root).append(tokens)


@dataclass
class Rig:
    p_tp: int = 1
    d_tp: int = 1
    layers: int = 3
    p_blocks: int = 32
    d_blocks: int = 16
    now: float = 0.0
    p_checksums: bool = True
    d_checksums: bool = True
    fences: object = None  # P's senders' fence source (fastkv.pd.fence)
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        clock = lambda: self.now  # noqa: E731
        self.fabric = InProcFabric(write_timeout_s=1.0, clock=clock)
        self.p = make_instance(self.p_tp, self.layers, self.p_blocks)
        self.d = make_instance(self.d_tp, self.layers, self.d_blocks)
        self.senders = [
            PDSender(
                self.fabric.endpoint(f"p{r}"),
                lay,
                clock=clock,
                checksums=self.p_checksums,
                fences=self.fences,  # type: ignore[arg-type]
            )
            for r, lay in enumerate(self.p.layouts)
        ]
        BUILT.extend(s.close for s in self.senders)
        self.receivers = [
            PDReceiver(self.fabric.endpoint(f"d{r}"), lay, checksums=self.d_checksums)
            for r, lay in enumerate(self.d.layouts)
        ]
        for r, rec in enumerate(self.receivers):  # the P rank holding its first head
            self.senders[r * self.p_tp // self.d_tp].connect(*rec.handshake())
        self.p_side = PrefillTransfers(
            self.p.mgr,
            layout_digest=self.p.layouts[0].digest(),
            num_ranks=self.p_tp,
            answer_timeout_s=TIMEOUT,
            send_timeout_s=TIMEOUT,
            clock=clock,
        )
        self.d_side = DecodeTransfers(
            self.d.mgr,
            layout_digest=self.d.layouts[0].digest(),
            num_ranks=self.d_tp,
            timeout_s=TIMEOUT,
            fence_grace_s=GRACE,
            clock=clock,
        )
        self.p_dead = False

    # -- one request ------------------------------------------------------------

    def offer(
        self, rid: str, tokens: list[int], *, chunked: bool = False
    ) -> Acceptance | Rejection:
        """P admits and allocates the prompt, offers it; D answers; P applies it."""
        mgr = self.p.mgr
        mgr.add_request(rid, tokens)
        assert mgr.allocate(rid, num_tokens=len(tokens))
        offer = self.p_side.offer(rid, len(tokens))
        answer = self.d_side.accept(offer, d_hashes(self.d.mgr, tokens))
        if isinstance(answer, Acceptance):
            for rec in self.receivers:
                rec.expect(answer, self.p_tp)
        if self.p_side.on_answer(answer):
            plan = self.p_side.plan(rid)
            for s in self.senders:
                s.start(plan, chunked=chunked)
        return answer

    def prefill(self, rid: str, tokens: list[int], *, stop_at: int | None = None) -> None:
        """P computes every layer, calling the hook after each (until `stop_at`)."""
        table = list(self.p.mgr.block_table(rid).block_ids)
        for layer in range(self.layers):
            if stop_at is not None and layer == stop_at:
                return
            self.p.write_layer(table, tokens, layer, 0)
            for s in self.senders:
                s.after_layer(layer)

    def prefill_chunk(self, rid: str, tokens: list[int], acc: Acceptance, end: int) -> None:
        """P computes positions up to `end` (from where the last chunk stopped),
        every layer, the hook after each; the senders get the chunk first."""
        table = list(self.p.mgr.block_table(rid).block_ids)
        start = getattr(self, "_chunk_end", 0)
        last = end == len(tokens)
        full = len(acc.block_ids) if last else max(0, end // BS - acc.num_prefix_blocks)
        for s in self.senders:
            s.chunk(acc.epoch, acc.transfer_id, full, last=last)
        for layer in range(self.layers):
            self.p.write_layer(table, tokens, layer, start, end)
            for s in self.senders:
                s.after_layer(layer)
        self._chunk_end = 0 if last else end

    def step(self, seconds: float = 0.0, *, pump: bool = True) -> list[Outcome]:
        self.now += seconds
        if pump:
            self.fabric.pump()
        if not self.p_dead:
            for s in self.senders:
                self.p_side.on_reports(s.poll())
            self.p_side.tick()
        got = []
        for rec in self.receivers:
            got += self.d_side.on_reports(rec.poll())
        got += self.d_side.tick()
        for rec in self.receivers:
            for epoch, tid in rec.expected():
                if not self.d_side.is_live(epoch, tid):
                    rec.forget(epoch, tid)
        self.outcomes += got
        return got

    def run_until_quiet(self, max_steps: int = 40) -> None:
        for _ in range(max_steps):
            self.step(0.5)
        assert self.fabric.num_queued == 0

    def finish_on_d(self, rid: str, tokens: list[int]) -> str:
        """Serve the request on D: received, or recomputed after a failure; check the
        KV bitwise; release it. Returns "received" or "recomputed"."""
        (out,) = [o for o in self.outcomes if o.request_id == rid]
        mgr = self.d.mgr
        if out.success:
            how = "received"
        else:
            start = mgr.block_table(rid).num_cached_blocks * BS  # D's own prefix
            assert mgr.allocate(rid, num_tokens=len(tokens))
            table = list(mgr.block_table(rid).block_ids)
            for layer in range(self.layers):
                self.d.write_layer(table, tokens, layer, start)
            mgr.commit(rid, num_computed_tokens=len(tokens))
            how = "recomputed"
        self.d.check_table(list(mgr.block_table(rid).block_ids), tokens, self.layers)
        mgr.finish(rid)
        return how

    def check_clean(self) -> None:
        """Both sides' invariants, and nothing left held anywhere."""
        self.d_side.check_invariants()
        assert self.d.mgr.num_receiving_blocks == 0, "D kept receiving blocks"
        assert all(rec.num_expected == 0 for rec in self.receivers)
        assert self.d.mgr.active_request_ids() == []
        if not self.p_dead:
            self.p_side.check_invariants()
            assert all(s.num_sends == 0 for s in self.senders)
            assert self.p.mgr.active_request_ids() == [], "P kept a request pinned"
