"""CacheConfig: every field is validated on construction, with a message that names
the field and what it accepts; the namespace key separates incompatible caches."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from fastkv import CacheConfig, ModelKVShape, WritePolicy

INT_FIELDS = {
    # field: (lowest allowed, highest allowed)
    "block_size": (1, 1 << 20),
    "num_device_blocks": (1, 2**31 - 1),
    "num_host_blocks": (0, 2**31 - 1),
    "selective_threshold": (1, 2**31 - 1),
    "tp_size": (1, 1 << 16),
}


def _range_text(low: int, high: int) -> str:
    return re.escape(f"[{low}, {high}]")


@pytest.mark.parametrize("field", sorted(INT_FIELDS))
@pytest.mark.parametrize("where", ["below", "above"])
def test_int_field_out_of_range_names_field_and_range(field: str, where: str) -> None:
    low, high = INT_FIELDS[field]
    value = low - 1 if where == "below" else high + 1
    with pytest.raises(ValueError, match=rf"^{field}: .*{_range_text(low, high)}"):
        CacheConfig(**{field: value})


@pytest.mark.parametrize("field", sorted(INT_FIELDS))
def test_int_field_bounds_are_inclusive(field: str) -> None:
    low, high = INT_FIELDS[field]
    for value in (low, high):
        kwargs = {field: value}
        if field == "tp_size":
            kwargs["tp_rank"] = value - 1
        assert getattr(CacheConfig(**kwargs), field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("block_size", -64),
        ("num_device_blocks", 0),
        ("num_host_blocks", -1),
        ("selective_threshold", 0),
        ("tp_size", 0),
        ("tp_rank", -1),
    ],
)
def test_named_bad_values(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: .*{value}.*allowed range"):
        CacheConfig(**{field: value})


@pytest.mark.parametrize("field", [*sorted(INT_FIELDS), "tp_rank"])
@pytest.mark.parametrize("value", [True, False, 16.0, "16", None], ids=repr)
def test_int_fields_reject_non_ints(field: str, value: object) -> None:
    # bool is an int subclass; it must not slip through as 1 or 0.
    with pytest.raises(ValueError, match=rf"^{field}: must be an int in \[-?\d+, \d+\]"):
        CacheConfig(**{field: value})


@pytest.mark.parametrize(("tp_size", "tp_rank"), [(1, 1), (4, 4), (4, 7)])
def test_tp_rank_must_be_below_tp_size(tp_size: int, tp_rank: int) -> None:
    with pytest.raises(ValueError, match=rf"^tp_rank: .*{_range_text(0, tp_size - 1)}"):
        CacheConfig(tp_size=tp_size, tp_rank=tp_rank)


def test_last_tp_rank_is_valid() -> None:
    assert CacheConfig(tp_size=8, tp_rank=7).tp_rank == 7


@pytest.mark.parametrize("policy", ["lru", "WRITE_BACK", "write-back", "", 1, None], ids=repr)
def test_unknown_write_policy_lists_allowed_values(policy: object) -> None:
    with pytest.raises(ValueError, match=r"^write_policy: ") as info:
        CacheConfig(write_policy=policy)
    for allowed in WritePolicy:
        assert allowed.value in str(info.value)


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_string_policy_is_coerced(policy: WritePolicy) -> None:
    config = CacheConfig(write_policy=policy.value)
    assert config.write_policy is policy
    assert type(config.write_policy) is WritePolicy
    assert CacheConfig(write_policy=policy).write_policy is policy


@pytest.mark.parametrize("field", ["model_id", "kv_dtype"])
@pytest.mark.parametrize("value", ["", None, 3, b"m"], ids=repr)
def test_namespace_parts_must_be_non_empty_strings(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: must be a non-empty string"):
        CacheConfig(**{field: value})


@pytest.mark.parametrize("value", ["", 5, b"ns"], ids=repr)
def test_explicit_namespace_must_be_none_or_non_empty_string(value: object) -> None:
    with pytest.raises(ValueError, match=r"^namespace: must be None or a non-empty string"):
        CacheConfig(namespace=value)


def test_config_is_frozen() -> None:
    config = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 16  # type: ignore[misc]


def test_has_host_tier() -> None:
    assert not CacheConfig(num_host_blocks=0).has_host_tier
    assert CacheConfig(num_host_blocks=1).has_host_tier


NAMESPACE_VARIANTS = [
    {},
    {"model_id": "llama-3-8b"},
    {"model_id": "qwen2-7b"},
    {"kv_dtype": "float16"},
    {"kv_dtype": "float8_e4m3fn"},
    {"block_size": 16},
    {"block_size": 128},
    {"tp_size": 2, "tp_rank": 0},
    {"tp_size": 2, "tp_rank": 1},
    {"tp_size": 4, "tp_rank": 1},
]


def test_namespace_key_differs_per_model_dtype_block_and_tp() -> None:
    keys = [CacheConfig(**kw).namespace_key() for kw in NAMESPACE_VARIANTS]
    assert len(set(keys)) == len(keys), keys


def test_namespace_key_ignores_fields_that_do_not_change_the_kv() -> None:
    base = CacheConfig().namespace_key()
    assert CacheConfig(num_device_blocks=7, num_host_blocks=9).namespace_key() == base
    assert CacheConfig(write_policy="write_through", selective_threshold=5).namespace_key() == (
        base
    )


def test_namespace_key_is_deterministic() -> None:
    kw = {"model_id": "m", "kv_dtype": "bfloat16", "block_size": 32, "tp_size": 2, "tp_rank": 1}
    assert CacheConfig(**kw).namespace_key() == CacheConfig(**kw).namespace_key()


@pytest.mark.parametrize("kw", NAMESPACE_VARIANTS)
def test_explicit_namespace_replaces_the_derived_key(kw: dict) -> None:
    assert CacheConfig(namespace="tenant-7/shared", **kw).namespace_key() == "tenant-7/shared"


def test_namespace_key_is_injective_for_separator_characters() -> None:
    parts = ["m", "a", "m|dtype=a", "a|dtype=b", "b", "x|block=64"]
    seen: dict[str, tuple[str, str]] = {}
    for model_id, kv_dtype in itertools.product(parts, repeat=2):
        key = CacheConfig(model_id=model_id, kv_dtype=kv_dtype).namespace_key()
        assert key not in seen, f"{(model_id, kv_dtype)} and {seen[key]} share {key!r}"
        seen[key] = (model_id, kv_dtype)


def test_model_kv_shape_counts_extra_layers_after_the_model_layers() -> None:
    shape = ModelKVShape(num_layers=28, num_kv_heads=4, head_dim=128, num_extra_layers=1)
    assert shape.total_layers == 29


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_layers", 0, "num_layers: 0 is outside"),
        ("num_kv_heads", True, "num_kv_heads: must be an int"),
        ("head_dim", 2.0, "head_dim: must be an int"),
        ("num_extra_layers", -1, "num_extra_layers: -1 is outside"),
    ],
)
def test_model_kv_shape_names_the_bad_field(field: str, value: object, message: str) -> None:
    fields = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64} | {field: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelKVShape(**fields)  # type: ignore[arg-type]
