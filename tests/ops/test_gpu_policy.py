"""The rules `make gpu-test` judges GPU tests by, checked on any machine: under
FASTKV_REQUIRE_GPU a skipped GPU test fails unless it needs more GPUs than the
machine has; the pinned fork test is a GPU test; and "this core runs on this GPU"
follows CUDA's compatibility rules (minor-version compatibility included)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fastkv.ops import core

from .gpu_support import cuda_runtime_problem, gpu_count_reason

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _pytest(args: list[str], cwd: Path, require_gpu: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FASTKV_REQUIRE_GPU"}
    if require_gpu:
        env["FASTKV_REQUIRE_GPU"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# ------------------------------------------------------------ FASTKV_REQUIRE_GPU


def _policy_suite(tmp_path: Path) -> Path:
    """A test folder whose conftest applies tests/ops' hook, with GPU tests that skip
    for the reasons a GPU machine can meet."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import pytest
            from ops.gpu_support import GPUS_MARK, require_gpu_hook

            def pytest_configure(config):
                config.addinivalue_line("markers", "gpu: needs a GPU")
                config.addinivalue_line("markers", GPUS_MARK + "(n): needs n GPUs")

            @pytest.hookimpl(hookwrapper=True)
            def pytest_runtest_makereport(item, call):
                outcome = yield
                require_gpu_hook(item, outcome.get_result())
            """
        )
    )
    (tmp_path / "test_policy.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from ops.gpu_support import needs_gpus

            @pytest.mark.gpu
            @needs_gpus(4096)
            def test_needs_more_gpus_than_any_machine():
                raise AssertionError("must not run")

            @pytest.mark.gpu
            @needs_gpus(1)
            def test_has_its_gpus_but_skips_for_another_reason():
                pytest.skip("something else went missing")

            @pytest.mark.gpu
            def test_gpu_test_that_skips():
                pytest.skip("no CuPy")

            @pytest.mark.gpu
            def test_paddle_part():
                pytest.skip("needs paddlepaddle-gpu: paddle is not installed")

            def test_cpu_test_that_skips():
                pytest.skip("not a GPU test")
            """
        )
    )
    return tmp_path


def _outcomes(out: str) -> dict[str, str]:
    """test name -> PASSED/FAILED/SKIPPED from pytest -v's per-test lines."""
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("test_policy.py::"):
            found[parts[0].split("::")[1]] = parts[1]
    return found


def test_under_require_gpu_only_absent_hardware_and_paddle_gpu_may_skip(tmp_path: Path) -> None:
    suite = _policy_suite(tmp_path)
    proc = _pytest(["-v", "-rs", "test_policy.py"], suite, require_gpu=True)
    out = proc.stdout + proc.stderr
    got = _outcomes(out)
    present = core.cuda_device_count()
    assert got["test_needs_more_gpus_than_any_machine"] == "SKIPPED", out
    assert gpu_count_reason(4096, present) in out
    assert got["test_gpu_test_that_skips"] == "FAILED", out
    assert "GPU test skipped under FASTKV_REQUIRE_GPU=1: Skipped: no CuPy" in out
    assert got["test_paddle_part"] == "SKIPPED", out
    assert got["test_cpu_test_that_skips"] == "SKIPPED", out
    # needs_gpus is no blanket pass: with too few GPUs the body never runs; with
    # enough, any skip of it fails like any other GPU test's.
    expected = "FAILED" if present >= 1 else "SKIPPED"
    assert got["test_has_its_gpus_but_skips_for_another_reason"] == expected, out
    assert proc.returncode == 1, out
    plain = _pytest(["-v", "test_policy.py"], suite, require_gpu=False)
    without = _outcomes(plain.stdout + plain.stderr)
    assert set(without.values()) == {"SKIPPED"}, without


def test_the_two_gpu_test_says_it_needs_two_gpus() -> None:
    """On a one-GPU machine its skip stands under FASTKV_REQUIRE_GPU (it used to skip
    from its body and fail `make gpu-test` on every machine lent)."""
    proc = _pytest(["--co", "-q", "-m", "gpus", "tests/ops/test_cuda_gpu.py"], ROOT, False)
    listed = [line for line in proc.stdout.splitlines() if "::" in line]
    assert listed == [
        "tests/ops/test_cuda_gpu.py::test_using_device_1_creates_no_context_on_device_0"
    ], proc.stdout + proc.stderr
    body = (ROOT / "tests/ops/test_cuda_gpu.py").read_text()
    assert 'pytest.skip("needs two GPUs' not in body


def test_the_pinned_fork_test_runs_with_the_gpu_tests() -> None:
    proc = _pytest(["--co", "-q", "-m", "gpu", "tests/ops/test_cuda_report.py"], ROOT, False)
    listed = [line for line in proc.stdout.splitlines() if "::" in line]
    assert listed == [
        "tests/ops/test_cuda_report.py::test_a_forked_child_does_not_inherit_the_host_tier[True]"
    ], proc.stdout + proc.stderr


# ------------------------------------------------------- runtime compatibility


def _info(runtime: int, driver: int, archs: str, status: str = "ok") -> core.CudaInfo:
    return core.CudaInfo(True, runtime, driver, 1, tuple(archs.split()), status)


DEFAULT = "sm_75 sm_80 sm_86 sm_89 sm_90 sm_100 sm_120 compute_75"


def test_an_older_driver_minor_than_the_runtime_is_fine_with_sass() -> None:
    """CUDA 13.1 runtime on a driver for 13.0 (minor-version compatibility): the old
    assertion (driver >= runtime) called this a failure."""
    info = _info(13010, 13000, DEFAULT)
    assert info.driver_version < info.runtime_version
    assert cuda_runtime_problem(info, 90) is None
    assert cuda_runtime_problem(info, 86) is None
    assert cuda_runtime_problem(info, 87) is None  # sm_86 SASS runs on 8.7
    assert cuda_runtime_problem(_info(13000, 13020, DEFAULT), 90) is None


def test_what_the_core_needs_of_the_driver_and_the_targets() -> None:
    older_major = cuda_runtime_problem(_info(13000, 12080, DEFAULT), 90)
    assert older_major is not None and "12.8" in older_major and "13.0" in older_major
    # Only PTX for a newer GPU: a driver at least as new as the runtime JITs it ...
    assert cuda_runtime_problem(_info(13000, 13000, "sm_80 compute_80"), 90) is None
    # ... an older one cannot, so under minor-version compatibility it needs SASS.
    no_jit = cuda_runtime_problem(_info(13010, 13000, "sm_80 compute_80"), 90)
    assert no_jit is not None and "cannot JIT" in no_jit and "sm_90" in no_jit
    # SASS of another major version never runs, and PTX never runs on an older GPU.
    assert cuda_runtime_problem(_info(13000, 13000, "sm_90 compute_90"), 100) is None
    assert cuda_runtime_problem(_info(13000, 13000, "sm_90 compute_90"), 89) is not None
    assert cuda_runtime_problem(_info(13000, 13000, "sm_100"), 90) is not None
    bad = _info(13000, 13000, DEFAULT, "the driver (CUDA 13.0) sees no CUDA device")
    assert "sees no CUDA device" in (cuda_runtime_problem(bad, 90) or "")
