"""FastDeploy's P and D engines (real ResourceManagerV1s with fastkv installed, `PDPair`)
in this process, each instance's ranks in a process of their own
(`real_fd_procs.WorkerProcess`), KV between the ranks over Mooncake Transfer Engine
on TCP loopback. The scheduler's PD tasks reach the ranks only with the engine's
payloads (the step's batch, the drained tasks); the ranks' RankReports come back
over each instance's results channel. Run by test_real_fd_pd_procs.py in a private
network namespace; prints one `RESULT <json>`.

    pd_procs_case.py TMPDIR TP
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["ENABLE_V1_KVCACHE_MANAGER"] = "1"
os.environ.setdefault("FD_LOG_DIR", tempfile.mkdtemp(prefix="fd-pd-procs-log-"))
os.environ.setdefault("GLOG_minloglevel", "1")
sys.path.insert(0, str(HERE))


def main() -> None:
    import subprocess

    from pd_te_case import borrow_mooncake

    tmp, tp = Path(sys.argv[1]), int(sys.argv[2])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    borrow_mooncake(tmp)  # before the ranks' processes start: they inherit sys.path
    from real_fd_config import build_fd_config, write_tiny_qwen2
    from real_fd_engine import Engine
    from real_fd_pd import PDPair
    from real_fd_procs import RemoteRunner, WorkerProcess

    import fastkv.integrations.fastdeploy as fkv_fd

    fkv_fd.install()
    model = write_tiny_qwen2(tmp / "model")
    engines, procs = [], []
    for role in ("prefill", "decode"):
        channel = f"fd-pd-procs-{role}-{os.getpid()}"
        os.environ[fkv_fd.CHANNEL_ENV] = channel

        def ranks(fd_config: object, role: str = role, channel: str = channel) -> list:
            proc = WorkerProcess(role, tp, model, channel)
            procs.append(proc)
            return [RemoteRunner(proc, rank) for rank in range(tp)]

        config = build_fd_config(
            model,
            num_gpu_blocks=24,
            splitwise_role=role,
            tensor_parallel_size=tp,
            max_num_batched_tokens=16 if role == "prefill" else 64,
        )
        engines.append(Engine(config, runners=ranks))
    p, d = engines
    pair = PDPair(p, d, ([None] * tp, [None] * tp), deployment_secret=b"s" * 32)
    bs = 8
    system = list(range(300, 300 + 2 * bs))
    # 27 and 29 tokens: P's budget of 16 tokens a step prefills each in chunks.
    first = pair.serve([("first", [*system, *range(700, 700 + bs + 3)], 4)])
    second = pair.serve([("second", [*system, *range(800, 800 + bs + 5)], 5)])
    pair.wait_idle()
    states = {
        "p": [r.state() for r in p.runners],
        "d": [r.state() for r in d.runners],
    }
    d_checked = sum(s["log"].positions_checked for s in states["d"])
    d.check_clean()
    pair.check_no_leaks()
    out = {
        "pids": sorted({os.getpid(), *(w.pid for w in procs)}),
        "dest": [s.dest_block_ids for s in first + second],
        "errors": [s.first_token_error for s in first + second],
        "d_mismatches": d.mismatches(),
        "d_positions_checked": d_checked,
        "committed": d.cache_manager.pd.counters["committed"],
        "sends_finished": p.cache_manager.pd.counters["sends_finished"],
        "bytes_sent": [s["bytes_sent"] for s in states["p"]],
        "bytes_received": [s["bytes_received"] for s in states["d"]],
        "arrivals": {
            side: [
                {"batch": s["arrivals"].batch, "drained": s["arrivals"].drained}
                for s in states[side]
            ]
            for side in ("p", "d")
        },
        "chunked_prefills": p.log.chunked_prefills,
    }
    for w in procs:  # the ranks first: they report to the engines' channels
        w.close()
    for e in engines:
        e.close()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the engines' threads: nothing left to wait for


if __name__ == "__main__":
    main()
