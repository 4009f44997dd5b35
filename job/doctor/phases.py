"""``ddp-job doctor``: preflight checks that fail in seconds instead of after the GPU hours start.

Runs under any launcher exactly like ``train`` (same ``load_config``, same ``detect_env``, same
``distributed.setup``), in three phases:

1. local checks on every rank (topology: GPUs, their peer access and NUMA placement; versions, /dev/shm,
   storage, data; ``ddp-job doctor`` only, on rank 0: a checkpoint's write timed against the launcher's stop
   notice) and the rendezvous endpoint, checked *before* ``init_process_group`` (which would block on
   a dead endpoint for the whole init timeout);
2. the process group, then one ``all_gather_object`` of every rank's facts: ranks unique and consistent
   with the launcher's layout, the same config hash and library versions everywhere;
3. communication: an all-reduce checked for correctness, then (``ddp-job doctor`` only) timed over the
   backend's sweep of sizes (``doctor.comm_sizes_kb``) with algorithm and bus bandwidth as nccl-tests define them.

Rank 0 prints one line per check (worst status over ranks) and writes ``run_dir/doctor.json``. Exit code:
0 without FAIL; 1 when only rendezvous/communication/storage space failed (may heal on restart); 2 otherwise
(bad input).
``train`` runs the quick variant (no bandwidth sweep) unless doctor.enabled=false, in two halves around the
process group that train creates itself: ``quick_local`` before it, ``quick_group`` on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from job.cluster.env import DistEnv, detect_env
from job.config import JobConfig, load_config
from job.config.plan import make_plan
from job.doctor import checks as dc
from job.doctor.checks import FAIL, PASS, Check
from job.doctor.communication import comm_checks, sweep_for
from job.doctor.consistency import consistency_checks, facts_of
from job.doctor.gpu_topology import gpu_topology_checks
from job.doctor.report import exit_code, merge, print_checks, summary, write_report
from job.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, BadInput, DoctorFailed, JobError
from job.parallel import distributed
from job.parallel import memory as pmemory
from job.parallel.memory import MemoryEstimate


@dataclass(frozen=True)
class Probes:
    """What the doctor checks but does not build itself, handed in by its caller (train, the command line),
    so that preflight depends on neither the model code nor the data code."""

    build_model: Callable[[JobConfig], Any]
    """The config's model (built on the meta device, or the one preflight built: the checkpoint's size)."""
    describe_data: Callable[[JobConfig], str]
    """The config's data, read as training will read it, in one line; raises BadInput naming what is wrong."""
    memory: Callable[[JobConfig, int, int], tuple[MemoryEstimate, MemoryEstimate] | None] | None = None
    """The (ddp, fsdp) memory estimates per device at a world size (job.parallel.memory), activations measured
    on the preflight batch; None where the run's strategy has none (dp)."""


def topology_check(env: DistEnv) -> Check:
    """WORLD_SIZE = nodes x processes per node. Slurm may place unequal task counts per node (env.py checks
    SLURM_TASKS_PER_NODE against the totals); every other launcher starts the same number on each node."""
    product = env.num_nodes * env.local_world_size
    if env.launcher != "slurm" and product != env.world_size:
        return Check(
            "topology.launcher",
            FAIL,
            f"launcher={env.launcher}: WORLD_SIZE={env.world_size} but {env.num_nodes} node(s) "
            f"x LOCAL_WORLD_SIZE={env.local_world_size} = {product}",
            "make WORLD_SIZE = number of nodes (GROUP_WORLD_SIZE / --nnodes) x processes per node (LOCAL_WORLD_SIZE / --nproc-per-node)",
        )
    return Check(
        "topology.launcher",
        PASS,
        f"launcher={env.launcher}: world size {env.world_size} = "
        f"{env.num_nodes} node(s) x {env.local_world_size} process(es) per node",
    )


def own_gpu(env: DistEnv, backend: str) -> int | None:
    """The index of the GPU this rank trains on, as distributed.setup will pick it; None without one."""
    try:
        device = distributed.pick_device(env, backend)
    except BadInput:
        return None  # more processes than GPUs: check_gpus says so
    if device.type != "cuda":
        return None
    return device.index


def local_checks(
    cfg: JobConfig, env: DistEnv, full: bool, environ: Mapping[str, str], probes: Probes
) -> tuple[list[Check], dict[str, str]]:
    """Phase 1 minus the rendezvous: every check this rank can do alone."""
    try:
        backend = distributed.pick_backend(cfg.dist, torch.cuda.is_available())
    except BadInput:
        backend = "nccl"  # asked for without a GPU: check_gpus says so
    checks = [topology_check(env)]
    try:
        plan = make_plan(cfg, env.world_size)
        micro = plan.micro_batch_size
    except BadInput as e:
        checks.append(Check("config.batch", FAIL, e.what, e.fix))
        micro = max(1, cfg.train.global_batch_size // env.world_size)
    checks.append(dc.check_gpus(env, backend, torch.cuda.device_count() if torch.cuda.is_available() else 0))
    checks += gpu_topology_checks(own_gpu(env, backend))
    vers = dc.versions()
    checks.append(dc.check_cuda_driver(vers))
    checks.append(dc.check_flight_recorder(backend, dict(environ)))
    checks.append(dc.check_shm(dc.shm_need_bytes(cfg, micro, env.local_world_size)))
    if env.is_main:  # rank 0 writes checkpoints, TensorBoard and config.yaml
        try:
            ckpt_bytes = dc.checkpoint_bytes(cfg, probes.build_model(cfg))
        except BadInput as e:
            checks.append(Check("config.model", FAIL, e.what, e.fix))
            ckpt_bytes = 0
        storage = dc.check_run_dir(cfg.run_dir, ckpt_bytes, cfg.ckpt.keep_last, create=full)
        checks += storage
        if full and ckpt_bytes and storage[0].status != FAIL:  # a save timed where the run saves
            checks.append(dc.check_notice(cfg, environ, cfg.run_dir, ckpt_bytes))
    if full and env.local_rank == 0:  # train's own preflight already validates the data
        checks.append(dc.check_data(cfg, lambda _data: probes.describe_data(cfg)))
    if env.local_rank == 0:  # one process per node: each node's devices alike
        checks += memory_checks(cfg, env, backend, probes)
    return checks, vers


def memory_checks(cfg: JobConfig, env: DistEnv, backend: str, probes: Probes) -> list[Check]:
    """The memory estimate against this device's capacity (none where the config or the devices fail their own
    checks, or the strategy has no estimate)."""
    if probes.memory is None:
        return []
    try:
        estimates = probes.memory(cfg, env.world_size, env.local_world_size)
        device = distributed.pick_device(env, backend)
    except BadInput:  # config.batch, config.model or topology.gpus says what is wrong
        return []
    if estimates is None:
        return []
    return [dc.check_memory(cfg.train.strategy, *estimates, pmemory.capacity_bytes(device, env.local_world_size))]


@dataclass
class LocalPhase:
    """What this rank found alone, before any process group: its checks (the rendezvous check last)."""

    checks: list[Check]
    versions: dict[str, str]
    t0: float

    @property
    def rendezvous_failed(self) -> bool:
        return self.checks[-1].status == FAIL


def local_phase(cfg: JobConfig, env: DistEnv, full: bool, environ: Mapping[str, str], probes: Probes) -> LocalPhase:
    """Phase 1: every check this rank can do alone, then whether the rendezvous endpoint is reachable."""
    t0 = time.perf_counter()
    checks, vers = local_checks(cfg, env, full, environ, probes)
    # Rank 0 opens the store itself unless torchrun's agent already serves it (TORCHELASTIC_USE_AGENT_STORE=True;
    # ddp-job launch turns that off with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 when workers may restart).
    hosts_store = env.rank == 0 and not (
        env.launcher == "torchrun" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    )
    checks.append(dc.check_rendezvous(env, cfg.doctor.rendezvous_timeout_s, hosts_store))
    return LocalPhase(checks, vers, t0)


def alone(env: DistEnv, local: LocalPhase) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """No process group possible: this rank reports its own checks."""
    merged = merge([[asdict(c) for c in local.checks]], 1)
    return merged, {"rank": env.rank, "env": asdict(env), "checks": merged, "wall_s": time.perf_counter() - local.t0}


def group_phase(
    cfg: JobConfig, env: DistEnv, rt: distributed.Runtime, local: LocalPhase, full: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Phase 2, on the process group the caller created: every rank's facts gathered, consistency and
    communication checks; returns the merged checks and the report."""
    world = dist.get_world_size()
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, facts_of(cfg, env, local.checks, local.versions), group=rt.control_group)
    shared = consistency_checks(facts, world)
    sweep = sweep_for(rt.backend, cfg.doctor.comm_sizes_kb, cfg.doctor.comm_iters)
    shared += comm_checks(rt, world, dist.get_rank(), full, sweep)
    per_rank = [f["checks"] for f in facts]
    merged = merge([per_rank[0] + [asdict(c) for c in shared], *per_rank[1:]], world, frozenset(c.name for c in shared))
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": time.perf_counter() - local.t0,
        "world_size": world,
        "launcher": env.launcher,
        "backend": rt.backend,
        "checks": merged,
        "ranks": [{k: f[k] for k in ("rank", "env", "host", "pid", "config_hash", "versions")} for f in facts],
    }
    return merged, report


# --- train's quick phase: two halves around the process group that train itself creates ---------------


def quick_local(cfg: JobConfig, env: DistEnv, environ: Mapping[str, str], probes: Probes) -> LocalPhase:
    """Before train creates its process group. Raises when the rendezvous cannot work (nothing to join)."""
    local = local_phase(cfg, env, False, environ, probes)
    if local.rendezvous_failed:
        merged, _ = alone(env, local)
        _report_quick(merged, env, local)
        _raise_failed(merged)
    return local


def quick_group(cfg: JobConfig, env: DistEnv, rt: distributed.Runtime, local: LocalPhase) -> None:
    """On train's process group: the checks that need every rank. Raises BadInput (exit 2) or DoctorFailed
    (exit 1) on every rank alike when a check FAILs; writes doctor.json only when all passed."""
    merged, report = group_phase(cfg, env, rt, local, False)
    if env.is_main:
        _report_quick(merged, env, local)
    if exit_code(merged) != EXIT_OK:
        _raise_failed(merged)
    if env.is_main:  # only on success: a failed start writes nothing (exit 2 contract)
        write_report(cfg.run_dir, report, "doctor.json")


def _report_quick(merged: list[dict[str, Any]], env: DistEnv, local: LocalPhase) -> None:
    print_checks(merged, only_problems=True)
    print(summary(merged, time.perf_counter() - local.t0) + " (skip with --doctor.enabled false)", flush=True)


def _raise_failed(merged: list[dict[str, Any]]) -> NoReturn:
    fails = "\n  ".join(f"{m['line']} -- fix: {m['fix']}" for m in merged if m["status"] == FAIL)
    error: type[JobError] = DoctorFailed
    if exit_code(merged) != EXIT_FAILURE:
        error = BadInput
    raise error(
        f"preflight checks failed (run `ddp-job doctor` for the full report):\n  {fails}",
        setting="doctor.enabled",
        value=True,
    )


def _run(
    cfg: JobConfig, env: DistEnv, full: bool, environ: Mapping[str, str], probes: Probes
) -> tuple[list[dict[str, Any]], distributed.Runtime | None, dict[str, Any]]:
    """``ddp-job doctor``: all phases on a process group of its own; returns the merged checks, the live
    runtime (None if the rendezvous failed) and the report."""
    local = local_phase(cfg, env, full, environ, probes)
    if local.rendezvous_failed:
        merged, report = alone(env, local)
        return merged, None, report
    rt = distributed.setup(env, cfg.dist)
    try:
        merged, report = group_phase(cfg, env, rt, local, full)
    except BaseException:
        distributed.teardown()
        raise
    return merged, rt, report


def main(argv: list[str], probes: Probes, environ: Mapping[str, str] | None = None) -> int:
    """``ddp-job doctor [--config PATH] [train overrides]``: the full checks; 0 ok, 1 transient FAIL, 2 FAIL."""
    environ = os.environ if environ is None else environ
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return EXIT_OK
    t0 = time.perf_counter()
    cfg = load_config(argv, environ, command="doctor")
    try:
        env = detect_env(environ)
    except BadInput as e:
        print(f"FAIL topology.launcher         {e.what}\n     fix: {e.fix}", flush=True)
        write_report(
            cfg.run_dir,
            {"checks": [{"name": "topology.launcher", "status": FAIL, "detail": e.what, "fix": e.fix}]},
            "doctor.json",
        )
        return EXIT_BAD_INPUT
    merged, rt, report = _run(cfg, env, True, environ, probes)
    try:
        if rt is None:  # rendezvous failed: every rank tells its own story
            print(f"[rank {env.rank}/{env.world_size}]", flush=True)
        if env.is_main or rt is None:
            print_checks(merged, only_problems=False)
            wall = time.perf_counter() - t0
            report["wall_s_total"] = wall
            name = "doctor.json" if rt is not None else f"doctor-rank{env.rank}.json"
            path = (
                write_report(cfg.run_dir, report, name)
                if not any(m["name"] == "storage.writable" and m["status"] == FAIL for m in merged)
                else None
            )
            print(summary(merged, wall) + (f"; report: {path}" if path else ""), flush=True)
    finally:
        if rt is not None:
            distributed.teardown()
    return exit_code(merged)
