"""What the core says about CUDA where it cannot use it, knobs read once per
process, and host tiers that a fork does not inherit. These run everywhere; the
"no device" cases skip (saying so) on a machine that has one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastkv.ops import core

NO_DEVICE = pytest.mark.skipif(
    core.cuda_device_count() > 0, reason="checks the no-device report; this machine has one"
)


def _python(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_info_reports_the_build() -> None:
    info = core.cuda_info()
    assert info.built_with_cuda == core.built_with_cuda()
    if info.built_with_cuda:
        assert info.runtime_version >= 12000
        assert info.archs and all(a.startswith(("sm_", "compute_")) for a in info.archs)
        assert "CUDA runtime" in info.describe() and " ".join(info.archs) in info.describe()
    else:
        assert info.archs == () and "built without CUDA" in info.status


@NO_DEVICE
def test_zero_devices_always_come_with_a_reason() -> None:
    info = core.cuda_info()
    assert info.device_count == 0 == core.cuda_device_count()
    assert info.status != "ok"
    if info.built_with_cuda and info.driver_version == 0:
        assert "no NVIDIA driver" in info.status
    elif info.built_with_cuda and info.driver_version < info.runtime_version:
        assert "update the driver" in info.status and "rebuild" in info.status


@NO_DEVICE
def test_cuda_entry_points_fail_with_the_reason_not_a_crash() -> None:
    reason = core.cuda_info().status
    with pytest.raises(RuntimeError) as info:
        core.cuda_init(0)
    assert reason in str(info.value) or "built without CUDA" in str(info.value)
    with pytest.raises(RuntimeError):
        core.stream_create(0, priority=1)
    with pytest.raises(RuntimeError):
        core.event_create(0)
    with pytest.raises(RuntimeError):
        core.Layout([(4096, 8192, 64)], 1, 1, 1, device=0)


def test_cuda_knobs_are_read_from_the_environment_once() -> None:
    """getenv on every call cost time on the launch path; the values are read at the
    first use and a later change of the environment does not apply."""
    code = (
        "import os; from fastkv.ops import core\n"
        "first = core.get_cuda_tuning()\n"
        "os.environ['FASTKV_CUDA_MAX_CTAS'] = '9'\n"
        "os.environ['FASTKV_CUDA_MEMCPY_MIN_BYTES'] = '99'\n"
        "print(first, core.get_cuda_tuning())"
    )
    out = _python(code, {"FASTKV_CUDA_MAX_CTAS": "7", "FASTKV_CUDA_MEMCPY_MIN_BYTES": "4096"})
    assert out == "(4096, 7) (4096, 7)"


def test_evict_launch_bound_is_read_from_the_environment_once() -> None:
    code = (
        "import os; from fastkv.ops import core\n"
        "first = core.get_cuda_evict_launch_bytes()\n"
        "os.environ['FASTKV_CUDA_EVICT_LAUNCH_BYTES'] = '99'\n"
        "print(first, core.get_cuda_evict_launch_bytes())"
    )
    assert _python(code, {"FASTKV_CUDA_EVICT_LAUNCH_BYTES": "65536"}) == "65536 65536"
    default = "from fastkv.ops import core; print(core.get_cuda_evict_launch_bytes())"
    assert _python(default, {"FASTKV_CUDA_EVICT_LAUNCH_BYTES": ""}) == str(2 << 20)


@pytest.mark.parametrize(
    "pinned",
    # The pinned case is a GPU test: `make gpu-test` (-m gpu) runs it and, there, its
    # skip would fail.
    [False, pytest.param(True, marks=pytest.mark.gpu)],
)
def test_a_forked_child_does_not_inherit_the_host_tier(pinned: bool) -> None:
    """MADV_DONTFORK: the tier is absent from a child's address space, so a fork
    neither copies nor shares hundreds of GB of (pinned) pages."""
    if pinned and core.cuda_device_count() == 0:
        pytest.skip("pinning needs a CUDA device; the unpinned tier is checked")
    code = f"""
import os
from fastkv.ops import core
n = 8 << 20
ptr = core.host_alloc(n, pin={pinned}, device={0 if pinned else -1})
def mapped(pid):
    with open(f"/proc/{{pid}}/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, b"1" if mapped("self") else b"0")
    os._exit(0)
os.waitpid(pid, 0)
print(mapped("self"), os.read(r, 1).decode())
core.host_free(ptr, n, {pinned})
"""
    assert _python(code) == "True 0"
