"""The engine's worker process: a CacheController and the model, driven one step at
a time by the scheduler process over a pipe.

Per step it submits the step's swaps (evictions fire-and-forget, the swap-in layer
by layer) and runs the model; before layer L touches the cache it waits for layer
L of the swap-in and checks the layer-L bytes of every cached block the step reads
against the checksum recorded when that block was written. A failed swap-in is
handled inside the step: the requests whose blocks it should have filled
recompute those positions into the same blocks, so the step's outputs are still
right, and its TransferResult tells the scheduler to roll the blocks back.

Tensor parallelism: one such process per rank, each with its own CacheController
over its share of the KV heads, all running the same StepBatch. Per layer the
ranks run two collectives over their RankGroup, in the model's compute path and
never in a copy path: before attention they agree whether every rank's layer
loaded (a failure on any rank makes every rank recompute, so all take the same
path and run the same collectives), and after it they all-gather their heads'
attention outputs. A last agreement after the step's final wait catches a load
that failed after its layer's wait (on a GPU that wait is on the device).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection

import numpy as np

from examples.engine.config import EngineConfig
from examples.engine.protocol import (
    RequestOutput,
    RequestWork,
    StepBatch,
    StepOutput,
    TransferTiming,
    WorkerDone,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)
from examples.engine.rank_group import RankGroup
from fastkv.config import CacheConfig, ModelKVShape
from fastkv.metadata import CacheLevel
from fastkv.worker.stats import ControllerStats

log = logging.getLogger(__name__)


def serve(
    conn: Connection,
    config: EngineConfig,
    rank: int = 0,
    peers: Mapping[int, socket.socket] | None = None,
) -> None:
    """Process entry point of rank `rank`: build the worker, then answer StepBatches
    until None. Any error goes back to the scheduler as a WorkerFailed message, and
    the rank's peer sockets close, so the other ranks' next exchange raises at once.

    Args:
        conn: the pipe to the scheduler.
        config: the engine's settings (the same on every rank).
        rank: this rank, in [0, config.tp_size).
        peers: this rank's sockets to the other ranks (RankGroup.mesh).
    """
    peers = dict(peers or {})
    worker = None
    try:
        group = RankGroup(rank, config.tp_size, peers, config.wait_timeout)
        worker = Worker(config, rank, group)
        conn.send(
            WorkerReady(rank, worker.device, sum(worker.ctrl.block_bytes), worker.stats())
        )
        while (batch := conn.recv()) is not None:
            conn.send(worker.step(batch))
        conn.send(worker.finish())
    except Exception:
        for sock in peers.values():  # first, so the peers stop waiting on this rank
            sock.close()
        with contextlib.suppress(OSError):  # the scheduler may be gone too
            conn.send(WorkerFailed(traceback.format_exc()))
    finally:
        for sock in peers.values():
            sock.close()
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
    """Rank `rank`'s worker: a CacheController over its share of the KV heads and its
    shard of the model.

    Args:
        config: the engine's settings.
        rank: this rank, in [0, config.tp_size).
        group: the ranks' collective; None for a single rank.
    """

    def __init__(
        self, config: EngineConfig, rank: int = 0, group: RankGroup | None = None
    ) -> None:
        with warnings.catch_warnings():
            # Importing paddle looks for ccache, which matters only when compiling
            # extensions; this process compiles nothing. This is its first paddle import.
            warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
            import paddle

        from examples.engine.model import TinyTransformer
        from fastkv.storage import StorageNamespace
        from fastkv.worker import CacheController, KVCacheSpec

        self.config = config
        self.device = _pick_device(config.device, paddle, rank)
        if self.device == "cpu" and config.kv_dtype == "float16":
            raise ValueError(
                "kv_dtype: float16 needs a GPU (Paddle's CPU build has no float16 "
                "gather); use bfloat16 or float32 on the CPU"
            )
        if group is None:
            group = RankGroup(0, 1, {}, config.wait_timeout)
        if (group.rank, group.size) != (rank, config.tp_size):
            raise ValueError(
                f"group: is rank {group.rank} of {group.size}, expected rank {rank} of "
                f"tp_size {config.tp_size}"
            )
        self.rank = rank
        self.group = group
        m = config.model
        cache = _cache_identity(config, rank)
        model_kv = ModelKVShape(m.num_layers, m.num_kv_heads // config.tp_size, m.head_dim)
        spec = KVCacheSpec.from_config(cache, model_kv)
        self.storage = _storage_backend(config, spec, rank)
        try:
            self.ctrl = CacheController(
                spec,
                device=self.device,
                fail_rate=config.rank_fail_rate(rank),
                storage=self.storage,
                storage_namespace=StorageNamespace.of(cache, model_kv).digest(),
                tp_rank=rank,
            )
        except BaseException:
            if self.storage is not None:
                self.storage.close()
            raise
        self.timings: list[TransferTiming] = []  # since the last StepOutput
        self.ctrl.add_transfer_listener(self._on_result)
        self.model = TinyTransformer(m, self.device, tp_rank=rank, tp_size=config.tp_size)
        self.kv = [
            (self.ctrl.key_caches[i], self.ctrl.value_caches[i]) for i in range(m.num_layers)
        ]
        # called once layer L of a step is in the cache (examples/engine/pd.py)
        self.after_layer: Callable[[int], None] | None = None
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
        self.ctrl.submit_storage_tasks(batch.storage_load, batch.storage_store, batch.lookups)
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
                loaded = True
                try:
                    counter.wait_all(self.config.wait_timeout)  # a failure after the last wait
                except TransferFailedError:
                    loaded = False
                if not self.group.agree(loaded):
                    raise TransferFailedError(
                        counter.transfer_id,
                        "the swap-in failed after its last layer's wait"
                        + ("" if not loaded else " on another rank"),
                    )
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
        if not works and not results:  # idle: let copies and storage requests land
            results = self.ctrl.wait_all(self.config.wait_timeout)
        outputs = {}
        for i, w in enumerate(works):
            row = logits[i]  # type: ignore[index]
            outputs[w.request_id] = RequestOutput(
                int(np.argmax(row)),
                row.astype(np.float32).tobytes(),
                recomputed.get(w.request_id, -1),
            )
        return StepOutput(
            batch.step,
            outputs,
            results,
            [f"rank {self.rank}: {p}" for p in self.problems],
            time.perf_counter() - start,
            self.stats(),
            self._take_timings(),
        )

    def finish(self) -> WorkerDone:
        self.ctrl.wait_all(self.config.wait_timeout)
        return WorkerDone(self.stats(), self._take_timings())

    def stats(self) -> WorkerStats:
        s = self.ctrl.get_stats()
        copied = {f.name: getattr(s, f.name) for f in fields(ControllerStats)}
        return WorkerStats(**copied, checksums_verified=self.verified)

    def _on_result(
        self, src: CacheLevel, dst: CacheLevel, blocks: int, seconds: float, success: bool
    ) -> None:
        self.timings.append(TransferTiming(src, dst, blocks, seconds, success))

    def _take_timings(self) -> list[TransferTiming]:
        timings, self.timings = self.timings, []
        return timings

    def close(self) -> None:
        self.ctrl.free_cache(self.config.wait_timeout)
        if self.storage is not None:
            self.storage.close()

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
            loaded = True
            try:
                if on_gpu:  # the model's stream waits on the device; the host goes on
                    counter.stream_wait_for_layer(layer)  # type: ignore[attr-defined]
                else:
                    counter.wait_for_layer(layer, timeout)  # type: ignore[attr-defined]
            except TransferFailedError:
                loaded = False
            loaded = loaded and not counter.failed  # type: ignore[attr-defined]
            # Every rank decides together, before anyone reads the layer: a rank that
            # recomputed alone would skip the all-gathers the others wait in.
            if not self.group.agree(loaded):
                raise TransferFailedError(
                    counter.transfer_id,  # type: ignore[attr-defined]
                    f"layer {layer} failed to load"
                    + ("" if not loaded else " on another rank"),
                )
            self._verify_layer(reads, layer)

        gather = self._gather_heads if self.config.tp_size > 1 else None
        return self.model.forward(
            seqs, self.kv, self.config.block_size, before_layer, gather, self.after_layer
        )

    def _gather_heads(self, local: object) -> object:
        """All-gather the ranks' attention outputs `[rows, their heads * head_dim]`
        into `[rows, num_heads * head_dim]`, in rank (= head) order."""
        import paddle

        mine = np.ascontiguousarray(local.numpy())  # type: ignore[attr-defined]
        parts = [
            np.frombuffer(p, dtype=mine.dtype).reshape(mine.shape)
            for p in self.group.all_gather(memoryview(mine).cast("B"))
        ]
        return paddle.to_tensor(np.concatenate(parts, axis=1), place=self.device)

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


def _pick_device(device: str, paddle: object, rank: int = 0) -> str:
    """An explicit device is every rank's; "auto" gives rank r GPU r (modulo the
    GPUs there are), or the CPU when Paddle has none."""
    if device != "auto":
        return device
    cuda = paddle.is_compiled_with_cuda()  # type: ignore[attr-defined]
    count = paddle.device.cuda.device_count() if cuda else 0  # type: ignore[attr-defined]
    return f"gpu:{rank % count}" if count else "cpu"


def _storage_backend(config: EngineConfig, spec: object, rank: int) -> object | None:
    """This rank's local-disk storage tier (its own directory: one process each)."""
    if not config.has_storage:
        return None
    from pathlib import Path

    from fastkv.storage import BlockLayout
    from fastkv.storage.local_disk import LocalDiskBackend

    layout = BlockLayout(tuple(spec.block_bytes()))  # type: ignore[attr-defined]
    directory = Path(config.storage_dir) / f"rank{rank}"  # type: ignore[arg-type]
    return LocalDiskBackend(directory, layout, capacity_blocks=config.storage_blocks)


def _cache_identity(config: EngineConfig, rank: int) -> CacheConfig:
    """The cache as this rank's worker names it: the engine's pools and dtype, and
    a namespace of the weights (their seed: other weights, other bytes), so that a
    storage directory kept across runs never serves another model's blocks. Its
    storage namespace is the one this demo has always keyed its blocks under."""
    return CacheConfig(
        block_size=config.block_size,
        num_device_blocks=config.num_device_blocks,
        num_host_blocks=config.num_host_blocks,
        kv_dtype=config.kv_dtype,
        model_id="tiny-transformer",
        tp_rank=rank,
        tp_size=config.tp_size,
        namespace=f"fastkv-engine-demo/seed{config.model.seed}",
    )
