"""Phase 2 of the doctor: every rank's facts (layout, config hash, versions, its own checks), and the checks
only all of them together can make, identical on every rank."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from job.cluster.env import DistEnv
from job.config import JobConfig, config_to_dict, flatten
from job.doctor.checks import FAIL, PASS, WARN, Check


def config_hash(flat: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def facts_of(cfg: JobConfig, env: DistEnv, checks: list[Check], vers: dict[str, str]) -> dict[str, Any]:
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
