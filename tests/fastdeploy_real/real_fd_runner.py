"""A stand-in for FastDeploy's GPU model runner, one per tensor-parallel rank.

Only what needs a GPU is stood in for: `fastdeploy.worker.gpu_model_runner` does not
import on CPU (its CUDA ops). Its cache calls are made exactly as it makes them
(snapshot `fastdeploy/worker/gpu_model_runner.py`):

- `__init__`: `CacheController(fd_config, local_rank, device_id)`, looked up in
  `fastdeploy.cache_manager.v1` (where `install()` puts fastkv's);
- `initialize_kv_cache`: `initialize_kv_cache(attn_backend=..., num_gpu_blocks=...)`
  with a real `AppendAttentionBackend` built as `_init_attn_backend` builds it, then
  `get_kv_caches()`; with MTP, `initialize_mtp_kv_cache(...)` and `get_kv_caches()`;
- `insert_tasks_v1`: `submit_swap_tasks(batch.cache_evict_metadata,
  batch.cache_swap_metadata)` before the batch's slots are set;
- each forward: `forward_meta.layer_done_counter = swap_layer_done_counter`, and
  every attention layer `layer_done_counter.wait_for_layer(layer_id)` before it
  reads or writes the cache;
- `clear_cache`: `free_gpu_cache()`.

What the model computes instead of attention: every position it reads (through the
slot's block table) is checked against `real_fd_model`, then it writes its new
positions' KV. Batches arrive pickled, as over FastDeploy's engine-worker queue,
and are merged by FastDeploy's own `BatchRequest.from_tasks`. Slots follow the
runner's rules: a prefill task resets the slot, a decode task replaces its block
table, a preempt or abort task stops it (its token this step is
PREEMPTED_TOKEN_ID); every other live slot decodes one token per step.
"""

from __future__ import annotations

import ctypes
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from real_fd_model import Sequence, expected_continuation

NOT_EMITTED = -1  # a chunk of a prefill that is not its last: no token


@dataclass
class Mismatch:
    """A position read back with other bytes than its KV."""

    request_id: str
    position: int
    layer: int
    role: int
    rank: int
    block: int
    reason: str


@dataclass
class Slot:
    request_id: str
    seq: Sequence
    block_table: list[int]
    max_tokens: int
    num_outputs: int
    num_computed: int  # positions with KV
    pending: tuple[int, int] | None = None  # prefill [start, end) this step
    decoding: bool = False  # its prefill is done: one token per step
    extend_only: list[int] = field(default_factory=list)  # extend blocks off its table
    truth: list[int] = field(default_factory=list)  # its outputs, as the model samples them
    accepted: list[int] | None = None  # speculative: this step's accepted tokens
    rejected: tuple[int, int] = (0, 0)  # speculative: positions of rejected drafts


@dataclass
class RunnerLog:
    positions_checked: int = 0
    positions_written: int = 0
    steps: int = 0
    swap_ins: int = 0
    evictions: int = 0
    failed_swap_ins: int = 0  # waits that raised (runner_change)
    dropped_steps: int = 0  # slots that emitted nothing for a failed swap-in
    bad_positions: int = 0  # positions read back wrong (or with no block)
    rejected_positions: int = 0  # speculative: rejected drafts' KV written (per layer)
    mismatches: list[Mismatch] = field(default_factory=list)  # the first few, in detail


def byte_views(tensors: list[Any]) -> list[np.ndarray]:
    """uint8 views [blocks, heads, block_size, bytes per head] of CPU cache tensors
    (no copy: the model reads and writes the tensors' own memory)."""
    views = []
    for t in tensors:
        blocks, heads, bs, dim = (int(d) for d in t.shape)
        nbytes = blocks * heads * bs * dim * t.element_size()
        raw = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
        views.append(np.ctypeslib.as_array(raw).reshape(blocks, heads, bs, -1))
    return views


class StandInRunner:
    """One rank's model runner.

    Args:
        fd_config: the deployment's FDConfig (a worker builds its own from the same
            arguments; one object serves here).
        local_rank: this worker's rank.
        mtp_layers: speculative (MTP) layers whose cache the controller also makes.
        runner_change: make the one runner change docs/fastdeploy.md asks for failed
            loads: a `SwapInFailedError` from `wait_for_layer` is caught, the step
            finishes for the other requests, and those whose block tables hold the
            failed blocks emit no token and lose their slot. Without it the runner
            is FastDeploy's, unmodified: the error propagates.

    Attributes:
        handle_extend: keep a slot that gets an EXTEND task and write its extend
            table's own blocks every step, as the text-to-image runner that sets
            `need_block_num_signal` does (the snapshot's GPU runner treats EXTEND
            like a preemption). Off by default.
        spec_tokens: speculative decoding (MTP) with this many draft tokens per
            step: a decoding slot verifies its drafts, writing the KV of the last
            token and of every draft (a rejected draft's KV is other bytes, as the
            KV of a wrong token is), and emits the accepted drafts plus one token;
            how many are accepted cycles with the step and slot. 0: off.
    """

    def __init__(
        self,
        fd_config: Any,
        local_rank: int,
        *,
        mtp_layers: int = 0,
        runner_change: bool = False,
    ) -> None:
        import fastdeploy.cache_manager.v1 as v1
        from fastdeploy.model_executor.layers.attention import AppendAttentionBackend

        self.fd_config = fd_config
        self.local_rank = local_rank
        self.device_id = local_rank
        self.rank = local_rank % fd_config.parallel_config.tensor_parallel_size
        self.cache_controller = v1.CacheController(fd_config, local_rank, self.device_id)
        self.attn_backends = [self._make_backend(AppendAttentionBackend)]
        self.mtp_layers = mtp_layers
        self.mtp_backend = self._make_backend(AppendAttentionBackend) if mtp_layers else None
        self.num_layers = fd_config.model_config.num_hidden_layers
        self.num_gpu_blocks = fd_config.cache_config.total_block_num
        self.block_size = fd_config.cache_config.block_size
        self.caches: list[Any] = []
        self.cache_kvs_map: Any = None
        self.mtp_caches: list[Any] = []
        self.views: list[np.ndarray] = []
        self.slots: dict[int, Slot] = {}
        self.preempted: set[int] = set()
        self.runner_change = runner_change
        self.handle_extend = False
        self.spec_tokens = 0
        # A prefill instance (splitwise role "prefill"): a slot stops after its
        # prefill's token (D decodes the rest).
        self.prefill_only = fd_config.scheduler_config.splitwise_role == "prefill"
        self.log = RunnerLog()

    def _make_backend(self, cls: type) -> Any:
        """As `_init_attn_backend` (the CPU platform selects no backend; the CUDA
        default is the append-attention backend)."""
        mc = self.fd_config.model_config
        tp = self.fd_config.parallel_config.tensor_parallel_size
        mc.kv_num_heads = max(1, int(mc.num_key_value_heads) // tp)
        return cls(
            self.fd_config,
            kv_num_heads=mc.kv_num_heads,
            num_heads=mc.num_attention_heads // tp,
            head_dim=mc.head_dim,
            encoder_block_shape_q=64,
            decoder_block_shape_q=16,
        )

    # -- the runner's cache lifecycle ---------------------------------------------

    def initialize_kv_cache(self) -> None:
        """`GPUModelRunner.initialize_kv_cache` with the v1 cache manager."""
        cc = self.cache_controller
        self.caches = cc.initialize_kv_cache(
            attn_backend=self.attn_backends[0],
            num_gpu_blocks=self.num_gpu_blocks,
        )
        self.cache_kvs_map = cc.get_kv_caches()
        if self.mtp_backend is not None:
            ratio = 1.0  # speculative_config.num_gpu_block_expand_ratio's default
            self.mtp_caches = cc.initialize_mtp_kv_cache(
                attn_backend=self.mtp_backend,
                num_gpu_blocks=int(self.num_gpu_blocks * ratio),
                num_mtp_layers=self.mtp_layers,
                layer_offset=self.num_layers,
            )
            self.cache_kvs_map = cc.get_kv_caches()
        self.views = byte_views(list(self.caches) + list(self.mtp_caches))
        self.slots.clear()

    def update_share_input_block_num(self, num_gpu_blocks: int) -> None:
        """`GPUModelRunner.update_share_input_block_num`: the cache again, with the
        block count the engine settled on."""
        self.num_gpu_blocks = num_gpu_blocks
        self.initialize_kv_cache()

    def clear_cache(self) -> None:
        """`GPUModelRunner.clear_cache` with the v1 cache manager: the runner drops
        its own references as its share_inputs are reset."""
        self.cache_controller.free_gpu_cache()
        self.caches = []
        self.mtp_caches = []
        self.cache_kvs_map = None
        self.views = []
        self.slots.clear()

    @property
    def roles(self) -> int:
        return len(self.caches) // self.num_layers if self.caches else 0

    # -- one step ---------------------------------------------------------------

    def receive(self, blob: bytes) -> None:
        """Take one queue payload (a pickled `[(BatchRequest, real_bsz)]`), merged as
        the worker merges what it reads from the queue, and insert its tasks."""
        from fastdeploy.engine.request import BatchRequest

        batch, control, _ = BatchRequest.from_tasks(pickle.loads(blob))
        assert not control, f"control requests are not stood in for: {control}"
        self.insert_tasks_v1(batch)

    def receive_storage(self, blob: bytes) -> None:
        """Take one prefetch task's pickled `StorageMetadata` off the engine-worker
        queue (PR #7529's worker-side prefetch handler) and start it, no step."""
        self.cache_controller.prefetch_from_storage(pickle.loads(blob))

    def insert_tasks_v1(self, batch: Any) -> None:
        from fastdeploy.engine.request import RequestType

        self.cache_controller.submit_swap_tasks(
            batch.cache_evict_metadata, batch.cache_swap_metadata
        )
        if batch.cache_swap_metadata is not None:
            self.log.swap_ins += 1
        if batch.cache_evict_metadata is not None:
            self.log.evictions += 1
        for request in batch:
            idx = request.idx
            kind = request.task_type.value
            if kind == RequestType.PREFILL.value:
                tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
                slot = self.slots.get(idx)
                if slot is None or slot.request_id != request.request_id:
                    shape = self.views[0].shape[1::2]  # (heads, bytes per head)
                    seq = Sequence(
                        self.num_layers + self.mtp_layers, self.roles, self.rank, shape
                    )
                else:
                    seq = slot.seq
                seq.set_tokens(tokens)
                self.slots[idx] = Slot(
                    truth=expected_continuation(
                        list(request.prompt_token_ids), request.sampling_params.max_tokens
                    ),
                    request_id=request.request_id,
                    seq=seq,
                    block_table=list(request.block_tables),
                    max_tokens=request.sampling_params.max_tokens,
                    num_outputs=len(request.output_token_ids),
                    num_computed=request.prefill_start_index,
                    pending=(request.prefill_start_index, request.prefill_end_index),
                )
                self.preempted.discard(idx)
            elif kind == RequestType.DECODE.value:
                slot = self.slots.get(idx)
                assert slot is not None and slot.request_id == request.request_id, (
                    f"decode task for {request.request_id} at slot {idx}, which holds "
                    f"{slot.request_id if slot else None}: the scheduler takes a request "
                    "the runner stopped (or never prefilled) for decoding"
                )
                slot.block_table = list(request.block_tables)
            elif kind == RequestType.EXTEND.value and self.handle_extend:
                slot = self.slots.get(idx)
                assert slot is not None and slot.request_id == request.request_id
                table = set(slot.block_table)
                slot.extend_only = [b for b in request.extend_block_tables if b not in table]
            else:  # preempted or aborted: stop the slot, answer PREEMPTED_TOKEN_ID
                slot = self.slots.pop(idx, None)
                self.preempted.add(idx)

    def execute_model(self) -> dict[int, int]:
        """One forward over every live slot, layer by layer, waiting for each
        layer's swap-in first as FastDeploy's attention does. Returns the token
        per slot (NOT_EMITTED for a prefill chunk that is not the last,
        PREEMPTED_TOKEN_ID for slots stopped this step).

        Raises:
            whatever `wait_for_layer` raises (an unmodified runner does not catch
            it).
        """
        from fastdeploy.config import PREEMPTED_TOKEN_ID

        self.log.steps += 1
        work: list[tuple[Slot, int, int]] = []  # slot, first new position, end
        for slot in self.slots.values():
            if slot.pending is not None:
                work.append((slot, *slot.pending))
            elif slot.decoding and self.spec_tokens:
                work.append((slot, *self._verify(slot)))
            elif slot.decoding:  # KV of the last token, then the next one
                end = len(slot.seq.tokens)
                work.append((slot, end - 1, end))
        if self.spec_tokens:  # newest slot first: a hit is read before its owner's
            work.reverse()  # writes of this step (no order within a step holds on a GPU)
        counter = self.cache_controller.swap_layer_done_counter
        failed: set[int] = set()  # blocks of a failed swap-in (runner_change)
        dropped: set[int] = set()  # id() of slots reading them
        for layer in range(self.num_layers):
            if counter is not None:
                try:
                    counter.wait_for_layer(layer)
                except Exception as e:
                    blocks = getattr(e, "device_block_ids", None)
                    if not self.runner_change or blocks is None:
                        raise
                    failed |= set(blocks)
                    self.log.failed_swap_ins += 1
            for slot, start, end in work:
                if failed & set(slot.block_table):
                    dropped.add(id(slot))
                if id(slot) not in dropped:
                    self._attend(slot, layer, start, end)
                    self._write_rejected(slot, layer)
            if getattr(self.cache_controller, "pd", None) is not None:
                self.cache_controller.after_layer(layer)  # PD's one runner line
        # The MTP model runs after the main one and, as FastDeploy's proposer,
        # waits for none of its layers (its forward_meta has no layer_done_counter).
        for layer in range(self.num_layers, self.num_layers + self.mtp_layers):
            for slot, start, end in work:  # the MTP layers' KV, checked the same way
                if id(slot) not in dropped:
                    self._attend(slot, layer, start, end)
                    self._write_rejected(slot, layer)
        for slot, _, _ in work:  # an extend table's own blocks: the model writes them
            for layer_role in range(self.num_layers * self.roles):
                self.views[layer_role][slot.extend_only] = 0xEE
        out: dict[int, int] = dict.fromkeys(self.preempted, PREEMPTED_TOKEN_ID)
        self.preempted.clear()
        for slot, _, end in work:
            idx = next(i for i, s in self.slots.items() if s is slot)
            if id(slot) in dropped:  # no token; the slot resets as if preempted
                out[idx] = NOT_EMITTED
                del self.slots[idx]
                self.log.dropped_steps += 1
                continue
            slot.num_computed = end
            slot.pending = None
            if slot.accepted is not None:  # speculative: the accepted tokens
                out[idx] = slot.accepted  # type: ignore[assignment]
                slot.num_outputs += len(slot.accepted)
                slot.accepted = None
                if slot.num_outputs >= slot.max_tokens:
                    del self.slots[idx]
                continue
            if end < len(slot.seq.tokens):  # a chunk, not the last: no token
                out[idx] = NOT_EMITTED
                continue
            slot.decoding = True
            token = slot.seq.next_token(slot.max_tokens, slot.num_outputs)
            slot.num_outputs += 1
            slot.seq.append(token)
            out[idx] = [token] if self.spec_tokens else token  # type: ignore[assignment]
            if slot.num_outputs >= slot.max_tokens or self.prefill_only:
                del self.slots[idx]  # EOS: the runner's stop flag
        return out

    def _verify(self, slot: Slot) -> tuple[int, int]:
        """A speculative decode step of `slot`: drafts for the next `spec_tokens`
        positions, the first `j` of them right (j cycles with the step), so `j`
        drafts and one more token are accepted. Their tokens join the sequence now;
        returns the positions whose KV the step writes right: the last token's and
        the accepted drafts'. The rejected drafts' positions get other bytes
        (`_write_rejected`)."""
        n = self.spec_tokens
        end = len(slot.seq.tokens)
        j = (self.log.steps + slot.num_outputs) % (n + 1)
        left = slot.max_tokens - slot.num_outputs
        accepted = slot.truth[slot.num_outputs : slot.num_outputs + min(j + 1, left)]
        for token in accepted:
            slot.seq.append(token)
        slot.accepted = accepted
        first_rejected = end + len(accepted) - 1  # the draft after the accepted ones
        slot.rejected = (first_rejected, end + n) if len(accepted) == j + 1 else (0, 0)
        return end - 1, first_rejected

    def _write_rejected(self, slot: Slot, layer: int) -> None:
        """Other bytes at the rejected drafts' positions (within the table)."""
        start, end = slot.rejected
        bs = self.block_size
        end = min(end, len(slot.block_table) * bs)
        if start >= end:
            return
        positions = np.arange(start, end)
        blocks = np.asarray(slot.block_table, np.int64)[positions // bs]
        for role in range(self.roles):
            self.views[layer * self.roles + role][blocks, :, positions % bs, :] = 0xDD
        self.log.rejected_positions += len(positions)

    def _attend(self, slot: Slot, layer: int, start: int, end: int) -> None:
        """Check positions [0, start) read through the block table, then write
        [start, end)."""
        bs = self.block_size
        table = slot.block_table
        need = (end + bs - 1) // bs
        if len(table) < need:
            why = f"block table has {len(table)} blocks, position {end - 1} needs {need}"
            self.log.bad_positions += end - start
            self._mismatch(slot, end - 1, layer, 0, -1, why)
            return
        if start:
            positions = np.arange(start)
            blocks = np.asarray(table, np.int64)[positions // bs]
            offsets = positions % bs
            for role in range(self.roles):
                got = self.views[layer * self.roles + role][blocks, :, offsets, :]
                want = slot.seq.kv(positions, layer, role)
                bad = np.nonzero((got != want).reshape(len(positions), -1).any(axis=1))[0]
                self.log.bad_positions += len(bad)
                for p in bad[:4]:
                    self._mismatch(
                        slot, int(p), layer, role, int(blocks[p]), "read back other bytes"
                    )
                self.log.positions_checked += len(positions)
        positions = np.arange(start, end)
        blocks = np.asarray(table, np.int64)[positions // bs]
        offsets = positions % bs
        for role in range(self.roles):
            self.views[layer * self.roles + role][blocks, :, offsets, :] = slot.seq.kv(
                positions, layer, role
            )
        self.log.positions_written += len(positions)

    def _mismatch(
        self, slot: Slot, position: int, layer: int, role: int, block: int, why: str
    ) -> None:
        if len(self.log.mismatches) >= 32:
            return
        self.log.mismatches.append(
            Mismatch(slot.request_id, position, layer, role, self.rank, block, why)
        )
