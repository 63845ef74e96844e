"""The same PD calls on FastDeploy's own v1 cache manager (fastkv uninstalled for the
test), for the side by side in docs/fastdeploy.md: ResourceManagerV1's prefill role
calls `update_cache_blocks`, which FastDeploy's v1 `CacheManager` does not have; in
its decode role `allocate_device_blocks` needs a match result `preallocate_resource_in_d`
never makes, logs an AttributeError and returns no block, and D answers P with an
empty `dest_block_ids` anyway; nothing on D has a deadline, so the request's slot stays
taken when P never sends (P killed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from real_fd_config import build_fd_config

import fastkv.integrations.fastdeploy as fkv_fd

BS = 8


@pytest.fixture
def fd_own(installed: list[str]) -> Iterator[None]:
    """FastDeploy's own v1 classes for this test; fastkv's back afterwards."""
    fkv_fd.uninstall()
    try:
        yield
    finally:
        fkv_fd.install()


def _rm(model_dir: Path, role: str) -> Any:
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    cfg = build_fd_config(model_dir, num_gpu_blocks=24, splitwise_role=role)
    pc, sc = cfg.parallel_config, cfg.scheduler_config
    rm = ResourceManagerV1(sc.max_num_seqs, cfg, pc.tensor_parallel_size, role, 0)
    assert not isinstance(rm.cache_manager, fkv_fd.FastDeployCacheManager)
    return rm


def _request(rid: str, prompt: list[int], role: str) -> Any:
    from fastdeploy.cache_manager.v1.cache_utils import get_request_block_hasher
    from fastdeploy.engine.request import Request
    from fastdeploy.engine.sampling_params import SamplingParams

    req = Request(
        request_id=rid,
        prompt_token_ids=prompt,
        prompt_token_ids_len=len(prompt),
        sampling_params=SamplingParams(max_tokens=4),
        disaggregate_info={"role": role},
    )
    req.set_block_hasher(get_request_block_hasher(block_size=BS))
    return req


def test_fd_own_v1_prefill_role_raises(fd_own: None, model_dir: Path) -> None:
    rm = _rm(model_dir, "prefill")
    with pytest.raises(AttributeError, match="update_cache_blocks"):
        rm.preallocate_resource_in_p(_request("a", list(range(100, 127)), "prefill"))


def test_fd_own_v1_decode_role_answers_no_blocks_and_holds_the_slot_when_p_dies(
    fd_own: None, model_dir: Path
) -> None:
    rm = _rm(model_dir, "decode")
    batch = rm.available_batch()
    req = _request("a", list(range(300, 327)), "decode")
    assert rm.preallocate_resource_in_d(req)  # "success" ...
    assert req.disaggregate_info["block_tables"] == []  # ... with no block for P
    for _ in range(3):  # P dies: no first token ever comes, no deadline on D
        rm.schedule()
    assert "a" in rm.requests and rm.available_batch() == batch - 1
