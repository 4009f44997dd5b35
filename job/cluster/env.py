"""Which process am I? Turn a launcher's environment into one ``DistEnv`` (pure: reads only the mapping given).

Every launcher (torchrun, submitit, a PyTorchJob pod, ``srun``, a plain shell) describes the process
layout with its own variables; this module is the only place that knows them. It never touches
``os.environ`` or ``torch.distributed``: callers pass ``os.environ`` in, tests pass dicts.

Variables verified against the real tools, not guessed:
* torchrun: ``LocalElasticAgent._start_workers`` in torch 2.14.1 exports RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR/PORT and TORCHELASTIC_RUN_ID to
  every worker (tests/test_env.py runs a real torchrun to prove it).
* Slurm 22.05 (recorded on a real two-node cluster, see tests/test_env.py): the batch script itself
  has SLURM_PROCID=0 and SLURM_NTASKS=<job tasks> but NO SLURM_STEP_ID/SLURM_STEPID; only tasks of an
  ``srun`` step have those. Inside a step SLURM_NTASKS/SLURM_NNODES/SLURM_TASKS_PER_NODE describe the
  step, while SLURM_JOB_NUM_NODES/SLURM_JOB_NODELIST describe the whole allocation (``srun -w n2 -n1``
  in a two-node job: SLURM_JOB_NODELIST=n[1-2], SLURM_STEP_NODELIST=n2), so the step variables win.
* Kubeflow Training Operator v1.9.4, pkg/controller.v1/pytorch/envvar.go on github.com/kubeflow/trainer (RANK is the pod
  index, WORLD_SIZE = pods x nprocPerNode, PET_* are torchrun's option defaults).
* Kubeflow Trainer v2.3 TrainJob (torch plugin on JobSet): only PET_NNODES, PET_NPROC_PER_NODE,
  PET_NODE_RANK (the pod's Job completion index), PET_MASTER_ADDR=<job>-node-0-0.<job> and
  PET_MASTER_PORT; no RANK/WORLD_SIZE/MASTER_*. The pod's hostname is <job>-node-0-<i> and the Job
  controller sets JOB_COMPLETION_INDEX=<i> (recorded pod environments: tests/data/k8s/trainjob-pod-env.json).
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from job.errors import BadInput

LAUNCHERS = ("torchrun", "env", "trainjob", "kubeflow", "slurm", "single")

# Deterministic Slurm rendezvous ports: below Linux' ephemeral range (32768-60999, so a port picked by
# the kernel for an outgoing connection never squats it), above the usual service ports, and clear of
# torchrun's defaults (29400 c10d, 29500 static) and Kubeflow's 23456 only by luck of the modulus, which
# is fine: those are never used in the same Slurm job.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 9000  # ports 20000..28999
# What a launcher sets in its children's environment (torchrun, Slurm, submitit, the Kubeflow operators). A
# fresh job started from inside another (a test, a benchmark) must drop them, or it would join that job.
LAUNCHER_VAR_PREFIXES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_",
    "MASTER_",
    "TORCHELASTIC",
    "SLURM_",
    "SUBMITIT_",
    "PET_",
)
SINGLE_PORT = 29500  # unused by a world of one (the distributed module uses an in-memory store)


@dataclass(frozen=True)
class DistEnv:
    """The process layout every launcher is translated into."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: str  # one of LAUNCHERS

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def describe(self, backend: str) -> str:
        """The one start-up line every rank prints (tests and humans grep for it)."""
        return (
            f"rank {self.rank}/{self.world_size} local {self.local_rank}/{self.local_world_size} "
            f"node {self.node_rank}/{self.num_nodes} launcher={self.launcher} backend={backend}"
        )

    def torch_env(self) -> dict[str, str]:
        """torchrun's worker contract for this process (what ``init_process_group("env://")`` reads).

        ``detect_env(env.torch_env())`` gives back the same layout with launcher "env"."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.num_nodes),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


# ----------------------------------------------------------------------------------------------------
# Reading variables: every failure names the variable, the bad value and the fix.


def _int(environ: Mapping[str, str], name: str, *, minimum: int = 0, fix: str = "") -> int:
    raw = environ.get(name)
    if raw is None:
        raise BadInput(f"{name} is not set.", fix or "set it, or launch with ddp-job launch / torchrun.", setting=name)
    try:
        value = int(raw.strip())
    except ValueError:
        raise BadInput(
            f"{name}={raw!r} is not an integer.", fix or f"set {name} to a whole number.", setting=name, value=raw
        ) from None
    if value < minimum:
        raise BadInput(
            f"{name}={raw!r} must be >= {minimum}.",
            fix or f"set {name} to a number >= {minimum}.",
            setting=name,
            value=raw,
        )
    return value


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` that is set (launchers spell the same thing several ways)."""
    return next((n for n in names if n in environ), None)


def _port(environ: Mapping[str, str], name: str) -> int:
    port = _int(environ, name, minimum=1)
    if port > 65535:
        raise BadInput(
            f"{name}={environ[name]!r} is not a TCP port.",
            f"set {name} to a port in 1..65535.",
            setting=name,
            value=environ[name],
        )
    return port


def _check_layout(env: DistEnv, names: Mapping[str, str]) -> DistEnv:
    """Cross-checks shared by all launchers. ``names`` maps a DistEnv field to the variable it came from."""

    def bad(field: str, value: int, rule: str, fix: str) -> BadInput:
        name = names.get(field, field)
        return BadInput(f"{name}={value} {rule} (launcher={env.launcher}).", fix, setting=name, value=value)

    if env.world_size < 1:
        raise bad("world_size", env.world_size, "must be >= 1", "start at least one process.")
    if not 0 <= env.rank < env.world_size:
        raise bad(
            "rank",
            env.rank,
            f"is outside 0..{env.world_size - 1} ({names.get('world_size')}={env.world_size})",
            "the launcher's rank and world size disagree; check the launch command.",
        )
    if env.num_nodes < 1 or not 0 <= env.node_rank < env.num_nodes:
        raise bad(
            "node_rank",
            env.node_rank,
            f"is outside 0..{env.num_nodes - 1} ({names.get('num_nodes')}={env.num_nodes})",
            "the node index must be below the node count.",
        )
    if env.local_world_size < 1 or env.local_world_size > env.world_size:
        raise bad(
            "local_world_size",
            env.local_world_size,
            f"must be between 1 and {names.get('world_size')}={env.world_size}",
            "set it to the number of processes on this node.",
        )
    if not 0 <= env.local_rank < env.local_world_size:
        raise bad(
            "local_rank",
            env.local_rank,
            f"is outside 0..{env.local_world_size - 1} ({names.get('local_world_size')}={env.local_world_size})",
            "set it to this process' index among the processes on its node.",
        )
    return env


# ----------------------------------------------------------------------------------------------------
# 1. torchrun / torch elastic


def _is_torchrun(environ: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    fix = "under torchrun (TORCHELASTIC_RUN_ID is set) the agent sets this for every worker; do not set or override it yourself."
    world = _int(environ, "WORLD_SIZE", minimum=1, fix=fix)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", minimum=1, fix=fix)
    # torchrun gives every node the same --nproc-per-node, so WORLD_SIZE = GROUP_WORLD_SIZE x LOCAL_WORLD_SIZE.
    if "GROUP_WORLD_SIZE" in environ:
        nodes = _int(environ, "GROUP_WORLD_SIZE", minimum=1, fix=fix)
    else:
        nodes = world // local_world
    if nodes * local_world != world:
        raise BadInput(
            f"WORLD_SIZE={world} is not GROUP_WORLD_SIZE={nodes} x LOCAL_WORLD_SIZE={local_world} under torchrun.",
            "do not set WORLD_SIZE/LOCAL_WORLD_SIZE/GROUP_WORLD_SIZE yourself; torchrun sets them.",
            setting="WORLD_SIZE",
            value=world,
        )
    env = DistEnv(
        rank=_int(environ, "RANK", fix=fix),
        # With --virtual-local-rank torchrun sets LOCAL_RANK=0 and one CUDA_VISIBLE_DEVICES entry per worker,
        # so 0 is then the right device index too.
        local_rank=_int(environ, "LOCAL_RANK", fix=fix),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(environ, "GROUP_RANK", fix=fix),
        num_nodes=nodes,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(environ, "MASTER_PORT") if "MASTER_PORT" in environ else SINGLE_PORT,
        launcher="torchrun",
    )
    return _check_layout(env, _TORCH_NAMES)


_TORCH_NAMES = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "num_nodes": "GROUP_WORLD_SIZE",
}


# ----------------------------------------------------------------------------------------------------
# 2. explicit env contract (submitit's TorchDistributedEnvironment.export(), hand-written scripts)

_CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _is_env_contract(environ: Mapping[str, str]) -> bool:
    return all(name in environ for name in _CONTRACT)


def _from_env_contract(environ: Mapping[str, str]) -> DistEnv:
    world = _int(environ, "WORLD_SIZE", minimum=1)
    rank = _int(environ, "RANK")
    local_rank = _int(environ, "LOCAL_RANK")
    if "LOCAL_WORLD_SIZE" in environ:
        local_world = _int(environ, "LOCAL_WORLD_SIZE", minimum=1)
    elif world == 1:
        local_world = 1
    else:
        # Guessing (e.g. "all on one node") would be right on some nodes and wrong on others; every rank
        # failing the same way at once beats node 0 waiting for peers that exited.
        raise BadInput(
            f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} are set but LOCAL_WORLD_SIZE is not.",
            "also export LOCAL_WORLD_SIZE (processes on this node), or launch with ddp-job launch / torchrun.",
            setting="LOCAL_WORLD_SIZE",
        )
    node_var = _first(environ, "GROUP_RANK", "NODE_RANK")
    # Without a node variable assume block placement (ranks of a node are consecutive), as torchrun and
    # submitit both place them.
    node_rank = _int(environ, node_var) if node_var else rank // local_world
    if "GROUP_WORLD_SIZE" in environ:
        nodes = _int(environ, "GROUP_WORLD_SIZE", minimum=1)
    elif world % local_world:
        raise BadInput(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}, so the node count is unknown.",
            "export GROUP_WORLD_SIZE (number of nodes) and GROUP_RANK (this node's index) as well.",
            setting="GROUP_WORLD_SIZE",
        )
    else:
        nodes = world // local_world
    if world > 1 and ("MASTER_ADDR" not in environ or "MASTER_PORT" not in environ):
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in environ]
        raise BadInput(
            f"RANK/WORLD_SIZE={world}/LOCAL_RANK are set but {' and '.join(missing)} not.",
            "export MASTER_ADDR (host of rank 0) and MASTER_PORT (a free port on it).",
            setting=missing[0],
        )
    env = DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=nodes,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(environ, "MASTER_PORT") if "MASTER_PORT" in environ else SINGLE_PORT,
        launcher="env",
    )
    return _check_layout(env, {**_TORCH_NAMES, "node_rank": node_var or "RANK // LOCAL_WORLD_SIZE"})


# ----------------------------------------------------------------------------------------------------
# 3. Kubeflow PyTorchJob pod started with plain python (no torchrun in the container)

_LAUNCH_FIX = (
    "start the container with `ddp-job launch -- <train args>` (torchrun reads the PET_* variables "
    "and starts the right processes) instead of `ddp-job train`."
)


def _is_kubeflow(environ: Mapping[str, str]) -> bool:
    return "PET_NNODES" in environ or "PET_NPROC_PER_NODE" in environ


def _from_kubeflow(environ: Mapping[str, str]) -> DistEnv:
    nproc_raw = environ.get("PET_NPROC_PER_NODE", "auto").strip()
    # The operator computes WORLD_SIZE with 1 process per pod for "auto"/"cpu"/"gpu" (only an integer counts).
    nproc = int(nproc_raw) if nproc_raw.isdigit() else 1
    if nproc > 1:
        raise BadInput(
            f"PET_NPROC_PER_NODE={nproc_raw!r}: this pod should run {nproc} processes but was started as one "
            "(RANK counts pods, WORLD_SIZE counts processes).",
            _LAUNCH_FIX,
            setting="PET_NPROC_PER_NODE",
            value=nproc_raw,
        )
    nnodes_raw = environ.get("PET_NNODES", "1").strip()
    if ":" in nnodes_raw:
        raise BadInput(
            f"PET_NNODES={nnodes_raw!r} is an elastic range (elasticPolicy): only torchrun's c10d rendezvous "
            "assigns ranks then.",
            _LAUNCH_FIX,
            setting="PET_NNODES",
            value=nnodes_raw,
        )
    nnodes = _int(environ, "PET_NNODES", minimum=1) if "PET_NNODES" in environ else 1
    if "RANK" not in environ:
        if nnodes == 1:
            return DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", SINGLE_PORT, "kubeflow")
        raise BadInput(
            f"PET_NNODES={nnodes_raw} pods but RANK/WORLD_SIZE are not set (a PyTorchJob without a Master replica).",
            _LAUNCH_FIX,
            setting="RANK",
        )
    world = _int(environ, "WORLD_SIZE", minimum=1)
    if "PET_NNODES" in environ and world != nnodes * nproc:
        raise BadInput(
            f"WORLD_SIZE={world} but PET_NNODES={nnodes} pods x 1 process: the pod's env was edited.",
            "do not set WORLD_SIZE, RANK, MASTER_* or PET_* in the manifest; the operator sets them.",
            setting="WORLD_SIZE",
            value=world,
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in environ and world > 1:
            raise BadInput(
                f"{name} is not set in a PyTorchJob pod with WORLD_SIZE={world}.",
                "give the job a Master replica.",
                setting=name,
            )
    rank = _int(environ, "RANK")
    env = DistEnv(
        rank=rank,
        local_rank=0,
        world_size=world,
        local_world_size=1,
        node_rank=_int(environ, "PET_NODE_RANK") if "PET_NODE_RANK" in environ else rank,
        num_nodes=world,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(environ, "MASTER_PORT") if "MASTER_PORT" in environ else SINGLE_PORT,
        launcher="kubeflow",
    )
    return _check_layout(
        env, {"rank": "RANK", "world_size": "WORLD_SIZE", "node_rank": "PET_NODE_RANK", "num_nodes": "WORLD_SIZE"}
    )


# ----------------------------------------------------------------------------------------------------
# 3a. Kubeflow Trainer v2 TrainJob pod started with plain python (no torchrun in the container)

# JobSet's pod hostname for completion index i of the trainer's only Job: <jobset>-node-0-<i>.
_TRAINJOB_HOST = re.compile(r"^(?P<job>.+)-node-0-(?P<index>\d+)$")


def _is_trainjob(environ: Mapping[str, str]) -> bool:
    # The v1 operator sets RANK next to PET_NODE_RANK and PET_MASTER_ADDR; the torch plugin sets neither RANK nor MASTER_*.
    return "PET_NODE_RANK" in environ and "PET_MASTER_ADDR" in environ and "RANK" not in environ


def _trainjob_node_rank(environ: Mapping[str, str]) -> int:
    """PET_NODE_RANK, which must agree with the completion index and the JobSet hostname when they are there."""
    node_rank = _int(environ, "PET_NODE_RANK")
    edited = "do not set PET_* in the TrainJob (the webhook rejects it) or the runtime; the torch plugin sets them."
    if "JOB_COMPLETION_INDEX" in environ and _int(environ, "JOB_COMPLETION_INDEX") != node_rank:
        raise BadInput(
            f"PET_NODE_RANK={node_rank} but JOB_COMPLETION_INDEX={environ['JOB_COMPLETION_INDEX']}: the pod's env was edited.",
            edited,
            setting="PET_NODE_RANK",
            value=node_rank,
        )
    host = _TRAINJOB_HOST.match(environ.get("HOSTNAME", ""))
    job = environ["PET_MASTER_ADDR"].split(".", 1)[-1]
    if host and host.group("job") == job and int(host.group("index")) != node_rank:
        raise BadInput(
            f"PET_NODE_RANK={node_rank} but this pod is {environ['HOSTNAME']} (JobSet index {host.group('index')}).",
            edited,
            setting="PET_NODE_RANK",
            value=node_rank,
        )
    return node_rank


def _from_trainjob(environ: Mapping[str, str]) -> DistEnv:
    nproc_raw = environ.get("PET_NPROC_PER_NODE", "1").strip()
    if nproc_raw != "1":
        raise BadInput(
            f"PET_NPROC_PER_NODE={nproc_raw!r}: this TrainJob pod should run that many processes (one per GPU for "
            "'auto') but was started as one.",
            _LAUNCH_FIX,
            setting="PET_NPROC_PER_NODE",
            value=nproc_raw,
        )
    nnodes = _int(environ, "PET_NNODES", minimum=1)
    node_rank = _trainjob_node_rank(environ)
    env = DistEnv(
        rank=node_rank,
        local_rank=0,
        world_size=nnodes,
        local_world_size=1,
        node_rank=node_rank,
        num_nodes=nnodes,
        master_addr=environ["PET_MASTER_ADDR"],
        master_port=_port(environ, "PET_MASTER_PORT") if "PET_MASTER_PORT" in environ else SINGLE_PORT,
        launcher="trainjob",
    )
    return _check_layout(
        env,
        {"rank": "PET_NODE_RANK", "world_size": "PET_NNODES", "node_rank": "PET_NODE_RANK", "num_nodes": "PET_NNODES"},
    )


# ----------------------------------------------------------------------------------------------------
# 4. Slurm srun step, one task per process


def _is_slurm_step(environ: Mapping[str, str]) -> bool:
    # SLURM_PROCID alone is not enough: the batch script has SLURM_PROCID=0 and SLURM_NTASKS=<all tasks>,
    # so a plain `python` in an sbatch script would wait forever for ranks that never start.
    return _first(environ, "SLURM_STEP_ID", "SLURM_STEPID") is not None and "SLURM_PROCID" in environ


def _slurm_tasks_per_node(
    environ: Mapping[str, str], world_var: str, world: int, fix: str
) -> tuple[list[int], str, str | None]:
    """Tasks on each node of the step, the variable that gave them, and the node-count variable."""
    tpn_var = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    nodes_var = _first(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    per_node = None
    if tpn_var is not None:
        try:
            per_node = parse_slurm_tasks_per_node(environ[tpn_var])
        except ValueError as e:
            raise BadInput(
                f"{tpn_var}={environ[tpn_var]!r}: {e}.", fix, setting=tpn_var, value=environ[tpn_var]
            ) from None
    nodes = _int(environ, nodes_var, minimum=1, fix=fix) if nodes_var else len(per_node or [1])
    if tpn_var is None or per_node is None:
        if world % nodes:
            raise BadInput(
                f"SLURM_TASKS_PER_NODE is not set and {world_var}={world} is not a multiple of {nodes_var}={nodes}.",
                fix,
                setting=world_var,
                value=world,
            )
        return [world // nodes] * nodes, "SLURM_TASKS_PER_NODE", nodes_var
    if len(per_node) != nodes or sum(per_node) != world:
        raise BadInput(
            f"{tpn_var}={environ[tpn_var]!r} describes {len(per_node)} nodes / {sum(per_node)} tasks but "
            f"{nodes_var}={nodes} and {world_var}={world}.",
            fix,
            setting=tpn_var,
            value=environ[tpn_var],
        )
    return per_node, tpn_var, nodes_var


def _slurm_master(environ: Mapping[str, str]) -> tuple[str, int]:
    """MASTER_ADDR/PORT as exported, else the step's first node and the job's port (slurm_master_port)."""
    if "MASTER_ADDR" in environ:
        master_addr = environ["MASTER_ADDR"]
    else:
        list_var = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if list_var is None:
            raise BadInput(
                "neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is set in an srun step.",
                "export MASTER_ADDR.",
                setting="MASTER_ADDR",
            )
        try:
            master_addr = expand_slurm_nodelist(environ[list_var])[0]
        except ValueError as e:
            raise BadInput(
                f"{list_var}={environ[list_var]!r}: {e}.",
                "export MASTER_ADDR (host of rank 0).",
                setting=list_var,
                value=environ[list_var],
            ) from None
    if "MASTER_PORT" in environ:
        return master_addr, _port(environ, "MASTER_PORT")
    job_var = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if job_var is None:
        raise BadInput(
            "neither MASTER_PORT nor SLURM_JOB_ID is set in an srun step.", "export MASTER_PORT.", setting="MASTER_PORT"
        )
    return master_addr, slurm_master_port(environ[job_var])


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    fix = "srun sets this for every task; launch one task per process with `srun ... ddp-job train` and do not override SLURM_*."
    world_var = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or "SLURM_NTASKS"
    world = _int(environ, world_var, minimum=1, fix=fix)
    node_rank = _int(environ, "SLURM_NODEID", fix=fix)
    per_node, tpn_var, nodes_var = _slurm_tasks_per_node(environ, world_var, world, fix)
    nodes = len(per_node)
    local_world = per_node[node_rank] if node_rank < nodes else 0
    master_addr, master_port = _slurm_master(environ)
    env = DistEnv(
        rank=_int(environ, "SLURM_PROCID", fix=fix),
        local_rank=_int(environ, "SLURM_LOCALID", fix=fix),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=nodes,
        master_addr=master_addr,
        master_port=master_port,
        launcher="slurm",
    )
    return _check_layout(
        env,
        {
            "rank": "SLURM_PROCID",
            "local_rank": "SLURM_LOCALID",
            "world_size": world_var,
            "local_world_size": f"{tpn_var}[SLURM_NODEID]",
            "node_rank": "SLURM_NODEID",
            "num_nodes": nodes_var or "nodes",
        },
    )


# ----------------------------------------------------------------------------------------------------
# 5. a single process


def _from_single(environ: Mapping[str, str]) -> DistEnv:
    # A half-set contract (say RANK=3 WORLD_SIZE=4 without LOCAL_RANK, or a node rank of 1 alone) is a launch
    # mistake: training alone as rank 0 of 1 would silently produce a different run.
    harmless = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0", "NODE_RANK": "0"}
    partial = {n: environ[n] for n in harmless if n in environ and environ[n].strip() != harmless[n]}
    if partial:
        shown = " ".join(f"{k}={v}" for k, v in partial.items())
        raise BadInput(
            f"{shown} is set but not all of RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE).",
            "export all of them plus MASTER_ADDR/MASTER_PORT, or unset them, or launch with ddp-job launch / torchrun.",
            setting=next(iter(partial)),
            value=next(iter(partial.values())),
        )
    port = _port(environ, "MASTER_PORT") if "MASTER_PORT" in environ else SINGLE_PORT
    return DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", port, "single")


# First match wins. The order is the design (docs/design.md, "Environment detection"):
DETECTION_ORDER: tuple[tuple[str, Callable[[Mapping[str, str]], bool], Callable[[Mapping[str, str]], DistEnv]], ...] = (
    # torchrun also runs inside srun and inside PyTorchJob pods, where SLURM_* and the pod's RANK describe
    # the node, not the worker; only the agent's per-worker variables are right.
    ("torchrun", _is_torchrun, _from_torchrun),
    # An explicit RANK/WORLD_SIZE/LOCAL_RANK is a deliberate per-process statement (submitit exports it
    # inside srun steps, whose SLURM_* would agree anyway); it beats anything inferred.
    ("env", _is_env_contract, _from_env_contract),
    # A TrainJob pod: PET_NODE_RANK/PET_MASTER_ADDR without RANK. Before the v1 rule, which PET_NNODES also matches.
    ("trainjob", _is_trainjob, _from_trainjob),
    # The operator sets RANK/WORLD_SIZE (no LOCAL_RANK) per pod; PET_* marks them as pod-level.
    ("kubeflow", _is_kubeflow, _from_kubeflow),
    # srun tasks: after the above because `srun torchrun` and submitit's export also carry SLURM_*.
    ("slurm", _is_slurm_step, _from_slurm),
    ("single", lambda environ: True, _from_single),
)


def detect_env(environ: Mapping[str, str]) -> DistEnv:
    """The process layout described by ``environ`` (pass ``os.environ``). Raises BadInput if inconsistent."""
    for _name, matches, build in DETECTION_ORDER:
        if matches(environ):
            return build(environ)
    raise AssertionError("unreachable: the single-process rule always matches")


# ----------------------------------------------------------------------------------------------------
# Slurm's compact notations


_NODE_GROUP = re.compile(r"\[([^\[\]]*)\]")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """``"n[1-2,5]"`` -> n1 n2 n5; ``"a1,b[01-03]"`` -> a1 b01 b02 b03 (zero padding kept);
    ``"gpu-[1-3]-x"`` -> gpu-1-x ...; several bracket groups in one name give their product.
    Raises ValueError on malformed input."""
    names: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if not item:
            raise ValueError("empty host name in the list")
        parts: list[list[str]] = []
        pos = 0
        for m in _NODE_GROUP.finditer(item):
            parts.append([item[pos : m.start()]])
            parts.append(_expand_ranges(m.group(1)))
            pos = m.end()
        tail = item[pos:]
        if "[" in tail or "]" in tail:
            raise ValueError(f"unbalanced bracket in {item!r}")
        parts.append([tail])
        names.extend("".join(combo) for combo in itertools.product(*parts))
    if not names:
        raise ValueError("no host names")
    return names


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, then each piece on tabs and spaces outside brackets, as Slurm's
    hostlist parser separates names (``"a b"``, ``"a ,b"``); an empty name between two commas stays an
    error."""
    items = []
    for piece in _split_outside_brackets(text, ","):
        names = [n for n in _split_outside_brackets(piece, " \t") if n]
        items.extend(names or [""])
    return items


def _split_outside_brackets(text: str, separators: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced bracket")
        elif ch in separators and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("unbalanced bracket")
    items.append(text[start:])
    return items


def _expand_ranges(spec: str) -> list[str]:
    out: list[str] = []
    for piece in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not m:
            raise ValueError(f"bad range {piece!r} (expected N or N-M)")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {piece!r}")
        width = len(lo)  # Slurm keeps the zero padding of the lower bound: 08-10 -> 08 09 10
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def parse_slurm_tasks_per_node(value: str) -> list[int]:
    """``"2(x3),1"`` -> [2, 2, 2, 1] (SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE). ValueError if malformed."""
    counts: list[int] = []
    for piece in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if not m:
            raise ValueError(f"bad entry {piece!r} (expected N or N(xK))")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_master_port(job_id: str) -> int:
    """A rendezvous port every task of the job computes alike (no communication needed), different for
    concurrent jobs with nearby ids, inside SLURM_PORT_BASE..SLURM_PORT_BASE+SLURM_PORT_SPAN-1."""
    job_id = job_id.strip()
    # Consecutive numeric ids get consecutive ports (no collision among SLURM_PORT_SPAN neighbours);
    # anything else (het-job "123+1", array "123_4") is hashed, stably across processes unlike hash().
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return SLURM_PORT_BASE + key % SLURM_PORT_SPAN


RESTART_VARS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "JOBSET_RESTART_ATTEMPT")
"""What each launcher counts its restarts in: Slurm's requeues of the job, torchrun's worker-group restarts
(reset by a new Slurm attempt or pod), and the JobSet's restart attempt (the pod label
``jobset.sigs.k8s.io/restart-attempt``, given to the container through the downward API)."""


def interruptions(environ: Mapping[str, str]) -> int:
    """How often this job has been interrupted so far, by every launcher's count (an unreadable count is 0:
    it only refines an estimate)."""
    total = 0
    for name in RESTART_VARS:
        raw = environ.get(name, "0").strip()
        if raw.isdigit():
            total += int(raw)
    return total


NOTICE_VAR = "DDP_JOB_NOTICE_S"
"""Where a shipped launcher states its stop notice (seconds from the stop signal to the hard kill): the
sbatch script's ``--signal`` lead time, the pod's ``terminationGracePeriodSeconds``. Not a ``JOB_*``
variable, so that a ``ckpt.grace_s`` set anywhere in the config wins over it."""


def launcher_notice_s(environ: Mapping[str, str]) -> float:
    """The launcher's stop notice, 0 when it states none."""
    raw = environ.get(NOTICE_VAR, "").strip()
    if not raw:
        return 0.0
    try:
        notice = float(raw)
    except ValueError:
        notice = -1.0
    if not notice >= 0:  # also refuses nan
        raise BadInput(
            f"{NOTICE_VAR}={raw!r} is not a number of seconds >= 0.",
            f"set {NOTICE_VAR} to the launcher's notice in seconds (the --signal lead time, the pod's "
            "terminationGracePeriodSeconds), or unset it.",
            setting=NOTICE_VAR,
            value=raw,
        )
    return notice


def stop_notice_s(grace_s: float, environ: Mapping[str, str]) -> tuple[float, str]:
    """The stop notice a save must fit in and where it comes from: ``grace_s`` (``ckpt.grace_s``) where set, else
    what the launcher states (0: unknown)."""
    if grace_s:
        return grace_s, "ckpt.grace_s"
    return launcher_notice_s(environ), NOTICE_VAR
