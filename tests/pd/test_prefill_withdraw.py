"""PrefillTransfers.withdraw: an engine that gives a request up before D answered
finishes it at once (FastDeploy's P drops a task after asking D)."""

from __future__ import annotations

from fastkv.config import CacheConfig
from fastkv.metadata import Epoch
from fastkv.pd.messages import Acceptance
from fastkv.pd.prefill import PrefillTransfers
from fastkv.scheduler import CacheManager

BS = 4


def _p() -> tuple[PrefillTransfers, CacheManager]:
    mgr = CacheManager(CacheConfig(block_size=BS, num_device_blocks=8))
    mgr.match("r", [], 2 * BS)
    assert mgr.allocate("r", num_tokens=2 * BS)
    return PrefillTransfers(mgr, layout_digest=b"L" * 32), mgr


def test_withdraw_unpins_an_offer_not_yet_answered() -> None:
    p, mgr = _p()
    p.offer("r", 2 * BS)
    assert p.withdraw("r")
    assert not p.is_pinned("r")
    p.release("r")  # finished now: no send can read its blocks
    assert not mgr.is_active("r")
    p.check_invariants()


def test_withdraw_refuses_a_send_under_way_and_a_request_not_offered() -> None:
    p, mgr = _p()
    assert not p.withdraw("r")
    p.offer("r", 2 * BS)
    acc = Acceptance("r", 1, Epoch(0), 2 * BS, 0, (5, 6), b"k" * 32, 5.0, 1)
    assert p.on_answer(acc)
    assert not p.withdraw("r")  # writes may read its blocks: stays pinned
    p.release("r")
    assert mgr.is_active("r") and p.is_pinned("r")
    p.check_invariants()
