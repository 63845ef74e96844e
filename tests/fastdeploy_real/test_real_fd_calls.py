"""Single calls FastDeploy's real code makes that the flows do not reach: the
prefill role's preallocation, what `match_prefix` leaves on the request, and the
controller's answers before its cache exists (FastDeploy's v1 answers them)."""

from __future__ import annotations

from typing import Any

from real_fd_config import BLOCK_SIZE as BS
from real_fd_model import prompt


def test_match_result_keeps_its_counts_while_the_request_allocates(make_engine: Any) -> None:
    """ResourceManagerV1 assigns `match_result.device_block_ids` to
    `request.block_tables` and extends that list as it allocates: the match's
    device count must stay what was matched."""
    engine = make_engine(num_gpu_blocks=24)
    shared = prompt(1, 3 * BS)
    engine.add_request("a", shared + prompt(2, 5), max_tokens=4)
    engine.run()
    b = engine.add_request("b", shared + prompt(3, 6), max_tokens=12)
    engine.step_until(lambda: any(r is b for r in engine.rm.running))
    assert len(b.block_tables) > 3
    assert b.match_result.matched_device_nums == 3, b.match_result
    assert b.match_result.total_matched_blocks == 3
    engine.run()
    engine.check_clean()


def test_prefill_role_preallocates(make_engine: Any) -> None:
    """splitwise_role="prefill": `preallocate_resource_in_p` matches, allocates and
    calls `cache_manager.update_cache_blocks(request, block_size, tokens)`; the P/D
    error path `pre_recycle_resource` then frees everything."""
    engine = make_engine(num_gpu_blocks=24, num_cpu_blocks=4, splitwise_role="prefill")
    from fastdeploy.engine.request import Request
    from fastdeploy.engine.sampling_params import SamplingParams

    request = Request(
        request_id="p0",
        prompt_token_ids=prompt(5, 2 * BS + 3),
        prompt_token_ids_len=2 * BS + 3,
        eos_token_ids=[2],
        sampling_params=SamplingParams(max_tokens=4),
    )
    request.set_block_hasher(engine.block_hasher)
    assert engine.rm.preallocate_resource_in_p(request) is True
    assert len(request.block_tables) == 3 + engine.fd_config.cache_config.enc_dec_block_num
    engine.rm.pre_recycle_resource("p0")
    engine.check_no_leaks()


def test_controller_before_its_cache_exists(make_engine: Any) -> None:
    """FastDeploy's v1 controller answers these before `initialize_kv_cache`
    without raising: reset_cache() True, an empty host map, no swap to submit;
    and free_cache() answers True, as FastDeploy's does."""
    import fastdeploy.cache_manager.v1 as v1

    engine = make_engine(num_gpu_blocks=16)
    config = engine.fd_config
    controller = v1.CacheController(config, 0, 0)
    try:
        assert controller.reset_cache() is True
        assert dict(controller.get_host_cache_kvs_map()) == {}
        assert controller.submit_swap_tasks(None, None) is None
    finally:
        assert controller.free_cache() is True
