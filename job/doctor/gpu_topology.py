"""How this node's GPUs are wired, as the doctor checks it: peer access between every pair of visible GPUs
(NVLink or PCIe P2P; a pair without it makes NCCL copy through host memory) and whether the CPUs this rank may
run on sit on its GPU's NUMA node (if not, every host-to-device copy and the input pipeline cross the socket
link). Both WARN at most: the job runs, only slower.

The decisions are pure: peer access comes from a ``can_access(i, j)`` callable, the NUMA facts from a /sys tree
under ``sys_root`` (a temporary directory in the tests) and the CPU affinity is passed in. ``gpu_topology_checks``
hands them torch's answers, the real /sys and ``os.sched_getaffinity``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from job.doctor.checks import PASS, WARN, Check

SYS = Path("/sys")
PEER, NUMA = "topology.peer_access", "topology.numa"
NO_GPU = "skipped: no GPU"
_SHOWN_PAIRS = 8
"""Pairs named in the WARN line; the report's data holds them all."""


def parse_cpulist(text: str) -> set[int]:
    """A sysfs CPU list ("0-3,8,10-11") as a set; empty text (a node with memory only) is no CPU."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def cpulist(cpus: Iterable[int]) -> str:
    """The inverse of ``parse_cpulist``: {0, 1, 2, 5} as "0-2,5"."""
    ranges: list[list[int]] = []
    for c in sorted(cpus):
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def cpus_per_node(sys_root: Path) -> dict[int, set[int]]:
    """NUMA node -> its CPUs from ``sys_root``/devices/system/node/node<N>/cpulist; nodes without CPUs (GPU or
    CXL memory) left out; empty when the kernel shows no NUMA information."""
    nodes = {}
    for path in (sys_root / "devices" / "system" / "node").glob("node[0-9]*/cpulist"):
        cpus = parse_cpulist(path.read_text())
        if cpus:
            nodes[int(path.parent.name[len("node") :])] = cpus
    return nodes


def pci_address(props: Any) -> str | None:
    """The sysfs name of a GPU's PCI function ("0000:17:00.0") from torch's device properties, formatted as
    torch.numa.binding does; None where torch gives no PCI ids."""
    try:
        domain, bus, device = props.pci_domain_id, props.pci_bus_id, props.pci_device_id
    except AttributeError:
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def pci_numa_node(sys_root: Path, address: str) -> int | None:
    """``sys_root``/bus/pci/devices/<address>/numa_node; None when absent or -1 (the firmware does not say)."""
    try:
        node = int((sys_root / "bus" / "pci" / "devices" / address / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    if node < 0:
        return None
    return node


def check_peer_access(count: int, can_access: Callable[[int, int], bool]) -> Check:
    """Every pair of the ``count`` visible GPUs, both directions; a pair lacking either is named."""
    if count == 0:
        return Check(PEER, PASS, NO_GPU)
    if count == 1:
        return Check(PEER, PASS, "1 visible GPU: no pair to check")
    pairs = [(i, j) for i in range(count) for j in range(i + 1, count)]
    missing = [(i, j) for i, j in pairs if not (can_access(i, j) and can_access(j, i))]
    data = {"gpus": count, "missing_pairs": missing}
    if not missing:
        return Check(PEER, PASS, f"peer access (NVLink or PCIe P2P) between all {count} GPUs", data=data)
    named = ", ".join(f"{i}-{j}" for i, j in missing[:_SHOWN_PAIRS])
    if len(missing) > _SHOWN_PAIRS:
        named += f" (+{len(missing) - _SHOWN_PAIRS} more)"
    return Check(
        PEER,
        WARN,
        f"{len(missing)} of {len(pairs)} GPU pairs without peer access (NVLink/PCIe P2P): {named}; NCCL copies "
        "their traffic through host memory",
        "compare `nvidia-smi topo -m` with the machine's spec (NV# links, PIX/PXB switches); in a VM or container "
        "the hypervisor and IOMMU/ACS settings must allow P2P",
        data,
    )


def _nodes(nodes: list[int]) -> str:
    if not nodes:
        return "no known NUMA node"
    return f"NUMA node{'s' if len(nodes) > 1 else ''} {','.join(map(str, nodes))}"


def check_numa(
    gpu: int, address: str | None, gpu_node: int | None, nodes: Mapping[int, set[int]], allowed: set[int]
) -> Check:
    """This rank's GPU ``gpu`` (PCI ``address``, NUMA node ``gpu_node``) against the NUMA ``nodes`` (node ->
    CPUs) of the CPUs it may run on (``allowed``). WARN only when none of them is on the GPU's node; a rank
    allowed on several nodes, the GPU's among them, passes with a hint (the scheduler may still move it)."""
    if len(nodes) <= 1:
        where = "single NUMA node"
        if not nodes:
            where = "no NUMA nodes shown in /sys/devices/system/node"
        return Check(NUMA, PASS, f"{where}: GPU {gpu} and this rank's CPUs cannot be apart")
    if address is None or gpu_node is None:
        return Check(NUMA, PASS, f"skipped: NUMA node of GPU {gpu} ({address or 'no PCI address'}) not known")
    mine = sorted(n for n, cpus in nodes.items() if cpus & allowed)
    data = {"gpu": gpu, "pci_address": address, "gpu_numa_node": gpu_node, "cpu_numa_nodes": mine}
    if gpu_node not in mine:
        return Check(
            NUMA,
            WARN,
            f"GPU {gpu} ({address}) is on NUMA node {gpu_node} but this rank runs on CPUs {cpulist(allowed)} "
            f"({_nodes(mine)}): host-device copies and data loading cross the socket link",
            f"bind each rank to its GPU's NUMA node: torchrun / ddp-job launch --numa-binding=node (needs numactl), "
            f"numactl --cpunodebind={gpu_node} --membind={gpu_node}, or srun --cpu-bind=ldoms with a task per GPU",
            data,
        )
    if mine == [gpu_node]:
        return Check(NUMA, PASS, f"GPU {gpu} ({address}) and this rank's CPUs on NUMA node {gpu_node}", data=data)
    return Check(
        NUMA,
        PASS,
        f"GPU {gpu} ({address}) on NUMA node {gpu_node}; this rank may run on {_nodes(mine)} "
        f"(unbound: --numa-binding=node keeps it on node {gpu_node})",
        data=data,
    )


def topology_checks(
    count: int,
    gpu: int | None,
    can_access: Callable[[int, int], bool],
    address_of: Callable[[int], str | None],
    sys_root: Path,
    allowed: set[int],
) -> list[Check]:
    """Both checks for this rank: ``count`` visible GPUs, ``gpu`` its own (None: it has none of its own)."""
    if count == 0:
        return [Check(PEER, PASS, NO_GPU), Check(NUMA, PASS, NO_GPU)]
    if gpu is None:  # more processes than GPUs: topology.gpus FAILs already
        skipped = "skipped: this rank has no GPU of its own (see topology.gpus)"
        return [Check(PEER, PASS, skipped), Check(NUMA, PASS, skipped)]
    address = address_of(gpu)
    gpu_node = None
    if address is not None:
        gpu_node = pci_numa_node(sys_root, address)
    return [check_peer_access(count, can_access), check_numa(gpu, address, gpu_node, cpus_per_node(sys_root), allowed)]


def gpu_topology_checks(gpu: int | None) -> list[Check]:
    """``topology_checks`` on this machine: torch's view of the visible GPUs, /sys and this process's CPU
    affinity (which numactl, taskset, srun --cpu-bind or torchrun --numa-binding set)."""
    count = 0
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
    allowed = os.sched_getaffinity(0)
    if count == 0 or gpu is None:
        return topology_checks(count, gpu, lambda i, j: False, lambda i: None, SYS, allowed)
    # Should a query create a CUDA context, it is this rank's own GPU's (which it is about to use), not GPU 0's.
    with torch.cuda.device(gpu):
        return topology_checks(
            count,
            gpu,
            torch.cuda.can_device_access_peer,
            lambda i: pci_address(torch.cuda.get_device_properties(i)),
            SYS,
            allowed,
        )
