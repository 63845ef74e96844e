"""A real Mooncake deployment for tests: `mooncake_master` and `mooncake_client`
(a storage-node process holding a memory segment), started from the venv's own
binaries inside the caller's network namespace.

Mooncake listens on all interfaces whatever its flags say, so the scenarios that
use this run in a private network namespace (`unshare --net`, see test_mooncake.py):
nothing is reachable from outside and ports cannot clash with anything else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
MASTER_PORT = 50051
METRICS_PORT = 9003
NODE_PORT = 50060
START_TIMEOUT = 20.0


def wait_for_port(port: int, proc: subprocess.Popen, what: str) -> None:
    end = time.monotonic() + START_TIMEOUT
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {START_TIMEOUT} s")


class Cluster:
    """One master and any number of storage nodes; every process is killed on close."""

    def __init__(self, logdir: Path, client_ttl_s: int = 2, lease_ttl_ms: int = 10_000) -> None:
        self.logdir = logdir
        self.client_ttl_s = client_ttl_s
        self.lease_ttl_ms = lease_ttl_ms
        self.master: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self._node_port = NODE_PORT
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{MASTER_PORT}"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def start_master(self) -> None:
        self.master = self._spawn(
            "master",
            [
                str(BIN / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={MASTER_PORT}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={METRICS_PORT}",
                f"--client_ttl={self.client_ttl_s}",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            ],
        )
        wait_for_port(MASTER_PORT, self.master, "mooncake_master")

    def start_node(self, segment: str = "64MB") -> subprocess.Popen:
        port = self._node_port
        self._node_port += 1
        node = self._spawn(
            f"node-{port}",
            [
                str(BIN / "mooncake_client"),
                "--host=127.0.0.1",
                f"--master_server_address={self.master_address}",
                "--metadata_server=P2PHANDSHAKE",
                f"--global_segment_size={segment}",
                f"--port={port}",
                "--protocol=tcp",
            ],
        )
        wait_for_port(port, node, "mooncake_client (storage node)")
        self.nodes.append(node)
        return node

    def kill_master(self) -> None:
        assert self.master is not None
        _kill(self.master)

    def kill_node(self, node: subprocess.Popen) -> None:
        _kill(node)

    def close(self) -> None:
        for proc in [self.master, *self.nodes]:
            if proc is not None:
                _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


__all__ = ["Cluster"]
