"""Which NUMA node the host KV cache should live on.

Host-to-GPU copies read host memory through the PCIe root complex of the GPU's
socket; a host cache on the other socket crosses the inter-socket link on every
transfer. So the host tier is bound to the GPU's node: its PCI bus id (from the
CUDA runtime through the fastkv core, else `nvidia-smi --query-gpu=pci.bus_id`)
gives `/sys/bus/pci/devices/<bus id>/numa_node`; when sysfs has no answer,
`nvidia-smi topo -m`'s "NUMA Affinity" column does.

Everything here reads files and runs nvidia-smi only; it imports neither paddle nor
cupy. `sysfs_root` and `nvidia_smi` are parameters so tests can point them at fakes.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

log = logging.getLogger("fastkv.worker.numa")

_SMI_TIMEOUT_S = 10.0
_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def parse_node_list(text: str) -> list[int]:
    """Parses a sysfs node list ("0-1,3") into sorted node ids.

    Raises:
        ValueError: the text is not a node list.
    """
    nodes: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"node list: {text.strip()!r} is not like '0-1,3'") from None
        nodes.update(range(first, last + 1))
    return sorted(nodes)


def count_numa_nodes(sysfs_root: str | os.PathLike[str] = "/sys") -> int:
    """Online NUMA nodes per `<sysfs_root>/devices/system/node/online`.

    Returns:
        The count; 1 when sysfs has no NUMA information (a kernel without NUMA).
    """
    node_dir = Path(sysfs_root) / "devices" / "system" / "node"
    try:
        nodes = parse_node_list((node_dir / "online").read_text())
    except (OSError, ValueError):
        nodes = [int(p.name[4:]) for p in node_dir.glob("node[0-9]*") if p.name[4:].isdigit()]
    return max(1, len(nodes))


def normalize_bus_id(bus_id: str) -> str:
    """Spells a PCI bus id as sysfs does: "00000000:3B:00.0" -> "0000:3b:00.0".

    Raises:
        ValueError: not a PCI bus id.
    """
    m = _BUS_ID.match(bus_id.strip())
    if not m:
        raise ValueError(f"bus_id: {bus_id!r} is not a PCI bus id like 0000:3b:00.0")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


def pci_numa_node(bus_id: str, sysfs_root: str | os.PathLike[str] = "/sys") -> int | None:
    """NUMA node of a PCI device from `<sysfs_root>/bus/pci/devices/<bus_id>/numa_node`.

    Returns:
        The node, or None when the file is missing or says -1 (no affinity known).

    Raises:
        ValueError: bus_id is not a PCI bus id.
    """
    path = Path(sysfs_root) / "bus" / "pci" / "devices" / normalize_bus_id(bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _run_smi(nvidia_smi: str, args: list[str]) -> str | None:
    try:
        proc = subprocess.run(
            [nvidia_smi, *args],
            capture_output=True,
            text=True,
            timeout=_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _smi_device(device_index: int) -> str:
    """The nvidia-smi -i selector for a CUDA device index.

    CUDA_VISIBLE_DEVICES renumbers devices; its entries (indices or UUIDs) are what
    nvidia-smi understands. Without it, CUDA and nvidia-smi agree on the order only
    under CUDA_DEVICE_ORDER=PCI_BUS_ID, which is why the CUDA runtime is asked first.
    """
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v]
    if 0 <= device_index < len(visible):
        return visible[device_index]
    return str(device_index)


def gpu_pci_bus_id(
    device_index: int, *, nvidia_smi: str | None = "nvidia-smi", use_cuda: bool = True
) -> tuple[str, str] | None:
    """PCI bus id of CUDA device `device_index` and where it came from.

    Args:
        device_index: CUDA device ordinal, as the worker uses it.
        nvidia_smi: nvidia-smi executable for the fallback; None disables it.
        use_cuda: ask the CUDA runtime through fastkv.ops.core first.

    Returns:
        (bus id in sysfs spelling, "cuda" or "nvidia-smi"), or None if neither knows.
    """
    if use_cuda:
        try:
            from fastkv.ops import core

            if device_index < core.cuda_device_count():
                return normalize_bus_id(core.cuda_pci_bus_id(device_index)), "cuda"
        except (ImportError, RuntimeError, ValueError):
            pass
    if nvidia_smi:
        out = _run_smi(
            nvidia_smi,
            [
                "--query-gpu=pci.bus_id",
                "--format=csv,noheader",
                "-i",
                _smi_device(device_index),
            ],
        )
        if out and out.strip():
            try:
                return normalize_bus_id(out.strip().splitlines()[0]), "nvidia-smi"
            except ValueError:
                return None
    return None


def numa_node_from_topo(topo_text: str, device_index: int) -> int | None:
    """The "NUMA Affinity" of row GPU<device_index> in `nvidia-smi topo -m` output.

    Returns:
        The node, or None when the table has no such row/column or says N/A.
    """
    lines = topo_text.splitlines()
    header = next((ln for ln in lines if "NUMA Affinity" in ln), None)
    if header is None:
        return None
    split = re.compile(r"\t| {2,}")
    columns = [c.strip() for c in split.split(header.rstrip())]
    column = columns.index("NUMA Affinity")
    label = f"GPU{device_index}"
    for line in lines:
        if line is header:
            continue
        cells = [c.strip() for c in split.split(line.strip())]
        if cells and cells[0] == label and column < len(cells):
            value = cells[column]
            return int(value) if value.isdigit() else None
    return None


def host_numa_node(
    device_index: int | None = 0,
    *,
    sysfs_root: str | os.PathLike[str] = "/sys",
    bus_id: str | None = None,
    nvidia_smi: str | None = "nvidia-smi",
    use_cuda: bool = True,
) -> int:
    """The NUMA node to bind the host cache of GPU `device_index` to, or -1.

    Logs exactly one INFO line saying what was found and decided. On a machine with
    one NUMA node, or with no GPU (device_index None, or no bus id found), it
    answers -1 (no binding) without further probing.

    Args:
        device_index: CUDA device ordinal of the worker's GPU; None = no GPU.
        sysfs_root: where sysfs is mounted (tests pass a fake tree).
        bus_id: the GPU's PCI bus id if the caller knows it (skips the lookup).
        nvidia_smi: nvidia-smi executable for fallbacks; None disables them.
        use_cuda: ask the CUDA runtime (through fastkv.ops.core) for the bus id.

    Returns:
        A node id >= 0 to pass to host_alloc(numa_node=...), or -1.
    """
    nodes = count_numa_nodes(sysfs_root)
    if nodes <= 1:
        log.info("fastkv.numa: %d NUMA node; host cache not bound", nodes)
        return -1
    if device_index is None:
        log.info("fastkv.numa: no GPU; host cache not bound (%d NUMA nodes)", nodes)
        return -1
    source = "given"
    if bus_id is None:
        found = gpu_pci_bus_id(device_index, nvidia_smi=nvidia_smi, use_cuda=use_cuda)
        if found is None:
            log.info(
                "fastkv.numa: GPU %d not found (no CUDA device, no nvidia-smi answer); "
                "host cache not bound (%d NUMA nodes)",
                device_index,
                nodes,
            )
            return -1
        bus_id, source = found
    bus_id = normalize_bus_id(bus_id)
    node = pci_numa_node(bus_id, sysfs_root)
    how = "sysfs"
    if node is None and nvidia_smi:
        topo = _run_smi(nvidia_smi, ["topo", "-m"])
        node = numa_node_from_topo(topo, device_index) if topo else None
        how = "nvidia-smi topo"
    if node is None:
        log.info(
            "fastkv.numa: GPU %d (%s) has no NUMA affinity in sysfs or nvidia-smi topo; "
            "host cache not bound (%d NUMA nodes)",
            device_index,
            bus_id,
            nodes,
        )
        return -1
    log.info(
        "fastkv.numa: GPU %d (%s, bus id via %s) is on NUMA node %d of %d (via %s); "
        "binding host cache to node %d",
        device_index,
        bus_id,
        source,
        node,
        nodes,
        how,
        node,
    )
    return node
