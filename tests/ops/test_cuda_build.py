"""How the CUDA core is built: the toolkit matches Paddle's CUDA major version (a
mismatch stops the build and says what to install), a CPU Paddle builds with any
nvcc, the architectures are SASS 75/80/86/89/90 (+100/120) and PTX of the lowest,
and the built library holds exactly what its own report says."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fastkv.ops import core
from fastkv.ops import cuda_build as cb

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "fastkv" / "ops" / "libfastkv_core.so"


def fake_nvcc(directory: Path, version: str) -> str:
    """An executable answering `--version` like nvcc `version` and `--list-gpu-code`
    like that toolkit."""
    bindir = directory / "bin"
    bindir.mkdir(parents=True)
    nvcc = bindir / "nvcc"
    major = int(version.split(".")[0])
    codes = "sm_75 sm_80 sm_86 sm_87 sm_89 sm_90" + (" sm_100 sm_120" if major >= 13 else "")
    nvcc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--list-gpu-code" ]; then '
        f"for c in {codes}; do echo $c; done; exit 0; fi\n"
        f'echo "Cuda compilation tools, release {version}, V{version}.1"\n'
    )
    nvcc.chmod(0o755)
    return str(nvcc)


# ------------------------------------------------------------- toolkit choice


def test_nvcc_version_and_candidates_are_found(tmp_path: Path) -> None:
    root = tmp_path / "usr_local"
    n124 = fake_nvcc(root / "cuda-12.4", "12.4")
    n130 = fake_nvcc(root / "cuda-13.0", "13.0")
    n118 = fake_nvcc(root / "cuda-11.8", "11.8")
    assert cb.nvcc_version(n124) == (12, 4)
    env = {"PATH": "/nonexistent"}
    assert cb.candidate_nvccs(env, roots=[str(root)]) == [n130, n124, n118]  # newest first
    home = fake_nvcc(tmp_path / "home", "12.8")
    env["CUDA_HOME"] = str(tmp_path / "home")
    assert cb.candidate_nvccs(env, roots=[str(root)])[0] == home
    assert cb.nvcc_version(str(tmp_path / "missing")) is None


def test_paddle_with_cuda_12_gets_a_cuda_12_toolkit() -> None:
    tk13, tk124 = cb.Toolkit("/a/nvcc", (13, 0)), cb.Toolkit("/b/nvcc", (12, 4))
    assert cb.select_toolkit("12.6", [tk13, tk124]) == tk124
    assert cb.select_toolkit("13.0", [tk124, tk13]) == tk13


def test_a_missing_matching_toolkit_stops_the_build_saying_what_to_install() -> None:
    tk13 = cb.Toolkit("/usr/local/cuda/bin/nvcc", (13, 0))
    with pytest.raises(cb.ToolkitError) as info:
        cb.select_toolkit("12.6", [tk13])
    msg = str(info.value)
    assert "built for CUDA 12.6" in msg and "CUDA 12.x toolkit" in msg
    assert "cuda-toolkit-12-6" in msg and "CUDA_HOME" in msg and "FASTKV_WITH_CUDA=0" in msg
    assert "13.0 at /usr/local/cuda/bin/nvcc" in msg
    with pytest.raises(cb.ToolkitError, match="nvcc found: none"):
        cb.select_toolkit("12.2", [])


def test_cuda_home_of_another_major_version_is_refused() -> None:
    tk13, tk12 = cb.Toolkit("/opt/cuda13/bin/nvcc", (13, 0)), cb.Toolkit("/b/nvcc", (12, 4))
    with pytest.raises(cb.ToolkitError, match=r"CUDA_HOME: /opt/cuda13/bin/nvcc is CUDA 13\.0"):
        cb.select_toolkit("12.6", [tk13, tk12], explicit=tk13.nvcc)
    assert cb.select_toolkit("12.6", [tk12, tk13], explicit=tk12.nvcc) == tk12


def test_cpu_paddle_builds_with_whatever_nvcc_is_there() -> None:
    tk13 = cb.Toolkit("/usr/local/cuda/bin/nvcc", (13, 0))
    assert cb.select_toolkit(None, [tk13]) == tk13
    assert cb.select_toolkit(None, []) is None


def test_paddle_cuda_version_reads_paddle_version_cuda(tmp_path: Path) -> None:
    fake = tmp_path / "paddle"
    fake.mkdir()
    (fake / "__init__.py").write_text("from . import version\n")
    (fake / "version.py").write_text("def cuda():\n    return '12.6'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = "from fastkv.ops import cuda_build as cb; print(cb.paddle_cuda_version())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "12.6"


def test_the_cpu_paddle_here_reports_no_cuda() -> None:
    pytest.importorskip("paddle", reason="checks the installed Paddle")
    import paddle

    if paddle.is_compiled_with_cuda():
        pytest.skip("this Paddle has CUDA")
    assert str(paddle.version.cuda()) == "False"
    assert cb.paddle_cuda_version(sys.executable) is None


def test_setup_refuses_a_toolkit_that_does_not_match_paddle(tmp_path: Path) -> None:
    """The real setup.py, with a Paddle that says CUDA 12.6 and only CUDA 13 around:
    it stops before compiling anything, saying what to install."""
    fake = tmp_path / "site" / "paddle"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("from . import version\n")
    (fake / "version.py").write_text("def cuda():\n    return '12.6'\n")
    home = tmp_path / "cuda13"
    fake_nvcc(home, "13.0")
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "site"),
        "CUDA_HOME": str(home),
        "FASTKV_BUILD_PADDLE_OPS": "0",
    }
    build = tmp_path / "build"
    proc = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "build_ext",
            "--build-temp",
            str(build / "tmp"),
            "--build-lib",
            str(build / "lib"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "built for CUDA 12.6" in out and "CUDA_HOME" in out, out[-2000:]
    assert not list(build.glob("lib/**/libfastkv_core.so"))


# -------------------------------------------------------------- architectures


def test_default_architectures_and_ptx_of_the_lowest() -> None:
    archs, ptx = cb.select_archs({75, 80, 86, 87, 89, 90, 100, 120}, None)
    assert archs == [75, 80, 86, 89, 90, 100, 120] and ptx == 75
    archs, ptx = cb.select_archs({75, 80, 86, 89, 90}, "")  # a CUDA 12.4 toolkit
    assert archs == [75, 80, 86, 89, 90] and ptx == 75
    assert cb.gencode_flags([75, 90], 75)[-1] == "arch=compute_75,code=compute_75"
    assert cb.arch_list([75, 90], 75) == "sm_75 sm_90 compute_75"


def test_requested_and_extra_architectures_are_checked() -> None:
    assert cb.select_archs({80, 90}, "90 80") == ([80, 90], 80)
    assert cb.select_archs({75, 80, 86, 87, 89, 90}, None, "8.7")[0] == [75, 80, 86, 87, 89, 90]
    with pytest.raises(cb.ToolkitError, match="FASTKV_CUDA_ARCHS: sm_70 is not supported"):
        cb.select_archs({75, 80}, "70")
    with pytest.raises(cb.ToolkitError, match="not a list of numbers"):
        cb.select_archs({75, 80}, "ampere")


def find_cuobjdump() -> str | None:
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    found = [str(Path(c) / "bin" / "cuobjdump") for c in candidates if c]
    purelib = sysconfig.get_paths()["purelib"]
    found += glob.glob(os.path.join(purelib, "nvidia", "cu*", "bin", "cuobjdump"))
    return next((f for f in found if os.access(f, os.X_OK)), None)


def fatbin_entries(data: bytes) -> list[tuple[str, int]]:
    """(kind, arch) of every entry of the fatbinaries in an ELF file's bytes: a
    reader of the fatbin container, independent of the CUDA tools."""
    magic = struct.pack("<I", 0xBA55ED50)
    entries = []
    pos = data.find(magic)
    while pos >= 0:
        _, header, size = struct.unpack_from("<HHQ", data, pos + 4)
        p, end = pos + header, pos + header + size
        while p < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            entries.append(("ptx" if kind == 1 else "elf", arch))
            p += entry_header + payload
        pos = data.find(magic, end)
    return entries


@pytest.mark.skipif(not core.built_with_cuda(), reason="the core was built without nvcc")
def test_built_library_holds_the_architectures_it_reports() -> None:
    info = core.cuda_info()
    reported_sass = sorted(int(a[3:]) for a in info.archs if a.startswith("sm_"))
    reported_ptx = [int(a[8:]) for a in info.archs if a.startswith("compute_")]
    entries = fatbin_entries(LIB.read_bytes())
    assert sorted(a for k, a in entries if k == "elf") == reported_sass
    assert [a for k, a in entries if k == "ptx"] == reported_ptx == [min(reported_sass)]
    cuobjdump = find_cuobjdump()
    if cuobjdump is not None:  # the CUDA tool agrees with the reader above
        elf = subprocess.run(
            [cuobjdump, "--list-elf", str(LIB)], capture_output=True, text=True, check=True
        ).stdout
        ptx = subprocess.run(
            [cuobjdump, "--list-ptx", str(LIB)], capture_output=True, text=True, check=True
        ).stdout
        assert sorted(int(a) for a in _sm_list(elf, "cubin")) == reported_sass
        assert [int(a) for a in _sm_list(ptx, "ptx")] == reported_ptx
    if not os.environ.get("FASTKV_CUDA_ARCHS"):  # the default build covers T4 .. H100
        assert {75, 80, 86, 89, 90} <= set(reported_sass)


def _sm_list(listing: str, suffix: str) -> list[str]:
    import re

    return re.findall(rf"\.sm_(\d+)\.{suffix}", listing)


# ----------------------------------------------------------- up-to-date builds


def test_a_library_built_otherwise_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same configuration is up to date; another one (compiler flags here,
    toolkit or architectures alike) rebuilds, and a stamp is per output path."""
    from fastkv.ops import native_build as nb

    monkeypatch.setenv("FASTKV_WITH_CUDA", "0")
    monkeypatch.setenv("CXX", "c++")
    out, tmp = tmp_path / "a" / nb.CORE_LIB, tmp_path / "tmp"
    nb.build_core(out, tmp)
    assert "built" in capsys.readouterr().out
    nb.build_core(out, tmp)
    assert "is up to date" in capsys.readouterr().out
    monkeypatch.setenv("CXX", "c++ -DFASTKV_ANOTHER_BUILD")
    nb.build_core(out, tmp)
    assert f"built {out}" in capsys.readouterr().out
    nb.build_core(tmp_path / "b" / nb.CORE_LIB, tmp)  # same temp folder, other output
    assert "built" in capsys.readouterr().out


def test_paddle_ops_built_against_another_paddle_are_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build folder shared by two environments (the .venv's CPU Paddle and a user's
    paddlepaddle-gpu): the op library linked against the other Paddle is not taken
    as up to date. The compiler is `false`, so any rebuild attempt shows as an error."""
    pytest.importorskip("paddle", reason="the Paddle op build needs paddle")
    from fastkv.ops import native_build as nb

    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("FASTKV_BUILD_PADDLE_OPS", "1")
    ops, tmp = tmp_path / "ops", tmp_path / "tmp"
    ops.mkdir()
    tmp.mkdir()
    (ops / nb.CORE_LIB).write_bytes(b"core")
    out = ops / nb.PADDLE_LIB
    out.write_bytes(b"ops")
    later = out.stat().st_mtime + 3600  # newer than every input
    os.utime(out, (later, later))
    config = nb.paddle_ops_config()[2]
    stamp = nb._stamp(tmp, out.resolve())
    stamp.write_text(config)
    assert nb.build_paddle_ops(out, tmp) is True  # up to date: the compiler never ran
    # The same folder, built from an environment whose Paddle lives elsewhere.
    from paddle.utils.cpp_extension import extension_utils

    elsewhere = ["/opt/another-env/site-packages/paddle/libs"]
    monkeypatch.setattr(extension_utils, "find_paddle_libraries", lambda use_cuda: elsewhere)
    assert json.loads(nb.paddle_ops_config()[2])["lib_dirs"] == elsewhere
    with pytest.raises(nb.NativeBuildError, match=r"compile fastkv_paddle_ops\.cc failed"):
        nb.build_paddle_ops(out, tmp)
