"""``ddp-job doctor``: preflight checks that fail in seconds instead of after the GPU hours start.

Runs under any launcher exactly like ``train`` (same ``load_config``, same ``detect_env``, same
``distributed.setup``), in three phases:

1. local checks on every rank (topology, versions, /dev/shm, storage, data) and the rendezvous endpoint,
   checked *before* ``init_process_group`` (which would block on a dead endpoint for the whole init timeout);
2. the process group, then one ``all_gather_object`` of every rank's facts: ranks unique and consistent
   with the launcher's layout, the same config hash and library versions everywhere;
3. communication: an all-reduce checked for correctness, then (``ddp-job doctor`` only) timed over
   ``doctor.comm_sizes_kb`` with algorithm and bus bandwidth as nccl-tests define them.

Rank 0 prints one line per check (worst status over ranks) and writes ``run_dir/doctor.json``. Exit code:
0 without FAIL; 1 when only rendezvous/communication failed (may heal on restart); 2 otherwise (bad input).
``train`` runs the quick variant (no bandwidth sweep) unless doctor.enabled=false, in two halves around the
process group that train creates itself: ``quick_local`` before it, ``quick_group`` on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from job.config import JobConfig, config_to_dict, flatten, load_config
from job.config.plan import make_plan
from job.doctor import checks as dc
from job.doctor.checks import FAIL, ORDER, PASS, WARN, Check
from job.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, BadInput, DoctorFailed, JobError
from job.launchers.env import DistEnv, detect_env
from job.parallel import distributed


def config_hash(flat: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


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


def local_checks(
    cfg: JobConfig, env: DistEnv, full: bool, environ: Mapping[str, str]
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
    vers = dc.versions()
    checks.append(dc.check_cuda_driver(vers))
    checks.append(dc.check_flight_recorder(backend, dict(environ)))
    checks.append(dc.check_shm(dc.shm_need_bytes(cfg, micro, env.local_world_size)))
    if env.is_main:  # rank 0 writes checkpoints, TensorBoard and config.yaml
        try:
            ckpt_bytes = dc.checkpoint_bytes(cfg)
        except BadInput as e:
            checks.append(Check("config.model", FAIL, e.what, e.fix))
            ckpt_bytes = 0
        checks += dc.check_run_dir(cfg.run_dir, ckpt_bytes, cfg.ckpt.keep_last, create=full)
    if full and env.local_rank == 0:  # train's own preflight already validates the data
        checks.append(dc.check_data(cfg))
    return checks, vers


def _facts(cfg: JobConfig, env: DistEnv, checks: list[Check], vers: dict[str, str]) -> dict[str, Any]:
    flat = flatten(config_to_dict(cfg))
    return {
        "rank": env.rank,
        "env": asdict(env),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "config_hash": config_hash(flat),
        "config": flat,
        "versions": vers,
        "checks": [asdict(c) for c in checks],
    }


def consistency_checks(facts: list[dict[str, Any]], pg_world: int) -> list[Check]:
    """Phase 2, identical on every rank: what only the gathered facts of all ranks can show."""
    return [_layout_check(facts, pg_world), _config_check(facts), _versions_check(facts)]


def _layout_problems(envs: list[dict[str, Any]], pg_world: int) -> tuple[list[str], int]:
    """What is wrong with the ranks' declared layout, and the number of nodes that joined."""
    problems = []
    ranks = sorted(e["rank"] for e in envs)
    if ranks != list(range(pg_world)):
        problems.append(f"ranks {ranks} are not unique 0..{pg_world - 1}")
    if {e["world_size"] for e in envs} != {pg_world}:
        problems.append(f"WORLD_SIZE per rank {[e['world_size'] for e in envs]} but {pg_world} processes joined")
    nodes: dict[int, list[dict[str, Any]]] = {}
    for e in envs:
        nodes.setdefault(e["node_rank"], []).append(e)
    for node, members in sorted(nodes.items()):
        declared = {m["local_world_size"] for m in members}
        if declared != {len(members)}:
            problems.append(
                f"node {node}: {len(members)} processes joined but they declare LOCAL_WORLD_SIZE {sorted(declared)}"
            )
        local_ranks = sorted(m["local_rank"] for m in members)
        if local_ranks != list(range(len(members))):
            problems.append(f"node {node}: local ranks {local_ranks} are not 0..{len(members) - 1}")
    if {e["num_nodes"] for e in envs} != {len(nodes)}:
        problems.append(f"{len(nodes)} node(s) joined but ranks declare {sorted({e['num_nodes'] for e in envs})} nodes")
    return problems, len(nodes)


def _layout_check(facts: list[dict[str, Any]], pg_world: int) -> Check:
    envs = [f["env"] for f in facts]
    problems, num_nodes = _layout_problems(envs, pg_world)
    if problems:
        fix = (
            "launch the same number of processes per node that the launcher's variables declare "
            "(nnodes x nproc-per-node = WORLD_SIZE)"
        )
        return Check("topology.layout", FAIL, "; ".join(problems), fix)
    hosts = sorted({f["host"] for f in facts})
    shown = ", ".join(hosts[:4])
    if len(hosts) > 4:
        shown += " ..."
    return Check(
        "topology.layout",
        PASS,
        f"{pg_world} ranks unique, {num_nodes} node(s) x {envs[0]['local_world_size']} as declared, hosts: {shown}",
    )


def _config_check(facts: list[dict[str, Any]]) -> Check:
    hashes = [f["config_hash"] for f in facts]
    if len(set(hashes)) == 1:
        return Check("config.same", PASS, f"config hash {hashes[0]} on all {len(facts)} ranks")
    odd = next(f for f in facts if f["config_hash"] != hashes[0])
    base = facts[0]["config"]
    diff = [
        f"{k}: rank 0 {base.get(k)!r} vs rank {odd['rank']} {odd['config'].get(k)!r}"
        for k in sorted(set(base) | set(odd["config"]))
        if base.get(k) != odd["config"].get(k)
    ]
    bad = [f["rank"] for f in facts if f["config_hash"] != hashes[0]]
    return Check(
        "config.same",
        FAIL,
        f"ranks {bad} resolved a different config than rank 0: {'; '.join(diff[:5])}",
        "give every rank the same --config, overrides and JOB_* variables",
    )


def _versions_check(facts: list[dict[str, Any]]) -> Check:
    vers = [f["versions"] for f in facts]
    differ = {k: sorted({v[k] for v in vers}) for k in vers[0] if len({v[k] for v in vers}) > 1}
    if not differ:
        v0 = vers[0]
        return Check(
            "versions.same",
            PASS,
            f"python {v0['python']}, torch {v0['torch']}, CUDA {v0['cuda_runtime']}, NCCL {v0['nccl']}, "
            f"cuDNN {v0['cudnn']} on all ranks",
        )
    status = WARN  # a driver or cuDNN minor difference runs; anything else is a different environment
    if any(k not in ("cuda_driver", "cudnn") for k in differ):
        status = FAIL
    return Check(
        "versions.same", status, f"versions differ across ranks: {differ}", "use one image / environment on every node"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def comm_checks(
    rt: distributed.Runtime, world: int, rank: int, full: bool, sizes_kb: Sequence[int], iters: int
) -> list[Check]:
    """Phase 3 on the training backend and device: correctness, then timed sizes (nccl-tests definitions)."""
    device = rt.device
    x = torch.arange(1024, dtype=torch.float32, device=device) * (rank + 1)
    dist.all_reduce(x)
    expected = torch.arange(1024, dtype=torch.float32, device=device) * (world * (world + 1) // 2)
    bad = int((x != expected).sum())
    flags = torch.tensor([bad], dtype=torch.int64)
    dist.all_reduce(flags, group=rt.control_group)
    if int(flags) or bad:
        return [
            Check(
                "communication.allreduce",
                FAIL,
                f"all-reduce ({rt.backend}) returned {int(flags)} wrong values (first: {x[:3].tolist()})",
                "check the interconnect (NCCL_DEBUG=INFO, NCCL_IB_DISABLE / NCCL_SOCKET_IFNAME)",
            )
        ]
    out = [Check("communication.allreduce", PASS, f"all-reduce on {rt.backend} across {world} rank(s) correct")]
    if not full:
        return out
    rows, mine = [], []
    for kb in sizes_kb:
        t = torch.ones(max(1, kb * 1024 // 4), dtype=torch.float32, device=device)
        dist.all_reduce(t)  # warm-up: connection set-up and allocation are not bandwidth
        _sync(device)
        distributed.barrier(rt)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        _sync(device)
        mine.append((time.perf_counter() - t0) / iters)
    times = torch.tensor(mine, dtype=torch.float64)
    gathered = [torch.zeros_like(times) for _ in range(world)]
    dist.all_gather(gathered, times, group=rt.control_group)
    per_rank = torch.stack(gathered)  # [rank, size]
    factor = 2 * (world - 1) / world
    for i, kb in enumerate(sizes_kb):
        sec = float(per_rank[:, i].max())  # the collective is as slow as its slowest rank
        algbw = kb * 1024 / sec / 1e9
        rows.append({"size_bytes": kb * 1024, "time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor})
    total = per_rank.sum(dim=1)
    slow = int(total.argmax())
    best = max(rows, key=lambda r: r["busbw_GBps"])
    detail = (
        f"peak busbw {best['busbw_GBps']:.3f} GB/s (algbw {best['algbw_GBps']:.3f}) at {best['size_bytes'] // 1024} KiB; "
        f"slowest rank {slow} ({float(total[slow]) * 1e3:.1f} ms vs median {statistics.median(total.tolist()) * 1e3:.1f} ms)"
    )
    out.append(
        Check(
            "communication.bandwidth",
            PASS,
            detail,
            data={"rows": rows, "slowest_rank": slow, "per_rank_total_s": total.tolist(), "backend": rt.backend},
        )
    )
    return out


def _merge(
    per_rank: list[list[dict[str, Any]]], world: int, shared: frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """One line per check name: the worst status over ranks, its distinct details and which ranks.
    ``shared`` names checks computed from all ranks' facts (no rank suffix)."""
    names: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for rank, checks in enumerate(per_rank):
        for c in checks:
            names.setdefault(c["name"], []).append((rank, c))
    merged = []
    for name, items in names.items():
        worst = max(ORDER[c["status"]] for _, c in items)
        groups: dict[str, list[int]] = {}
        for rank, c in items:
            if ORDER[c["status"]] == worst:
                # PASS details differ only in numbers (ports, timings): one line, rank 0's words
                groups.setdefault(items[0][1]["detail"] if worst == 0 else c["detail"], []).append(rank)
        for detail, ranks in groups.items():
            c = next((c for r, c in items if c["detail"] == detail), items[0][1])
            who = (
                ""
                if world == 1 or name in shared
                else (
                    " [all ranks]"
                    if len(ranks) == world
                    else f" [rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}]"
                )
            )
            merged.append({**c, "ranks": ranks, "line": f"{c['status']} {name:<24} {detail}{who}"})
    return merged


def exit_code(merged: list[dict[str, Any]]) -> int:
    fails = [m for m in merged if m["status"] == FAIL]
    if not fails:
        return EXIT_OK
    return EXIT_FAILURE if all(m["name"].startswith(dc.TRANSIENT) for m in fails) else EXIT_BAD_INPUT


def _print(merged: list[dict[str, Any]], only_problems: bool) -> None:
    for m in merged:
        if only_problems and m["status"] == PASS:
            continue
        print(m["line"], flush=True)
        for row in m["data"].get("rows", []) if not only_problems else []:  # nccl-tests style table
            print(
                f"     {row['size_bytes']:>10} B {row['time_us']:>10.0f} us  algbw {row['algbw_GBps']:7.3f} GB/s  busbw {row['busbw_GBps']:7.3f} GB/s",
                flush=True,
            )
        if m["status"] != PASS and m["fix"]:
            print(f"     fix: {m['fix']}", flush=True)


def _summary(merged: list[dict[str, Any]], wall: float) -> str:
    n = {s: sum(m["status"] == s for m in merged) for s in (FAIL, WARN, PASS)}
    return f"doctor: {n[FAIL]} FAIL, {n[WARN]} WARN, {n[PASS]} PASS in {wall:.2f} s"


def _write_report(run_dir: Path, report: dict[str, Any], name: str) -> Path | None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        os.replace(tmp, path)
        return path
    except OSError as e:
        print(f"doctor: report not written to {run_dir} ({e.strerror})", file=sys.stderr, flush=True)
        return None


@dataclass
class LocalPhase:
    """What this rank found alone, before any process group: its checks (the rendezvous check last)."""

    checks: list[Check]
    versions: dict[str, str]
    t0: float

    @property
    def rendezvous_failed(self) -> bool:
        return self.checks[-1].status == FAIL


def local_phase(cfg: JobConfig, env: DistEnv, full: bool, environ: Mapping[str, str]) -> LocalPhase:
    """Phase 1: every check this rank can do alone, then whether the rendezvous endpoint is reachable."""
    t0 = time.perf_counter()
    checks, vers = local_checks(cfg, env, full, environ)
    # Rank 0 opens the store itself unless torchrun's agent already serves it (TORCHELASTIC_USE_AGENT_STORE=True;
    # ddp-job launch turns that off with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so elastic restarts work).
    hosts_store = env.rank == 0 and not (
        env.launcher == "torchrun" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    )
    checks.append(dc.check_rendezvous(env, cfg.doctor.rendezvous_timeout_s, hosts_store))
    return LocalPhase(checks, vers, t0)


def alone(env: DistEnv, local: LocalPhase) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """No process group possible: this rank reports its own checks."""
    merged = _merge([[asdict(c) for c in local.checks]], 1)
    return merged, {"rank": env.rank, "env": asdict(env), "checks": merged, "wall_s": time.perf_counter() - local.t0}


def group_phase(
    cfg: JobConfig, env: DistEnv, rt: distributed.Runtime, local: LocalPhase, full: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Phase 2, on the process group the caller created: every rank's facts gathered, consistency and
    communication checks; returns the merged checks and the report."""
    world = dist.get_world_size()
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, _facts(cfg, env, local.checks, local.versions), group=rt.control_group)
    shared = consistency_checks(facts, world)
    shared += comm_checks(rt, world, dist.get_rank(), full, cfg.doctor.comm_sizes_kb, cfg.doctor.comm_iters)
    per_rank = [f["checks"] for f in facts]
    merged = _merge(
        [per_rank[0] + [asdict(c) for c in shared], *per_rank[1:]], world, frozenset(c.name for c in shared)
    )
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


def quick_local(cfg: JobConfig, env: DistEnv, environ: Mapping[str, str]) -> LocalPhase:
    """Before train creates its process group. Raises when the rendezvous cannot work (nothing to join)."""
    local = local_phase(cfg, env, False, environ)
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
        _write_report(cfg.run_dir, report, "doctor.json")


def _report_quick(merged: list[dict[str, Any]], env: DistEnv, local: LocalPhase) -> None:
    _print(merged, only_problems=True)
    print(_summary(merged, time.perf_counter() - local.t0) + " (skip with --doctor.enabled false)", flush=True)


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
    cfg: JobConfig, env: DistEnv, full: bool, environ: Mapping[str, str]
) -> tuple[list[dict[str, Any]], distributed.Runtime | None, dict[str, Any]]:
    """``ddp-job doctor``: all phases on a process group of its own; returns the merged checks, the live
    runtime (None if the rendezvous failed) and the report."""
    local = local_phase(cfg, env, full, environ)
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


def main(argv: list[str], environ: Mapping[str, str] | None = None) -> int:
    """``ddp-job doctor [--config PATH] [train overrides]``: the full checks; 0 ok, 1 transient FAIL, 2 FAIL."""
    environ = os.environ if environ is None else environ
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return EXIT_OK
    t0 = time.perf_counter()
    cfg = load_config(argv, environ)
    try:
        env = detect_env(environ)
    except BadInput as e:
        print(f"FAIL topology.launcher         {e.what}\n     fix: {e.fix}", flush=True)
        _write_report(
            cfg.run_dir,
            {"checks": [{"name": "topology.launcher", "status": FAIL, "detail": e.what, "fix": e.fix}]},
            "doctor.json",
        )
        return EXIT_BAD_INPUT
    merged, rt, report = _run(cfg, env, True, environ)
    try:
        if rt is None:  # rendezvous failed: every rank tells its own story
            print(f"[rank {env.rank}/{env.world_size}]", flush=True)
        if env.is_main or rt is None:
            _print(merged, only_problems=False)
            wall = time.perf_counter() - t0
            report["wall_s_total"] = wall
            name = "doctor.json" if rt is not None else f"doctor-rank{env.rank}.json"
            path = (
                _write_report(cfg.run_dir, report, name)
                if not any(m["name"] == "storage.writable" and m["status"] == FAIL for m in merged)
                else None
            )
            print(_summary(merged, wall) + (f"; report: {path}" if path else ""), flush=True)
    finally:
        if rt is not None:
            distributed.teardown()
    return exit_code(merged)
