"""Configuration of the example engine (importable without paddle)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        wait_timeout: bound on every wait for a copy, in seconds.
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
    wait_timeout: float = 60.0
    model: ModelConfig = field(default_factory=ModelConfig)
