"""The cache's life around requests, through FastDeploy's real call sites: pause
(abort every request, then `reset_cache`), KV sleep and wake-up, the profile run's
init -> free -> init and `update_cache_config`, MTP caches, and what a dropped
engine leaves behind (issue 17)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
from real_fd_config import BLOCK_SIZE as BS
from real_fd_config import LAYERS, build_fd_config
from real_fd_engine import Engine
from real_fd_model import prompt
from real_fd_runner import StandInRunner


def pause(engine: Engine, max_steps: int = 500) -> bool:
    """`EngineService._control_pause` as far as it reaches the resource manager and
    the cache: every request aborted, the scheduling loop run until the resource
    manager holds none, then `cache_manager.reset_cache()`. Returns its answer."""
    rm = engine.rm
    rm.log_status()
    rm.add_abort_req_ids(list(rm.requests.keys()))
    for _ in range(max_steps):  # _wait_inflight_drained, the loop still scheduling
        if not rm.requests:
            break
        late = set(rm.requests) - rm.waiting_abort_req_id_set - rm.to_be_aborted_req_id_set
        if late:
            rm.add_abort_req_ids(list(late))
        engine.step()
    assert not rm.requests, f"pause: still {list(rm.requests)} after {max_steps} steps"
    return rm.cache_manager.reset_cache()


def test_pause_aborts_and_reset_cache_forgets(make_engine: Any) -> None:
    """Pause with requests decoding, host copies in flight: every request ends
    (aborted), `reset_cache()` at FastDeploy's call site forgets every block, and
    requests after the resume get no hit and right KV."""
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=8, max_num_seqs=3)
    prompts = [prompt(60 + i, 2 * BS + 3) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(f"old{i}", p, 40)
    engine.step_until(lambda: bool(engine.rm.running))
    engine.step()
    assert engine.rm.running, "the pause must find requests running"
    assert pause(engine) is True
    stats = engine.cache_manager.get_stats()
    assert stats["cached_nodes"] == 0 and stats["active_requests"] == 0, stats
    for i, p in enumerate(prompts):
        engine.add_request(f"new{i}", p, 5)
    engine.run()
    assert all(engine.log.cached_tokens[f"new{i}"] == 0 for i in range(3)), engine.log
    engine.check_clean(aborted=frozenset(f"old{i}" for i in range(3)))


def test_sleep_and_wakeup_of_the_kv_cache(make_engine: Any) -> None:
    """`/sleep` with kv_cache: pause, `reset_cache()` (prefix caching on), every
    runner's `clear_cache()` (free_gpu_cache); `/wakeup`: `initialize_kv_cache()`
    again. The new tensors hold nothing, so nothing cached before may hit."""
    engine = make_engine(num_gpu_blocks=16, num_cpu_blocks=8)
    p = prompt(70, 3 * BS)
    engine.add_request("before", [*p, 5], 4)
    engine.run()
    assert pause(engine) is True
    assert engine.cache_manager.reset_cache() is True  # the sleep's own call
    for runner in engine.runners:
        runner.clear_cache()
    for runner in engine.runners:
        runner.initialize_kv_cache()
    engine.add_request("after", [*p, 6], 4)
    engine.run()
    assert engine.log.cached_tokens["after"] == 0
    engine.check_clean()


@pytest.mark.parametrize("blocks", [20, 10])
def test_profile_then_update_cache_config(make_engine: Any, blocks: int) -> None:
    """The profile run's pattern: caches made with the profile's block count,
    freed, the engine's `cache_config.reset(n)` and
    `resource_manager.reset_cache_config(cache_config)` (update_cache_config),
    the runners' `update_share_input_block_num(n)`; then real work on n blocks."""
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=8, max_num_seqs=3)
    for runner in engine.runners:  # end of profile_run
        runner.clear_cache()
    cc = engine.fd_config.cache_config
    cc.reset(blocks)
    engine.rm.reset_cache_config(cc)
    for runner in engine.runners:
        runner.update_share_input_block_num(blocks)
    assert engine.cache_manager.num_gpu_blocks == blocks
    for i in range(6):
        engine.add_request(f"u{i}", prompt(80 + i % 3, 3 * BS + i), 12)
    engine.run()
    assert engine.cache_manager.num_gpu_blocks == blocks
    engine.check_clean()


def test_free_gpu_cache_releases_every_kv_tensor(make_engine: Any) -> None:
    """Issue 17: after the runner's `clear_cache()` (free_gpu_cache) and its own
    references dropped, no KV tensor is reachable; init -> free -> init works and
    the second cache serves requests."""
    engine = make_engine(num_gpu_blocks=16, num_cpu_blocks=8)
    runner = engine.runners[0]
    refs = [weakref.ref(t) for t in runner.caches]
    assert len(refs) == 2 * LAYERS
    runner.clear_cache()
    gc.collect()
    alive = [i for i, r in enumerate(refs) if r() is not None]
    assert not alive, f"tensors {alive} of {len(refs)} still reachable after free_gpu_cache"
    runner.initialize_kv_cache()
    engine.add_request("again", prompt(90, 2 * BS + 1), 6)
    engine.run()
    engine.check_clean()


def test_get_kv_caches_has_fastdeploys_names(make_engine: Any) -> None:
    """`get_kv_caches()` is FastDeploy's name -> tensor dict, layer-major and named
    as its runner names them; `initialize_kv_cache` returns the same tensors flat."""
    engine = make_engine(num_gpu_blocks=16, tensor_parallel_size=2)
    for runner in engine.runners:
        names = [
            f"{kind}_{layer}_rank{runner.rank}.device{runner.device_id}"
            for layer in range(LAYERS)
            for kind in ("key_caches", "value_caches")
        ]
        kvs = runner.cache_kvs_map
        assert isinstance(kvs, dict) and list(kvs) == names, list(kvs)
        assert all(a is b for a, b in zip(kvs.values(), runner.caches, strict=True))


def test_mtp_caches(make_engine: Any) -> None:
    """With an MTP proposer the runner also calls `initialize_mtp_kv_cache` (its
    layers after the model's); `get_kv_caches()` then names them too, and swaps
    still leave every position right, the MTP layer's too (the stand-in runner
    reads and writes them after the main layers)."""
    engine = make_engine(num_gpu_blocks=12, num_cpu_blocks=16, mtp_layers=1)
    runner = engine.runners[0]
    assert len(runner.mtp_caches) == 2
    assert f"key_caches_{LAYERS}_rank0.device0" in runner.cache_kvs_map
    for rnd in range(2):
        for i in range(4):
            engine.add_request(f"m{i}-{rnd}", [*prompt(95 + i, 3 * BS), rnd + 7], 3)
            engine.run()
    engine.check_clean()


def test_second_resource_manager_on_the_same_port(
    installed: list[str], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 17: a ResourceManagerV1 dropped without a collector run frees its
    results channel's name (derived from the engine-worker queue port), so the
    next one on the same port builds (FastDeploy's own tests do this)."""
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    from fastkv.integrations.fastdeploy import CHANNEL_ENV

    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    config = build_fd_config(model_dir, num_gpu_blocks=16)

    def build() -> Any:
        sc, pc = config.scheduler_config, config.parallel_config
        return ResourceManagerV1(
            sc.max_num_seqs, config, pc.tensor_parallel_size, sc.splitwise_role, 0
        )

    gc.collect()
    gc.disable()
    try:
        first = build()
        assert first.cache_manager.results.name.startswith("fd-")
        del first
        second = build()  # raised OSError: address in use
    finally:
        gc.enable()
    close = getattr(second.cache_manager, "close", None)
    if close is not None:
        close()


def test_sitecustomize_route(tmp_path: Path, model_dir: Path) -> None:
    """fastkv put in by a `sitecustomize.py` as docs/fastdeploy.md says: a FastDeploy
    process builds fastkv's classes, and a Python process that never imports
    FastDeploy does not pay for it (neither fastdeploy nor paddle imported)."""
    import fastdeploy

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # docs/fastdeploy.md's sitecustomize.py
        "from fastkv.integrations.fd_hook import install_on_import\ninstall_on_import()\n"
    )
    fd_src = Path(fastdeploy.__file__).resolve().parents[1]
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(fd_src), str(repo)])
    env["ENABLE_V1_KVCACHE_MANAGER"] = "1"
    env["FASTKV_RESULTS_CHANNEL"] = f"fd-real-site-{os.getpid()}"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from pathlib import Path
        from real_fd_config import build_fd_config
        from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
        import fastdeploy.cache_manager.v1 as v1
        config = build_fd_config(Path({str(model_dir)!r}), num_gpu_blocks=16)
        rm = ResourceManagerV1(4, config, 1, "mixed", 0)
        print(type(rm.cache_manager).__module__, v1.CacheController.__module__)
        rm.cache_manager.close()
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last == "fastkv.integrations.fd_scheduler fastkv.integrations.fd_worker", last
    plain = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; print(sorted({'fastdeploy', 'paddle'} & set(sys.modules)))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.strip() == "[]", "sitecustomize imported " + plain.stdout.strip()


def test_stand_in_runner_uses_the_installed_controller(
    installed: list[str], model_dir: Path, channel: str
) -> None:
    """The runner looks its controller up where gpu_model_runner imports it from."""
    from fastkv.integrations.fastdeploy import FastDeployCacheController

    runner = StandInRunner(build_fd_config(model_dir, num_gpu_blocks=16), 0)
    assert isinstance(runner.cache_controller, FastDeployCacheController)
    runner.cache_controller.free_cache()


def test_copies_after_a_pause_run_in_the_next_cache_epoch(make_engine: Any) -> None:
    """Transfer ids restart after the pause's `reset_cache`: the next epoch's
    evictions and swap-ins carry it in their tags through FastDeploy's
    BatchRequest, both ranks echo it, and their results apply (none is taken for
    a report from before the pause)."""
    engine = make_engine(
        num_gpu_blocks=12,
        num_cpu_blocks=16,
        tensor_parallel_size=2,
        write_policy="write_back",
        max_num_seqs=1,
        max_model_len=80,
        max_num_batched_tokens=80,
    )
    base = prompt(50, 2 * BS)

    def device_and_host_hits(tag: str) -> tuple[int, int]:
        engine.add_request(f"base-{tag}", base + prompt(51, 3 * BS), 2)
        engine.run()
        engine.add_request(f"keep-{tag}", base + prompt(52, 2), 2)
        engine.run()
        engine.add_request(f"fill-{tag}", prompt(53, 9 * BS), 2)  # evicts the tail
        engine.run()
        engine.settle()
        engine.add_request(f"both-{tag}", base + prompt(51, 3 * BS) + prompt(54, 3), 2)
        engine.run()
        return engine.log.hits[f"both-{tag}"]

    cm = engine.cache_manager
    assert all(device_and_host_hits("before"))
    epoch = cm.manager.epoch
    assert pause(engine) is True
    assert cm.manager.epoch == epoch + 1
    assert all(device_and_host_hits("after")), engine.log.hits
    stats = cm.get_stats()
    assert stats["device_to_host_transfers"] > 0 and stats["host_to_device_transfers"] > 0
    assert stats["results_stale"] == 0 and stats["results_unknown"] == 0, stats
    engine.check_clean()
