"""Configuration of the example engine (importable without paddle)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MODEL_ID = "fastkv-engine-demo"  # the cache namespace's model id and the metrics' model label


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The demo transformer: a few layers, hidden 256, grouped-query attention."""

    vocab_size: int = 4096
    hidden: int = 256
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    rope_base: float = 10_000.0
    max_positions: int = 16_384
    seed: int = 0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's cache, batching and worker settings.

    Attributes:
        block_size: tokens per KV block.
        num_device_blocks, num_host_blocks: pool sizes; small device pools force
            evictions to host and loads back.
        write_policy: see fastkv.config.WritePolicy.
        enable_cache: False runs every prompt in full (the recomputation baseline).
        max_running: requests decoding at once.
        max_step_tokens: prefill tokens per step (a request larger than this runs
            alone in its step).
        kv_dtype: KV cache dtype: bfloat16, float16 or float32.
        device: "auto" (a GPU when Paddle has one), "cpu" or "gpu:N".
        fail_rate: fraction of copy calls that fail (fault injection, spread
            evenly); the engine must still produce identical outputs.
        fail_rank: the only rank whose copies fail; None: every rank.
        wait_timeout: bound on every wait for a copy or for another rank, in seconds.
        tp_size: tensor-parallel ranks, one worker process each, each holding
            num_kv_heads / tp_size of the KV heads; must divide num_heads and
            num_kv_heads.
        storage_dir: a directory for the local-disk storage tier behind host
            memory (one subdirectory per rank); None: no storage tier.
        storage_blocks: the storage tier's capacity per rank, in blocks.
        storage_write_policy: see fastkv.config.StorageWritePolicy.

    Raises:
        ValueError: tp_size, fail_rank or fail_rate out of range (the message
            names the field and the values allowed).
    """

    block_size: int = 16
    num_device_blocks: int = 192
    num_host_blocks: int = 2048
    write_policy: str = "write_back"
    enable_cache: bool = True
    max_running: int = 8
    max_step_tokens: int = 2048
    kv_dtype: str = "bfloat16"
    device: str = "auto"
    fail_rate: float = 0.0
    fail_rank: int | None = None
    wait_timeout: float = 60.0
    tp_size: int = 1
    storage_dir: str | None = None
    storage_blocks: int = 8192
    storage_write_policy: str = "write_through"
    model: ModelConfig = field(default_factory=ModelConfig)

    @property
    def has_storage(self) -> bool:
        return self.storage_dir is not None and self.enable_cache

    def __post_init__(self) -> None:
        m = self.model
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp_size: must be an int >= 1, got {tp!r}")
        if m.num_heads % tp or m.num_kv_heads % tp:
            common = math.gcd(m.num_heads, m.num_kv_heads)
            allowed = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
            raise ValueError(
                f"tp_size: {tp} does not divide the model's {m.num_heads} attention heads "
                f"and {m.num_kv_heads} KV heads (each rank holds an equal share); "
                f"allowed: {allowed}"
            )
        rank = self.fail_rank
        if rank is not None and (
            isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp
        ):
            raise ValueError(
                f"fail_rank: must be an int in [0, {tp}) (tp_size {tp}), or None for "
                f"every rank; got {rank!r}"
            )
        rate = self.fail_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"fail_rate: must be a number in [0, 1], got {rate!r}")

    def rank_fail_rate(self, rank: int) -> float:
        """The fault-injection rate of `rank`'s copies."""
        return self.fail_rate if self.fail_rank in (None, rank) else 0.0
