"""A worker's cache spec derived from the cache's identity (`CacheConfig` and
`ModelKVShape`), never typed again."""

from __future__ import annotations

import pytest

pytest.importorskip("paddle", reason="fastkv.worker's cache shapes load with paddle")

from fastkv import CacheConfig, ModelKVShape
from fastkv.worker import CacheController, KVCacheSpec


def test_from_config_is_the_spec_built_by_hand() -> None:
    config = CacheConfig(block_size=4, num_device_blocks=6, num_host_blocks=16, kv_dtype="fp8")
    model_kv = ModelKVShape(num_layers=2, num_kv_heads=1, head_dim=8, num_extra_layers=1)
    spec = KVCacheSpec.from_config(config, model_kv)
    assert spec == KVCacheSpec(
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        block_size=4,
        num_device_blocks=6,
        num_host_blocks=16,
        dtype="fp8",
        num_extra_layers=1,
    )
    spec.shape().check_against(config)  # the one shape contract holds by construction
    with CacheController(spec, config=config) as ctrl:
        assert ctrl.shape.num_layers == model_kv.total_layers


def test_from_config_names_what_it_refuses() -> None:
    config = CacheConfig(block_size=4, num_device_blocks=6)
    model_kv = ModelKVShape(2, 1, 8)
    with pytest.raises(ValueError, match="config: expected a CacheConfig, got ModelKVShape"):
        KVCacheSpec.from_config(model_kv, model_kv)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_kv: expected a ModelKVShape, got dict"):
        KVCacheSpec.from_config(config, {"num_layers": 2})  # type: ignore[arg-type]
    odd = CacheConfig(block_size=4, num_device_blocks=6, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype: 'int4' is not one of"):
        KVCacheSpec.from_config(odd, model_kv)
