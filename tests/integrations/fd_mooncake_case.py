"""FastDeploy's `--kvcache-storage-backend mooncake` served by fastkv, against a
real mooncake_master and storage node, run by test_fd_storage_mooncake.py as its
own process inside a private network namespace:

    unshare --net --fork python tests/integrations/fd_mooncake_case.py LOGDIR

Two workers, each built only from a FastDeploy-style config (the connection from
FastDeploy's Mooncake settings: one from its `MOONCAKE_*` variables, one from the
JSON file `MOONCAKE_CONFIG_PATH` names), as two machines of one cluster would be:
the first writes a host block to Mooncake, the second looks it up and loads it,
and its bytes are checked. Prints one line `RESULT <json>`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "storage"), str(HERE.parents[1])]

from fd_standins import (  # noqa: E402
    AttentionBackend,
    CacheLevel,
    CacheSwapMetadata,
    FDCacheConfig,
    FDConfig,
    ModelConfig,
)
from mooncake_cluster import Cluster  # noqa: E402

from fastkv.channel import ResultsReceiver  # noqa: E402
from fastkv.integrations import fastdeploy as fd  # noqa: E402
from fastkv.integrations.fd_transfers import storage_to_fastdeploy  # noqa: E402
from fastkv.metadata import CacheLevel as FK  # noqa: E402
from fastkv.metadata import CacheSwapMetadata as FKMeta  # noqa: E402
from fastkv.metadata import LookupResult, StorageLookup, TransferResult  # noqa: E402
from fastkv.storage.mooncake import MooncakeBackend  # noqa: E402

BS = 4


@dataclass
class MooncakeCacheConfig(FDCacheConfig):
    kvcache_storage_backend: str | None = "mooncake"
    kvcache_storage_config: dict | None = None


def worker(name: str, logdir: Path) -> tuple[fd.CacheController, ResultsReceiver]:
    cfg = FDConfig(
        MooncakeCacheConfig(BS, total_block_num=8, num_cpu_blocks=4),
        ModelConfig(num_hidden_layers=2),
    )
    channel = f"mc-{name}-{os.getpid()}"
    receiver = ResultsReceiver(channel, 1)
    w = fd.CacheController(cfg, 0, 0, channel_name=channel, report_interval_s=0)
    w.initialize_kv_cache(
        attn_backend=AttentionBackend(num_kv_heads=2, head_dim=4, block_size=BS),
        num_gpu_blocks=8,
    )
    return w, receiver


def results(w: fd.CacheController, receiver: ResultsReceiver, count: int) -> list:
    got: list = []
    deadline = time.monotonic() + 20
    while len(got) < count and time.monotonic() < deadline:
        w.report_results()
        got += receiver.poll()
        time.sleep(0.005)
    return got


def run(cluster: Cluster, logdir: Path) -> dict:
    cluster.start_master()
    cluster.start_node()
    key_file = logdir / "keys"
    key_file.write_text("5e" * 32 + "\n")
    key_file.chmod(0o600)
    os.environ["FASTKV_STORAGE_KEY_FILE"] = str(key_file)
    # machine A: FastDeploy's variables
    os.environ["MOONCAKE_MASTER_SERVER_ADDR"] = cluster.master_address
    os.environ["MOONCAKE_LOCAL_HOSTNAME"] = "127.0.0.1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    os.environ["MOONCAKE_GLOBAL_SEGMENT_SIZE"] = "0"
    a, rx_a = worker("a", logdir)
    # machine B: FastDeploy's JSON file (the variables above are not read for
    # what it sets)
    conf = logdir / "mooncake.json"
    conf.write_text(
        json.dumps(
            {
                "master_server_addr": cluster.master_address,
                "local_hostname": "127.0.0.1",
                "protocol": "tcp",
                "global_segment_size": "16MB",
            }
        )
    )
    os.environ["MOONCAKE_CONFIG_PATH"] = str(conf)
    b, rx_b = worker("b", logdir)
    out: dict = {}
    try:
        out["backends"] = [type(w._storage_backend).__name__ for w in (a, b)]
        out["segments"] = [w._storage_backend.options.connection.segment_bytes for w in (a, b)]
        assert all(isinstance(w._storage_backend, MooncakeBackend) for w in (a, b))
        ca, cb = a.controller, b.controller
        for t in range(len(ca.caches)):
            ca.host_blocks(t)[0] = 0x5A + t
        write = FKMeta(40, FK.HOST, FK.STORAGE, [0], [], ["blk"])
        a.submit_swap_tasks(
            storage_to_fastdeploy(None, write, (), CacheSwapMetadata, CacheLevel), None
        )
        out["write"] = [str(r) for r in results(a, rx_a, 1)]
        lookup = [StorageLookup(41, ["blk", "other"])]
        load = FKMeta(42, FK.STORAGE, FK.HOST, [], [3], ["blk"])
        b.submit_swap_tasks(
            storage_to_fastdeploy(load, None, lookup, CacheSwapMetadata, CacheLevel), None
        )
        got = results(b, rx_b, 2)
        out["lookup_hits"] = [r.num_hits for r in got if isinstance(r, LookupResult)]
        out["load_ok"] = [r.success for r in got if isinstance(r, TransferResult)]
        out["bytes_equal"] = all(
            bool((cb.host_blocks(t)[3] == 0x5A + t).all()) for t in range(len(cb.caches))
        )
    finally:
        for w, rx in ((a, rx_a), (b, rx_b)):
            w.free_cache()
            rx.close()
    return out


def main() -> None:
    logdir = Path(sys.argv[1])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    cluster = Cluster(logdir)
    code = 0
    try:
        print("RESULT " + json.dumps(run(cluster, logdir)), flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        code = 1
    finally:
        cluster.close()
    sys.stderr.flush()
    os._exit(code)  # Mooncake's client threads keep retrying a dead master


if __name__ == "__main__":
    main()
