"""fastkv.worker.numa against fake sysfs trees and a fake nvidia-smi."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from fastkv.worker import numa

TOPO_TABS = (
    "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tSYS\t0-47,96-143\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\t48-95,144-191\t1\t\tN/A\n"
    "NIC0\tSYS\tSYS\t X \t\t\t\t\n"
    "\nLegend:\n  X    = Self\n"
)
TOPO_SPACES = (
    "        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
    "GPU0     X      NV8     0-31            0               N/A\n"
    "GPU1    NV8      X      32-63           1               N/A\n"
)
TOPO_NA = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\tN/A\t\tN/A\n"


def fake_sysfs(root: Path, online: str | None, gpus: dict[str, str]) -> Path:
    node = root / "devices" / "system" / "node"
    node.mkdir(parents=True)
    if online is not None:
        (node / "online").write_text(online + "\n")
        for n in numa.parse_node_list(online):
            (node / f"node{n}").mkdir()
    for bus, value in gpus.items():
        dev = root / "bus" / "pci" / "devices" / bus
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(value + "\n")
    return root


def fake_smi(tmp_path: Path, bus_id: str | None, topo: str | None) -> str:
    """A nvidia-smi stand-in answering the two queries numa.py makes."""
    script = tmp_path / "nvidia-smi"
    (tmp_path / "topo.txt").write_text(topo or "")
    lines = ["#!/bin/sh", f'echo "$@" >> "{tmp_path}/calls.txt"']
    if bus_id is not None:
        lines.append(f'case "$1" in --query-gpu=pci.bus_id) echo "{bus_id}"; exit 0;; esac')
    if topo is not None:
        lines.append(f'if [ "$1" = topo ]; then cat "{tmp_path}/topo.txt"; exit 0; fi')
    lines.append("exit 9")
    script.write_text("\n".join(lines) + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_parse_node_list() -> None:
    assert numa.parse_node_list("0") == [0]
    assert numa.parse_node_list("0-1,3\n") == [0, 1, 3]
    assert numa.parse_node_list("2,0-1") == [0, 1, 2]
    with pytest.raises(ValueError, match="node list"):
        numa.parse_node_list("zero")


def test_count_numa_nodes(tmp_path: Path) -> None:
    assert numa.count_numa_nodes(fake_sysfs(tmp_path / "a", "0-3", {})) == 4
    assert numa.count_numa_nodes(fake_sysfs(tmp_path / "b", None, {})) == 1
    only_dirs = fake_sysfs(tmp_path / "c", None, {})
    for n in (0, 1):
        (only_dirs / "devices" / "system" / "node" / f"node{n}").mkdir()
    assert numa.count_numa_nodes(only_dirs) == 2
    assert numa.count_numa_nodes(tmp_path / "missing") == 1


def test_normalize_bus_id() -> None:
    assert numa.normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert numa.normalize_bus_id("0000:af:00.1") == "0000:af:00.1"
    assert numa.normalize_bus_id("3b:00.0") == "0000:3b:00.0"
    with pytest.raises(ValueError, match="bus_id: 'GPU-1234' is not a PCI bus id"):
        numa.normalize_bus_id("GPU-1234")


def test_pci_numa_node(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, "0-1", {"0000:3b:00.0": "1", "0000:af:00.0": "-1"})
    assert numa.pci_numa_node("00000000:3B:00.0", root) == 1
    assert numa.pci_numa_node("0000:af:00.0", root) is None
    assert numa.pci_numa_node("0000:01:00.0", root) is None


@pytest.mark.parametrize(
    ("text", "device", "node"),
    [
        (TOPO_TABS, 0, 0),
        (TOPO_TABS, 1, 1),
        (TOPO_SPACES, 1, 1),
        (TOPO_TABS, 5, None),
        (TOPO_NA, 0, None),
        ("no table here", 0, None),
    ],
)
def test_numa_node_from_topo(text: str, device: int, node: int | None) -> None:
    assert numa.numa_node_from_topo(text, device) == node


def _one_line(caplog: pytest.LogCaptureFixture) -> str:
    records = [r for r in caplog.records if r.name == "fastkv.worker.numa"]
    assert len(records) == 1, [r.getMessage() for r in records]
    return records[0].getMessage()


def test_single_node_machine_is_a_no_op(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "fastkv.worker.numa")
    root = fake_sysfs(tmp_path, "0", {"0000:3b:00.0": "0"})
    smi = fake_smi(tmp_path, "00000000:3B:00.0", TOPO_TABS)
    assert numa.host_numa_node(0, sysfs_root=root, nvidia_smi=smi) == -1
    assert "1 NUMA node; host cache not bound" in _one_line(caplog)
    assert not (tmp_path / "calls.txt").exists(), "one node: nothing else is probed"


def test_no_gpu_is_a_no_op(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "fastkv.worker.numa")
    root = fake_sysfs(tmp_path, "0-1", {})
    assert numa.host_numa_node(None, sysfs_root=root) == -1
    assert "no GPU" in _one_line(caplog)
    caplog.clear()
    smi = fake_smi(tmp_path, None, None)
    assert numa.host_numa_node(0, sysfs_root=root, nvidia_smi=smi, use_cuda=False) == -1
    assert "GPU 0 not found" in _one_line(caplog)


def test_bus_id_from_nvidia_smi_then_sysfs(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "fastkv.worker.numa")
    root = fake_sysfs(tmp_path, "0-1", {"0000:3b:00.0": "1"})
    smi = fake_smi(tmp_path, "00000000:3B:00.0", None)
    assert numa.host_numa_node(0, sysfs_root=root, nvidia_smi=smi, use_cuda=False) == 1
    line = _one_line(caplog)
    assert "0000:3b:00.0" in line and "node 1 of 2" in line and "via sysfs" in line
    assert "-i 0" in (tmp_path / "calls.txt").read_text()


def test_cuda_visible_devices_maps_the_nvidia_smi_selector(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    smi = fake_smi(tmp_path, "00000000:AF:00.0", None)
    assert numa.gpu_pci_bus_id(1, nvidia_smi=smi, use_cuda=False) == (
        "0000:af:00.0",
        "nvidia-smi",
    )
    assert "-i 1" in (tmp_path / "calls.txt").read_text()
    (tmp_path / "calls.txt").unlink()
    assert numa.gpu_pci_bus_id(0, nvidia_smi=smi, use_cuda=False) is not None
    assert "-i 3" in (tmp_path / "calls.txt").read_text()


def test_topo_fallback_when_sysfs_has_no_affinity(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "fastkv.worker.numa")
    root = fake_sysfs(tmp_path, "0-1", {"0000:3b:00.0": "-1"})
    smi = fake_smi(tmp_path, None, TOPO_TABS)
    assert numa.host_numa_node(1, sysfs_root=root, bus_id="0000:3b:00.0", nvidia_smi=smi) == 1
    assert "via nvidia-smi topo" in _one_line(caplog)


def test_no_affinity_anywhere_leaves_memory_unbound(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, "fastkv.worker.numa")
    root = fake_sysfs(tmp_path, "0-1", {"0000:3b:00.0": "-1"})
    smi = fake_smi(tmp_path, None, TOPO_NA)
    assert numa.host_numa_node(0, sysfs_root=root, bus_id="3b:00.0", nvidia_smi=smi) == -1
    assert "no NUMA affinity" in _one_line(caplog)
    caplog.clear()
    missing = str(tmp_path / "no-such-nvidia-smi")
    assert numa.host_numa_node(0, sysfs_root=root, bus_id="3b:00.0", nvidia_smi=missing) == -1
    assert "no NUMA affinity" in _one_line(caplog)


def test_real_machine_answer_is_consistent() -> None:
    """On this machine: a node id the kernel accepts, or -1."""
    node = numa.host_numa_node(0)
    assert node == -1 or node in numa.parse_node_list(
        Path("/sys/devices/system/node/online").read_text()
    )
    assert numa.count_numa_nodes() >= 1
    assert os.path.isdir("/sys") or numa.count_numa_nodes() == 1
