"""The rendered PyTorchJob, run pod by pod as the training operator and kubelet would (tests/support/k8s_sim.py).

Each pod is a network namespace with its own IP, hostname, /etc/hosts, mount and PID namespace; the
container's command runs as written with the operator's environment; restarts follow restartPolicy.
Faults: kill -9 of a worker pod (the image task), SIGTERM to every pod (node drain, with the language-model
task, against an uninterrupted run), a worker pod that joins late, a time budget (train.max_time) that ends
every attempt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from support import k8s_sim as ks
from support import k8s_validate as kv
from support import lm
from support.ci import KUBECTL_MISSING, kubectl, require
from support.runs import assert_same_end

pytestmark = [pytest.mark.netns, pytest.mark.integration]
TIMEOUT = 420  # per job; a loaded 2-core machine is 5-10x slower than an idle one


@pytest.fixture(scope="module", autouse=True)
def _requirements() -> Iterator[None]:
    require(os.geteuid() == 0, "the operator simulation needs root (network namespaces, mounts)")
    for tool, package in (
        ("ip", "iproute2"),
        ("mount", "mount"),
        ("nsenter", "util-linux"),
        ("getent", "libc-bin"),
    ):
        require(
            shutil.which(tool) is not None,
            f"{tool} not found: install {package} (scripts/test.sh installs the Debian packages when run as root)",
        )
    require(kubectl() is not None, KUBECTL_MISSING)
    require(
        (ks.REPO / ".venv" / "bin" / "ddp-job").exists(),
        "the simulated image runs .venv/bin/ddp-job: pip install -e . into .venv",
    )
    yield


def _wait_for(what: str, cond: Callable[[], bool], timeout: float = TIMEOUT) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"no {what} after {timeout} s")
        time.sleep(0.2)
    return time.monotonic() - t0


def _config(sim: ks.Simulation) -> dict:
    """The training config the pods read (the rendered ConfigMap's job.yaml)."""
    (data,) = sim.config_maps.values()
    return yaml.safe_load(data["job.yaml"])


def _run_dir(sim: ks.Simulation) -> Path:
    """The run directory on the simulated PVC (run.output_dir is under its /workspace mount)."""
    run = _config(sim)["run"]
    return sim.workdir / "pvc" / "ddp-job-workspace" / Path(run["output_dir"]).relative_to("/workspace") / run["name"]


def _first_checkpoint(sim: ks.Simulation) -> Path:
    return _run_dir(sim) / f"step-{_config(sim)['ckpt']['every']:07d}"


def _steps(sim: ks.Simulation) -> int:
    return _config(sim)["train"]["steps"]


def _final_step(log: str) -> int:
    return int(re.findall(r"^FINAL step=(\d+)", log, re.M)[-1])


def _resumed_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+)", log)]


def _print_timeline(sim: ks.Simulation, t0: float) -> None:
    """Pod events relative to the fault (shown with pytest -s): where the restart time goes."""
    for t, pod, what in sim.events:
        if t >= t0 - 1:
            print(f"  {t - t0:+7.1f} s  {pod:24} {what}")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if item)


def test_operator_env_matches_the_worked_example() -> None:
    """§3's worked example: resnet-ddp, nprocPerNode "8", Master 1 + Worker 3, no port declared."""
    tmpl = {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}}
    job = {
        "metadata": {"name": "resnet-ddp"},
        "spec": {
            "nprocPerNode": "8",
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "template": tmpl},
                "Worker": {"replicas": 3, "template": tmpl},
            },
        },
    }
    assert [n for *_, n in ks.pod_names(job)] == ["resnet-ddp-master-0"] + [f"resnet-ddp-worker-{i}" for i in range(3)]
    assert dict(ks.operator_env(job, "Master", 0)) == {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": "23456",
        "PET_MASTER_PORT": "23456",
        "MASTER_ADDR": "resnet-ddp-master-0",
        "PET_MASTER_ADDR": "resnet-ddp-master-0",
        "WORLD_SIZE": "32",
        "RANK": "0",
        "PET_NODE_RANK": "0",
        "PET_NPROC_PER_NODE": "8",
        "PET_NNODES": "4",
    }
    assert dict(ks.operator_env(job, "Worker", 2))["RANK"] == "3"
    el = {
        "metadata": {"name": "e"},
        "spec": {
            "elasticPolicy": {"maxRestarts": 3},
            "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "template": tmpl}},
        },
    }
    assert dict(ks.operator_env(el, "Worker", 1)) == {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": "auto",
        "PET_RDZV_ENDPOINT": "e-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "2:2",
        "PET_MAX_RESTARTS": "3",
    }


def _check_pod_environment(sim: ks.Simulation, master: ks.Pod, worker: ks.Pod) -> None:
    """While the pods run: each sees exactly the container env + the operator's env, its own hostname, and
    resolves the other pod by name; the worker runs the image's interpreter and the checkout under test."""
    _wait_for("running containers", lambda: master.pid1 is not None and worker.pid1 is not None)
    # pid1 is known right after the shim's fork; its environment is the container's only after the exec
    _wait_for(
        "the worker's container command",
        lambda: b"ddp-job\x00launch" in Path(f"/proc/{worker.pid1}/cmdline").read_bytes(),
        60,
    )
    env = _environ(worker.pid1)
    assert {k: env.get(k) for k, _ in ks.operator_env(sim.job, "Worker", 0)} == dict(
        ks.operator_env(sim.job, "Worker", 0)
    )
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4" and env["PET_NNODES"] == "2"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and "LOCAL_RANK" not in env
    # Nothing of the host's environment leaks in: exactly the image's, the kubelet's HOSTNAME, the
    # container's env and the operator's (a sentinel set by the caller must not reach the pod either).
    container = next(c for c in sim.types["Worker"]["template"]["spec"]["containers"] if c["name"] == "pytorch")
    declared = {
        *ks.IMAGE_ENV,
        "HOSTNAME",
        *(e["name"] for e in container.get("env") or []),
        *(k for k, _ in ks.operator_env(sim.job, "Worker", 0)),
    }
    assert set(env) == declared, sorted(set(env) ^ declared)
    assert env["HOME"] == next(e["value"] for e in container["env"] if e["name"] == "HOME")
    # The pod runs the image: its venv's interpreter and the checkout under test at the image's paths.
    argv = Path(f"/proc/{worker.pid1}/cmdline").read_bytes().split(b"\0")
    assert argv[:2] == [f"{ks.IMAGE_VENV}/bin/python".encode(), f"{ks.IMAGE_VENV}/bin/ddp-job".encode()], argv
    imported = subprocess.run(
        ["nsenter", "-t", str(worker.pid1), "-m", "python", "-c", "import job; print(job.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert imported.stdout.strip() == f"{ks.IMAGE_SRC}/job/__init__.py", imported
    uts = subprocess.run(["nsenter", "-t", str(worker.pid1), "-u", "hostname"], capture_output=True, text=True)
    assert uts.stdout.strip() == "ddp-smoke-worker-0"
    hosts = Path(f"/proc/{worker.pid1}/root/etc/hosts").read_text()  # as the pod sees it
    assert f"{worker.ip} ddp-smoke-worker-0" in hosts and f"{master.ip} ddp-smoke-master-0" in hosts


def _with_subcommand(docs: list[dict], subcommand: str) -> list[dict]:
    """The rendered manifests with the containers' `ddp-job launch -- ARGS` turned into `... -- SUBCOMMAND ARGS`."""
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        c = next(c for c in rs["template"]["spec"]["containers"] if c["name"] == "pytorch")
        assert c["command"] == ["ddp-job", "launch"] and c["args"][0] == "--", c
        c["args"] = ["--", subcommand, *c["args"][1:]]
    return docs


def test_doctor_in_both_pods(tmp_path: Path) -> None:
    """cpu-smoke with only the subcommand changed (`ddp-job launch -- doctor --config ...`): the full
    preflight checks pass in both pods, among them the rendezvous check against the master pod's DNS
    name and the all-reduce across the pods; rank 0 writes the JSON report to the PVC."""
    docs = _with_subcommand(kv.render(kv.K8S / "overlays" / "cpu-smoke"), "doctor")
    t0 = time.monotonic()
    with ks.Simulation(docs, tmp_path) as sim:
        sim.start()
        assert sim.wait(TIMEOUT) == "Succeeded"
        wall = time.monotonic() - t0
    master, worker = sim.pods["ddp-smoke-master-0"], sim.pods["ddp-smoke-worker-0"]
    log_m, log_w = sim.log(master.name), sim.log(worker.name)
    assert master.exit_codes == [0], log_m[-4000:]
    # The worker's agent leaves torchrun's exit barrier with the master's; cleanPodPolicy Running may still stop
    # it first (the job succeeds when the Master does, and the operator stops what still runs): a FAIL would
    # have exited 1 or 2.
    assert len(worker.exit_codes) == 1 and worker.exit_codes[0] in (0, 137), (worker.exit_codes, log_w[-4000:])
    assert "FAIL " not in log_m + log_w and "doctor: 0 FAIL" in log_m, log_m[-4000:]
    for line in (
        r"PASS topology\.launcher\s+launcher=torchrun: world size 4 = 2 node\(s\) x 2 process\(es\) per node",
        r"PASS topology\.layout\s+4 ranks unique, 2 node\(s\) x 2 as declared, hosts: ddp-smoke-master-0, ddp-smoke-worker-0",
        r"PASS rendezvous\s+MASTER_ADDR=ddp-smoke-master-0 MASTER_PORT=23456 resolves to 10\.232\.0\.\d+",
        r"PASS communication\.allreduce\s+all-reduce on gloo across 4 rank",
        r"PASS communication\.bandwidth\s+peak busbw",
    ):
        assert re.search(line, log_m), (line, log_m[-4000:])
    run_dir = _run_dir(sim)
    report = json.loads((run_dir / "doctor.json").read_text())
    assert report["world_size"] == 4 and report["launcher"] == "torchrun" and report["backend"] == "gloo"
    by_rank = {r["rank"]: r for r in report["ranks"]}
    assert {r: by_rank[r]["host"] for r in by_rank} == {
        0: "ddp-smoke-master-0",
        1: "ddp-smoke-master-0",
        2: "ddp-smoke-worker-0",
        3: "ddp-smoke-worker-0",
    }
    assert {by_rank[r]["env"]["master_addr"] for r in by_rank} == {"ddp-smoke-master-0"}
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["rendezvous"]["status"] == "PASS" and checks["rendezvous"]["ranks"] == [0, 1, 2, 3]
    bw = checks["communication.bandwidth"]["data"]["rows"]
    assert bw and all(r["busbw_GBps"] > 0 for r in bw)
    assert not list(run_dir.glob("step-*")), "doctor must not train"
    print(
        f"\ndoctor in 2 pods x 2 processes: {wall:.1f} s job wall (checks {report['wall_s']:.1f} s); gloo busbw "
        + ", ".join(f"{r['size_bytes'] // 1024} KiB {r['busbw_GBps']:.3f} GB/s" for r in bw)
    )


def test_two_pods_train_and_a_killed_worker_pod_restarts_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu-smoke as rendered, Master + 1 Worker x 2 processes (the pods' environment, names and image checked while
    they run), then kill -9 of the worker pod's processes: the container exits 137 and restarts in place
    (OnFailure, after the kubelet's back-off); the master's trainers lose their peer and restart too; training
    resumes from the newest checkpoint and finishes."""
    docs = kv.render(kv.K8S / "overlays" / "cpu-smoke")
    monkeypatch.setenv("DDP_JOB_HOST_ONLY", "1")
    with ks.Simulation(docs, tmp_path) as sim:
        sim.start()
        _check_pod_environment(sim, sim.pods["ddp-smoke-master-0"], sim.pods["ddp-smoke-worker-0"])
        first = _first_checkpoint(sim)
        _wait_for(f"checkpoint {first.name}", first.is_dir)
        t_kill = time.monotonic()  # before the kill: its exit is recorded after this
        sim.kill("ddp-smoke-worker-0", signal.SIGKILL)
        _wait_for("a resume", lambda: _resumed_steps(sim.log("ddp-smoke-master-0")))
        resume_s = time.monotonic() - t_kill
        assert sim.wait(TIMEOUT) == "Succeeded"
    worker, master = sim.pods["ddp-smoke-worker-0"], sim.pods["ddp-smoke-master-0"]
    print(f"\nkill -9 worker pod -> trainers resumed after {resume_s:.1f} s (kubelet back-off 10 s)")
    _print_timeline(sim, t_kill)
    assert worker.exit_codes[0] == 137 and worker.restarts >= 1 and worker.generation == 0
    assert master.exit_codes[0] != 0 and master.exit_codes[-1] == 0
    exits = [(t, pod, what) for t, pod, what in sim.events if what.startswith("exited")]
    assert exits and exits[0][0] >= t_kill and exits[0][1:] == (worker.name, "exited 137"), (
        exits
    )  # nothing failed first
    log_m, log_w = sim.log(master.name), sim.log(worker.name)
    assert "node 0/2 launcher=torchrun backend=gloo" in log_m and "rank 3/4 local 1/2 node 1/2" in log_w
    assert "doctor: 0 FAIL" in log_m  # train's quick preflight phase passed across both pods first
    resumed = _resumed_steps(log_m)
    assert resumed and resumed[0] >= _config(sim)["ckpt"]["every"]
    assert _final_step(log_m) == _steps(sim)
    assert (_run_dir(sim) / f"step-{_steps(sim):07d}").is_dir() and (_run_dir(sim) / "tb").is_dir()


def test_time_budget_ends_each_attempt_with_143_and_the_pods_restart(tmp_path: Path) -> None:
    """train.max_time spent at once: each attempt trains one step, saves it, records reason time-budget and
    exits 143; restartPolicy OnFailure restarts the containers in place, which resume, until the run is done. A
    stop agreed on the last step finishes the run: exit 0, no stop save, no extra attempt."""
    docs = _with_args(kv.render(kv.K8S / "overlays" / "cpu-smoke"), "--train.steps", "2", "--train.max-time", "0.001")
    with ks.Simulation(docs, tmp_path) as sim:
        sim.start()
        assert sim.wait(TIMEOUT) == "Succeeded", sim.log("ddp-smoke-master-0")[-4000:]
    log = sim.log("ddp-smoke-master-0")
    master, worker = sim.pods["ddp-smoke-master-0"], sim.pods["ddp-smoke-worker-0"]
    assert master.exit_codes == [143, 0], (master.exit_codes, sim.events)  # restarted in place (OnFailure)
    # The job succeeds when the Master does; cleanPodPolicy Running then stops a worker still in torchrun's exit
    # barrier (137), as the operator would (test_doctor_in_both_pods): its first attempt must have saved and left.
    assert worker.exit_codes[0] == 143 and worker.exit_codes[1:] in ([0], [137]), (worker.exit_codes, sim.events)
    stopped = re.findall(r"\[rank 0/\d+\] INFO stop requested \(time budget[^)]*\): saving at step (\d+)", log)
    assert stopped == ["1"], log[-4000:]
    assert "stop save of step 1 (time-budget); exit code 143" in log, log[-4000:]
    assert sorted(set(_resumed_steps(log))) == [1] and _final_step(log) == 2  # every rank logs its resume


def _rendered_config(docs: list[dict]) -> dict:
    """The training config in the rendered ConfigMap (job.yaml), before any pod runs."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "job.yaml" in d.get("data", {})]
    return yaml.safe_load(cm["data"]["job.yaml"])


def _with_args(docs: list[dict], *args: str) -> list[dict]:
    """The rendered manifests with ARGS appended to every `pytorch` container's training arguments."""
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        c = next(c for c in rs["template"]["spec"]["containers"] if c["name"] == "pytorch")
        c["args"] = [*c["args"], *args]
    return docs


def test_elastic_worker_joins_late(tmp_path: Path) -> None:
    """cpu-smoke-elastic: worker-0 trains alone (1 pod x 2 processes), worker-1 is scheduled later;
    torchrun's c10d rendezvous admits it, the group restarts with 4 processes and resumes."""
    docs = kv.render(kv.K8S / "overlays" / "cpu-smoke-elastic")
    config = _rendered_config(docs)
    steps, every = config["train"]["steps"], config["ckpt"]["every"]
    # Rank 0 straggles 5 s in every step after the first checkpoint, so the second pod (torch imports take
    # tens of seconds under load) joins while the first still trains: once, under CI load, the first pod
    # finished all its steps before the second arrived, and there was no mid-run restart to test.
    delayed = "[" + ",".join(str(s) for s in range(every + 1, steps + 1)) + "]"
    docs = _with_args(
        docs, "--debug.straggler-delay-s", "5", "--debug.straggler-rank", "0", "--debug.straggler-steps", delayed
    )
    with ks.Simulation(docs, tmp_path) as sim:
        sim.start(only=["ddp-smoke-elastic-worker-0"])
        first = _first_checkpoint(sim)
        _wait_for(f"checkpoint {first.name}", first.is_dir)
        sim.add("ddp-smoke-elastic-worker-1")
        assert sim.wait(TIMEOUT) == "Succeeded"
    log0, log1 = sim.log("ddp-smoke-elastic-worker-0"), sim.log("ddp-smoke-elastic-worker-1")
    assert "rank 0/2 local 0/2 node 0/1" in log0  # alone first
    assert re.search(r"rank \d/4 local \d/2 node \d/2", log1)  # then a 4-process group
    saved = re.findall(r"saving at step (\d+) and exiting 143", log0)  # the agent restarts the group
    assert saved and _resumed_steps(log1)[0] == int(saved[0]) and _final_step(log0 + log1) == _steps(sim)


def _language_model(docs: list[dict], workdir: Path, corpus: Path) -> list[dict]:
    """cpu-smoke's manifests training the language-model task (support.lm) over ``corpus``, copied onto the
    simulated PVC; rank 0 sleeps 0.5 s before each step after the first checkpoint (a testing aid that does
    not change the math) so that a drain then lands mid-run."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "job.yaml" in d.get("data", {})]
    cfg = yaml.safe_load(cm["data"]["job.yaml"])
    every, steps = cfg["ckpt"]["every"], cfg["train"]["steps"]
    cfg = lm.job_config(cfg, "/workspace/pycorpus")
    cfg["debug"] = {"straggler_delay_s": 0.5, "straggler_rank": 0, "straggler_steps": list(range(every + 1, steps + 1))}
    cm["data"]["job.yaml"] = yaml.safe_dump(cfg)
    shutil.copytree(corpus, workdir / "pvc" / "ddp-job-workspace" / "pycorpus")
    return docs


def _uninterrupted(docs: list[dict], workdir: Path) -> tuple[Path, str]:
    """The run directory and the master's log of the manifests run to completion."""
    with ks.Simulation(docs, workdir) as sim:
        sim.start()
        assert sim.wait(TIMEOUT) == "Succeeded", sim.log("ddp-smoke-master-0")[-4000:]
    return _run_dir(sim), sim.log("ddp-smoke-master-0")


def test_node_drain_saves_exits_143_and_resumes_bitwise(tmp_path: Path) -> None:
    """SIGTERM to every pod (eviction) after the first checkpoint, with the language-model task (dropout and
    a random window shift: RNG state the checkpoint must carry): the trainers save at the next step boundary,
    every container exits 143, the operator recreates the pods (new IPs), they resume from the step every rank
    stopped at, and the run ends bitwise equal to an uninterrupted run of the same manifests (run beside it, in
    its own simulation): parameters, optimizer state and validation."""
    corpus = lm.make_corpus(tmp_path / "pycorpus")
    ref_docs = _language_model(kv.render(kv.K8S / "overlays" / "cpu-smoke"), tmp_path / "ref", corpus)
    docs = _language_model(kv.render(kv.K8S / "overlays" / "cpu-smoke"), tmp_path / "drained", corpus)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_uninterrupted, ref_docs, tmp_path / "ref")
        with ks.Simulation(docs, tmp_path / "drained") as sim:
            sim.start()
            first = _first_checkpoint(sim)
            _wait_for(f"checkpoint {first.name}", first.is_dir)
            old_ips = {n: p.ip for n, p in sim.pods.items()}
            sim.evict(list(sim.pods))
            t_drain = time.monotonic()
            _wait_for("a resume", lambda: _resumed_steps(sim.log("ddp-smoke-master-0")))
            resume_s = time.monotonic() - t_drain
            assert sim.wait(TIMEOUT) == "Succeeded", sim.log("ddp-smoke-master-0")[-4000:]
        ref_dir, ref_log = reference.result(timeout=TIMEOUT)
    print(f"\nnode drain -> trainers resumed after {resume_s:.1f} s")
    _print_timeline(sim, t_drain)
    log = sim.log("ddp-smoke-master-0")
    for name, pod in sim.pods.items():
        assert pod.exit_codes[0] == 143 and pod.generation == 1 and pod.ip != old_ips[name], (name, sim.events)
    stopped = [int(s) for s in re.findall(r"saving at step (\d+) and exiting 143", log)]
    assert stopped and _config(sim)["ckpt"]["every"] <= stopped[0] < _steps(sim), stopped
    assert set(_resumed_steps(log + sim.log("ddp-smoke-worker-0"))) == {stopped[0]}
    assert _final_step(log) == _steps(sim)
    assert_same_end(ref_dir, ref_log, _run_dir(sim), log)
