"""The doctor's checks as functions, in this process: the GPU topology check on fake topologies (peer access
from a table, NUMA placement from /sys trees written in a temporary directory), and the bandwidth sweep (its
numbers, the per-backend sizes, one rank's busbw n/a, an all-reduce timed on gloo for real and the CUDA-event
path with its events simulated on the CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.fake_cuda import FakeEvents

from job.cluster.env import detect_env
from job.config import load_config
from job.doctor import communication
from job.doctor.communication import SWEEPS, Sweep, bandwidth_check, bandwidth_rows, comm_checks, sweep_for
from job.doctor.gpu_topology import (
    check_peer_access,
    cpulist,
    gpu_topology_checks,
    parse_cpulist,
    pci_address,
    topology_checks,
)
from job.doctor.report import bandwidth_line, print_checks
from job.parallel import distributed

# --- GPU topology ------------------------------------------------------------------------------------------


def sys_tree(root: Path, nodes: dict[int, str], gpus: dict[str, str]) -> Path:
    """A /sys with NUMA ``nodes`` (node -> cpulist text) and PCI ``gpus`` (address -> numa_node text), plus the
    files the kernel keeps next to the node directories."""
    node_dir = root / "devices" / "system" / "node"
    node_dir.mkdir(parents=True)
    for name, text in {"online": "0-1\n", "possible": "0-3\n", "has_cpu": "0-1\n"}.items():
        (node_dir / name).write_text(text)
    for n, text in nodes.items():
        (node_dir / f"node{n}").mkdir()
        (node_dir / f"node{n}" / "cpulist").write_text(text + "\n")
        (node_dir / f"node{n}" / "meminfo").write_text("Node 0 MemTotal: 1 kB\n")
    for address, text in gpus.items():
        (root / "bus" / "pci" / "devices" / address).mkdir(parents=True)
        (root / "bus" / "pci" / "devices" / address / "numa_node").write_text(text + "\n")
    return root


GPU0, GPU1 = "0000:17:00.0", "0000:65:00.0"
TWO_SOCKETS = {0: "0-3,8-11", 1: "4-7,12-15", 2: ""}  # node 2: memory only (a GPU's or CXL memory)


def numa(tmp_path: Path, allowed: set[int], gpu: int = 0, nodes: dict[int, str] = TWO_SOCKETS) -> dict:
    root = sys_tree(tmp_path / "sys", nodes, {GPU0: "1", GPU1: "-1"})
    checks = topology_checks(2, gpu, lambda i, j: True, {0: GPU0, 1: GPU1}.get, root, allowed)
    assert [c.name for c in checks] == ["topology.peer_access", "topology.numa"]
    return vars(checks[1])


def test_cpulists_read_as_the_kernel_writes_them() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("\n") == set()
    assert cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert cpulist(parse_cpulist("5,7-9")) == "5,7-9"


def test_rank_on_the_other_socket_than_its_gpu_warns_with_the_binding_to_use(tmp_path: Path) -> None:
    c = numa(tmp_path, allowed={0, 1, 2, 3})
    assert c["status"] == "WARN", c
    assert "GPU 0 (0000:17:00.0) is on NUMA node 1" in c["detail"] and "CPUs 0-3 (NUMA node 0)" in c["detail"]
    assert "--numa-binding=node" in c["fix"] and "numactl --cpunodebind=1 --membind=1" in c["fix"]
    assert c["data"] == {"gpu": 0, "pci_address": GPU0, "gpu_numa_node": 1, "cpu_numa_nodes": [0]}


def test_rank_bound_to_its_gpus_node_passes(tmp_path: Path) -> None:
    c = numa(tmp_path, allowed={4, 5, 12})
    assert (c["status"], c["detail"]) == ("PASS", "GPU 0 (0000:17:00.0) and this rank's CPUs on NUMA node 1"), c


def test_unbound_rank_passes_with_a_hint(tmp_path: Path) -> None:
    c = numa(tmp_path, allowed=set(range(16)))
    assert c["status"] == "PASS" and "may run on NUMA nodes 0,1 (unbound" in c["detail"], c


def test_unknown_or_single_numa_node_is_not_a_warning(tmp_path: Path) -> None:
    c = numa(tmp_path / "a", allowed={0}, gpu=1)  # the firmware wrote -1 for GPU 1
    assert c["status"] == "PASS" and c["detail"].startswith("skipped: NUMA node of GPU 1 (0000:65:00.0)"), c
    c = numa(tmp_path / "b", allowed={0}, nodes={0: "0-15", 1: ""})  # node 1: the GPU's memory (Grace Hopper)
    assert c["status"] == "PASS" and c["detail"].startswith("single NUMA node"), c
    root = tmp_path / "c"
    root.mkdir()  # no /sys/devices/system/node at all
    (c,) = topology_checks(1, 0, lambda i, j: True, lambda i: GPU0, root, {0})[1:]
    assert c.status == "PASS" and "no NUMA nodes shown" in c.detail, c


def test_gpu_pairs_without_peer_access_warn_and_are_named() -> None:
    nvlink = {(0, 1), (1, 0), (2, 3), (3, 2), (0, 2)}  # two NVLink pairs; 0->2 one way only
    c = check_peer_access(4, lambda i, j: (i, j) in nvlink)
    assert c.status == "WARN", c
    assert c.detail.startswith("4 of 6 GPU pairs without peer access (NVLink/PCIe P2P): 0-2, 0-3, 1-2, 1-3;"), c
    assert c.data["missing_pairs"] == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert "nvidia-smi topo -m" in c.fix
    c = check_peer_access(8, lambda i, j: i // 4 == j // 4)  # two islands of 4
    assert c.status == "WARN" and "16 of 28" in c.detail and "(+8 more)" in c.detail, c
    assert check_peer_access(8, lambda i, j: True).status == "PASS"
    assert check_peer_access(1, lambda i, j: False).status == "PASS"


def test_gpu_topology_without_gpus_is_skipped() -> None:
    """This machine: a CPU-only node (the real torch and /sys)."""
    assert not torch.cuda.is_available()
    checks = gpu_topology_checks(None)
    assert [(c.name, c.status, c.detail) for c in checks] == [
        ("topology.peer_access", "PASS", "skipped: no GPU"),
        ("topology.numa", "PASS", "skipped: no GPU"),
    ]
    skipped = topology_checks(2, None, lambda i, j: False, lambda i: None, Path("/nonexistent"), {0})
    assert all("no GPU of its own" in c.detail for c in skipped)


def test_pci_address_from_torchs_device_properties() -> None:
    # the ids torch's CUDA device properties carry (torch.numa.binding reads the same three)
    assert {"pci_domain_id", "pci_bus_id", "pci_device_id"} <= set(dir(torch._C._CudaDeviceProperties))
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x17, pci_device_id=0)
    assert pci_address(props) == GPU0
    assert pci_address(SimpleNamespace(pci_domain_id=0x10000, pci_bus_id=1, pci_device_id=0x1F)) == "10000:01:1f.0"
    assert pci_address(SimpleNamespace(name="old torch")) is None


# --- bandwidth ---------------------------------------------------------------------------------------------


def test_bandwidth_numbers_as_nccl_tests_define_them() -> None:
    per_rank = [[1e-3, 2e-3], [2e-3, 1e-3], [1e-3, 4e-3], [1e-3, 1e-3]]  # seconds per all-reduce, 4 ranks
    rows = bandwidth_rows([1024, 4096], per_rank)
    assert [r["time_us"] for r in rows] == pytest.approx([2000, 4000])  # the slowest rank's
    assert rows[0]["algbw_GBps"] == pytest.approx(1024 * 1024 / 2e-3 / 1e9)
    assert rows[1]["busbw_GBps"] == pytest.approx(rows[1]["algbw_GBps"] * 1.5)  # 2(n-1)/n, n = 4
    c = bandwidth_check([1024, 4096], per_rank, "nccl")
    assert c.detail.startswith("peak busbw 1.573 GB/s (algbw 1.049) at 4096 KiB; slowest rank 2"), c.detail


def test_one_rank_has_no_bus_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    c = bandwidth_check([4, 64], [[1e-5, 2e-5]], "gloo")
    assert c.detail.startswith("1 rank: busbw n/a (no communication); peak algbw 3.277 GB/s at 64 KiB"), c.detail
    assert all(r["busbw_GBps"] is None for r in c.data["rows"])
    assert bandwidth_line(c.data["rows"][0]).endswith("busbw     n/a GB/s")
    print_checks([{**vars(c), "line": "PASS communication.bandwidth"}], only_problems=False)
    assert capsys.readouterr().out.count("n/a GB/s") == 2


def test_each_backend_sweeps_its_own_sizes() -> None:
    defaults = load_config([], {}).doctor
    nccl = sweep_for("nccl", defaults.comm_sizes_kb, defaults.comm_iters)
    gloo = sweep_for("gloo", defaults.comm_sizes_kb, defaults.comm_iters)
    assert max(nccl.sizes_kb) * 1024 >= 256 * 2**20 and nccl.warmup >= 1 and nccl == SWEEPS["nccl"]
    assert max(gloo.sizes_kb) <= 8192 and gloo == SWEEPS["gloo"]  # the doctor stays quick on CPUs
    assert sweep_for("nccl", (4, 256), 3) == Sweep((4, 256), 3, nccl.warmup)  # the config's choice wins


@pytest.fixture
def runtime() -> Iterator[distributed.Runtime]:
    """World size 1 on gloo in this process."""
    rt = distributed.setup(detect_env({}), load_config([], {}).dist)
    yield rt
    distributed.teardown()


def test_timed_all_reduce_on_one_gloo_rank(runtime: distributed.Runtime) -> None:
    checks = comm_checks(runtime, 1, 0, True, Sweep((4, 256), iters=3, warmup=1))
    assert [c.status for c in checks] == ["PASS", "PASS"]
    rows = checks[1].data["rows"]
    assert [r["size_bytes"] for r in rows] == [4096, 262144] and all(r["time_us"] > 0 for r in rows)
    assert all(r["busbw_GBps"] is None for r in rows) and "busbw n/a" in checks[1].detail


def test_cuda_path_times_only_the_timed_loop_with_events(
    runtime: distributed.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's path with its events simulated on the CPU: per size one event before the timed iterations and
    one after (warm-ups untimed), read after waiting for both; the time is the events' span / iterations."""
    events = FakeEvents()
    monkeypatch.setattr(communication, "stopwatch", lambda device: events.stopwatch())
    all_reduce = communication.dist.all_reduce

    def logged(*args: Any, **kwargs: Any) -> Any:
        events.log.append("all_reduce")
        return all_reduce(*args, **kwargs)

    monkeypatch.setattr(communication.dist, "all_reduce", logged)
    mine = communication._time_sizes(runtime, Sweep((4, 64), iters=4, warmup=2))
    timed = ["record", *["all_reduce"] * 4, "record", "synchronize", "synchronize", "elapsed_time"]
    assert events.log == (["all_reduce"] * 2 + timed) * 2
    t = [e.t for e in events.created]
    assert mine == pytest.approx([(t[1] - t[0]) / 4, (t[3] - t[2]) / 4])
