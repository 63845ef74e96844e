"""KVLayout over CacheControllers: fp8 scales and extra (speculative) layers are
registered and sent with their blocks, head slices land on the right D rank, and the
digest tells P and D of different TP sizes apart only when their caches differ."""

from __future__ import annotations

import numpy as np
import pytest

from fastkv.metadata import Epoch
from fastkv.pd.inproc import InProcFabric
from fastkv.pd.layout import KVLayout, check_pair, check_tp
from fastkv.pd.messages import Acceptance, SendPlan
from fastkv.pd.receiver import PDReceiver
from fastkv.pd.sender import PDSender
from fastkv.worker.cache_controller import CacheController
from fastkv.worker.cache_shape import KVCacheSpec

from .rig import BUILT


def _ctrl(heads: int, dtype: str = "fp8", extra: int = 1, head_dim: int = 8) -> CacheController:
    spec = KVCacheSpec(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=head_dim,
        block_size=4,
        num_device_blocks=8,
        num_host_blocks=0,
        dtype=dtype,
        num_extra_layers=extra,
    )
    ctrl = CacheController(spec, "cpu")
    BUILT.append(ctrl.free_cache)
    return ctrl


def test_fp8_scales_and_extra_layers_move_with_their_blocks_over_tp_1_to_2() -> None:
    p_ctrl = _ctrl(4)
    d_ctrls = [_ctrl(2), _ctrl(2)]
    p_lay = KVLayout.of_controller(p_ctrl)
    d_lays = [KVLayout.of_controller(c, tp_rank=r, tp_size=2) for r, c in enumerate(d_ctrls)]
    assert len(p_lay.tensors) == 3 * 4 and p_lay.num_layers == 3  # K, V, 2 scales x 3
    assert p_lay.digest() == d_lays[0].digest() == d_lays[1].digest()
    rng = np.random.default_rng(1)
    for i in range(len(p_ctrl.caches)):
        view = p_ctrl.device_blocks(i)
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    fabric = InProcFabric()
    sender = PDSender(fabric.endpoint("p"), p_lay)
    receivers = [PDReceiver(fabric.endpoint(f"d{r}"), lay) for r, lay in enumerate(d_lays)]
    for rec in receivers:
        sender.connect(*rec.handshake())
    src, dst = (1, 2, 5), (7, 0, 3)
    acc = Acceptance("r", 1, Epoch(0), 12, 0, dst, b"k" * 32, 5.0, 2)
    for rec in receivers:
        rec.expect(acc, 1)
    sender.start(SendPlan(1, Epoch(0), b"k" * 32, src, dst, 2, 5.0))
    for layer in range(3):
        sender.after_layer(layer)
    (p_report,) = sender.poll()
    assert p_report.ok
    reports = [r for rec in receivers for r in rec.poll()]
    assert [r.ok for r in reports] == [True, True]
    for r, ctrl in enumerate(d_ctrls):
        for i in range(len(p_ctrl.caches)):
            whole = p_ctrl.device_blocks(i)
            half = whole.shape[1] // 2
            got = ctrl.device_blocks(i)
            for s, d in zip(src, dst, strict=True):
                assert got[d].tobytes() == whole[s, r * half : (r + 1) * half].tobytes()


def test_digest_and_pairing_refuse_what_differs() -> None:
    base = KVLayout.of_controller(_ctrl(4, "bfloat16", 0))
    assert KVLayout.of_controller(_ctrl(4, "float16", 0)).digest() != base.digest()
    assert KVLayout.of_controller(_ctrl(4, "bfloat16", 1)).digest() != base.digest()
    assert KVLayout.of_controller(_ctrl(4, "bfloat16", 0, 16)).digest() != base.digest()
    two = KVLayout.of_controller(_ctrl(2, "bfloat16", 0), tp_rank=1, tp_size=2)
    assert two.digest() == base.digest()
    assert check_pair(base, two) == 1
    with pytest.raises(ValueError, match="multiple"):
        check_tp(2, 3)
    mla_p = KVLayout.of_arrays(
        [np.zeros((4, 1, 4, 8), np.float16)], tensors_per_layer=1, block_size=4
    )
    mla_d = KVLayout.of_arrays(
        [np.zeros((4, 1, 4, 8), np.float16)],
        tensors_per_layer=1,
        block_size=4,
        tp_rank=0,
        tp_size=2,
    )
    with pytest.raises(ValueError, match="layouts differ"):
        check_pair(mla_p, mla_d)
