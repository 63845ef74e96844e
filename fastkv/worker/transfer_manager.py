"""Runs swap-ins layer by layer and evictions fire-and-forget, in order.

Two streams: the input stream carries host-to-device loads, the output stream
device-to-host copies (fire-and-forget). Every copy runs layer by layer with one
event per layer, so layer L's attention waits for layer L only. `BlockHazards`
orders a new copy (or the model's writes) after every in-flight copy that touches
the same block, per layer: layer L of a load into a block an eviction still reads
waits for that eviction's layer L, not for all of it. Nothing is overwritten while
a copy still reads it, and nothing is read before the copy that fills it is done.
On a GPU those orderings are stream waits on events, never a host synchronize.

Blocks handed over. An eviction names the blocks its scheduler has already given
to a new owner (`reused_block_ids`): the model may write them in this very step,
knowing nothing of the copy. The manager orders the compute stream after those
reads itself, at submission (device-side on a GPU), and keeps doing so at every
later submission while the copy runs; blocks not handed over (write-through
backups, evictions not reused yet) never hold the model up.

The compute stream (where the model runs) may change from step to step: every
submission takes the step's compute stream, falling back to the one given at
construction. A CUDA error seen while checking a transfer (a sticky fault) fails
that transfer's result; it never escapes `poll()` and loses the others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

from fastkv.metadata import TransferResult
from fastkv.worker.streams import DONE, CopyLayer, CopyLayers, Event, Launch, Stream

DEFAULT_TIMEOUT = 60.0


class TransferTimeoutError(TimeoutError):
    """A bounded wait on a transfer ran out."""


class TransferFailedError(RuntimeError):
    """A copy of the transfer failed; its destination blocks hold garbage."""

    def __init__(self, transfer_id: int, error: str) -> None:
        super().__init__(f"transfer {transfer_id} failed: {error}")
        self.transfer_id = transfer_id
        self.error = error


class _Status:
    """Outcome of one transfer, written by whichever thread ran its copies. Layers
    before the first failed one were copied intact; that one and all after it
    were not."""

    __slots__ = ("error", "failed_layer", "lock")

    def __init__(self) -> None:
        self.error: str | None = None
        self.failed_layer = -1
        self.lock = threading.Lock()

    def fail(self, exc: BaseException, layer: int = 0) -> None:
        with self.lock:
            if self.error is None:  # the first failure is the cause
                self.error = f"{type(exc).__name__}: {exc}"
                self.failed_layer = layer

    def failed_at(self, layer: int) -> bool:
        return self.error is not None and self.failed_layer <= layer


class BlockHazards:
    """The in-flight copies touching each block of one tier.

    A copy that writes a block must follow every in-flight copy reading or writing
    it; a copy (or the model) that reads a block must follow the in-flight copy
    writing it. Each entry is O(1) to add and to remove (readers are keyed by
    transfer id), and a query on an empty table costs nothing per block.
    """

    def __init__(self) -> None:
        self._writer: dict[int, _InFlight] = {}
        self._readers: dict[int, dict[int, _InFlight]] = {}

    def conflicts(self, reads: Iterable[int], writes: Iterable[int]) -> list[_InFlight]:
        """The unfinished copies that a new access must wait for."""
        writer_of, readers_of = self._writer, self._readers
        if not writer_of and not readers_of:
            return []
        found: dict[int, _InFlight] = {}
        for block in writes:
            writer = writer_of.get(block)
            if writer is not None:
                found[writer.transfer_id] = writer
            readers = readers_of.get(block)
            if readers:
                found.update(readers)
        if writer_of:
            for block in reads:
                writer = writer_of.get(block)
                if writer is not None:
                    found[writer.transfer_id] = writer
        return [t for t in found.values() if not t.finished()]

    def add(self, reads: Iterable[int], writes: Iterable[int], transfer: _InFlight) -> None:
        tid = transfer.transfer_id
        readers_of = self._readers
        for block in reads:
            readers = readers_of.get(block)
            if readers is None:
                readers_of[block] = {tid: transfer}
            else:
                readers[tid] = transfer
        for block in writes:
            self._writer[block] = transfer

    def remove(self, reads: Iterable[int], writes: Iterable[int], transfer: _InFlight) -> None:
        tid = transfer.transfer_id
        readers_of = self._readers
        for block in reads:
            readers = readers_of.get(block)
            if readers is not None and readers.pop(tid, None) is not None and not readers:
                del readers_of[block]
        writer_of = self._writer
        for block in writes:
            if writer_of.get(block) is transfer:
                del writer_of[block]

    def read_blocks(self) -> frozenset[int]:
        """The blocks an in-flight copy still reads (added at submit, dropped when
        the copy is retired by `poll` / `wait_all`)."""
        return frozenset(self._readers)

    def __len__(self) -> int:
        return len(self._writer) + len(self._readers)


class LayerDoneCounter:
    """Completion of one step's swap-in, per layer.

    Also carries the waits the model's own writes need this step (blocks it writes
    that an in-flight eviction still reads), folded into each layer's wait: layer
    L's wait covers the guarding copies' layer L only.

    Args:
        transfer_id: the swap-in's transfer id, or -1 when the step has none.
        layer_events: one event per layer (empty when there is no swap-in).
        status: the swap-in's outcome.
        compute: the stream the model runs on.
        write_guards: per guarding copy, its per-layer events: the model waits for
            layer L of each before writing layer L's KV.
        num_layers: layers covered.
    """

    def __init__(
        self,
        transfer_id: int,
        layer_events: Sequence[Event],
        status: _Status | None,
        compute: Stream,
        write_guards: Sequence[Sequence[Event]],
        num_layers: int,
    ) -> None:
        self.transfer_id = transfer_id
        self.num_layers = num_layers
        self._events = list(layer_events)
        self._status = status
        self._compute = compute
        self._guards = list(write_guards)

    @property
    def has_swap_in(self) -> bool:
        return bool(self._events)

    @property
    def failed(self) -> bool:
        """Some layer failed to load (those before it are intact)."""
        return self._status is not None and self._status.error is not None

    def is_layer_done(self, layer: int) -> bool:
        """Would a host wait for layer `layer` return without waiting? (A CUDA error
        while checking fails the transfer and counts as done.)"""
        self._check_layer(layer)
        for event in self._waits(layer):
            try:
                if not event.query():
                    return False
            except Exception as e:
                self._fail(e, layer)
        return True

    def wait_for_layer(
        self, layer: int, timeout: float = DEFAULT_TIMEOUT, *, on_device: bool | None = None
    ) -> None:
        """Wait until layer `layer` is loaded (and the step's write guards are done).

        On a GPU the wait is on the device by default: the compute stream waits for
        the layer's event and the host goes on at once (as `stream_wait_for_layer`).
        On the CPU stand-in, or with `on_device=False`, the calling thread blocks:
        precisely (it wakes within tens of microseconds) and at most `timeout`.

        Raises:
            TransferTimeoutError: a host wait not done within `timeout` seconds.
            TransferFailedError: the swap-in failed at or before this layer (known
                once the launch failed, or after a host wait); its blocks hold garbage.
            CudaCaptureError: a device-side wait asked for while the compute stream
                captures a graph, with the layer not known to be loaded (see
                `stream_wait_for_layer`).
            IndexError: no such layer.
        """
        self._check_layer(layer)
        if self._compute.on_device if on_device is None else on_device:
            self.stream_wait_for_layer(layer)
            self._raise_if_failed(layer)
            return
        for event in self._waits(layer):
            try:
                done = event.synchronize(timeout)
            except Exception as e:  # a CUDA error: the copy's bytes cannot be trusted
                self._fail(e, layer)
                break
            if not done:
                raise TransferTimeoutError(
                    f"transfer {self.transfer_id}: layer {layer} not loaded after {timeout} s"
                )
        self._raise_if_failed(layer)

    def stream_wait_for_layer(self, layer: int) -> None:
        """Make the compute stream wait for layer `layer` without blocking the host
        (on the CPU stand-in the compute stream is the caller: this blocks, bounded).

        A failure surfaces through `failed`, `wait_all` and the TransferResult.

        Raises:
            CudaCaptureError: the compute stream is capturing a CUDA graph and the
                layer is not known to be loaded: a wait captured into the graph
                would replay against this step's events. Nothing touched the
                capture (only its status was read); with nothing left to wait
                for, a captured region may call this freely.
        """
        self._check_layer(layer)
        waits = [e for e in self._waits(layer) if not e.known_done]
        if waits and self._compute.capturing():
            from fastkv.ops.core import CudaCaptureError  # the native core: GPU only

            raise CudaCaptureError(
                f"transfer {self.transfer_id}: layer {layer} is still loading while the "
                "compute stream captures a CUDA graph; wait for it before capture begins"
            )
        for event in waits:
            self._compute.wait_event(event)

    def wait_all(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Block the calling thread until every layer is loaded (a host wait on every
        device, so a failure is known when it returns).

        Raises:
            TransferTimeoutError, TransferFailedError: as for `wait_for_layer`.
        """
        if self.num_layers:
            self.wait_for_layer(self.num_layers - 1, timeout, on_device=False)

    def _fail(self, exc: BaseException, layer: int) -> None:
        if self._status is None:  # a write guard's copy failed: not this step's load
            self._status = _Status()
        # A CUDA error is not tied to a layer (the context is broken): fail them all.
        self._status.fail(exc, 0)

    def _waits(self, layer: int) -> list[Event]:
        return [*(g[layer] for g in self._guards), *self._events[layer : layer + 1]]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer: {layer} outside [0, {self.num_layers})")

    def _raise_if_failed(self, layer: int) -> None:
        if self._status is not None and self._status.failed_at(layer):
            raise TransferFailedError(self.transfer_id, self._status.error or "")


class _InFlight:
    """One launched transfer: a device-to-host copy reads its device blocks and
    writes its host blocks; a host-to-device load does the opposite. `events[L]`
    completes once layer L is copied (the last one once all are)."""

    __slots__ = (
        "device_ids",
        "events",
        "host_ids",
        "reused",
        "status",
        "to_host",
        "transfer_id",
    )

    def __init__(
        self,
        transfer_id: int,
        to_host: bool,
        device_ids: Sequence[int],
        host_ids: Sequence[int],
        reused: Sequence[int] = (),
    ) -> None:
        self.transfer_id = transfer_id
        self.status = _Status()
        self.events: list[Event] = [DONE]
        self.to_host = to_host
        self.device_ids = device_ids
        self.host_ids = host_ids
        self.reused = reused

    @property
    def done(self) -> Event:
        return self.events[-1]

    def finished(self, timeout: float | None = None) -> bool:
        """Has the transfer completed (None: query; else wait up to `timeout`)? A
        CUDA error while checking fails it and counts as finished."""
        try:
            if timeout is None:
                return self.done.query()
            return self.done.synchronize(timeout)
        except Exception as e:
            self.status.fail(e)
            return True

    def accesses(self) -> tuple[Sequence[int], Sequence[int], Sequence[int], Sequence[int]]:
        """(device reads, device writes, host reads, host writes)."""
        if self.to_host:
            return self.device_ids, (), (), self.host_ids
        return (), self.device_ids, self.host_ids, ()


class TransferManager:
    """Launches copies on the input and output streams and reports their results.

    Args:
        input_stream: host-to-device loads.
        output_stream: device-to-host copies.
        compute: the stream the model runs on by default; copies wait for its work
            so far. A submission may name the step's own compute stream instead.
        num_layers: layers per transfer (model layers plus extra layers).
    """

    def __init__(
        self, input_stream: Stream, output_stream: Stream, compute: Stream, num_layers: int
    ) -> None:
        self.input_stream = input_stream
        self.output_stream = output_stream
        self.compute = compute
        self.num_layers = num_layers
        self.device_hazards = BlockHazards()
        self.host_hazards = BlockHazards()
        self._inflight: dict[int, _InFlight] = {}
        # In-flight evictions whose device blocks have a new owner already.
        self._handed_over: dict[int, _InFlight] = {}
        self.ordering_waits = 0
        self.handover_waits = 0

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def is_inflight(self, transfer_id: int) -> bool:
        return transfer_id in self._inflight

    def handed_over_blocks(self) -> frozenset[int]:
        """Device blocks an in-flight eviction still reads that already belong to a
        new owner (the model's writes into them are ordered by `order_compute`)."""
        return frozenset(b for t in self._handed_over.values() for b in t.reused)

    def submit_to_host(
        self,
        transfer_id: int,
        device_ids: Sequence[int],
        host_ids: Sequence[int],
        copy_layer: CopyLayer,
        compute: Stream | None = None,
        copy_layers: CopyLayers | None = None,
        reused_block_ids: Sequence[int] = (),
        copy_all: Launch | None = None,
    ) -> Event:
        """Launch a device-to-host copy, layer by layer; returns its completion event.

        It waits (on the device) for the model's work so far on `compute` (this
        step's compute stream; default: the manager's), which may have written
        these blocks, and, per layer, for in-flight copies touching the same blocks.

        Args:
            copy_layer: `copy_layer(layer, stream_handle)` copies one layer.
            compute: this step's compute stream.
            copy_layers: `copy_layers(stream_handle, events)` enqueues every layer
                in one native call (CUDA), used when nothing orders it per layer.
            reused_block_ids: device blocks among `device_ids` that already belong
                to a new owner: every `order_compute` while the copy runs makes the
                compute stream wait for it.
            copy_all: `copy_all(stream_handle)` copies every layer at once (one
                kernel launch on a GPU). Used when no block is handed over: then
                nothing writes these blocks before the copy is retired, so no one
                needs its layers one by one; every layer's event is its end.
        """
        self._check_new(transfer_id)
        compute = compute or self.compute
        stream = self.output_stream
        stream.wait_event(compute.record())
        transfer = _InFlight(transfer_id, True, device_ids, host_ids, tuple(reused_block_ids))
        if copy_all is not None and not transfer.reused:
            self._launch_whole(stream, transfer, copy_all)
        else:
            self._launch(stream, transfer, copy_layer, copy_layers)
        self._track(transfer)
        if transfer.reused:
            self._handed_over[transfer_id] = transfer
        return transfer.done

    def submit_to_device(
        self,
        transfer_id: int,
        host_ids: Sequence[int],
        device_ids: Sequence[int],
        copy_layer: CopyLayer,
        write_block_ids: Iterable[int] = (),
        compute: Stream | None = None,
        copy_layers: CopyLayers | None = None,
    ) -> LayerDoneCounter:
        """Launch a host-to-device load with one event per layer.

        After the first failed layer the remaining layers are skipped (their events
        still complete, so nothing waits forever).

        Args:
            copy_layer: `copy_layer(layer, stream_handle)` copies one layer.
            write_block_ids: device blocks the model writes this step; the
                counter's wait for layer L also waits for layer L of in-flight
                copies still reading them.
            compute: this step's compute stream (default: the manager's).
            copy_layers: `copy_layers(stream_handle, events)` enqueues every layer
                in one native call, recording events[layer] after each; a CUDA input
                stream uses it when nothing orders the load per layer.
        """
        self._check_new(transfer_id)
        compute = compute or self.compute
        stream = self.input_stream
        stream.wait_event(compute.record())
        transfer = _InFlight(transfer_id, False, device_ids, host_ids)
        guards = self._write_guards(write_block_ids)  # before our own load
        self._launch(stream, transfer, copy_layer, copy_layers)
        self._track(transfer)
        return LayerDoneCounter(
            transfer_id, transfer.events, transfer.status, compute, guards, self.num_layers
        )

    def guard_writes(
        self, write_block_ids: Iterable[int], compute: Stream | None = None
    ) -> LayerDoneCounter:
        """A counter for a step without swap-in: waits only for in-flight copies
        still reading blocks the model is about to write."""
        guards = self._write_guards(write_block_ids)
        return LayerDoneCounter(-1, (), None, compute or self.compute, guards, self.num_layers)

    def order_compute(self, compute: Stream | None = None) -> int:
        """Make `compute` wait (device-side on a GPU; on the CPU stand-in the caller
        blocks, bounded) until no in-flight eviction still reads a block that has a
        new owner. Returns how many evictions it was ordered after.

        Call it once per step, after the step's copies are launched and before the
        model runs: a load launched afterwards would wait (through the compute
        stream's work so far) for the whole eviction, not per layer.
        """
        compute = compute or self.compute
        waits = [t for t in self._handed_over.values() if not t.finished()]
        for t in waits:
            compute.wait_event(t.done)
        self.handover_waits += len(waits)
        return len(waits)

    def poll(self) -> list[TransferResult]:
        """Results of the transfers that finished since the last call (non-blocking).

        A transfer whose completion check raises (a CUDA error, e.g. a sticky fault)
        is reported failed with that error; the others are reported as usual.
        """
        finished = [tid for tid, t in list(self._inflight.items()) if t.finished()]
        return [self._retire(tid) for tid in finished]

    def wait_all(self, timeout: float = DEFAULT_TIMEOUT) -> list[TransferResult]:
        """Wait until every in-flight transfer has finished; return their results.

        Raises:
            TransferTimeoutError: something is still running after `timeout` seconds
                in all. Nothing is retired then: `poll` reports every result later.
        """
        deadline = time.monotonic() + timeout
        for tid, t in self._inflight.items():
            if not t.finished(max(0.0, deadline - time.monotonic())):
                raise TransferTimeoutError(
                    f"transfer {tid} not finished after {timeout} s "
                    f"({len(self._inflight)} in flight; poll for their results later)"
                )
        return [self._retire(tid) for tid in list(self._inflight)]

    def describe_inflight(self) -> str:
        """The transfers still in flight, for an error message."""
        parts = [
            f"{tid} ({'D2H' if t.to_host else 'H2D'}, {len(t.device_ids)} blocks)"
            for tid, t in list(self._inflight.items())[:8]
        ]
        more = len(self._inflight) - len(parts)
        return ", ".join(parts) + (f" and {more} more" if more > 0 else "") or "none"

    def _write_guards(self, write_block_ids: Iterable[int]) -> list[list[Event]]:
        return [t.events for t in self.device_hazards.conflicts((), write_block_ids)]

    def _launch(
        self,
        stream: Stream,
        transfer: _InFlight,
        copy_layer: CopyLayer,
        copy_layers: CopyLayers | None,
    ) -> None:
        """Enqueue the transfer's layers on `stream`, layer L after the layer-L
        event of every in-flight copy it conflicts with (per layer: a load into a
        block an eviction still reads starts its layer 0 once the eviction's layer
        0 is copied, not once the whole eviction is). With `copy_layers` a CUDA
        stream does all of it in one native call."""
        device_reads, device_writes, host_reads, host_writes = transfer.accesses()
        waits = self.device_hazards.conflicts(device_reads, device_writes)
        waits += self.host_hazards.conflicts(host_reads, host_writes)
        self.ordering_waits += len(waits)
        status = transfer.status

        def run(layer: int, handle: int) -> None:
            if status.error is None:
                copy_layer(layer, handle)

        # On a GPU with `copy_layers`, one native call whatever the waits: each
        # layer's waits are enqueued inside it, before that layer.
        transfer.events = stream.launch_layers(
            self.num_layers, run, status.fail, copy_layers, [o.events for o in waits]
        )

    def _launch_whole(self, stream: Stream, transfer: _InFlight, copy_all: Launch) -> None:
        """Enqueue every layer of the transfer at once, after every in-flight copy
        it conflicts with; its one completion event stands for every layer."""
        device_reads, device_writes, host_reads, host_writes = transfer.accesses()
        waits = self.device_hazards.conflicts(device_reads, device_writes)
        waits += self.host_hazards.conflicts(host_reads, host_writes)
        self.ordering_waits += len(waits)
        for other in waits:
            stream.wait_event(other.done)
        stream.launch(copy_all, transfer.status.fail)
        transfer.events = [stream.record()] * self.num_layers

    def _track(self, transfer: _InFlight) -> None:
        device_reads, device_writes, host_reads, host_writes = transfer.accesses()
        self.device_hazards.add(device_reads, device_writes, transfer)
        self.host_hazards.add(host_reads, host_writes, transfer)
        self._inflight[transfer.transfer_id] = transfer

    def _retire(self, transfer_id: int) -> TransferResult:
        t = self._inflight.pop(transfer_id)
        self._handed_over.pop(transfer_id, None)
        device_reads, device_writes, host_reads, host_writes = t.accesses()
        self.device_hazards.remove(device_reads, device_writes, t)
        self.host_hazards.remove(host_reads, host_writes, t)
        error = t.status.error
        return TransferResult(transfer_id, error is None, error or "")

    def _check_new(self, transfer_id: int) -> None:
        if self.is_inflight(transfer_id):
            raise ValueError(f"transfer_id: {transfer_id} is already in flight")


__all__ = [
    "DEFAULT_TIMEOUT",
    "BlockHazards",
    "LayerDoneCounter",
    "TransferFailedError",
    "TransferManager",
    "TransferTimeoutError",
]
