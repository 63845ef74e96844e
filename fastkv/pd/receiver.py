"""D's worker half, one per D rank: check every notice and what landed.

    receiver = PDReceiver(transport, KVLayout.of_controller(ctrl, tp_rank=r, tp_size=d))
    address, layout = receiver.handshake()   # sent to the P ranks (PDSender.connect)
    receiver.expect(acceptance, num_p_ranks) # per transfer, from D's scheduler half
    reports = receiver.poll()                # each step -> DecodeTransfers.on_reports
    receiver.forget(epoch, transfer_id)      # once D's scheduler resolved it

A notice is verified before anything is believed: its authenticator under the
transfer's secret, then epoch, transfer id, the P rank that serves this rank, rank
counts, layer count and checksum count; a done notice's per-layer checksums are then
compared with the checksum of what landed in each layer of the destination blocks.
A forged or malformed notice is dropped and counted (`forged`), a second one from
the same transfer too (`duplicate`); a notice of a transfer not expected yet waits
(bounded) for its `expect`, one of an epoch before the newest expected one is
dropped (`stale`), one of a forgotten transfer too (`late`). Only a verified final
notice becomes a `RankReport`.

Progress notices (P: these layers' writes all settled done) let D check layers
while later ones still land: `poll` verifies each layer a progress notice names
and remembers the checksum of those whose landed bytes matched
(`layers_early`); the final notice's check then skips a layer whose checksum is
the one remembered and checks every other layer itself. A progress notice
reports nothing and fences nothing, so one lost, late (the final notice came
first, `late`), repeated (`duplicate`), forged or of a transfer not expected
(`unknown`, never kept waiting) changes only how much the final check costs.
What this gives up: a layer verified early is not checked again, so a foreign
write into it after that check is not caught; with one final check, a foreign
write after it (after the commit) was not caught either, and now the window
opens at the layer's progress notice (docs/pd.md, who can write into D's memory).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fastkv.metadata import Epoch
from fastkv.pd.layout import KVLayout, check_tp, layer_checksum
from fastkv.pd.messages import (
    Acceptance,
    Notice,
    NoticeError,
    RankReport,
    decode_notice,
    peek_notice,
    peek_progress,
)
from fastkv.pd.transport import PDTransport, check_transport_memory


@dataclass(slots=True)
class _Expected:
    acceptance: Acceptance
    p_rank: int
    num_p_ranks: int
    reported: bool = False
    seen: set[int] = field(default_factory=set)  # layers named by progress notices
    verified: dict[int, int] = field(default_factory=dict)  # layer -> checksum matched


@dataclass(slots=True)
class ReceiverCounters:
    received: int = 0
    forged: int = 0
    duplicate: int = 0
    stale: int = 0
    unknown: int = 0
    late: int = 0
    bad_checksum: int = 0
    checksum_mismatch: int = 0  # P's and D's `checksums` settings differ
    progress: int = 0  # progress notices taken (not drops)
    layers_early: int = 0  # layers verified on a progress notice (not drops)


NOT_DROPS = ("received", "progress", "layers_early")  # the other counters count drops


class PDReceiver:
    """D rank's transfers (one thread: D's worker step).

    Args:
        transport: this rank's transport; every cache tensor is registered once.
        layout: this rank's cache (`KVLayout`).
        max_waiting: notices of not yet expected transfers kept (oldest dropped,
            counted as `unknown`).
        checksums: verify each block's checksum against P's (default). False:
            P's senders must be built with `checksums=False` as well (a notice with
            checksums is refused here, as one without them is by a D with them on)
            and D trusts whatever landed once a done notice arrived: for
            measurement and trusted fabrics only (docs/pd.md).

    Raises:
        ValueError: a GPU layout over a transport without `device_memory`.
    """

    def __init__(
        self,
        transport: PDTransport,
        layout: KVLayout,
        *,
        max_waiting: int = 256,
        checksums: bool = True,
    ):
        if not isinstance(checksums, bool):
            raise ValueError(f"checksums: must be a bool, got {checksums!r}")
        self.transport = transport
        self.checksums = checksums
        check_transport_memory(transport, layout.device)
        self.layout = layout
        self.max_waiting = max_waiting
        for t in layout.tensors:
            transport.register(t.ptr, t.nbytes)
        self._expected: dict[tuple[Epoch, int], _Expected] = {}
        self._waiting: OrderedDict[tuple[Epoch, int], list[bytes]] = OrderedDict()
        self._epoch = Epoch(0)
        self._done: OrderedDict[tuple[Epoch, int], None] = OrderedDict()  # forgotten
        self._ready: list[RankReport] = []  # from notices that waited for `expect`
        self.counters = ReceiverCounters()
        self._checksum_error = ""  # why the last checksum of landed bytes raised
        self._block_bytes = sum(t.block_bytes for t in layout.tensors)
        self.bytes_received = 0  # verified and reported ok

    def handshake(self) -> tuple[str, KVLayout]:
        """What P ranks need to write here: the address and the layout."""
        return self.transport.address, self.layout

    def expect(self, acceptance: Acceptance, num_p_ranks: int) -> None:
        """Expect this rank's notice for an accepted transfer.

        Raises:
            ValueError: the TP pair is refused, the acceptance names another D size,
                a block id out of range, or the transfer is expected already."""
        check_tp(num_p_ranks, self.layout.tp_size)
        if acceptance.num_d_ranks != self.layout.tp_size:
            raise ValueError(
                f"acceptance.num_d_ranks: {acceptance.num_d_ranks}, this D has "
                f"{self.layout.tp_size} ranks"
            )
        for i, b in enumerate(acceptance.block_ids):
            if not 0 <= b < self.layout.num_blocks:
                raise ValueError(f"acceptance.block_ids[{i}]: {b} out of range")
        key = (acceptance.epoch, acceptance.transfer_id)
        if key in self._expected:
            raise ValueError(f"transfer {key} is expected already")
        k = self.layout.tp_size // num_p_ranks
        self._expected[key] = _Expected(acceptance, self.layout.tp_rank // k, num_p_ranks)
        if acceptance.epoch > self._epoch:
            self._epoch = acceptance.epoch
        for payload in self._waiting.pop(key, []):
            report = self._check(payload)
            if report is not None:
                self._ready.append(report)

    def poll(self) -> list[RankReport]:
        """Verify the notices that arrived; the reports of those that verified."""
        reports, self._ready = self._ready, []
        for _sender, payload in self.transport.poll_notices():
            report = self._check(payload)
            if report is not None:
                reports.append(report)
        return reports

    def forget(self, epoch: Epoch, transfer_id: int) -> None:
        """D's scheduler is done with the transfer (`DecodeTransfers.is_live` is
        False: committed, or its blocks released): later notices for it are late."""
        if self._expected.pop((epoch, transfer_id), None) is not None:
            self._done[(epoch, transfer_id)] = None
            while len(self._done) > 4 * self.max_waiting:
                self._done.popitem(last=False)

    def expected(self) -> list[tuple[Epoch, int]]:
        """The (epoch, transfer id) of every transfer expected and not forgotten."""
        return list(self._expected)

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    # -- internals ------------------------------------------------------------

    def _check(self, payload: bytes) -> RankReport | None:
        try:
            key = peek_notice(payload)
        except NoticeError:
            self.counters.forged += 1
            return None
        exp = self._expected.get(key)
        if exp is None:
            if key in self._done:
                self.counters.late += 1
            elif peek_progress(payload):  # a hint: not worth a place in the buffer
                if key[0] < self._epoch:
                    self.counters.stale += 1
                else:
                    self.counters.unknown += 1
            else:
                self._wait(key, payload)
            return None
        try:
            notice = decode_notice(payload, exp.acceptance.secret)
        except NoticeError:
            self.counters.forged += 1
            return None
        if not self._fits(notice, exp):
            self.counters.forged += 1
            return None
        if notice.progress:
            self._progress(notice, exp)
            return None
        if exp.reported:
            self.counters.duplicate += 1
            return None
        exp.reported = True
        self.counters.received += 1
        return self._verdict(notice, exp)

    def _progress(self, notice: Notice, exp: _Expected) -> None:
        """Verify the layers a progress notice names; remember those that match."""
        layers = range(notice.first_layer, notice.first_layer + len(notice.checksums))
        if exp.reported:
            self.counters.late += 1
            return
        if any(layer in exp.seen for layer in layers):
            self.counters.duplicate += 1
            return
        exp.seen.update(layers)
        self.counters.progress += 1
        if not self.checksums:
            return  # the final notice is refused (checksum_mismatch)
        for layer, want in zip(layers, notice.checksums, strict=True):
            if self._landed(layer, exp.acceptance) == want:  # None: checked at the end
                exp.verified[layer] = want
                self.counters.layers_early += 1

    def _landed(self, layer: int, acc: Acceptance) -> int | None:
        """The checksum of what landed in the layer; None when taking it raised
        (on a GPU: a CUDA error, or the kernel's wait ran out), which the caller
        treats as a mismatch: raising out of `poll` would lose the notices it
        drained from the transport, other transfers' included."""
        try:
            return layer_checksum(
                self.layout.layer(layer), acc.block_ids, device=self.layout.device
            )
        except Exception as exc:
            self._checksum_error = repr(exc)
            return None

    def _wait(self, key: tuple[Epoch, int], payload: bytes) -> None:
        if key[0] < self._epoch:
            self.counters.stale += 1
            return
        self._waiting.setdefault(key, []).append(payload)
        self._waiting.move_to_end(key)
        while sum(len(v) for v in self._waiting.values()) > self.max_waiting:
            _, dropped = self._waiting.popitem(last=False)
            self.counters.unknown += len(dropped)

    def _fits(self, n: Notice, exp: _Expected) -> bool:
        acc = exp.acceptance
        return (
            n.p_rank == exp.p_rank
            and n.num_p_ranks == exp.num_p_ranks
            and n.d_rank == self.layout.tp_rank
            and n.num_d_ranks == self.layout.tp_size
            and n.num_layers == self.layout.num_layers
            and (
                n.first_layer + len(n.checksums) <= n.num_layers and bool(acc.block_ids)
                if n.progress
                else n.first_layer == 0 and (n.failed or len(n.checksums) in (0, n.num_layers))
            )
        )

    def _verdict(self, notice: Notice, exp: _Expected) -> RankReport:
        acc, rank = exp.acceptance, self.layout.tp_rank
        if notice.failed:
            why = "P reported a failure" + (
                " (stopped: every write it started landed)"
                if notice.stopped
                else " (a write failed: D fences by its grace)"
            )
            return RankReport(acc.transfer_id, acc.epoch, rank, False, why, notice.stopped)
        if acc.block_ids and bool(notice.checksums) != self.checksums:
            self.counters.checksum_mismatch += 1
            return RankReport(
                acc.transfer_id,
                acc.epoch,
                rank,
                False,
                f"notice {'with' if notice.checksums else 'without'} block checksums, "
                f"this D has checksums={self.checksums}: P and D must agree",
                False,
            )
        if not self.checksums:
            self.bytes_received += len(acc.block_ids) * self._block_bytes
            return RankReport(acc.transfer_id, acc.epoch, rank, True)
        for layer, want in enumerate(notice.checksums):
            if exp.verified.get(layer) == want:
                continue
            landed = self._landed(layer, acc)
            if landed != want:
                self.counters.bad_checksum += landed is not None
                why = (
                    "landed bytes do not match P's checksum"
                    if landed is not None
                    else f"checksum of the landed bytes failed: {self._checksum_error}"
                )
                return RankReport(
                    acc.transfer_id, acc.epoch, rank, False, f"layer {layer}: {why}", False
                )
        self.bytes_received += len(acc.block_ids) * self._block_bytes
        return RankReport(acc.transfer_id, acc.epoch, rank, True)


__all__ = ["PDReceiver", "ReceiverCounters"]
