"""The storage namespace derived from a cache's identity (`StorageNamespace.of`) is
the one its callers built by hand before: stored blocks keep their keys."""

from __future__ import annotations

import pytest

from fastkv import CacheConfig, ModelKVShape
from fastkv.storage import StorageNamespace

# Each caller's namespace as it was built by hand, with the digest it had then.
FASTDEPLOY = CacheConfig(
    block_size=64, num_device_blocks=100, model_id="/models/llama", tp_size=2
)
CASES = {
    # fd_worker_storage: FastDeploy's model path is the config's model_id (fd_config).
    "fastdeploy": (
        FASTDEPLOY,
        ModelKVShape(num_layers=32, num_kv_heads=4, head_dim=128, num_extra_layers=1),
        StorageNamespace(
            FASTDEPLOY.namespace_key(),
            "/models/llama",
            "bfloat16",
            64,
            2,
            32,
            4,
            128,
            num_extra_layers=1,
        ),
        "f76e2ee53d3da7b36cf3bf910df49d23799558fae9d15642dc362c1748edce3c",
    ),
    # tools/trace_replay.py's DiskStorage.
    "trace_replay": (
        CacheConfig(
            block_size=512, num_device_blocks=1, namespace="trace-replay", model_id="trace"
        ),
        ModelKVShape(num_layers=1, num_kv_heads=1, head_dim=1),
        StorageNamespace("trace-replay", "trace", "bfloat16", 512, 1, 1, 1, 1),
        "12caa24c7c889f511ddff2270f008ce9fe1a85285ed6838a418187a7361f6dea",
    ),
    # examples/engine/worker.py, rank 1 of 2 (the default model, seed 0).
    "engine_example": (
        CacheConfig(
            block_size=16,
            num_device_blocks=192,
            namespace="fastkv-engine-demo/seed0",
            model_id="tiny-transformer",
            tp_rank=1,
            tp_size=2,
        ),
        ModelKVShape(num_layers=3, num_kv_heads=1, head_dim=64),
        StorageNamespace(
            "fastkv-engine-demo/seed0", "tiny-transformer", "bfloat16", 16, 2, 3, 1, 64
        ),
        "804e86d5ad02ea9166085f90cd07ccbf270bcbb5a18b9c1ed8613be30f61fce7",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_of_gives_the_namespace_callers_built_by_hand(case: str) -> None:
    config, model_kv, by_hand, digest = CASES[case]
    derived = StorageNamespace.of(config, model_kv)
    assert derived == by_hand
    assert derived.digest() == by_hand.digest() == bytes.fromhex(digest)


def test_every_field_of_the_identity_reaches_the_digest() -> None:
    config, model_kv, _, _ = CASES["fastdeploy"]
    base = StorageNamespace.of(config, model_kv).digest()
    configs = [
        CacheConfig(block_size=64, num_device_blocks=100, model_id="/models/other", tp_size=2),
        CacheConfig(block_size=32, num_device_blocks=100, model_id="/models/llama", tp_size=2),
        CacheConfig(block_size=64, num_device_blocks=100, model_id="/models/llama", tp_size=4),
        CacheConfig(
            block_size=64,
            num_device_blocks=100,
            model_id="/models/llama",
            tp_size=2,
            kv_dtype="fp8",
        ),
    ]
    shapes = [
        ModelKVShape(31, 4, 128, 1),
        ModelKVShape(32, 8, 128, 1),
        ModelKVShape(32, 4, 64, 1),
        ModelKVShape(32, 4, 128, 0),
    ]
    others = [StorageNamespace.of(c, model_kv).digest() for c in configs]
    others += [StorageNamespace.of(config, s).digest() for s in shapes]
    assert len({base, *others}) == len(others) + 1
    # Pool sizes change no block's bytes: the same namespace.
    bigger = CacheConfig(
        block_size=64,
        num_device_blocks=999,
        num_host_blocks=8,
        model_id="/models/llama",
        tp_size=2,
    )
    assert StorageNamespace.of(bigger, model_kv).digest() == base


def test_of_names_an_argument_of_the_wrong_type() -> None:
    config, model_kv, by_hand, _ = CASES["trace_replay"]
    with pytest.raises(
        ValueError, match="config: expected a CacheConfig, got StorageNamespace"
    ):
        StorageNamespace.of(by_hand, model_kv)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_kv: expected a ModelKVShape, got tuple"):
        StorageNamespace.of(config, (1, 1, 1))  # type: ignore[arg-type]
