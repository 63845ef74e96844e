"""The engine's worker process: a CacheController and the model, driven one step at
a time by the scheduler process over a pipe.

Per step it submits the step's swaps (evictions fire-and-forget, the swap-in layer
by layer), runs the model with layer L's attention waiting for layer L, verifies
the bytes of every cached block the step reads against the checksum recorded when
the block was written, and reports the finished transfers. A failed swap-in is
handled inside the step: the affected requests recompute the positions it should
have loaded, into the same blocks, so the step's outputs are still right.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from fastkv.engine.config import EngineConfig
from fastkv.engine.protocol import (
    RequestOutput,
    RequestWork,
    StepBatch,
    StepOutput,
    WorkerReady,
    WorkerStats,
)

log = logging.getLogger(__name__)


def serve(conn: Connection, config: EngineConfig) -> None:
    """Process entry point: build the worker, then answer StepBatches until None."""
    worker = Worker(config)
    conn.send(WorkerReady(worker.device, sum(worker.ctrl.block_bytes)))
    try:
        while (batch := conn.recv()) is not None:
            conn.send(worker.step(batch))
        conn.send(worker.finish())
    finally:
        worker.close()


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        import paddle

        from fastkv.engine.model import TinyTransformer
        from fastkv.ops import paddle_ops
        from fastkv.worker import CacheController, KVCacheSpec

        self.config = config
        self.device = _pick_device(config.device, paddle)
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
        if config.fail_rate > 0:
            _inject_copy_failures(paddle_ops, config.fail_rate)
        self.ctrl = CacheController(spec, device=self.device)
        self.model = TinyTransformer(m, device=self.device)
        self.kv = [
            (self.ctrl.key_caches[i], self.ctrl.value_caches[i]) for i in range(m.num_layers)
        ]
        self.checksums: dict[bytes, int] = {}
        self.verified = 0
        self.mismatched = 0

    def step(self, batch: StepBatch) -> StepOutput:
        from fastkv.engine.model import SeqRows
        from fastkv.worker.transfer_manager import TransferFailedError

        start = time.perf_counter()
        bs = self.config.block_size
        timeout = self.config.wait_timeout
        works = batch.requests
        writes = [
            w.block_table[b]
            for w in works
            for b in range(w.start // bs, (w.start + len(w.tokens) - 1) // bs + 1)
        ]
        counter = self.ctrl.submit_swap_tasks(batch.evict, batch.swap_in, writes)
        recomputed: dict[str, int] = {}
        logits = None
        if works:
            seqs = [SeqRows(w.tokens, w.start, w.block_table) for w in works]
            try:
                logits = self.model.forward(
                    seqs, self.kv, bs, lambda layer: counter.wait_for_layer(layer, timeout)
                )
            except TransferFailedError as e:
                log.info(
                    "step %d: %s; recomputing the blocks it should have loaded", batch.step, e
                )
                _drain(counter, timeout)
                for i, w in enumerate(works):
                    if w.swapped_from >= 0:
                        begin = w.swapped_from * bs
                        recomputed[w.request_id] = begin
                        tokens = w.all_tokens[begin : w.start + len(w.tokens)]
                        seqs[i] = SeqRows(tokens, begin, w.block_table)
                logits = self.model.forward(seqs, self.kv, bs)
        elif batch.swap_in is not None:
            _drain(counter, timeout)
        mismatches = self._check(works)
        results = self.ctrl.poll_results()
        if not works and not results and self.ctrl.get_stats().inflight_transfers:
            results = self.ctrl.wait_all(timeout)  # an idle step: let evictions land
        outputs = {}
        for i, w in enumerate(works):
            row = logits[i]  # type: ignore[index]
            outputs[w.request_id] = RequestOutput(
                int(np.argmax(row)),
                row.astype(np.float32).tobytes(),
                recomputed.get(w.request_id, -1),
            )
        return StepOutput(batch.step, outputs, results, mismatches, time.perf_counter() - start)

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
            checksum_mismatches=self.mismatched,
        )

    def close(self) -> None:
        self.ctrl.free_cache(self.config.wait_timeout)

    def _check(self, works: list[RequestWork]) -> list[str]:
        """Verify the blocks read from the cache; record the blocks completed."""
        wanted = {w.block_table[p] for w in works for p, _ in (*w.verify, *w.record)}
        sums = self._block_checksums(sorted(wanted))
        problems = []
        for w in works:
            for pos, h in w.verify:
                expected = self.checksums.get(h)
                self.verified += 1
                if expected != sums[w.block_table[pos]]:
                    problems.append(
                        f"{w.request_id} block {pos}: read bytes differ from stored"
                    )
            for pos, h in w.record:
                got = sums[w.block_table[pos]]
                if self.checksums.setdefault(h, got) != got:
                    problems.append(f"{w.request_id} block {pos}: recomputed bytes differ")
        self.mismatched += len(problems)
        return problems

    def _block_checksums(self, blocks: list[int]) -> dict[int, int]:
        """CRC-32 of each block's bytes across every layer's K and V."""
        if not blocks:
            return {}
        sums = dict.fromkeys(blocks, 0)
        for i in range(len(self.ctrl.caches)):
            view = self.ctrl.device_blocks(i)
            for b in blocks:
                sums[b] = zlib.crc32(view[b], sums[b])
        return sums


def _drain(counter: object, timeout: float) -> None:
    """Wait until every layer of a (possibly failed) swap-in has settled."""
    from fastkv.worker.transfer_manager import TransferFailedError

    for layer in range(counter.num_layers):  # type: ignore[attr-defined]
        with contextlib.suppress(TransferFailedError):
            counter.wait_for_layer(layer, timeout)  # type: ignore[attr-defined]


def _pick_device(device: str, paddle: object) -> str:
    if device != "auto":
        return device
    has_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0  # type: ignore[attr-defined]
    return "gpu:0" if has_gpu else "cpu"


def _inject_copy_failures(paddle_ops: object, rate: float) -> None:
    """Fault injection: a `rate` fraction of copy calls fail (spread evenly: call n
    fails when floor(n * rate) steps up), before touching memory, as a failed DMA
    would be reported."""
    lock = threading.Lock()
    calls = [0]

    def flaky(op: Callable[..., None]) -> Callable[..., None]:
        def call(*args: object, **kwargs: object) -> None:
            with lock:
                calls[0] += 1
                n = calls[0]
            if int(n * rate) > int((n - 1) * rate):
                raise RuntimeError("fastkv[ECUDA] injected copy failure")
            op(*args, **kwargs)

        return call

    for name in ("swap_layer", "swap_all_layers"):
        setattr(paddle_ops, name, flaky(getattr(paddle_ops, name)))
