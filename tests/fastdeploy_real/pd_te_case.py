"""One FastDeploy P instance and one D instance (real ResourceManagerV1s, `PDPair`)
whose ranks move KV over Mooncake Transfer Engine on TCP loopback. Run by
test_real_fd_pd_te.py in a private network namespace; prints one `RESULT <json>`.

    pd_te_case.py TMPDIR TP

Mooncake TE is not among build/venv-fd's requirements before this test: where
`mooncake.engine` does not import, the wheel .venv installed (same CPython) is put
on the path from a folder of links (`--mooncake-from` or `../../.venv`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ["ENABLE_V1_KVCACHE_MANAGER"] = "1"
os.environ.setdefault("FD_LOG_DIR", tempfile.mkdtemp(prefix="fd-pd-te-log-"))
os.environ.setdefault("GLOG_minloglevel", "1")
sys.path.insert(0, str(HERE))


def borrow_mooncake(tmp: Path) -> str:
    """Import `mooncake.engine`; from .venv's site-packages if not installed here."""
    try:
        import mooncake.engine

        return "installed"
    except ImportError:
        pass
    venv = Path(os.environ.get("FASTKV_MAIN_VENV", HERE.parents[1] / ".venv"))
    site = next(venv.glob("lib/python3*/site-packages"))
    links = tmp / "mooncake-links"
    links.mkdir(exist_ok=True)
    for name in ("mooncake", "mooncake_transfer_engine_non_cuda.libs"):
        if (site / name).exists() and not (links / name).exists():
            (links / name).symlink_to(site / name)
    sys.path.append(str(links))
    import mooncake.engine  # noqa: F401

    return f"borrowed from {site}"


def main() -> None:
    tmp, tp = Path(sys.argv[1]), int(sys.argv[2])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    source = borrow_mooncake(tmp)
    from real_fd_config import build_fd_config, write_tiny_qwen2
    from real_fd_engine import Engine
    from real_fd_pd import PDPair

    import fastkv.integrations.fastdeploy as fkv_fd
    from fastkv.pd.mooncake_te import MooncakeTransport

    fkv_fd.install()
    model = write_tiny_qwen2(tmp / "model")
    engines = []
    for role in ("prefill", "decode"):
        os.environ[fkv_fd.CHANNEL_ENV] = f"fd-pd-te-{role}-{os.getpid()}"
        engines.append(
            Engine(
                build_fd_config(
                    model, num_gpu_blocks=24, splitwise_role=role, tensor_parallel_size=tp
                )
            )
        )
    p, d = engines
    transports = (
        [MooncakeTransport("127.0.0.1", write_timeout_s=5.0) for _ in range(tp)],
        [MooncakeTransport("127.0.0.1", write_timeout_s=5.0) for _ in range(tp)],
    )
    pair = PDPair(p, d, transports, deployment_secret=b"s" * 32, fence_grace_s=6.0)
    bs = 8
    system = list(range(300, 300 + 2 * bs))
    first = pair.serve([("first", [*system, *range(700, 700 + bs + 3)], 4)])
    sent_first = sum(w.sender.bytes_sent for w in pair.p_workers)
    second = pair.serve([("second", [*system, *range(800, 800 + bs + 5)], 5)])
    sent_second = sum(w.sender.bytes_sent for w in pair.p_workers) - sent_first
    pair.wait_idle()
    d_checked = sum(r.log.positions_checked for r in d.runners)
    d.check_clean()
    pair.check_no_leaks()
    out = {
        "mooncake": source,
        "addresses": [t.address for ts in transports for t in ts],
        "dest": [s.dest_block_ids for s in first + second],
        "errors": [s.first_token_error for s in first + second],
        "bytes": [sent_first, sent_second],
        "d_mismatches": d.mismatches(),
        "d_positions_checked": d_checked,
        "committed": d.cache_manager.pd.counters["committed"],
        "received_verified": sum(w.receiver.bytes_received for w in pair.d_workers),
    }
    for e in engines:
        e.close()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the engines' threads: nothing left to wait for


if __name__ == "__main__":
    main()
