"""The engine's worker process: a CacheController and the model, driven one step at
a time by the scheduler process over a pipe.

Per step it submits the step's swaps (evictions fire-and-forget, the swap-in layer
by layer) and runs the model; before layer L touches the cache it waits for layer
L of the swap-in and checks the layer-L bytes of every cached block the step reads
against the checksum recorded when that block was written. A failed swap-in is
handled inside the step: the requests whose blocks it should have filled
recompute those positions into the same blocks, so the step's outputs are still
right, and its TransferResult tells the scheduler to roll the blocks back.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from examples.engine.config import EngineConfig
from examples.engine.protocol import (
    RequestOutput,
    RequestWork,
    StepBatch,
    StepOutput,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)

log = logging.getLogger(__name__)


def serve(conn: Connection, config: EngineConfig) -> None:
    """Process entry point: build the worker, then answer StepBatches until None.
    Any error goes back to the scheduler as a WorkerFailed message."""
    worker = None
    try:
        worker = Worker(config)
        conn.send(WorkerReady(worker.device, sum(worker.ctrl.block_bytes)))
        while (batch := conn.recv()) is not None:
            conn.send(worker.step(batch))
        conn.send(worker.finish())
    except Exception:
        conn.send(WorkerFailed(traceback.format_exc()))
    finally:
        if worker is not None:
            worker.close()


@dataclass(frozen=True, slots=True)
class _Read:
    """A cached block a step reads: verified layer by layer before use."""

    request_id: str
    position: int
    block: int
    block_hash: bytes


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        import paddle

        from examples.engine.model import TinyTransformer
        from fastkv.worker import CacheController, KVCacheSpec

        self.config = config
        self.device = _pick_device(config.device, paddle)
        if self.device == "cpu" and config.kv_dtype == "float16":
            raise ValueError(
                "kv_dtype: float16 needs a GPU (Paddle's CPU build has no float16 "
                "gather); use bfloat16 or float32 on the CPU"
            )
        m = config.model
        spec = KVCacheSpec(
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            block_size=config.block_size,
            num_device_blocks=config.num_device_blocks,
            num_host_blocks=config.num_host_blocks,
            dtype=config.kv_dtype,
        )
        self.ctrl = CacheController(spec, device=self.device, fail_rate=config.fail_rate)
        self.model = TinyTransformer(m, device=self.device)
        self.kv = [
            (self.ctrl.key_caches[i], self.ctrl.value_caches[i]) for i in range(m.num_layers)
        ]
        self.checksums: dict[bytes, list[int]] = {}  # block hash -> CRC-32 per layer
        self.verified = 0
        self.problems: list[str] = []

    def step(self, batch: StepBatch) -> StepOutput:
        from fastkv.worker.transfer_manager import TransferFailedError

        start = time.perf_counter()
        self.problems = []
        works = batch.requests
        counter = self.ctrl.submit_swap_tasks(
            batch.evict, batch.swap_in, self._blocks_written(works, {})
        )
        reads = [
            _Read(w.request_id, pos, w.block_table[pos], h)
            for w in works
            for pos, h in w.verify
        ]
        recomputed: dict[str, int] = {}
        logits = None
        if works:
            try:
                logits = self._forward(works, {}, counter, reads)
                counter.wait_all(self.config.wait_timeout)  # a failure after the last wait
            except TransferFailedError as e:
                log.info("step %d: %s; recomputing what it should have loaded", batch.step, e)
                _drain(counter, self.config.wait_timeout)
                recomputed = self._lost_positions(works, batch)
                guard = self.ctrl.submit_swap_tasks(
                    None, None, self._blocks_written(works, recomputed)
                )
                kept = [
                    r
                    for r in reads
                    if r.position * self.config.block_size
                    < recomputed.get(r.request_id, 1 << 62)
                ]
                logits = self._forward(works, recomputed, guard, kept)
                self._verify_recomputed(
                    [r for r in reads if r not in kept]
                )  # recomputation must reproduce the stored bytes
        elif batch.swap_in is not None:
            _drain(counter, self.config.wait_timeout)
        self._record(works)
        results = self.ctrl.poll_results()
        if not works and not results and self.ctrl.get_stats().inflight_transfers:
            results = self.ctrl.wait_all(self.config.wait_timeout)  # idle: let copies land
        outputs = {}
        for i, w in enumerate(works):
            row = logits[i]  # type: ignore[index]
            outputs[w.request_id] = RequestOutput(
                int(np.argmax(row)),
                row.astype(np.float32).tobytes(),
                recomputed.get(w.request_id, -1),
            )
        return StepOutput(
            batch.step, outputs, results, self.problems, time.perf_counter() - start
        )

    def finish(self) -> WorkerStats:
        self.ctrl.wait_all(self.config.wait_timeout)
        s = self.ctrl.get_stats()
        return WorkerStats(
            device_to_host_blocks=s.device_to_host_blocks,
            host_to_device_blocks=s.host_to_device_blocks,
            device_to_host_bytes=s.device_to_host_bytes,
            host_to_device_bytes=s.host_to_device_bytes,
            failed_transfers=s.failed_transfers,
            checksums_verified=self.verified,
        )

    def close(self) -> None:
        self.ctrl.free_cache(self.config.wait_timeout)

    # -- the forward pass -------------------------------------------------------

    def _forward(
        self,
        works: list[RequestWork],
        recompute_from: dict[str, int],
        counter: object,
        reads: list[_Read],
    ) -> np.ndarray:
        """Run the model over the step's rows; `recompute_from` moves a request's
        first computed position back (its failed swap-in's positions)."""
        from examples.engine.model import SeqRows
        from fastkv.worker.transfer_manager import TransferFailedError

        seqs = []
        for w in works:
            begin = recompute_from.get(w.request_id, w.start)
            tokens = (
                w.tokens if begin == w.start else w.all_tokens[begin : w.start + len(w.tokens)]
            )
            seqs.append(SeqRows(tokens, begin, w.block_table))
        on_gpu = self.device != "cpu"
        timeout = self.config.wait_timeout

        def before_layer(layer: int) -> None:
            if on_gpu:  # the model's stream waits on the device; the host goes on
                counter.stream_wait_for_layer(layer)  # type: ignore[attr-defined]
            else:
                counter.wait_for_layer(layer, timeout)  # type: ignore[attr-defined]
            if counter.failed:  # type: ignore[attr-defined]
                raise TransferFailedError(counter.transfer_id, "a layer failed to load")  # type: ignore[attr-defined]
            self._verify_layer(reads, layer)

        return self.model.forward(seqs, self.kv, self.config.block_size, before_layer)

    def _blocks_written(
        self, works: list[RequestWork], recompute_from: dict[str, int]
    ) -> list[int]:
        bs = self.config.block_size
        out = []
        for w in works:
            begin = recompute_from.get(w.request_id, w.start)
            out += [
                w.block_table[b]
                for b in range(begin // bs, (w.start + len(w.tokens) - 1) // bs + 1)
            ]
        return out

    def _lost_positions(self, works: list[RequestWork], batch: StepBatch) -> dict[str, int]:
        """First token position of each request that the failed swap-in should have
        filled (its destination blocks)."""
        lost = set(batch.swap_in.dst_block_ids) if batch.swap_in is not None else set()
        bs = self.config.block_size
        out = {}
        for w in works:
            positions = [p for p in range(w.start // bs) if w.block_table[p] in lost]
            if positions:
                out[w.request_id] = positions[0] * bs
        return out

    # -- checksums --------------------------------------------------------------

    def _layer_sums(self, blocks: list[int], layer: int) -> dict[int, int]:
        """CRC-32 of layer `layer`'s K and V bytes of each block."""
        sums = dict.fromkeys(blocks, 0)
        if not blocks:
            return sums
        per_layer = self.ctrl.spec.tensors_per_layer
        for i in range(layer * per_layer, (layer + 1) * per_layer):
            rows = self._tensor_blocks(i, blocks)
            for b, row in zip(blocks, rows, strict=True):
                sums[b] = zlib.crc32(row, sums[b])
        return sums

    def _tensor_blocks(self, tensor_index: int, blocks: list[int]) -> np.ndarray:
        if self.device == "cpu":
            return self.ctrl.device_blocks(tensor_index)[blocks]
        import paddle

        tensor = self.ctrl.caches[tensor_index]
        picked = paddle.index_select(tensor, paddle.to_tensor(blocks, dtype="int64"), axis=0)
        return picked.numpy().view(np.uint8).reshape(len(blocks), -1)

    def _verify_layer(self, reads: list[_Read], layer: int) -> None:
        sums = self._layer_sums(sorted({r.block for r in reads}), layer)
        for r in reads:
            stored = self.checksums.get(r.block_hash)
            self.verified += layer == 0
            if stored is None or stored[layer] != sums[r.block]:
                self.problems.append(
                    f"{r.request_id} block {r.position} layer {layer}: the bytes read "
                    "differ from the bytes stored"
                )

    def _verify_recomputed(self, reads: list[_Read]) -> None:
        for layer in range(self.ctrl.spec.num_layers):
            self._verify_layer(reads, layer)

    def _record(self, works: list[RequestWork]) -> None:
        """Checksums of the blocks this step completed, per layer."""
        done = [
            (w.request_id, pos, w.block_table[pos], h) for w in works for pos, h in w.record
        ]
        if not done:
            return
        blocks = sorted({b for _, _, b, _ in done})
        per_layer = [
            self._layer_sums(blocks, layer) for layer in range(self.ctrl.spec.num_layers)
        ]
        for request_id, pos, block, h in done:
            sums = [layer_sums[block] for layer_sums in per_layer]
            if self.checksums.setdefault(h, sums) != sums:  # written twice, differently
                self.problems.append(
                    f"{request_id} block {pos}: recomputed bytes differ from the cached ones"
                )


def _drain(counter: object, timeout: float) -> None:
    """Wait until every layer of a (possibly failed) swap-in has settled."""
    from fastkv.worker.transfer_manager import TransferFailedError

    for layer in range(counter.num_layers):  # type: ignore[attr-defined]
        with contextlib.suppress(TransferFailedError):
            counter.wait_for_layer(layer, timeout)  # type: ignore[attr-defined]


def _pick_device(device: str, paddle: object) -> str:
    if device != "auto":
        return device
    cuda = paddle.is_compiled_with_cuda()  # type: ignore[attr-defined]
    has_gpu = cuda and paddle.device.cuda.device_count() > 0  # type: ignore[attr-defined]
    return "gpu:0" if has_gpu else "cpu"
