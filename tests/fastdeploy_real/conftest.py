"""Tests against FastDeploy's real engine code (`make fd-test`).

Runs in build/venv-fd with FastDeploy's snapshot on PYTHONPATH. The environment
FastDeploy reads is set before anything imports it: the v1 cache manager on, its
logs under a temporary directory. fastkv goes in as docs/fastdeploy.md tells users:
`fastkv.integrations.fastdeploy.install()` before FastDeploy builds its cache
classes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["ENABLE_V1_KVCACHE_MANAGER"] = "1"
os.environ.setdefault("FD_LOG_DIR", tempfile.mkdtemp(prefix="fd-real-log-"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_fd_config import build_fd_config, write_tiny_qwen2
from real_fd_engine import Engine

import fastkv.integrations.fastdeploy as fkv_fd


@pytest.fixture(scope="session")
def installed() -> Iterator[list[str]]:
    """fastkv's classes in FastDeploy's modules for the whole session."""
    replaced = fkv_fd.install()
    yield replaced
    fkv_fd.uninstall()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture
def channel(monkeypatch: pytest.MonkeyPatch) -> str:
    """A results-channel name of this test's own (the engine and its workers
    share it through FASTKV_RESULTS_CHANNEL, as docs/fastdeploy.md says)."""
    name = f"fd-real-{os.getpid()}-{os.urandom(6).hex()}"
    monkeypatch.setenv(fkv_fd.CHANNEL_ENV, name)
    return name


@pytest.fixture
def make_engine(
    installed: list[str], model_dir: Path, channel: str
) -> Iterator[Callable[..., Engine]]:
    """Engines over fresh FDConfigs (`build_fd_config`'s keywords), closed after
    the test as FastDeploy's teardown would."""
    engines: list[Engine] = []

    def make(
        *,
        fail_rate: float = 0.0,
        mtp_layers: int = 0,
        runner_change: bool = False,
        spec_tokens: int = 0,
        **config: Any,
    ) -> Engine:
        config.setdefault("num_gpu_blocks", 24)
        engine = Engine(
            build_fd_config(model_dir, **config),
            fail_rate=fail_rate,
            mtp_layers=mtp_layers,
            runner_change=runner_change,
            spec_tokens=spec_tokens,
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
