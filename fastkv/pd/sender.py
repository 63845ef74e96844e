"""P's worker half, one per P rank: send each layer's blocks as soon as the layer is
written, then one notice per D rank served.

    sender = PDSender(transport, KVLayout.of_controller(ctrl, tp_rank=r, tp_size=p))
    sender.connect(d_address, d_layout)      # once per D rank served (handshake)
    sender.start(plan)                       # per transfer (PrefillTransfers.plan)
    ... the model runs; after writing layer L of the step the engine calls
    sender.after_layer(L)                    # on a GPU: after the kernel's event
    reports = sender.poll()                  # each step: settled sends -> RankReport

The hook does only what cannot wait: it hands the layer's pieces (computed at
`start`) to the transport, for every send whose next layer this is. `poll` finishes
a send once its last layer was handed over and every write settled: it notifies each
D rank (done, with one checksum per layer of the blocks as that rank receives them,
or failed when a write failed or could not start), then reports the send settled to
P's scheduler. A final notice goes out only after every write it covers settled, so
its arrival tells D no write of this rank can land any more.

While a send's writes are in flight, each `poll` takes the checksum of every layer
handed over since (its blocks are final then and pinned: the last chunk's layer),
and sends each D rank a progress notice for the layers whose writes all settled
done since the last one, so D verifies those layers while later ones still land
(`fastkv.pd.receiver`). Both overlap the transfer instead of following it. A
progress notice is a hint: one lost or refused costs D a check after the final
notice, nothing else.

Layers are numbered over the whole layout, extra (speculative) layers last: the
engine calls the hook for each of them, in order.

Fences (`fastkv.pd.fence`): with a fence source (the default where the layout is
GPU memory: `CudaFences`, CUDA events on the engine's stream), the hook does the
same bookkeeping but, instead of starting the layer's writes, records one fence
on the engine's stream (or the one it passes) and queues the layer behind it. A
waiter thread waits for the queued fences in the order the hook recorded them,
each in slices bounded by the earliest deadline of the sends it holds, and hands
a layer's writes to the transport only once its fence completed, under the same
lock as the hook's: so a layer's write never reads KV its kernel has not written,
layers stay in order, and a send stopped meanwhile (abort, its deadline, `close`)
starts none of its queued layers. A layer whose fence fails (a device error) or
does not complete by the send's deadline stops the send, which then settles
failed as any stopped send. Checksums and progress notices cover only the layers
whose writes were started (their fence completed).

A chunked prefill: `start(plan, chunked=True)`, then before each step that writes
a chunk `chunk(epoch, transfer_id, num_blocks, last=...)`: that step's hooks send
the blocks that became full since the last chunk (a block split between chunks goes
with the chunk that completes it; the last chunk sends the rest, the partial last
block included).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fastkv.metadata import Epoch
from fastkv.pd.fence import Fence, FenceSource
from fastkv.pd.layout import KVLayout, check_pair, layer_checksum
from fastkv.pd.messages import Notice, RankReport, SendPlan, encode_notice
from fastkv.pd.transport import (
    PDTransport,
    Piece,
    TransportError,
    WriteHandle,
    WriteState,
    check_transport_memory,
)


@dataclass(slots=True)
class _Target:
    d_rank: int
    address: str
    index: int  # D's head slice in P's blocks


@dataclass(slots=True)
class _Send:
    plan: SendPlan
    k: int  # D ranks per P rank
    deadline: float
    # The current chunk: per layer, (peer, pieces) for each D rank served.
    layers: list[list[tuple[str, list[Piece]]]] = field(default_factory=list)
    layer_bytes: list[int] = field(default_factory=list)
    next_layer: int = 0
    in_step: bool = False  # the current chunk's layers are being handed over
    last: bool = False  # the current chunk is the last
    finished: bool = False  # every chunk handed over, or the send failed
    sent_upto: int = 0  # blocks of the plan in chunks so far
    handles: list[WriteHandle] = field(default_factory=list)
    layer_handles: list[list[WriteHandle]] = field(default_factory=list)  # all chunks
    final_layers: int = 0  # layers of the last chunk handed over: their blocks are final
    sums: list[dict[int, int]] = field(default_factory=list)  # per layer, per D rank
    notified: int = 0  # layers covered by progress notices (or skipped)
    failed: str = ""
    queued: int = 0  # layers handed over behind a fence, writes not started yet


@dataclass(slots=True)
class _Layer:
    """One send's layer, as the hook handed it over (the chunk may move on before
    its fence completes)."""

    send: _Send
    layer: int
    writes: list[tuple[str, list[Piece]]]
    nbytes: int
    last: bool  # of the send's last chunk


@dataclass(slots=True)
class _Fenced:
    """The layers one hook call handed over behind one fence."""

    fence: Fence
    layer: int
    layers: list[_Layer]


class PDSender:
    """P rank's sends. The hook may run on the engine's thread while `start`,
    `chunk`, `abort` and `poll` run on another (one lock orders them; the hook with
    nothing to send takes none); not for concurrent calls of the same method.

    Args:
        transport: this rank's transport; every cache tensor is registered once here.
        layout: this rank's cache (`KVLayout`).
        notify_timeout_s: the longest a notice may take to go out.
        clock: monotonic seconds (send deadlines).
        checksums: put each block's checksum in the notice (default). False sends
            notices without them, which a D refuses unless its `PDReceiver` was
            built with `checksums=False` too: D then trusts whatever landed (for
            measurement and trusted fabrics only, docs/pd.md).
        fences: orders each layer's writes after the engine's work on its stream
            (module docstring). Default: none on host memory; `CudaFences` on the
            layout's GPU.
        fence_slice_s: the longest single wait of the waiter thread on a fence
            (it rechecks deadlines and `close` between slices).

    Raises:
        ValueError: a bad argument, or a GPU layout over a transport that does
            not declare `device_memory` (it would copy device pointers on the CPU).
        RuntimeError: a GPU layout and no fence source can be made (the core
            has no CUDA or no framework is imported to read the stream from).
    """

    def __init__(
        self,
        transport: PDTransport,
        layout: KVLayout,
        *,
        notify_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        checksums: bool = True,
        fences: FenceSource | None = None,
        fence_slice_s: float = 0.05,
    ) -> None:
        if not isinstance(checksums, bool):
            raise ValueError(f"checksums: must be a bool, got {checksums!r}")
        if not 0 < fence_slice_s <= 60:
            raise ValueError(f"fence_slice_s: {fence_slice_s!r} must be in (0, 60] s")
        check_transport_memory(transport, layout.device)
        if fences is None and layout.device is not None:
            from fastkv.pd.fence import CudaFences

            fences = CudaFences(layout.device)
        self._fences = fences
        self._fence_slice_s = fence_slice_s
        self.transport = transport
        self.checksums = checksums
        self.layout = layout
        self.notify_timeout_s = notify_timeout_s
        self._notify_until: float | None = None  # set by close: notices go until then
        self._clock = clock
        for t in layout.tensors:
            transport.register(t.ptr, t.nbytes)
        self._targets: dict[int, _Target] = {}
        self._d_layouts: dict[int, KVLayout] = {}
        self._sends: dict[tuple[Epoch, int], _Send] = {}
        self._active: list[_Send] = []  # sends in a step: the hook's list
        # Held by the hook while it hands layers over, and by whatever changes which
        # sends it sees (start, chunk, abort, poll's settling).
        self._lock = threading.Lock()
        self._fenced: deque[_Fenced] = deque()  # the waiter's queue, in hook order
        self._wake = threading.Condition(self._lock)
        self._waiter: threading.Thread | None = None
        self._closed = False
        self.layers_sent = 0
        self.bytes_sent = 0  # handed to the transport (landed or not)
        self.progress_sent = 0  # progress notices sent (one per D rank)
        self.progress_failed = 0  # progress notices the transport refused

    def connect(self, address: str, d_layout: KVLayout) -> None:
        """Pair with D rank `d_layout.tp_rank` reachable at `address`.

        Raises:
            ValueError: layouts differ, or the TP pair is refused (`check_pair`)."""
        index = check_pair(self.layout, d_layout)
        if self._d_layouts and next(iter(self._d_layouts.values())).tp_size != d_layout.tp_size:
            raise ValueError("d_layout.tp_size: differs from an earlier D rank's")
        self._targets[d_layout.tp_rank] = _Target(d_layout.tp_rank, address, index)
        self._d_layouts[d_layout.tp_rank] = d_layout

    def start(self, plan: SendPlan, *, chunked: bool = False) -> None:
        """Prepare a send to every D rank this rank serves: every block goes in the
        next step's hooks, or, `chunked`, the blocks each `chunk` call names.

        Raises:
            ValueError: a D rank this rank serves is not connected, a block id out of
                range, source and destination lists of different lengths, the
                transfer is sending already, or the sender was closed."""
        k = plan.num_d_ranks // self.layout.tp_size if plan.num_d_ranks else 0
        want = range(self.layout.tp_rank * k, (self.layout.tp_rank + 1) * k)
        if (
            k < 1
            or plan.num_d_ranks % self.layout.tp_size
            or any(r not in self._targets for r in want)
        ):
            raise ValueError(
                f"plan.num_d_ranks: {plan.num_d_ranks}; D ranks {list(want)} must be "
                f"connected (connected: {sorted(self._targets)})"
            )
        if len(plan.src_block_ids) != len(plan.dst_block_ids):
            raise ValueError("plan: src_block_ids and dst_block_ids differ in length")
        if (plan.epoch, plan.transfer_id) in self._sends:
            raise ValueError(f"plan.transfer_id: {plan.transfer_id} is already sending")
        if self._closed:
            raise ValueError(f"plan.transfer_id: {plan.transfer_id}: the sender was closed")
        self._check_ids("src_block_ids", plan.src_block_ids, self.layout.num_blocks)
        for r in want:
            self._check_ids("dst_block_ids", plan.dst_block_ids, self._d_layouts[r].num_blocks)
        send = _Send(plan, k, self._clock() + plan.timeout_s)
        send.layer_handles = [[] for _ in range(self.layout.num_layers)]
        with self._lock:
            if self._closed:  # again: a `close` on another thread since the check
                raise ValueError(f"plan.transfer_id: {plan.transfer_id}: the sender was closed")
            self._sends[(plan.epoch, plan.transfer_id)] = send
            if not chunked:
                self._next_chunk(send, len(plan.src_block_ids), True)

    def chunk(self, epoch: Epoch, transfer_id: int, num_blocks: int, *, last: bool) -> None:
        """The next step writes a chunk after which the send's first `num_blocks`
        blocks are full (`last`: the prompt's end; `num_blocks` is then all of them):
        its hooks send those not sent yet.

        Raises:
            ValueError: no such send, one not started `chunked` or finished, the
                previous chunk's layers not all handed over, or `num_blocks` below
                what was sent or above the send's blocks (or not all with `last`)."""
        send = self._sends.get((epoch, transfer_id))
        if send is None or send.finished or send.in_step:
            raise ValueError(
                f"transfer_id: ({epoch}, {transfer_id}) has no send waiting for a chunk"
            )
        total = len(send.plan.src_block_ids)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise ValueError(f"num_blocks: must be an int, got {num_blocks!r}")
        if not send.sent_upto <= num_blocks <= total or (last and num_blocks != total):
            raise ValueError(
                f"num_blocks: {num_blocks} must be in [{send.sent_upto}, {total}]"
                + (f" and {total} with last" if last else "")
            )
        with self._lock:
            self._next_chunk(send, num_blocks, last)

    def _next_chunk(self, send: _Send, upto: int, last: bool) -> None:
        plan = send.plan
        lo = send.sent_upto
        runs = self._runs(plan.src_block_ids[lo:upto], plan.dst_block_ids[lo:upto], send.k)
        k = send.k
        want = range(self.layout.tp_rank * k, (self.layout.tp_rank + 1) * k)
        send.layers = [
            [(self._targets[r].address, self._pieces(runs, k, layer, r)) for r in want]
            for layer in range(self.layout.num_layers)
        ]
        send.layer_bytes = [sum(p.length for _, ps in lay for p in ps) for lay in send.layers]
        send.sent_upto, send.last = upto, last
        if runs:
            send.in_step = True
            self._active = [*self._active, send]
        else:
            send.finished = last
            if last:  # the previous chunk's layers were final: those behind a fence too
                send.final_layers = self.layout.num_layers - send.queued
                for item in self._fenced:
                    for lay in item.layers:
                        lay.last = lay.last or lay.send is send

    def after_layer(self, layer: int, stream: int | None = None) -> None:
        """The hook: layer `layer` of the step is written (host memory) or its
        kernel was launched on `stream` (None: the engine's current stream; with
        a fence source only): start its writes, or queue them behind a fence."""
        if not self._active:
            return
        with self._lock:
            taken = self._hand_over(layer)
            if not taken:
                return
            if self._fences is None:
                for lay in taken:
                    self._issue(lay)
            else:
                self._queue_fenced(layer, taken, stream)

    def _hand_over(self, layer: int) -> list[_Layer]:
        done = False
        taken = []
        for send in self._active:
            if send.next_layer == 0 and layer != 0:
                continue  # started during a step: its chunk goes with the next step
            if send.next_layer != layer:
                self._stop(send, f"hook called for layer {layer}, expected {send.next_layer}")
                done = True
                continue
            nbytes = send.layer_bytes[layer]
            taken.append(_Layer(send, layer, send.layers[layer], nbytes, send.last))
            send.next_layer += 1
            if send.next_layer == len(send.layers):  # the chunk is handed over
                send.next_layer, send.in_step, send.finished = 0, False, send.last
                done = True
        if done:
            self._active = [s for s in self._active if s.in_step]
        return taken

    def _issue(self, lay: _Layer) -> None:
        """Start one layer's writes (the lock held; the send not stopped)."""
        send, layer = lay.send, lay.layer
        try:
            for peer, pieces in lay.writes:
                handle = self.transport.write(peer, pieces)
                send.handles.append(handle)
                send.layer_handles[layer].append(handle)
        except Exception as exc:  # TransportError, or a transport's bug: never lost
            # On the waiter thread an escaping error would end the thread, and
            # every later fenced layer would wait for its send's deadline.
            why = str(exc) if isinstance(exc, TransportError) else repr(exc)
            self._stop(send, f"layer {layer}: {why}")
            self._active = [s for s in self._active if s is not send]
            return
        self.layers_sent += 1
        self.bytes_sent += lay.nbytes
        if lay.last:
            send.final_layers = layer + 1

    def _queue_fenced(self, layer: int, taken: list[_Layer], stream: int | None) -> None:
        """One fence after the engine's work so far; the layers wait behind it."""
        assert self._fences is not None
        try:
            fence = self._fences.record(stream)
        except Exception as exc:
            for lay in taken:
                self._stop(lay.send, f"layer {layer}: recording its fence failed: {exc}")
            self._active = [s for s in self._active if not s.failed]
            return
        for lay in taken:
            lay.send.queued += 1
        self._fenced.append(_Fenced(fence, layer, taken))
        if self._waiter is None:
            self._waiter = threading.Thread(
                target=self._wait_fences, name="fastkv-pd-fences", daemon=True
            )
            self._waiter.start()
        self._wake.notify()

    def _wait_fences(self) -> None:
        """The waiter thread: the queued fences in order; a layer's writes start
        once its fence completed, under the lock, unless its send was stopped."""
        while True:
            with self._lock:
                while not self._fenced and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                item = self._fenced[0]
            start = self._await(item)
            with self._lock:
                self._fenced.popleft()
                for lay in item.layers:
                    lay.send.queued -= 1
                    if start and not lay.send.failed and not self._closed:
                        self._issue(lay)

    def _await(self, item: _Fenced) -> bool:
        """Wait for `item`'s fence while a send behind it is live; False when
        none is any more (stopped, or stopped here: the fence failed, or each
        one's own deadline passed)."""
        while True:
            with self._lock:
                live = [lay.send for lay in item.layers if not lay.send.failed]
                if self._closed or not live:
                    return False
                now = self._clock()
                late = [send for send in live if send.deadline <= now]
                if late:  # only these: a later send may still see the fence complete
                    why = f"deadline passed with layer {item.layer}'s fence pending"
                    self._stop_all(late, why)
                    continue
                left = min(send.deadline for send in live) - now
            try:
                if item.fence.synchronize(min(left, self._fence_slice_s)):
                    return True
            except Exception as exc:
                with self._lock:
                    self._stop_all(live, f"layer {item.layer}: its fence failed: {exc}")
                return False

    def _stop_all(self, sends: list[_Send], reason: str) -> None:
        """Stop `sends` and drop them from the hook's list (the lock held)."""
        for send in sends:
            self._stop(send, reason)
        self._active = [s for s in self._active if not s.failed]

    def abort(self, epoch: Epoch, transfer_id: int) -> None:
        """Start no more writes for the transfer; it settles (failed) as usual."""
        with self._lock:
            send = self._sends.get((epoch, transfer_id))
            if send is not None and (not send.finished or send.queued):
                self._stop(send, "aborted on P")
                self._active = [s for s in self._active if s is not send]

    def abort_all(self, reason: str) -> int:
        """`abort` every send not finished handing over, with `reason`; returns
        how many it stopped (every send settles as usual: a stopped one failed)."""
        with self._lock:
            stopped = [s for s in self._sends.values() if not s.finished or s.queued]
            for send in stopped:
                self._stop(send, reason)
            self._active = []
            return len(stopped)

    def close(self, timeout_s: float = 5.0, *, notify_until: float | None = None) -> None:
        """Stop every send (`abort_all`) and the fence waiter: no write starts once
        this returns, whatever fence is still pending. The sends still settle
        through `poll`. Idempotent. With `notify_until` (`time.monotonic()`
        seconds) their notices go out only until then, each waiting at most
        what is left: past it a send settles failed without its notice (D fences
        by its grace), so a D that does not answer cannot stretch a bounded close
        by a notify timeout per send.

        Raises:
            ValueError: `timeout_s` not in (0, 3600], or `notify_until` not a
                finite number."""
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s: {timeout_s!r} must be in (0, 3600] s")
        if notify_until is not None and not (
            isinstance(notify_until, int | float)
            and not isinstance(notify_until, bool)
            and math.isfinite(notify_until)
        ):
            raise ValueError(f"notify_until: {notify_until!r} must be a finite number")
        self.abort_all("the sender was closed")
        with self._lock:
            if notify_until is not None:
                self._notify_until = notify_until
            self._closed = True
            self._wake.notify_all()
            waiter = self._waiter
        if waiter is not None and waiter is not threading.current_thread():
            # The waiter is at most one fence slice away from seeing `_closed`, and
            # it starts writes only under the lock, after checking it.
            waiter.join(timeout_s)

    @staticmethod
    def _stop(send: _Send, reason: str) -> None:
        send.failed = send.failed or reason
        send.in_step, send.finished = False, True

    def poll(self) -> list[RankReport]:
        """Settle the sends whose writes all settled: notify D, report to P. For
        the others, checksum the layers handed over since and send D progress
        notices for the layers whose writes all settled done."""
        now = self._clock()
        settled = []
        in_flight = []  # handed over in part or whole, writes pending
        with self._lock:  # the hook starts no write for a send stopped here
            for key, send in list(self._sends.items()):
                if not send.finished or (send.queued and not send.failed):
                    if now < send.deadline:
                        in_flight.append(send)
                        continue
                    why = "a layer's fence completed" if send.finished else "the last layer"
                    self._stop(send, f"deadline passed before {why}")
                    self._active = [s for s in self._active if s is not send]
                states = [h.state() for h in send.handles]
                if WriteState.PENDING in states and now < send.deadline:
                    in_flight.append(send)
                    continue
                del self._sends[key]
                settled.append((send, states))
        for send in in_flight:  # outside the lock: the hook does not wait for it
            if (
                self.checksums
                and not send.failed
                and send.plan.src_block_ids
                and self._sums_taken(send, send.final_layers)
            ):
                self._progress(send)
        return [self._settle(send, states) for send, states in settled]

    def _sums_taken(self, send: _Send, upto: int) -> bool:
        """`_take_sums`; if it raises (on a GPU: a CUDA error, or the kernel's wait
        ran out), stop the send instead: it settles failed as usual, and `poll`
        goes on settling the others (their reports and notices are not lost)."""
        try:
            self._take_sums(send, upto)
        except Exception as exc:
            with self._lock:
                self._stop_all([send], f"checksum of layer {len(send.sums)}: {exc!r}")
            return False
        return True

    @property
    def num_sends(self) -> int:
        return len(self._sends)

    # -- internals ------------------------------------------------------------

    def _settle(self, send: _Send, states: list[WriteState]) -> RankReport:
        plan = send.plan
        if WriteState.PENDING in states:
            # Past the deadline with a write unsettled: no notice, since a notice
            # tells D no write can land any more; D fences by its grace instead.
            # Nor is the report fenced: that write may still move bytes.
            reason = send.failed or "writes still pending at the deadline"
            rank = self.layout.tp_rank
            return RankReport(plan.transfer_id, plan.epoch, rank, False, reason, False)
        if not send.failed and WriteState.FAILED in states:
            send.failed = "a write failed"
        if not send.failed and self.checksums and plan.src_block_ids:
            self._sums_taken(send, self.layout.num_layers)  # else: stopped, failed
        ok = not send.failed
        # stopped rather than failed: every write started settled done, so D may
        # free the blocks on this notice; a failed write's bytes may still land,
        # and so may a done one's where done means only "sent"
        stopped = WriteState.FAILED not in states and bool(
            getattr(self.transport, "done_means_applied", True)
        )
        for peer, notice in self._notices(send, ok, stopped):
            try:
                self.transport.notify(peer, notice, self._notify_timeout())
            except TransportError as exc:
                ok = False
                send.failed = send.failed or f"notice to {peer}: {exc}"
        return RankReport(plan.transfer_id, plan.epoch, self.layout.tp_rank, ok, send.failed)

    def _notices(self, send: _Send, ok: bool, stopped: bool) -> list[tuple[str, bytes]]:
        plan = send.plan
        with_sums = ok and self.checksums and bool(plan.src_block_ids)  # sums taken
        return [
            (
                self._targets[r].address,
                self._notice(
                    send,
                    r,
                    failed=not ok,
                    stopped=not ok and stopped,
                    sums=self._sums_of(send, r, 0) if with_sums else (),
                ),
            )
            for r in self._served(send)
        ]

    def _notify_timeout(self) -> float:
        """A notice's timeout: `notify_timeout_s`, at most what is left before the
        `notify_until` of `close` (TransportError when nothing is)."""
        until = self._notify_until
        if until is None:
            return self.notify_timeout_s
        left = until - time.monotonic()
        if left <= 0:
            raise TransportError("the sender closed: no time left for the notice")
        return min(self.notify_timeout_s, left)

    def _served(self, send: _Send) -> range:
        """The D ranks this rank serves in `send`."""
        return range(self.layout.tp_rank * send.k, (self.layout.tp_rank + 1) * send.k)

    def _notice(
        self,
        send: _Send,
        d_rank: int,
        *,
        failed: bool,
        sums: tuple[int, ...],
        first: int = 0,
        progress: bool = False,
        stopped: bool = False,
    ) -> bytes:
        plan = send.plan
        notice = Notice(
            plan.epoch,
            plan.transfer_id,
            self.layout.tp_rank,
            self.layout.tp_size,
            d_rank,
            plan.num_d_ranks,
            failed,
            self.layout.num_layers,
            sums,
            first,
            progress,
            stopped,
        )
        return encode_notice(notice, plan.secret)

    @staticmethod
    def _sums_of(
        send: _Send, d_rank: int, first: int, upto: int | None = None
    ) -> tuple[int, ...]:
        return tuple(layer[d_rank] for layer in send.sums[first:upto])

    def _take_sums(self, send: _Send, upto: int) -> None:
        """Checksum layers `len(send.sums)` to `upto` of the send as each D rank it
        serves receives them (its head slice). A layer of the last chunk is final
        once handed over and stays pinned until the send settles, so this may run
        while the writes are still in flight."""
        plan, k = send.plan, send.k
        while len(send.sums) < upto:
            tensors = self.layout.layer(len(send.sums))
            send.sums.append(
                {
                    r: layer_checksum(
                        tensors,
                        plan.src_block_ids,
                        slices=k,
                        index=self._targets[r].index,
                        device=self.layout.device,
                    )
                    for r in self._served(send)
                }
            )

    def _progress(self, send: _Send) -> None:
        """Tell each D rank served which checksummed layers' writes all settled
        done since the last progress notice (a hint: a failure to send it only
        costs D a check after the final notice)."""
        upto = send.notified
        while upto < len(send.sums) and all(
            h.state() is WriteState.DONE for h in send.layer_handles[upto]
        ):
            upto += 1
        if upto == send.notified:
            return
        first, send.notified = send.notified, upto
        for r in self._served(send):
            payload = self._notice(
                send,
                r,
                failed=False,
                sums=self._sums_of(send, r, first, upto),
                first=first,
                progress=True,
            )
            try:
                self.transport.notify(self._targets[r].address, payload, self._notify_timeout())
            except TransportError:
                self.progress_failed += 1
            else:
                self.progress_sent += 1

    def _pieces(
        self, runs: list[tuple[int, int, int]], k: int, layer: int, d_rank: int
    ) -> list[Piece]:
        """The layer's pieces for one D rank, one per run of blocks per tensor."""
        index = self._targets[d_rank].index
        pieces: list[Piece] = []
        for pt, dt in zip(
            self.layout.layer(layer), self._d_layouts[d_rank].layer(layer), strict=True
        ):
            size = pt.block_bytes // k
            p_base, p_bb, d_base, d_bb = (
                pt.ptr + index * size,
                pt.block_bytes,
                dt.ptr,
                dt.block_bytes,
            )
            pieces += [
                Piece(p_base + s * p_bb, d_base + d * d_bb, n * size) for s, d, n in runs
            ]
        return pieces

    @staticmethod
    def _runs(
        src_ids: tuple[int, ...], dst_ids: tuple[int, ...], k: int
    ) -> list[tuple[int, int, int]]:
        """(first source block, first destination block, count) of each run of
        blocks consecutive on both sides; single blocks when a head slice moves
        (k > 1: a slice of one block is not contiguous with the next one's)."""
        runs: list[tuple[int, int, int]] = []
        for s, d in zip(src_ids, dst_ids, strict=True):
            if (
                k == 1
                and runs
                and s == runs[-1][0] + runs[-1][2]
                and d == runs[-1][1] + runs[-1][2]
            ):
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((s, d, 1))
        return runs

    @staticmethod
    def _check_ids(name: str, ids: tuple[int, ...], limit: int) -> None:
        for i, b in enumerate(ids):
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < limit:
                raise ValueError(f"plan.{name}[{i}]: {b!r} not a block id in [0, {limit})")


__all__ = ["PDSender"]
