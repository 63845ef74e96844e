"""A real FastDeploy `FDConfig`, built the way the engine builds it: `EngineArgs` over
a model directory, `create_engine_config()`.

The model directory holds only the `config.json` of a tiny Qwen2 (no weights: the
engine side never loads them). `EngineArgs.__post_init__` turns the v1 KV-cache
scheduler and prefix caching off on a platform that is not CUDA, so
`current_platform.is_cuda()` answers True while (and only while) the config is
built. FastDeploy's model registry is imported before that, on the CPU platform
(with is_cuda True it would import the CUDA attention ops).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LAYERS = 2
KV_HEADS = 2
HEADS = 4
HEAD_DIM = 16
DTYPE = "bfloat16"
BLOCK_SIZE = 8  # tokens per block in every test (small: many blocks, short prompts)


def write_tiny_qwen2(directory: Path, *, layers: int = LAYERS) -> Path:
    """A model directory FastDeploy's ModelConfig reads: a tiny Qwen2's config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": HEADS * HEAD_DIM,
        "intermediate_size": 2 * HEADS * HEAD_DIM,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": layers,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": DTYPE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@contextlib.contextmanager
def cuda_platform() -> Iterator[None]:
    """`current_platform.is_cuda()` answers True inside (SNAPSHOT.md: the switch a
    CPU test has to answer while the config is built)."""
    from fastdeploy.platforms import current_platform

    cls = type(current_platform)
    original = cls.__dict__.get("is_cuda")
    cls.is_cuda = lambda self: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        if original is None:
            del cls.is_cuda
        else:
            cls.is_cuda = original  # type: ignore[method-assign]


def host_swap_space(num_cpu_blocks: int, *, block_size: int, layers: int = LAYERS) -> float:
    """The `swap_space` (GiB) FastDeploy turns into `num_cpu_blocks` host blocks."""
    bytes_per_block = KV_HEADS * HEAD_DIM * 2 * 2 * block_size * layers  # bf16, K and V
    return (num_cpu_blocks + 0.5) * bytes_per_block / 1024**3


def build_fd_config(
    model_dir: Path,
    *,
    num_gpu_blocks: int,
    num_cpu_blocks: int = 0,
    block_size: int = BLOCK_SIZE,
    max_model_len: int = 64,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    write_policy: str = "write_back",
    write_through_threshold: int = 2,
    enable_prefix_caching: bool = True,
    tensor_parallel_size: int = 1,
    layers: int = LAYERS,
    engine_worker_queue_port: int | None = None,
    splitwise_role: str = "mixed",
    speculative_tokens: int = 0,
) -> Any:
    """FDConfig from EngineArgs (ENABLE_V1_KVCACHE_MANAGER must be 1 already).

    Raises:
        AssertionError: FastDeploy's own checks (e.g. too few blocks for
            max_model_len).
    """
    assert os.environ.get("ENABLE_V1_KVCACHE_MANAGER") == "1"
    from fastdeploy.engine.args_utils import EngineArgs

    for name in (
        "fastdeploy.model_executor.layers.attention",
        "fastdeploy.model_executor.models",
    ):
        importlib.import_module(name)  # on the CPU platform, before the switch

    kwargs: dict[str, Any] = {}
    if engine_worker_queue_port is not None:
        kwargs["engine_worker_queue_port"] = str(engine_worker_queue_port)
    if speculative_tokens:  # MTP, its model the main one (only its config is read)
        kwargs["speculative_config"] = {
            "method": "mtp",
            "num_speculative_tokens": speculative_tokens,
            "model": str(model_dir),
        }
    with cuda_platform():
        args = EngineArgs(
            model=str(model_dir),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_gpu_blocks_override=num_gpu_blocks,
            swap_space=(
                host_swap_space(num_cpu_blocks, block_size=block_size, layers=layers)
                if num_cpu_blocks
                else None
            ),
            write_policy=write_policy,
            write_through_threshold=write_through_threshold,
            enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size,
            splitwise_role=splitwise_role,
            **kwargs,
        )
        fd_config = args.create_engine_config()
    cc = fd_config.cache_config
    assert cc.total_block_num == num_gpu_blocks, cc.total_block_num
    assert cc.num_cpu_blocks == num_cpu_blocks, (cc.num_cpu_blocks, num_cpu_blocks)
    assert cc.enable_prefix_caching == enable_prefix_caching
    return fd_config
