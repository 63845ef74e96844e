"""FastDeploy's `--kvcache-storage-backend mooncake`, served by fastkv's Mooncake
backend: the connection comes from FastDeploy's own Mooncake settings (its
`kvcache_storage_config`, the JSON file `MOONCAKE_CONFIG_PATH`, the `MOONCAKE_*`
variables, in that order), and two workers built from such configs share blocks
through a real mooncake_master in a private network namespace (nothing skipped:
without Mooncake or `unshare` the last test fails)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from fd_standins import FDCacheConfig, FDConfig, ModelConfig
from netns_case import run_in_netns

from fastkv.integrations import fd_config as fdc
from fastkv.storage.mooncake import MooncakeConnection

HERE = Path(__file__).resolve().parent


@dataclass
class MooncakeCacheConfig(FDCacheConfig):
    kvcache_storage_backend: str | None = "mooncake"
    kvcache_storage_config: object = None


def config(**kw) -> FDConfig:
    cc = {"block_size": 4, "total_block_num": 8, "num_cpu_blocks": 4, **kw}
    return FDConfig(MooncakeCacheConfig(**cc), ModelConfig(num_hidden_layers=2))


@pytest.fixture
def no_mooncake_env(monkeypatch) -> None:
    for env in (*fdc.MOONCAKE_ENV.values(), fdc.MOONCAKE_CONFIG_ENV):
        monkeypatch.delenv(env, raising=False)


def test_mooncake_turns_the_storage_tier_on_and_attention_store_is_refused(
    no_mooncake_env, monkeypatch
) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDR", "10.0.0.7:50051")
    assert fdc.storage_backend(config()) == "mooncake"
    assert fdc.cache_config_from_fastdeploy(config()).storage is not None
    assert fdc.storage_directory(config(), 0) is None  # no disk for mooncake
    assert isinstance(fdc.storage_target(config(), 0), MooncakeConnection)
    bad = config(kvcache_storage_backend="attention_store")
    with pytest.raises(
        ValueError, match=r"'attention_store'; fastkv serves 'file' .*'mooncake'"
    ):
        fdc.storage_target(bad, 0)


def test_settings_come_from_config_then_file_then_variables(
    no_mooncake_env, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDR", "10.0.0.1:1")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.2")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("MOONCAKE_RDMA_DEVICES", "mlx5_0")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1GB")
    c = fdc.mooncake_connection(config())
    assert c == MooncakeConnection(
        "10.0.0.1:1", "10.0.0.2", "rdma", "mlx5_0", "P2PHANDSHAKE", 1 << 30
    )
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps({"master_server_addr": "10.0.0.3:3", "global_segment_size": 4096})
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    c = fdc.mooncake_connection(config())
    assert (c.master_address, c.segment_bytes, c.local_hostname) == (
        "10.0.0.3:3",
        4096,
        "10.0.0.2",
    )
    extra = json.dumps({"master_server_addr": "10.0.0.4:4", "metadata_server": "etcd://x:2379"})
    c = fdc.mooncake_connection(config(kvcache_storage_config=extra))
    assert (c.master_address, c.metadata_server, c.segment_bytes) == (
        "10.0.0.4:4",
        "etcd://x:2379",
        4096,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "no master address"),
        ({"master_server_addr": "nocolon"}, "master_address: expected 'host:port'"),
        (
            {"master_server_addr": "h:1", "global_segment_size": "lots"},
            "global_segment_size.*byte count",
        ),
        ({"master_server_addr": "h:1", "global_segment_size": -1}, "global_segment_size.*>= 0"),
        ("{not json", "kvcache_storage_config: not JSON"),
        ([1], "kvcache_storage_config: expected a dict"),
    ],
)
def test_bad_settings_are_refused_by_name(no_mooncake_env, extra: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fdc.mooncake_connection(config(kvcache_storage_config=extra))


def test_two_workers_from_fastdeploy_configs_share_blocks_through_mooncake(
    tmp_path: Path,
) -> None:
    pytest.importorskip("paddle", reason="the worker's CacheController needs paddle")
    out = run_in_netns(HERE / "fd_mooncake_case.py", [str(tmp_path)], tmp_path, timeout_s=180)
    assert out["backends"] == ["MooncakeBackend", "MooncakeBackend"]
    assert out["segments"] == [0, 16 << 20]  # from the variables / from the JSON file
    assert out["write"][0].startswith("TransferResult(transfer_id=40, success=True")
    assert out["lookup_hits"] == [1] and out["load_ok"] == [True] and out["bytes_equal"]
