"""The in-process transport keeps the same `PDTransport` contract as Mooncake TE
(tests/pd/transport_contract.py), so what the rig proves over it carries over."""

from __future__ import annotations

import pytest

from fastkv.pd.inproc import InProcFabric

from .transport_contract import CHECKS, Pair, pair_from


def make_pair() -> Pair:
    fabric = InProcFabric(write_timeout_s=5.0)
    return pair_from(fabric.endpoint("p0"), fabric.endpoint("d0"))


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_inproc_transport_keeps_the_transport_contract(check: str) -> None:
    CHECKS[check](make_pair)
