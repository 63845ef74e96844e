"""ResourceManagerV1's extend-table path (text-to-image) on the snapshot's code:
the worker asks for extend blocks through `need_block_num_signal` (numpy int32
counts reach `can_allocate_gpu_blocks` / `allocate_gpu_blocks`), the scheduler
makes a decode allocation and the extend table in one step, the runner writes the
extend table's own blocks every step; every request still reads back its own KV,
and every block comes back when the request ends (FastDeploy's own v1 leaks the
extend blocks there)."""

from __future__ import annotations

from typing import Any

from real_fd_config import BLOCK_SIZE
from real_fd_model import prompt

BS = BLOCK_SIZE


def test_extend_block_tables_end_to_end(make_engine: Any) -> None:
    engine = make_engine(num_gpu_blocks=24, num_cpu_blocks=8)
    for runner in engine.runners:
        runner.handle_extend = True
    rm = engine.rm
    img = engine.add_request("img", prompt(11, 2 * BS + 1), 4 * BS)
    engine.add_request("txt", prompt(12, 2 * BS + 3), 12)
    engine.step_until(lambda: len(img.output_token_ids) >= 2)
    img.use_extend_tables = True
    rm.need_block_num_signal.value[img.idx] = 2  # what the image worker writes
    engine.step_until(lambda: "img" in rm.using_extend_tables_req_id)
    reuse = rm.reuse_block_num_map["img"]
    extend_only = img.extend_block_tables[reuse:]
    assert len(extend_only) == 2
    assert not set(extend_only) & set(img.block_tables)
    assert img.extend_block_tables[:reuse] == img.block_tables[:reuse]
    assert engine.cache_manager.get_stats()["table_mismatches"] == 0
    engine.run()  # img decodes 4 blocks more past its extension: its table grows
    stats = engine.cache_manager.get_stats()
    assert stats["table_mismatches"] == 0 and stats["allocation_failures"] == 0, stats
    # a request with img's prompt hits the blocks img computed
    engine.add_request("again", prompt(11, 2 * BS + 1), 3)
    engine.run()
    assert engine.log.hits["again"][0] == 2 * BS
    engine.check_clean()
