"""Issue 13 item 4 and P5, measured on the CPU.

    .venv/bin/python tools/bench_handover.py [--runs N] [--json]

1. Wrong-KV rate of a seeded model that writes its new blocks right after
   `submit_swap_tasks`, before any layer's wait and without `write_block_ids`
   (tests/worker/handover_model.py: a real CacheManager with reuse_evicted_blocks
   and a CPU CacheController whose eviction stream runs each layer after a seeded
   delay). "before": the evictions' `reused_block_ids` stripped, so nothing orders
   the model's writes (what the worker did without the list); "after": as sent.
2. Host cost of the worker's block hazards (`BlockHazards`) on the submit path:
   add, conflict query and remove of transfers that all read one block (the
   readers of a block being evicted and backed up many times over), per entry.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "worker"))


def handover_rates(runs: int) -> dict[str, object]:
    import handover_model

    out: dict[str, object] = {"runs": runs}
    for name, hand_over in (("before", False), ("after", True)):
        bad, wrong, reused = handover_model.rate(runs, hand_over=hand_over)
        out[name] = {"runs_with_wrong_kv": bad, "wrong_blocks": wrong, "blocks_reused": reused}
    return out


def hazard_costs(readers: int) -> dict[str, float]:
    from fastkv.worker.transfer_manager import BlockHazards, _InFlight

    hazards = BlockHazards()
    transfers = [_InFlight(i, True, [0], [i]) for i in range(readers)]
    t0 = time.perf_counter()
    for t in transfers:
        hazards.add(t.device_ids, (), t)
    t1 = time.perf_counter()
    found = hazards.conflicts((), [0])
    t2 = time.perf_counter()
    for t in transfers:
        hazards.remove(t.device_ids, (), t)
    t3 = time.perf_counter()
    assert len(found) == 0 and len(hazards) == 0  # DONE events: all finished
    return {
        "readers": readers,
        "add_us_per_entry": (t1 - t0) / readers * 1e6,
        "conflicts_us_per_reader": (t2 - t1) / readers * 1e6,
        "remove_us_per_entry": (t3 - t2) / readers * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    result = {
        "handover": handover_rates(args.runs),
        "hazards": [hazard_costs(n) for n in (100, 1000, 10000)],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    h = result["handover"]
    for name in ("before", "after"):
        r = h[name]  # type: ignore[index]
        print(
            f"{name:>6}: {r['runs_with_wrong_kv']} of {args.runs} runs read wrong KV "
            f"({r['wrong_blocks']} blocks; {r['blocks_reused']} blocks handed over)"
        )
    for c in result["hazards"]:  # type: ignore[union-attr]
        print(
            f"hazards, {c['readers']:>5} readers of one block: add "
            f"{c['add_us_per_entry']:.2f} us, conflicts "
            f"{c['conflicts_us_per_reader']:.2f} us, remove "
            f"{c['remove_us_per_entry']:.2f} us per entry"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
