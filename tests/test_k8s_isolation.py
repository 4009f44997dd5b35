"""Simulated pods depend on nothing outside their simulation (tests/support/k8s_sim.py, tests/support/k8s_pod.py).

Three simulations run at once: two of the same PyTorchJob (the same pod names) and one TrainJob, each
pod a probe container over the rendered cpu-smoke volumes. While every probe runs, directories at the
pods' mount paths (the image's ``/opt/venv``, ``/opt/ddp-job``, the volumes' ``/workspace``, ``/config``,
...) are created and removed on the host, and one simulation ends. On Linux, removing a directory lazily
detaches every mount on it in every mount namespace: a pod whose mounts sat on host directories would
lose its venv or its PVC here. Each probe must still import torch and the job from the image, read its
ConfigMap and write its result to its PVC afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import k8s_sim as ks
from support import k8s_trainjob_sim as ts
from support import k8s_validate as kv
from support.ci import KUBECTL_MISSING, kubectl, require

pytestmark = [pytest.mark.netns, pytest.mark.integration]
TIMEOUT = 300  # a loaded 2-core machine imports torch 5-10x slower than an idle one
CHURN_ROUNDS = 3

# Runs in each pod: argv = the PVC's and the ConfigMap's mount paths. It waits for the test's go-ahead
# (a file the test writes into the PVC on the host) and only then imports torch and the job.
PROBE = """
import json, os, pathlib, sys, time
pvc, config = map(pathlib.Path, sys.argv[1:3])
host = os.environ["HOSTNAME"]
(pvc / f"{host}.ready").write_text("")
deadline = time.monotonic() + 600
while not (pvc / "go").exists():
    if time.monotonic() > deadline:
        sys.exit(f"{pvc}/go never appeared: the volume is no longer mounted")
    time.sleep(0.1)
import torch, job.cli
result = {"job": job.__file__, "torch": torch.__file__, "config": sorted(os.listdir(config))}
(pvc / f"{host}.json").write_text(json.dumps(result))
"""


@pytest.fixture(scope="module", autouse=True)
def _requirements() -> None:
    require(os.geteuid() == 0, "the pod simulations need root (network namespaces, mounts)")
    require(shutil.which("ip") is not None, "ip not found (scripts/test.sh installs the Debian packages)")
    require(kubectl() is not None, KUBECTL_MISSING)
    require((ks.REPO / ".venv" / "bin" / "ddp-job").exists(), "the simulated image runs .venv/bin/ddp-job")


def _mount_path(container: dict, pod_spec: dict, kind: str) -> str:
    """The mount path of the container's one volume of ``kind`` (persistentVolumeClaim, configMap)."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (path,) = [m["mountPath"] for m in container["volumeMounts"] if kind in volumes[m["name"]]]
    return path


def _probe_command(container: dict, pod_spec: dict) -> None:
    pvc, config = (
        _mount_path(container, pod_spec, "persistentVolumeClaim"),
        _mount_path(container, pod_spec, "configMap"),
    )
    container["command"], container["args"] = ["python", "-c", PROBE, pvc, config], []


def _pytorchjob() -> list[dict]:
    """cpu-smoke's PyTorchJob with its Master only, running the probe."""
    docs = kv.render(kv.K8S / "overlays" / "cpu-smoke")
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    del specs["Worker"]
    pod_spec = specs["Master"]["template"]["spec"]
    _probe_command(next(c for c in pod_spec["containers"] if c["name"] == "pytorch"), pod_spec)
    return docs


def _trainjob() -> list[dict]:
    """cpu-smoke's TrainJob on one node, running the probe (the runtime's container: its volumes)."""
    docs = kv.render(kv.K8S / "trainjob" / "overlays" / "cpu-smoke")
    job = next(d for d in docs if d["kind"] == "TrainJob")
    runtime = ts.runtime_of(docs, job)
    pod_spec = ts.trainer_job(runtime)["template"]["spec"]["template"]["spec"]
    container = next(c for c in pod_spec["containers"] if c["name"] == ts.TRAINER_JOB)
    _probe_command(container, pod_spec)
    job["spec"].setdefault("trainer", {}).update(numNodes=1, command=container["command"], args=[])
    return docs


def _containers(docs: list[dict]) -> list[dict]:
    """Every container of the rendered workloads (their volume mount paths are churned on the host)."""
    out = []
    for d in docs:
        if d["kind"] == "PyTorchJob":
            out += [c for rs in d["spec"]["pytorchReplicaSpecs"].values() for c in rs["template"]["spec"]["containers"]]
        if d["kind"] == "TrainingRuntime":
            out += [c for j in d["spec"]["template"]["spec"]["replicatedJobs"] for c in _job_containers(j)]
    return out


def _job_containers(replicated_job: dict) -> list[dict]:
    return replicated_job["template"]["spec"]["template"]["spec"]["containers"]


def _pvc(sim: ks.Simulation | ts.TrainJobSimulation) -> Path:
    (claim,) = (sim.workdir / "pvc").iterdir()
    return claim


def _wait_for(what: str, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {TIMEOUT} s")
        time.sleep(0.2)


def _ready(sim: ks.Simulation | ts.TrainJobSimulation) -> bool:
    """Every probe of ``sim`` is waiting for the go-ahead (none may have exited yet)."""
    exited = {n: p.exit_codes for n, p in sim.pods.items() if p.exit_codes}
    assert not exited, (exited, {n: sim.log(n)[-3000:] for n in exited})
    return (sim.workdir / "pvc").is_dir() and all((_pvc(sim) / f"{n}.ready").exists() for n in sim.pods)


def _churn(paths: set[str]) -> list[str]:
    """Create and remove each absent path on the host, a few times; returns the paths churned."""
    churned = sorted(p for p in paths if not Path(p).exists() and Path(p).parent.is_dir())
    for _ in range(CHURN_ROUNDS):
        for p in churned:
            Path(p).mkdir()
        time.sleep(0.2)
        for p in reversed(churned):
            Path(p).rmdir()
    return churned


def _finish(sim: ks.Simulation | ts.TrainJobSimulation, done: str) -> dict[str, dict]:
    """Let every probe of ``sim`` go on; wait for the job's ``done`` condition; every pod's result."""
    (_pvc(sim) / "go").write_text("")
    condition = ks.wait_for_condition(sim, (done, "Failed"), TIMEOUT)
    logs = {n: sim.log(n)[-3000:] for n in sim.pods}
    assert condition == done, logs
    return {n: json.loads((_pvc(sim) / f"{n}.json").read_text()) for n in sim.pods}


def _assert_image(results: dict[str, dict], docs: list[dict]) -> None:
    """Each pod imported the image's torch and job, and listed its ConfigMap's keys."""
    config_keys = sorted(next(d for d in docs if d["kind"] == "ConfigMap")["data"])
    for name, result in results.items():
        assert result["job"] == f"{ks.IMAGE_SRC}/job/__init__.py", (name, result)
        assert result["torch"].startswith(f"{ks.IMAGE_VENV}/"), (name, result)
        assert result["config"] == config_keys, (name, result)


def test_pods_keep_their_image_and_volumes_while_the_host_changes(tmp_path: Path) -> None:
    v1, v2 = _pytorchjob(), _trainjob()
    paths = {ks.IMAGE_VENV, ks.IMAGE_SRC} | {m["mountPath"] for c in _containers(v1 + v2) for m in c["volumeMounts"]}
    on_host = {p for p in paths if Path(p).exists()}
    with contextlib.ExitStack() as everything:
        first = contextlib.ExitStack()
        everything.enter_context(first)
        a = ks.Simulation(v1, tmp_path / "a")
        b = ks.Simulation(v1, tmp_path / "b")  # the same pod names as a's
        c = ts.TrainJobSimulation(v2, tmp_path / "c")
        for stack, sim in ((first, a), (everything, b), (everything, c)):
            stack.enter_context(sim)
            sim.start()
        for sim in (a, b, c):
            _wait_for(f"probe in every pod of {sim.workdir.name}", lambda s=sim: _ready(s))
        churned = _churn(paths)
        print(f"\ncreated and removed on the host, {CHURN_ROUNDS} times: {churned}")
        _assert_image(_finish(a, "Succeeded"), v1)
        first.close()  # one simulation ends while the others' pods run
        _assert_image(_finish(b, "Succeeded"), v1)
        _assert_image(_finish(c, ts.COMPLETE), v2)
    assert {p for p in paths if Path(p).exists()} == on_host  # the simulations made nothing at those paths
