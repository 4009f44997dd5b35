"""job.cluster.env: every launcher's environment -> DistEnv, and every bad environment -> BadInput naming it.

The Slurm and PyTorchJob environments below are not invented: the Slurm ones were recorded on a real
Slurm 22.05 cluster (tests/infra/slurm-cluster.sh, 2 nodes n1 n2, `sbatch --nodes=2 --ntasks-per-node=2`
then `env` in the batch script and in srun steps); the PyTorchJob ones follow the operator's injection
table (Kubeflow Training Operator v1.9.4, pkg/controller.v1/pytorch/envvar.go on github.com/kubeflow/trainer: the order it appends
them). The TrainJob ones (Kubeflow Trainer v2) are recorded from the pods of the Trainer v2 simulation
(tests/data/k8s/trainjob-pod-env.json: the cpu-smoke TrainJob's two pods and a torchrun worker in one of
them; tests/test_k8s_trainjob_sim.py checks that the simulated pods still carry exactly these). The
torchrun variables are proved by test_real_torchrun_workers at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from job.cluster.env import (
    DETECTION_ORDER,
    LAUNCHER_VAR_PREFIXES,
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    DistEnv,
    detect_env,
    expand_slurm_nodelist,
    parse_slurm_tasks_per_node,
    slurm_master_port,
)
from job.errors import BadInput

REPO = Path(__file__).resolve().parents[1]


def D(rank, local_rank, world, local_world, node, nodes, addr, port, launcher) -> DistEnv:
    return DistEnv(rank, local_rank, world, local_world, node, nodes, addr, port, launcher)


# --- recorded from real Slurm 22.05 ------------------------------------------------------------------

# The batch script of `sbatch --nodes=2 --ntasks-per-node=2` (runs on n1). Note: SLURM_PROCID, SLURM_NTASKS
# and SLURM_LOCALID are there, SLURM_STEP_ID is not.
SLURM_BATCH = {
    "SLURMD_NODENAME": "n1",
    "SLURM_CLUSTER_NAME": "ci",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_GTIDS": "0",
    "SLURM_JOBID": "1",
    "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "1",
    "SLURM_JOB_NAME": "job.sh",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "n[1-2]",
    "SLURM_NPROCS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "0",
    "SLURM_SUBMIT_DIR": "/tmp/envprobe",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASK_PID": "6596",
    "SLURM_TOPOLOGY_ADDR": "n1",
}


def slurm_step(procid: int, localid: int, nodeid: int, node: str, **step) -> dict[str, str]:
    """A task of `srun` inside that job: the batch variables plus what srun adds or overrides (recorded)."""
    env = {
        **SLURM_BATCH,
        "SLURMD_NODENAME": node,
        "SLURM_TOPOLOGY_ADDR": node,
        "SLURM_DISTRIBUTION": "block",
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
        "SLURM_SRUN_COMM_HOST": "127.0.0.1",
        "SLURM_STEPID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_UMASK": "0022",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
    }
    env.update(step)
    return env


# `srun -n3` in that job: 2 tasks on n1, 1 on n2 (recorded: SLURM_STEP_TASKS_PER_NODE=2,1, NTASKS=3).
SRUN_N3 = dict(
    SLURM_NTASKS="3",
    SLURM_NPROCS="3",
    SLURM_STEP_NUM_TASKS="3",
    SLURM_STEP_TASKS_PER_NODE="2,1",
    SLURM_TASKS_PER_NODE="2,1",
)
# `srun -w n2 -N1 -n1`: the step lives on n2 only; the job variables still say n[1-2] / 2 nodes.
SRUN_ON_N2 = dict(
    SLURM_NTASKS="1",
    SLURM_NPROCS="1",
    SLURM_NNODES="1",
    SLURM_STEP_NUM_TASKS="1",
    SLURM_STEP_NUM_NODES="1",
    SLURM_STEP_TASKS_PER_NODE="1",
    SLURM_TASKS_PER_NODE="1",
    SLURM_STEP_NODELIST="n2",
)
PORT1 = slurm_master_port("1")


# --- TrainJob pods as Trainer v2's torch plugin and JobSet build them (recorded from the simulation) ---------
TRAINJOB_ENV = json.loads((REPO / "tests" / "data" / "k8s" / "trainjob-pod-env.json").read_text())
TJ_NODE0, TJ_NODE1 = TRAINJOB_ENV["ddp-smoke-node-0-0"], TRAINJOB_ENV["ddp-smoke-node-0-1"]
TJ_MASTER = "ddp-smoke-node-0-0.ddp-smoke"


# --- PyTorchJob pods as the operator builds them --------------------------------------------------------


def pytorchjob_pod(rank: int, *, workers: int = 1, nproc: str = "1", job: str = "demo") -> dict[str, str]:
    """Master + Worker layout, no elasticPolicy (operator steps 1, 2, 3, 4b)."""
    total = 1 + workers
    nproc_int = int(nproc) if nproc.isdigit() else 1
    return {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": "23456",
        "PET_MASTER_PORT": "23456",
        "MASTER_ADDR": f"{job}-master-0",
        "PET_MASTER_ADDR": f"{job}-master-0",
        "WORLD_SIZE": str(total * nproc_int),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NNODES": str(total),
    }


def torchrun_worker(rank: int, local_rank: int, nproc: int, nnodes: int, group_rank: int, **extra) -> dict[str, str]:
    """What LocalElasticAgent._start_workers exports (torch 2.14.1), plus whatever the parent had."""
    env = {
        "RANK": str(rank),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(nproc * nnodes),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_WORLD_SIZE": str(nproc * nnodes),
        "MASTER_ADDR": "node-a",
        "MASTER_PORT": "41234",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "job1",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "LOCAL_RANK": str(local_rank),
    }
    env.update(extra)
    return env


VALID = {
    # torchrun, one node, 2 workers
    "torchrun-1node-r0": (torchrun_worker(0, 0, 2, 1, 0), D(0, 0, 2, 2, 0, 1, "node-a", 41234, "torchrun")),
    "torchrun-1node-r1": (torchrun_worker(1, 1, 2, 1, 0), D(1, 1, 2, 2, 0, 1, "node-a", 41234, "torchrun")),
    # torchrun, 2 nodes x 2: global rank 3 is local 1 on node 1
    "torchrun-2nodes-r3": (torchrun_worker(3, 1, 2, 2, 1), D(3, 1, 4, 2, 1, 2, "node-a", 41234, "torchrun")),
    # `srun torchrun` (one task per node): SLURM_* describe the node's task, torchrun's variables win
    "srun-torchrun": (
        torchrun_worker(
            2,
            0,
            2,
            2,
            1,
            **{
                k: v
                for k, v in slurm_step(
                    1,
                    0,
                    1,
                    "n2",
                    **{"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"},
                ).items()
            },
        ),
        D(2, 0, 4, 2, 1, 2, "node-a", 41234, "torchrun"),
    ),
    # torchrun inside a PyTorchJob pod: the pod's RANK=1 / WORLD_SIZE=16 are replaced by the agent's
    "pytorchjob-torchrun": (
        {**pytorchjob_pod(1, workers=1, nproc="8"), **torchrun_worker(13, 5, 8, 2, 1)},
        D(13, 5, 16, 8, 1, 2, "node-a", 41234, "torchrun"),
    ),
    # submitit's TorchDistributedEnvironment.export() inside an srun step (2 nodes x 2 tasks, rank 3)
    "submitit-export": (
        {
            **slurm_step(3, 1, 1, "n2"),
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "27183",
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
        },
        D(3, 1, 4, 2, 1, 2, "n1", 27183, "env"),
    ),
    "env-manual-node-rank": (
        {
            "RANK": "5",
            "WORLD_SIZE": "6",
            "LOCAL_RANK": "2",
            "LOCAL_WORLD_SIZE": "3",
            "NODE_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
        },
        D(5, 2, 6, 3, 1, 2, "10.0.0.1", 1234, "env"),
    ),
    "env-world-1": (
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
        D(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, "env"),
    ),
    # PyTorchJob, plain python, nprocPerNode "1": master pod and worker-1 pod (rank 2 of 3 pods)
    "pytorchjob-master": (pytorchjob_pod(0, workers=2), D(0, 0, 3, 1, 0, 3, "demo-master-0", 23456, "kubeflow")),
    "pytorchjob-worker-1": (pytorchjob_pod(2, workers=2), D(2, 0, 3, 1, 2, 3, "demo-master-0", 23456, "kubeflow")),
    # nprocPerNode unset: the operator defaults it to "auto", counted as 1 process per pod
    "pytorchjob-auto": (pytorchjob_pod(1, nproc="auto"), D(1, 0, 2, 1, 1, 2, "demo-master-0", 23456, "kubeflow")),
    # Worker-only job with one pod (no Master: no RANK/WORLD_SIZE/MASTER_*)
    "pytorchjob-one-worker": (
        {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "1"},
        D(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, "kubeflow"),
    ),
    # TrainJob: torchrun's worker in node 1's pod (numProcPerNode 2), as recorded
    "trainjob-torchrun-worker": (
        TRAINJOB_ENV["ddp-smoke-node-0-1/local-rank-1"],
        D(3, 1, 4, 2, 1, 2, TJ_MASTER, 29500, "torchrun"),
    ),
    # TrainJob with numProcPerNode 1 started as plain python: the completion index is the rank
    "trainjob-node-0": ({**TJ_NODE0, "PET_NPROC_PER_NODE": "1"}, D(0, 0, 2, 1, 0, 2, TJ_MASTER, 29500, "trainjob")),
    "trainjob-node-1": ({**TJ_NODE1, "PET_NPROC_PER_NODE": "1"}, D(1, 0, 2, 1, 1, 2, TJ_MASTER, 29500, "trainjob")),
    # srun, 2 nodes x 2 tasks (recorded)
    "srun-r0": (slurm_step(0, 0, 0, "n1"), D(0, 0, 4, 2, 0, 2, "n1", PORT1, "slurm")),
    "srun-r3": (slurm_step(3, 1, 1, "n2"), D(3, 1, 4, 2, 1, 2, "n1", PORT1, "slurm")),
    # srun -n3: uneven "2,1"; rank 2 is alone on n2
    "srun-n3-r2": (slurm_step(2, 0, 1, "n2", **SRUN_N3), D(2, 0, 3, 1, 1, 2, "n1", PORT1, "slurm")),
    "srun-n3-r1": (slurm_step(1, 1, 0, "n1", **SRUN_N3), D(1, 1, 3, 2, 0, 2, "n1", PORT1, "slurm")),
    # srun -w n2: the master is the step's first node n2, not the job's n1; one node, not the job's two
    "srun-on-n2": (slurm_step(0, 0, 0, "n2", **SRUN_ON_N2), D(0, 0, 1, 1, 0, 1, "n2", PORT1, "slurm")),
    # 4 nodes, "2(x3),1" tasks per node, zero-padded node names, MASTER_* exported by the script
    "srun-uneven-padded": (
        {
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "6",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "3",
            "SLURM_NTASKS": "7",
            "SLURM_NNODES": "4",
            "SLURM_TASKS_PER_NODE": "2(x3),1",
            "SLURM_JOB_NODELIST": "gpu[08-11]",
            "SLURM_JOB_ID": "77",
            "MASTER_PORT": "15000",
        },
        D(6, 0, 7, 1, 3, 4, "gpu08", 15000, "slurm"),
    ),
    "srun-master-addr-env": (
        slurm_step(1, 1, 0, "n1", MASTER_ADDR="127.0.0.1"),
        D(1, 1, 4, 2, 0, 2, "127.0.0.1", PORT1, "slurm"),
    ),
    # a plain `python` in the batch script is ONE process, not rank 0 of SLURM_NTASKS=4
    "sbatch-batch-step": (SLURM_BATCH, D(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, "single")),
    "plain": ({"PATH": "/usr/bin", "HOME": "/root"}, D(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, "single")),
    "plain-port": ({"MASTER_PORT": "29600", "RANK": "0"}, D(0, 0, 1, 1, 0, 1, "127.0.0.1", 29600, "single")),
}


@pytest.mark.parametrize("name", list(VALID))
def test_detect(name: str) -> None:
    environ, expected = VALID[name]
    assert detect_env(environ) == expected


def test_detection_order_is_the_documented_one() -> None:
    assert [name for name, _, _ in DETECTION_ORDER] == ["torchrun", "env", "trainjob", "kubeflow", "slurm", "single"]


@pytest.mark.parametrize("name", [n for n, (_, e) in VALID.items() if e.launcher != "single"])
def test_torch_env_round_trip(name: str) -> None:
    """What the distributed module passes on describes the same layout (as the explicit contract)."""
    env = detect_env(VALID[name][0])
    again = detect_env(env.torch_env())
    assert again == DistEnv(**{**env.__dict__, "launcher": "env"})


def test_describe_and_properties() -> None:
    env = D(3, 1, 8, 4, 1, 2, "n1", 20001, "slurm")
    assert env.describe("nccl") == "rank 3/8 local 1/4 node 1/2 launcher=slurm backend=nccl"
    assert not env.is_main and env.is_distributed
    single = detect_env({})
    assert single.is_main and not single.is_distributed
    assert set(env.torch_env()) >= {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-2,5]", ["n1", "n2", "n5"]),
        ("a1,b[01-03]", ["a1", "b01", "b02", "b03"]),
        ("gpu-[1-3]-x", ["gpu-1-x", "gpu-2-x", "gpu-3-x"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("r[1-2]c[1-2]", ["r1c1", "r1c2", "r2c1", "r2c2"]),
        ("x[7],y", ["x7", "y"]),
        ("host-a.example,host-b.example", ["host-a.example", "host-b.example"]),
    ],
)
def test_expand_slurm_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[[1]]", "a,,b", "n[1-]"])
def test_expand_slurm_nodelist_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_slurm_nodelist(bad)


@pytest.mark.parametrize(
    ("value", "counts"),
    [("2", [2]), ("2(x2)", [2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2),1(x1)", [4, 2, 2, 1])],
)
def test_parse_tasks_per_node(value: str, counts: list[int]) -> None:
    assert parse_slurm_tasks_per_node(value) == counts


def test_slurm_master_port() -> None:
    ports = [slurm_master_port(str(i)) for i in range(1000, 1000 + SLURM_PORT_SPAN)]
    assert len(set(ports)) == SLURM_PORT_SPAN  # neighbouring jobs never share a port
    assert min(ports) == SLURM_PORT_BASE and max(ports) == SLURM_PORT_BASE + SLURM_PORT_SPAN - 1
    assert max(ports) < 32768  # below the Linux ephemeral range
    # Every task computes the port in its own process, and slurm/train.sbatch in bash: the values are fixed by the
    # formula, never by the process. A numeric id is 20000 + id mod 9000 (the sbatch's rdzv_port); any other id
    # (het-job "123+1", array "123_4") 20000 + crc32(id) mod 9000, e.g. crc32(b"123+1") = 29552795.
    assert slurm_master_port("123456") == 26456
    assert slurm_master_port(" 123456\n") == 26456
    assert slurm_master_port("4294967295") == 25295
    assert [slurm_master_port(i) for i in ("123+1", "123+2", "123_4")] == [25795, 22889, 27398]


# --- bad environments: each message names the variable, the value and a fix -------------------------

BAD = {
    "torchrun-rank-not-int": (torchrun_worker(0, 0, 2, 1, 0, RANK="zero"), ["RANK", "'zero'", "Fix"]),
    "torchrun-missing-local-world": (
        {k: v for k, v in torchrun_worker(0, 0, 2, 1, 0).items() if k != "LOCAL_WORLD_SIZE"},
        ["LOCAL_WORLD_SIZE", "not set"],
    ),
    "torchrun-rank-too-big": (torchrun_worker(4, 0, 2, 2, 1), ["RANK=4", "WORLD_SIZE=4", "Fix"]),
    "torchrun-world-mismatch": (
        torchrun_worker(0, 0, 2, 2, 0, WORLD_SIZE="6"),
        ["WORLD_SIZE=6", "GROUP_WORLD_SIZE=2", "Fix"],
    ),
    "torchrun-bad-port": (torchrun_worker(0, 0, 2, 1, 0, MASTER_PORT="70000"), ["MASTER_PORT", "'70000'", "1..65535"]),
    "env-negative-rank": (
        {
            "RANK": "-1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        },
        ["RANK", "'-1'", ">= 0"],
    ),
    "env-rank-ge-world": (
        {
            "RANK": "2",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        },
        ["RANK=2", "WORLD_SIZE=2", "Fix"],
    ),
    "env-local-rank-ge-local-world": (
        {
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        },
        ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2", "Fix"],
    ),
    "env-world-zero": ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, ["WORLD_SIZE", "'0'", ">= 1"]),
    "env-no-local-world": (
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
        ["LOCAL_WORLD_SIZE is not", "WORLD_SIZE=2", "Fix"],
    ),
    "env-not-divisible": (
        {
            "RANK": "1",
            "WORLD_SIZE": "3",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        },
        ["WORLD_SIZE=3", "LOCAL_WORLD_SIZE=2", "GROUP_WORLD_SIZE"],
    ),
    "env-no-master": (
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        ["MASTER_ADDR and MASTER_PORT", "Fix"],
    ),
    "env-local-world-not-int": (
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "two",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        },
        ["LOCAL_WORLD_SIZE", "'two'"],
    ),
    "partial-contract": ({"RANK": "3", "WORLD_SIZE": "4"}, ["RANK=3", "WORLD_SIZE=4", "LOCAL_RANK", "Fix"]),
    "pytorchjob-nproc-8": (pytorchjob_pod(1, nproc="8"), ["PET_NPROC_PER_NODE='8'", "ddp-job launch"]),
    "pytorchjob-elastic": (
        {
            "PYTHONUNBUFFERED": "1",
            "PET_NPROC_PER_NODE": "1",
            "PET_RDZV_ENDPOINT": "demo-worker-0:23456",
            "PET_RDZV_BACKEND": "c10d",
            "PET_NNODES": "2:2",
        },
        ["PET_NNODES='2:2'", "elastic", "ddp-job launch"],
    ),
    "pytorchjob-worker-only": (
        {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "1", "PET_NNODES": "3"},
        ["PET_NNODES=3", "RANK", "ddp-job launch"],
    ),
    "pytorchjob-world-edited": (
        {**pytorchjob_pod(1, workers=2), "WORLD_SIZE": "5"},
        ["WORLD_SIZE=5", "PET_NNODES=3", "Fix"],
    ),
    "pytorchjob-rank-too-big": (pytorchjob_pod(3, workers=2), ["RANK=3", "WORLD_SIZE=3"]),
    # TrainJob pods as recorded run 2 processes each: plain python is one
    "trainjob-nproc-2": (TJ_NODE1, ["PET_NPROC_PER_NODE='2'", "ddp-job launch"]),
    "trainjob-nproc-auto": ({**TJ_NODE0, "PET_NPROC_PER_NODE": "auto"}, ["PET_NPROC_PER_NODE='auto'", "one per GPU"]),
    "trainjob-index-edited": (
        {**TJ_NODE1, "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0"},
        ["PET_NODE_RANK=0", "JOB_COMPLETION_INDEX=1", "Fix"],
    ),
    "trainjob-hostname-disagrees": (
        {**TJ_NODE1, "PET_NPROC_PER_NODE": "1", "JOB_COMPLETION_INDEX": "0", "PET_NODE_RANK": "0"},
        ["PET_NODE_RANK=0", "ddp-smoke-node-0-1", "JobSet index 1"],
    ),
    "trainjob-rank-outside": (
        {**TJ_NODE1, "PET_NPROC_PER_NODE": "1", "PET_NNODES": "1"},
        ["PET_NODE_RANK=1", "PET_NNODES=1"],
    ),
    "srun-procid-not-int": (slurm_step(0, 0, 0, "n1", SLURM_PROCID="x"), ["SLURM_PROCID", "'x'", "srun"]),
    "srun-procid-ge-ntasks": (slurm_step(4, 0, 1, "n2"), ["SLURM_PROCID=4", "SLURM_STEP_NUM_TASKS=4"]),
    "srun-localid-ge-tasks-on-node": (
        slurm_step(2, 1, 1, "n2", **SRUN_N3),
        ["SLURM_LOCALID=1", "SLURM_STEP_TASKS_PER_NODE"],
    ),
    "srun-nodeid-ge-nnodes": (slurm_step(3, 1, 2, "n3"), ["SLURM_NODEID=2", "SLURM_STEP_NUM_NODES=2"]),
    "srun-bad-tasks-per-node": (
        slurm_step(0, 0, 0, "n1", SLURM_STEP_TASKS_PER_NODE="2(x)"),
        ["SLURM_STEP_TASKS_PER_NODE", "'2(x)'"],
    ),
    "srun-tasks-per-node-mismatch": (
        slurm_step(0, 0, 0, "n1", SLURM_STEP_TASKS_PER_NODE="2(x3)"),
        ["SLURM_STEP_TASKS_PER_NODE='2(x3)'", "SLURM_STEP_NUM_TASKS=4"],
    ),
    "srun-bad-nodelist": (
        slurm_step(0, 0, 0, "n1", SLURM_STEP_NODELIST="n[1-2"),
        ["SLURM_STEP_NODELIST", "'n[1-2'", "MASTER_ADDR"],
    ),
    "srun-bad-master-port": (slurm_step(0, 0, 0, "n1", MASTER_PORT="0"), ["MASTER_PORT", "'0'"]),
    "single-bad-port": ({"MASTER_PORT": "http"}, ["MASTER_PORT", "'http'"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(name: str) -> None:
    environ, needles = BAD[name]
    with pytest.raises(BadInput) as info:
        detect_env(environ)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert "Fix: " in message, message


def test_detect_env_reads_only_the_mapping() -> None:
    """Pure: the real process environment (whatever it holds) does not leak in."""
    assert detect_env({"PATH": os.environ.get("PATH", "")}).launcher == "single"


# --- the real torchrun ----------------------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import os
    from job.cluster.env import detect_env
    # One file per worker: two workers printing to one pipe can interleave their lines.
    with open(f"detected-{os.environ['RANK']}", "w") as f:
        f.write(repr(detect_env(os.environ)))
    """
)


@pytest.mark.integration
def test_real_torchrun_workers(tmp_path: Path) -> None:
    """torchrun --standalone --nproc-per-node 2: each worker's real environment detects as its rank.
    Proves the torchrun variable names above are the ones torch 2.14.1 really exports. Does not import
    torch in the workers, so it takes about as long as the agent's start (~5-10 s here)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VAR_PREFIXES)}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = [p.read_text() for p in sorted(tmp_path.glob("detected-*"))]
    assert len(found) == 2, proc.stdout + proc.stderr
    envs = [eval(text, {"DistEnv": DistEnv}) for text in found]
    envs.sort(key=lambda e: e.rank)
    for rank, got in enumerate(envs):
        assert (
            got.rank,
            got.local_rank,
            got.world_size,
            got.local_world_size,
            got.node_rank,
            got.num_nodes,
            got.launcher,
        ) == (rank, rank, 2, 2, 0, 1, "torchrun")
        assert 0 < got.master_port < 65536 and got.master_addr
    assert envs[0].master_port == envs[1].master_port


# --- node lists written with spaces, and a node rank alone ---------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("alpha beta gamma", ["alpha", "beta", "gamma"]),
        ("host5 ,host6", ["host5", "host6"]),
        ("a\tb", ["a", "b"]),
        ("n[1, 3] x", ["n1", "n3", "x"]),
    ],
)
def test_a_node_list_splits_on_tab_comma_and_space_as_slurm_does(nodelist: str, hosts: list[str]) -> None:
    """Slurm's hostlist parser separates names by tab, comma and space (outside brackets)."""
    assert expand_slurm_nodelist(nodelist) == hosts


def test_the_master_of_a_node_list_with_spaces_is_its_first_name() -> None:
    env = detect_env({**slurm_step(0, 0, 0, "n1"), "SLURM_STEP_NODELIST": "alpha beta", "SLURM_JOB_NODELIST": "x"})
    assert env.master_addr == "alpha"


@pytest.mark.parametrize("name", ["NODE_RANK", "GROUP_RANK"])
def test_a_node_rank_alone_is_refused(name: str) -> None:
    """One node of several, started without the rest of the contract, would train alone as rank 0."""
    with pytest.raises(BadInput) as info:
        detect_env({name: "1"})
    assert info.value.setting == name and info.value.value == "1" and info.value.fix, info.value
    assert detect_env({name: "0"}).launcher == "single"


# --- cases of peers' own test suites -------------------------------------------------------------------

# submitit, submitit/slurm/test_slurm.py: test_slurm_node_list and test_slurm_node_list_online_documentation
# (SlurmJobEnvironment.hostnames of SLURM_JOB_NODELIST).
SUBMITIT_NODE_LISTS = [
    ("compute-b24", ["compute-b24"]),
    ("compute-a1,compute-b2", ["compute-a1", "compute-b2"]),
    ("compute-b2[1,2]", ["compute-b21", "compute-b22"]),
    ("compute-b2[011,022]", ["compute-b2011", "compute-b2022"]),
    ("compute-b2[1-3]", ["compute-b21", "compute-b22", "compute-b23"]),
    ("compute-b2[1-3,5,6,8]", [f"compute-b2{i}" for i in (1, 2, 3, 5, 6, 8)]),
    ("compute-b2[1-3,5-6,8]", [f"compute-b2{i}" for i in (1, 2, 3, 5, 6, 8)]),
    ("compute-b2[1-3,5-6,8],compute-a1", [*(f"compute-b2{i}" for i in (1, 2, 3, 5, 6, 8)), "compute-a1"]),
    ("compute[042,044]", ["compute042", "compute044"]),
    ("compute[042-043,045,048-049]", ["compute042", "compute043", "compute045", "compute048", "compute049"]),
    (
        "compute-b24-[1-3,5-9],compute-b25-[1,4,8]",
        [*(f"compute-b24-{i}" for i in (1, 2, 3, 5, 6, 7, 8, 9)), *(f"compute-b25-{i}" for i in (1, 4, 8))],
    ),
]


@pytest.mark.parametrize(("nodelist", "hosts"), SUBMITIT_NODE_LISTS)
def test_submitit_node_lists(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


# submitit, submitit/slurm/test_slurm.py: test_slurm_invalid_parse (SlurmParseException there).
@pytest.mark.parametrize("bad", ["compute-b2[1-,4]", "compute-b2[1,2,compute-b3]"])
def test_submitit_invalid_node_lists(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_slurm_nodelist(bad)


def test_submitit_missing_node_list_is_refused_here() -> None:
    """submitit, submitit/slurm/test_slurm.py: test_slurm_missing_node_list gives ``[hostname]`` for an empty
    SLURM_JOB_NODELIST. We differ on purpose: an srun step without a node list names no rendezvous host,
    and guessing this host is wrong on every other node."""
    with pytest.raises(ValueError):
        expand_slurm_nodelist("")


# Lightning, tests/tests_fabric/plugins/environments/test_slurm.py: test_main_address_from_slurm_node_list
# (SLURMEnvironment.main_address of SLURM_NODELIST: the first host).
LIGHTNING_MAIN_ADDRESSES = [
    ("127.0.0.1", "127.0.0.1"),
    ("alpha", "alpha"),
    ("alpha,beta,gamma", "alpha"),
    ("alpha beta gamma", "alpha"),
    ("1.2.3.[100-110]", "1.2.3.100"),
    ("1.2.3.[089, 100-110]", "1.2.3.089"),
    ("host[22]", "host22"),
    ("host[1,5-9]", "host1"),
    ("host[5-9,1]", "host5"),
    ("alpha, host[5-9], gamma", "alpha"),
    ("alpha[3,1], beta", "alpha3"),
]


@pytest.mark.parametrize(("nodelist", "master"), LIGHTNING_MAIN_ADDRESSES)
def test_lightning_main_addresses(nodelist: str, master: str) -> None:
    assert expand_slurm_nodelist(nodelist)[0] == master
    step = {k: v for k, v in slurm_step(0, 0, 0, "n1").items() if "NODELIST" not in k}
    assert detect_env({**step, "SLURM_NODELIST": nodelist}).master_addr == master


# Lightning, tests/tests_fabric/plugins/environments/test_slurm.py: test_attributes_from_environment_variables.
LIGHTNING_ENV = {
    "SLURM_NODELIST": "1.1.1.1, 1.1.1.2",
    "SLURM_JOB_ID": "0001234",
    "SLURM_NTASKS": "20",
    "SLURM_NTASKS_PER_NODE": "10",
    "SLURM_LOCALID": "2",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "3",
    "SLURM_JOB_NAME": "JOB",
}


def test_lightning_environment_is_a_batch_script_here() -> None:
    """Lightning reads it as rank 1 of 20 (local rank 2, node 3, main 1.1.1.1:16234). It has no SLURM_STEP_ID:
    to us that is the batch script, not an srun task, so a plain python there is one process (the rule that
    keeps it from waiting for ranks that never start); as an srun task, node 3 of a 2-node list is refused."""
    assert detect_env(LIGHTNING_ENV) == D(0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, "single")
    with pytest.raises(BadInput, match="SLURM_NODEID=3"):
        detect_env({**LIGHTNING_ENV, "SLURM_STEP_ID": "0"})
    fixed = {**LIGHTNING_ENV, "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "10(x2)"}
    env = detect_env(fixed)
    assert (env.rank, env.local_rank, env.world_size, env.master_addr) == (1, 2, 20, "1.1.1.1")
    assert env.master_port == slurm_master_port("0001234")  # our formula, not Lightning's 15000 + id


# Lightning, same file: test_detect. SLURM_NTASKS=2 alone is a Slurm environment to Lightning; to us, without
# an srun step, one process.
def test_lightning_detect_cases() -> None:
    assert detect_env({}).launcher == "single"
    assert detect_env({"SLURM_NTASKS": "2"}).launcher == "single"
    assert detect_env({"SLURM_JOB_NAME": "bash"}).launcher == "single"
