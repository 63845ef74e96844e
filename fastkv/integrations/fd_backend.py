"""KV cache tensors made through a FastDeploy attention backend, as its model runner
makes them.

Two backend APIs exist, and both are answered:

- `get_kv_cache_shape(max_num_blocks=, kv_cache_quant_type=)` returning
  `(key_shape, value_shape)` (FastDeploy up to at least 2026-05-19): the runner makes
  the tensors itself. Per layer: K; V unless `value_shape` is empty (MLA keeps one
  latent tensor); with `block_wise_fp8`, a K scale `key_shape[:3]` (and a V scale when
  there is V) in Paddle's default float dtype. K and V are uint8 when the KV cache is
  quantized, else the model's dtype.
- `create_kv_cache(num_layers=, num_blocks=, cache_dtype=, kv_cache_quant_type=,
  layer_offset=)` returning `{(role, layer): tensor}` (upstream since): the backend
  makes them. Roles are "key", "value", "key_scale", "value_scale"; a layer is
  accepted as given (`layer_offset` .. `layer_offset + num_layers - 1`) or counted
  from 0 (then `layer_offset` is added).

Anything else (the per-layer `create_kv_cache(max_num_blocks, ...)` of an earlier
draft, a third shape such as DSA's indexer cache `[blocks, block_size, dim]`, a role
fastkv does not know) is refused with an error that says what was found.

Tensors come back layer-major in the runner's order (K, V, K scale, V scale), with
FastDeploy's names: `<key_caches|value_caches|key_cache_scales|value_cache_scales>_
<layer>_rank<tp rank>.device<device id>`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

ROLES = {
    "key": "key_caches",
    "value": "value_caches",
    "key_scale": "key_cache_scales",
    "value_scale": "value_cache_scales",
}
"""Role -> FastDeploy's name prefix, in the runner's per-layer order."""

CREATE_PARAMS = (
    "num_layers",
    "num_blocks",
    "cache_dtype",
    "kv_cache_quant_type",
    "layer_offset",
)
"""The keyword parameters of the upstream `create_kv_cache`."""

FP8_QUANT = "block_wise_fp8"


@dataclass
class LayerTensors:
    """What a backend made for a run of layers.

    Attributes:
        tensors: flat, layer-major, the runner's order.
        per_layer: tensors per layer.
        names: FastDeploy's name of each tensor, in the same order.
    """

    tensors: list[Any]
    per_layer: int
    names: list[str]


def _create_form(backend: Any) -> inspect.Signature | None:
    """The upstream `create_kv_cache`'s signature if `backend` has that form."""
    create = getattr(backend, "create_kv_cache", None)
    if not callable(create):
        return None
    try:
        sig = inspect.signature(create)
    except (TypeError, ValueError):
        return None
    params = sig.parameters
    takes_all = all(p in params for p in CREATE_PARAMS) or any(
        p.kind is p.VAR_KEYWORD for p in params.values()
    )
    return sig if takes_all and "num_layers" in params else None


def describe(backend: Any) -> str:
    """What `backend` offers for cache allocation, for error messages."""
    found = []
    for name in ("create_kv_cache", "get_kv_cache_shape"):
        fn = getattr(backend, name, None)
        if callable(fn):
            try:
                found.append(f"{name}{inspect.signature(fn)}")
            except (TypeError, ValueError):
                found.append(f"{name}(?)")
    what = ", ".join(found) if found else "neither create_kv_cache nor get_kv_cache_shape"
    return f"{type(backend).__name__} has {what}"


def make_layers(
    backend: Any,
    *,
    num_blocks: int,
    first_layer: int,
    num_layers: int,
    model_dtype: str,
    quant: str | None,
    tp_rank: int,
    device_id: int,
) -> LayerTensors:
    """Make layers `first_layer` .. `first_layer + num_layers - 1` through `backend`.

    Args:
        num_blocks: blocks per tensor.
        model_dtype: the model's dtype (K/V dtype unless `quant`).
        quant: FastDeploy's `kv_cache_quant_type`, or None.
        tp_rank, device_id: for the names.

    Raises:
        ValueError: a backend of neither form, shapes or roles fastkv cannot move,
            or layers whose tensor counts differ (the message says what was found).
    """
    cache_dtype = "uint8" if quant else model_dtype
    if _create_form(backend) is not None:
        made = backend.create_kv_cache(
            num_layers=num_layers,
            num_blocks=num_blocks,
            cache_dtype=cache_dtype,
            kv_cache_quant_type=quant,
            layer_offset=first_layer,
        )
        by_layer = _from_dict(made, first_layer, num_layers)
    elif callable(getattr(backend, "get_kv_cache_shape", None)):
        by_layer = _from_shapes(
            backend, num_blocks, first_layer, num_layers, cache_dtype, quant
        )
    else:
        raise ValueError(
            f"attn_backend: {describe(backend)}; fastkv needs get_kv_cache_shape("
            f"max_num_blocks, kv_cache_quant_type) or create_kv_cache("
            f"{', '.join(CREATE_PARAMS)})"
        )
    tensors: list[Any] = []
    names: list[str] = []
    per_layer = None
    for layer, roles in by_layer:
        if per_layer is None:
            per_layer = len(roles)
        if len(roles) != per_layer:
            raise ValueError(
                f"attn_backend: layer {layer} has roles {[r for r, _ in roles]}, "
                f"expected {per_layer} tensors like layer {first_layer}"
            )
        for role, tensor in roles:
            tensors.append(tensor)
            names.append(f"{ROLES[role]}_{layer}_rank{tp_rank}.device{device_id}")
    assert per_layer is not None
    return LayerTensors(tensors, per_layer, names)


def _from_shapes(
    backend: Any,
    num_blocks: int,
    first_layer: int,
    num_layers: int,
    cache_dtype: str,
    quant: str | None,
) -> list[tuple[int, list[tuple[str, Any]]]]:
    import paddle

    shapes = backend.get_kv_cache_shape(max_num_blocks=num_blocks, kv_cache_quant_type=quant)
    if not isinstance(shapes, (tuple, list)) or len(shapes) != 2:
        count = len(shapes) if isinstance(shapes, (tuple, list)) else type(shapes).__name__
        raise ValueError(
            f"attn_backend.get_kv_cache_shape: returned {count} shapes ({shapes!r:.200}); "
            "fastkv moves (key_shape, value_shape) caches, not a third tensor such as "
            "DSA's indexer cache"
        )
    key_shape, value_shape = (list(s) if s else [] for s in shapes)
    if len(key_shape) < 3:
        raise ValueError(
            f"attn_backend.get_kv_cache_shape: key shape {key_shape} has no "
            "[blocks, heads, block_size, ...] layout"
        )
    scale_shape = key_shape[:3] if quant == FP8_QUANT else None
    scale_dtype = paddle.get_default_dtype()
    out = []
    for layer in range(first_layer, first_layer + num_layers):
        roles: list[tuple[str, Any]] = [("key", paddle.zeros(key_shape, dtype=cache_dtype))]
        if value_shape:
            roles.append(("value", paddle.zeros(value_shape, dtype=cache_dtype)))
        if scale_shape is not None:
            roles.append(("key_scale", paddle.zeros(scale_shape, dtype=scale_dtype)))
            if value_shape:
                roles.append(("value_scale", paddle.zeros(scale_shape, dtype=scale_dtype)))
        out.append((layer, roles))
    return out


def _from_dict(
    made: Any, first_layer: int, num_layers: int
) -> list[tuple[int, list[tuple[str, Any]]]]:
    if not isinstance(made, dict):
        raise ValueError(
            f"attn_backend.create_kv_cache: returned {type(made).__name__}, expected a "
            "dict {(role, layer): tensor}"
        )
    layers: dict[int, dict[str, Any]] = {}
    for key, tensor in made.items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int)):
            raise ValueError(
                f"attn_backend.create_kv_cache: key {key!r:.80} is not (role, layer)"
            )
        role, layer = key
        role = getattr(role, "value", role)  # an enum of role names
        if role not in ROLES:
            raise ValueError(
                f"attn_backend.create_kv_cache: role {role!r} (layer {layer}) is not one "
                f"of {list(ROLES)}"
            )
        layers.setdefault(layer, {})[role] = tensor
    wanted = set(range(first_layer, first_layer + num_layers))
    offset = 0
    if set(layers) != wanted:
        if first_layer and set(layers) == set(range(num_layers)):
            offset = first_layer  # layers counted from 0: the offset is ours to add
        else:
            raise ValueError(
                f"attn_backend.create_kv_cache: made layers {sorted(layers)}, asked for "
                f"{first_layer}..{first_layer + num_layers - 1}"
            )
    return [
        (layer + offset, [(r, layers[layer][r]) for r in ROLES if r in layers[layer]])
        for layer in sorted(layers)
    ]


__all__ = ["CREATE_PARAMS", "FP8_QUANT", "ROLES", "LayerTensors", "describe", "make_layers"]
