"""The rendered TrainJob, run pod by pod as Kubeflow Trainer v2 + JobSet + kubelet would (tests/support/k8s_trainjob_sim.py).

Each pod is a network namespace with its own IP, hostname, /etc/hosts, mount and PID namespace, named
and resolved as JobSet names them; the container runs `ddp-job launch` with exactly the torch plugin's
environment. A run suspended in the middle (SIGTERM to every pod, as Kueue preemption does; the
language-model task) and resumed with new pods must end bitwise where an uninterrupted run of its manifests
beside it ends, and a run whose pods JobSet recreates after a kill -9 where the module's uninterrupted run
(2 pods x 2 processes, the image task) ends: every resume restarts
at a step boundary from a checkpoint holding the model, optimizer, data position and RNG state, and the
same 4 ranks sum the same gradients in the same order (gloo, DDP's settled bucket layout).

Timings (suspend to checkpoint on disk, resume to first step) are printed: run with -s.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from support import k8s_sim as ks
from support import k8s_trainjob_sim as ts
from support import k8s_validate as kv
from support import lm
from support import trainjob_status as tjs
from support.ci import KUBECTL_MISSING, kubectl, require
from support.runs import assert_same_end

from job.cluster.env import detect_env
from job.observe.trainjob import MIN_INTERVAL_S

pytestmark = [pytest.mark.netns, pytest.mark.integration]
TIMEOUT = 420  # per run; a loaded 2-core machine is 5-10x slower than an idle one
OVERLAYS = kv.K8S / "trainjob" / "overlays"
RECORDED_ENV = Path(__file__).resolve().parent / "data" / "k8s" / "trainjob-pod-env.json"
NODE0, NODE1 = "ddp-smoke-node-0-0", "ddp-smoke-node-0-1"
RUNWAY = {"straggler_delay_s": 0.5, "straggler_rank": 0}  # a testing aid (no effect on the math): steps >= 4


@pytest.fixture(scope="module", autouse=True)
def _requirements() -> Iterator[None]:
    require(os.geteuid() == 0, "the Trainer v2 simulation needs root (network namespaces, mounts)")
    for tool in ("ip", "mount", "getent"):
        require(shutil.which(tool) is not None, f"{tool} not found (scripts/test.sh installs the Debian packages)")
    require(kubectl() is not None, KUBECTL_MISSING)
    require((ks.REPO / ".venv" / "bin" / "ddp-job").exists(), "the simulated image runs .venv/bin/ddp-job")
    yield


def _render(overlay: str) -> list[dict]:
    """The overlay as rendered, its config logging every step and with a slow rank 0 from step 4 on (the
    same for every run here, so the runs stay comparable; a suspend after step 3 then lands mid-run)."""
    docs = kv.render(OVERLAYS / overlay)
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["job.yaml"])
    cfg["log"]["every"] = 1
    cfg["debug"] = {**RUNWAY, "straggler_steps": list(range(4, cfg["train"]["steps"] + 1))}
    cm["data"]["job.yaml"] = yaml.safe_dump(cfg)
    return docs


def _config(sim: ts.TrainJobSimulation) -> dict:
    (data,) = sim.config_maps.values()
    return yaml.safe_load(data["job.yaml"])


def _run_dir(sim: ts.TrainJobSimulation) -> Path:
    run = _config(sim)["run"]
    return sim.workdir / "pvc" / "ddp-job-workspace" / Path(run["output_dir"]).relative_to("/workspace") / run["name"]


def _checkpoint(sim: ts.TrainJobSimulation, step: int) -> Path:
    return _run_dir(sim) / f"step-{step:07d}"


def _wait_for(what: str, cond: Callable[[], bool], timeout: float = TIMEOUT) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"no {what} after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _final_params(run_dir: Path) -> tuple[int, dict]:
    from job.checkpoint import store

    found = store.find_latest(run_dir)
    assert found is not None, f"no complete checkpoint in {run_dir}"
    return found.step, store.read_checkpoint(found.path)["model"]


def _assert_same_params(a: Path, b: Path) -> None:
    import torch

    (step_a, pa), (step_b, pb) = _final_params(a), _final_params(b)
    assert step_a == step_b and pa.keys() == pb.keys()
    worst = max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)
    print(f"  max abs parameter difference against the uninterrupted run: {worst:.2e}")
    for k in pa:
        assert torch.equal(pa[k], pb[k]), f"{k}: differs from the uninterrupted run (max abs {worst:.2e})"


def _print_timeline(sim: ts.TrainJobSimulation, t0: float) -> None:
    for t, pod, what in sim.events:
        if t >= t0 - 1:
            print(f"  {t - t0:+7.1f} s  {pod:22} {what}")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if item)


def _worker_env(pid1: int, local_rank: str) -> dict[str, str] | None:
    """The environment torchrun gave the worker ``local_rank`` of the agent ``pid1`` (None until it runs)."""
    try:
        children = Path(f"/proc/{pid1}/task/{pid1}/children").read_text().split()
        envs = [_environ(int(pid)) for pid in children]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return next((e for e in envs if e.get("LOCAL_RANK") == local_rank), None)


def _capture_envs(sim: ts.TrainJobSimulation) -> dict[str, dict[str, str]]:
    """Each pod's container environment and node 1's second worker's, read from /proc while they run."""
    out: dict[str, dict[str, str]] = {}
    for name in (NODE0, NODE1):
        pod = sim.pods[name]
        _wait_for(f"{name}'s container", lambda p=pod: p.pid1 is not None, 120)
        _wait_for(f"{name}'s command", lambda p=pod: b"launch" in Path(f"/proc/{p.pid1}/cmdline").read_bytes(), 60)
        out[name] = _environ(sim.pods[name].pid1 or 0)
    pid1 = sim.pods[NODE1].pid1 or 0
    _wait_for("node 1's workers", lambda: _worker_env(pid1, "1") is not None, 120)
    out[f"{NODE1}/local-rank-1"] = _worker_env(pid1, "1") or {}
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """cpu-smoke, uninterrupted: the run every other run here is compared with."""
    workdir = tmp_path_factory.mktemp("reference")
    with ts.TrainJobSimulation(_render("cpu-smoke"), workdir) as sim:
        sim.start()
        envs = _capture_envs(sim)
        hosts = Path(f"/proc/{sim.pods[NODE1].pid1}/root/etc/hosts").read_text()  # as the pod sees it
        condition = sim.wait(TIMEOUT)
    (workdir / "envs.json").write_text(json.dumps(envs, indent=1, sort_keys=True) + "\n")
    return {"sim": sim, "envs": envs, "hosts": hosts, "condition": condition, "run_dir": _run_dir(sim)}


def test_torch_plugin_env_names_and_policies() -> None:
    """BEHAVIOUR.md's rules as pure functions: names, PET_* (auto with GPUs, CPU count without), the Job's
    podFailurePolicy and JobSet's failurePolicy as the cpu-smoke runtime sets them: bad input fails the TrainJob,
    a stop save restarts it without spending maxRestarts, any other failure spends one."""
    docs = kv.render(OVERLAYS / "cpu-smoke")
    runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
    gpu = {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}
    job = {"metadata": {"name": "resnet"}, "spec": {"trainer": {"numNodes": 3, "resourcesPerNode": gpu}}}
    assert ts.hostnames(job, runtime) == ["resnet-node-0-0", "resnet-node-0-1", "resnet-node-0-2"]
    assert dict(ts.torch_env(job, runtime, 2)) == {
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "auto",
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "resnet-node-0-0.resnet",
        "PET_MASTER_PORT": "29500",
    }
    assert ts.nproc_per_node({"resourcesPerNode": {"requests": {"cpu": "3500m"}}}) == "4"
    assert ts.nproc_per_node({"resourcesPerNode": {"limits": {"cpu": "2"}}}) == "2"
    assert ts.nproc_per_node({}) == "1" and ts.nproc_per_node({"numProcPerNode": 2}) == "2"
    pfp = ts.trainer_job(runtime)["template"]["spec"]["podFailurePolicy"]
    assert ts.pod_failure_rule(2, pfp) == ("FailJob", 0) and ts.pod_failure_rule(143, pfp) == ("FailJob", 1)
    assert [ts.pod_failure_action(c, pfp) for c in (1, 124, 137)] == ["Count"] * 3
    bad_input, stopped = ts.fail_job_message(NODE1, 2, 0), ts.fail_job_message(NODE1, 143, 1)
    assert (
        stopped == f"Container node for pod default/{NODE1} failed with exit code 143 matching FailJob rule at index 1"
    )
    policy = runtime["spec"]["template"]["spec"]["failurePolicy"]
    most = policy["maxRestarts"]
    assert ts.jobset_action("PodFailurePolicy", bad_input, policy, 0) == "FailJobSet"
    assert ts.jobset_action("PodFailurePolicy", stopped, policy, most) == "RestartJobSetAndIgnoreMaxRestarts"
    failed = "Job has reached the specified backoff limit"
    assert ts.jobset_action("BackoffLimitExceeded", failed, policy, most - 1) == "RestartJobSet"
    assert ts.jobset_action("BackoffLimitExceeded", failed, policy, most) == "FailJobSet"
    assert ts.jobset_action("BackoffLimitExceeded", failed, None, 0) == "FailJobSet"


def test_two_nodes_train_to_completion(reference: dict) -> None:
    """cpu-smoke as rendered: 2 pods x 2 processes finish; each pod's environment is exactly the image's,
    the container's and the torch plugin's; node 1 reaches node 0 as <job>-node-0-0.<job>."""
    sim, envs = reference["sim"], reference["envs"]
    assert reference["condition"] == ts.COMPLETE
    for name, pod in sim.pods.items():
        assert envs[name] == ts.container_env(sim.job, sim.runtime, pod.index), name
        assert pod.exit_codes == [0] and pod.generation == 0, (name, pod.exit_codes)
    assert envs[NODE1]["PET_NODE_RANK"] == envs[NODE1]["JOB_COMPLETION_INDEX"] == "1"
    assert envs[NODE1]["PET_MASTER_ADDR"] == "ddp-smoke-node-0-0.ddp-smoke"
    assert f"{sim.pods[NODE0].ip} ddp-smoke-node-0-0.ddp-smoke " in reference["hosts"]
    assert not re.search(r"\sddp-smoke-node-0-0$", reference["hosts"], re.M), "a bare peer hostname resolved"
    worker = detect_env(envs[f"{NODE1}/local-rank-1"])
    assert (worker.rank, worker.world_size, worker.node_rank, worker.launcher) == (3, 4, 1, "torchrun")
    log0, log1 = sim.log(NODE0), sim.log(NODE1)
    assert "node 0/2 launcher=torchrun backend=gloo" in log0 and "rank 3/4 local 1/2 node 1/2" in log1
    assert int(re.findall(r"^FINAL step=(\d+)", log0, re.M)[-1]) == _config(sim)["train"]["steps"]


def test_recorded_pod_environments_are_the_simulated_ones(reference: dict) -> None:
    """tests/data/k8s/trainjob-pod-env.json (read by tests/test_env.py) is what these pods carry; to
    record it again, copy the fixture's envs.json there."""
    recorded = json.loads(RECORDED_ENV.read_text())
    live = reference["envs"]
    assert recorded.keys() == live.keys()
    for name in (NODE0, NODE1):
        assert recorded[name] == live[name], name
    worker = f"{NODE1}/local-rank-1"  # the agent's per-run values (error-file paths) differ
    assert recorded[worker].keys() == live[worker].keys()
    assert detect_env(recorded[worker]) == detect_env(live[worker])


def _suspend_and_time(sim: ts.TrainJobSimulation) -> tuple[int, float, float]:
    """Suspend now; returns (stop step, seconds to its checkpoint on disk, seconds until no pod is left)."""
    t0 = time.monotonic()
    done = threading.Thread(target=sim.suspend)
    done.start()
    _wait_for("the stop line", lambda: "saving at step" in sim.log(NODE0), 180)
    step = int(re.findall(r"saving at step (\d+) and exiting 143", sim.log(NODE0))[0])
    _wait_for(f"checkpoint step {step}", _checkpoint(sim, step).is_dir, 180)
    to_disk = time.monotonic() - t0
    done.join()
    return step, to_disk, time.monotonic() - t0


def test_jobset_restart_of_all_pods_resumes(reference: dict, tmp_path: Path) -> None:
    """kill -9 of node 1's pod: it exits 137, its Job fails (backoffLimit 0), JobSet deletes node 0's
    pod too, waits until both are gone and recreates both (restart attempt 1, new IPs); the trainers
    resume from the newest checkpoint and end bitwise equal to the uninterrupted run."""
    with ts.TrainJobSimulation(_render("cpu-smoke"), tmp_path) as sim:
        sim.start()
        _wait_for("the first checkpoint", _checkpoint(sim, _config(sim)["ckpt"]["every"]).is_dir)
        first_ips = {n: p.ip for n, p in sim.pods.items()}
        t_kill = time.monotonic()
        sim.kill(NODE1, signal.SIGKILL)
        to_resume = _wait_for("a resume", lambda: "resumed from" in sim.log(NODE0))
        assert sim.wait(TIMEOUT) == ts.COMPLETE
    print(f"\nkill -9 of a pod -> JobSet restart of both -> trainers resumed after {to_resume:.1f} s")
    _print_timeline(sim, t_kill)
    assert sim.restart_attempt == 1 and sim.pods[NODE1].exit_codes == [137, 0]
    for name, pod in sim.pods.items():
        assert pod.generation == 1 and pod.ip != first_ips[name] and pod.exit_codes[-1] == 0, name
    resumed = [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+)", sim.log(NODE0))]
    assert len(resumed) == 2 and len(set(resumed)) == 1 and resumed[0] >= _config(sim)["ckpt"]["every"]
    _assert_same_params(_run_dir(sim), reference["run_dir"])


def test_time_budget_attempts_restart_without_spending_max_restarts(tmp_path: Path) -> None:
    """train.max_time spent at once, under a runtime that allows no failure (maxRestarts 0): the first attempt
    trains one step, saves it, records reason time-budget and every container exits 143; the Job fails by its
    podFailurePolicy and JobSet restarts all pods by the stop-save rule, which does not count towards
    maxRestarts; the second attempt resumes from the step it saved, and its stop, agreed on the last step,
    finishes the run (exit 0)."""
    docs = kv.render(OVERLAYS / "cpu-smoke")
    trainer = next(d for d in docs if d["kind"] == "TrainJob")["spec"]["trainer"]
    trainer["args"] = [*trainer["args"], "--train.steps", "2", "--train.max-time", "0.001"]
    runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
    runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] = 0
    with ts.TrainJobSimulation(docs, tmp_path) as sim:
        sim.start()
        condition = sim.wait(TIMEOUT)
    log = sim.log(NODE0)
    assert condition == ts.COMPLETE, (sim.events, log[-4000:])
    restarts = [what for _, pod, what in sim.events if pod == "jobset"]
    assert len(restarts) == 1 and all("exit code 143" in r for r in restarts), restarts
    assert all(r.endswith(": RestartJobSetAndIgnoreMaxRestarts") for r in restarts), restarts
    assert (sim.restart_attempt, sim.restarts_counted) == (1, 0)
    for name, pod in sim.pods.items():
        assert pod.exit_codes == [143, 0] and pod.generation == 1, (name, pod.exit_codes)
    stopped = re.findall(r"\[rank 0/\d+\] INFO stop requested \(time budget[^)]*\): saving at step (\d+)", log)
    assert stopped == ["1"], log[-4000:]
    assert "stop save of step 1 (time-budget); exit code 143" in log, log[-4000:]
    assert re.findall(r"resumed from \S+ \(step (\d+)", log) == ["1", "1"], log[-4000:]
    assert int(re.findall(r"^FINAL step=(\d+)", log, re.M)[-1]) == 2


def test_doctor_in_a_trainjob(tmp_path: Path) -> None:
    """cpu-smoke with spec.trainer.args starting ["--", "doctor", ...] (docs/kubernetes.md): the preflight
    checks pass in both pods, the rendezvous check resolves the JobSet name of node 0, and the report
    on the PVC names both pods."""
    docs = kv.render(OVERLAYS / "cpu-smoke")
    trainer = next(d for d in docs if d["kind"] == "TrainJob")["spec"]["trainer"]
    assert trainer["args"][0] == "--", trainer
    trainer["args"] = ["--", "doctor", *trainer["args"][1:]]
    with ts.TrainJobSimulation(docs, tmp_path) as sim:
        sim.start()
        assert sim.wait(TIMEOUT) == ts.COMPLETE
    log0 = sim.log(NODE0)
    assert all(p.exit_codes == [0] for p in sim.pods.values()), [p.exit_codes for p in sim.pods.values()]
    assert "FAIL " not in log0 + sim.log(NODE1) and "doctor: 0 FAIL" in log0, log0[-4000:]
    assert re.search(r"PASS rendezvous\s+MASTER_ADDR=ddp-smoke-node-0-0\.ddp-smoke MASTER_PORT=29500 resolves", log0)
    report = json.loads((_run_dir(sim) / "doctor.json").read_text())
    assert report["world_size"] == 4 and {r["host"] for r in report["ranks"]} == {NODE0, NODE1}
    assert not list(_run_dir(sim).glob("step-*")), "doctor must not train"


def _language_model(overlay: str, workdir: Path, corpus: Path) -> list[dict]:
    """The overlay as ``_render`` makes it, training the language-model task (support.lm) over ``corpus``,
    copied onto the simulated PVC."""
    docs = _render(overlay)
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    cm["data"]["job.yaml"] = yaml.safe_dump(
        lm.job_config(yaml.safe_load(cm["data"]["job.yaml"]), "/workspace/pycorpus")
    )
    shutil.copytree(corpus, workdir / "pvc" / "ddp-job-workspace" / "pycorpus")
    return docs


def _uninterrupted(docs: list[dict], workdir: Path) -> tuple[Path, str]:
    """The run directory and node 0's log of the manifests run to completion."""
    with ts.TrainJobSimulation(docs, workdir) as sim:
        sim.start()
        assert sim.wait(TIMEOUT) == ts.COMPLETE, sim.log(NODE0)[-4000:]
    return _run_dir(sim), sim.log(NODE0)


def test_suspend_then_resume_loses_nothing(tmp_path: Path) -> None:
    """cpu-smoke-kueue with the language-model task (dropout and a random window shift: RNG state the checkpoint
    must carry): created suspended (no pods) until admitted; suspended after the first checkpoint, as Kueue
    preempts: every pod gets SIGTERM, all ranks stop after the same step, the checkpoint is on disk before the
    pods are gone, every container exits 143; resumed with new pods and new IPs, every rank resumes from the
    step all stopped at, and the run ends bitwise equal to an uninterrupted run of the same manifests (run
    beside it, in its own simulation): parameters, optimizer state and validation."""
    corpus = lm.make_corpus(tmp_path / "pycorpus")
    ref_docs = _language_model("cpu-smoke", tmp_path / "ref", corpus)
    docs = _language_model("cpu-smoke-kueue", tmp_path / "suspended", corpus)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_uninterrupted, ref_docs, tmp_path / "ref")
        with ts.TrainJobSimulation(docs, tmp_path / "suspended") as sim:
            sim.start()
            time.sleep(2)  # several controller passes: a suspended TrainJob starts nothing
            assert sim.condition == ts.SUSPENDED and all(p.thread is None for p in sim.pods.values())
            sim.resume()  # Kueue admits the workload
            _wait_for("the first checkpoint", _checkpoint(sim, _config(sim)["ckpt"]["every"]).is_dir)
            first_ips = {n: p.ip for n, p in sim.pods.items()}
            step, to_disk, gone = _suspend_and_time(sim)
            assert sim.condition == ts.SUSPENDED and all(p.exit_codes == [143] for p in sim.pods.values())
            t_resume = time.monotonic()
            sim.resume()
            first = f"step {step + 1}/{_config(sim)['train']['steps']} "
            to_step = _wait_for(f"step {step + 1} after the resume", lambda: first in sim.log(NODE0))
            assert sim.wait(TIMEOUT) == ts.COMPLETE, sim.log(NODE0)[-4000:]
        ref_dir, ref_log = reference.result(timeout=TIMEOUT)
    print(f"\nsuspend -> checkpoint of step {step} on disk {to_disk:.1f} s, all pods gone {gone:.1f} s")
    print(f"resume (new pods) -> first step (step {step + 1}) done {to_step:.1f} s")
    _print_timeline(sim, t_resume)
    for name, pod in sim.pods.items():
        assert pod.exit_codes == [143, 0] and pod.generation == 1 and pod.ip != first_ips[name], (name, sim.events)
    assert _config(sim)["ckpt"]["every"] < step < _config(sim)["train"]["steps"], step
    # Each of the four ranks resumed once, from the step every rank stopped at.
    for name in (NODE0, NODE1):
        assert re.findall(r"resumed from \S+ \(step (\d+)", sim.log(name)) == [str(step)] * 2, name
    assert_same_end(ref_dir, ref_log, _run_dir(sim), sim.log(NODE0))


# ----------------------------------------------------------------------------- TrainJob status (progress)
POST_TWICE = """
import os, sys, time
from job.errors import ReportFailed
from job.observe.status import Status
from job.observe.trainjob import TrainJobProgress
sink = TrainJobProgress.from_environ(os.environ)
assert sink is not None, "no KUBEFLOW_TRAINER_SERVER_* variables"
for step in (1, 2):
    try:
        sink.send(Status(step, 4, time.time(), 1.0, {"train/loss": 1.0 / step}))
    except ReportFailed as e:
        sys.exit(f"send {step}: {e}")
    print("sent", step, flush=True)
    time.sleep(float(sys.argv[1]))
"""


def test_a_pod_reports_to_the_status_endpoint(tmp_path: Path) -> None:
    """The TrainJobStatus gate on: each pod carries the plugin's three variables, resolves the controller's
    Service name on the pods' network, trusts its CA from the projected volume and sends with its own token;
    a send after a rotation carries the new token, which the controller accepts."""
    docs = kv.render(OVERLAYS / "cpu-smoke")
    trainer = next(d for d in docs if d["kind"] == "TrainJob")["spec"]["trainer"]
    rotate_s = 2.0
    trainer["command"], trainer["args"] = ["python", "-c", POST_TWICE, str(rotate_s * 1.5)], []
    with ts.TrainJobSimulation(docs, tmp_path, trainjob_status=True, token_rotate_s=rotate_s) as sim:
        sim.start()
        envs = {n: _environ(_wait_pid1(sim, n, b"TrainJobProgress")) for n in (NODE0, NODE1)}
        condition = sim.wait(TIMEOUT)
    assert condition == ts.COMPLETE, (sim.log(NODE0), sim.log(NODE1))
    server = sim.status_server
    assert server is not None
    for name, pod in sim.pods.items():
        assert envs[name] == ts.container_env(sim.job, sim.runtime, pod.index, trainjob_status=True), name
        assert envs[name]["KUBEFLOW_TRAINER_SERVER_URL"] == (
            "https://kubeflow-trainer-controller-manager.kubeflow-system.svc:10443"
            "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs/ddp-smoke/status"
        )
        sent = [r for r in server.requests if r.claims()["kubernetes.io"]["pod"]["name"] == name]
        assert [r.code for r in sent] == [200, 200], [(r.code, r.answer) for r in server.requests]
        issued = [t for _, t in sim.tokens[f"{name}.0"]]
        assert sent[0].token != sent[1].token and {r.token for r in sent} <= set(issued), name
    assert server.trainer_status is not None and server.trainer_status["progressPercentage"] == 50


def _wait_pid1(sim: ts.TrainJobSimulation, name: str, marker: bytes) -> int:
    """The container's PID 1 once it runs the container's command (``marker`` in its command line)."""
    pod = sim.pods[name]
    _wait_for(f"{name}'s container", lambda: pod.pid1 is not None, 120)
    _wait_for(f"{name}'s command", lambda: marker in Path(f"/proc/{pod.pid1}/cmdline").read_bytes(), 60)
    return pod.pid1 or 0


SINK = "trainjob status"  # the sink's name in the reporter's log lines
CKPT_EVERY = 5
FAULT_STEPS = 40  # with rank 0's 2 s per step, room for four faults and their recoveries at 5 s a report
FAULT_STEP_S = 2.0  # slower steps, not more of them: the run lasts as long for a fraction of the CPU


def _progress_docs(steps: int, step_s: float = RUNWAY["straggler_delay_s"], ckpt_every: int = CKPT_EVERY) -> list[dict]:
    """cpu-smoke long enough for several reports: ``steps`` steps with rank 0 slowed by ``step_s`` each (a testing
    aid: the reports' pace is the throttle's, not the CPU's), a status every step, a checkpoint every
    ``ckpt_every``."""
    docs = kv.render(OVERLAYS / "cpu-smoke")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["job.yaml"])
    cfg["train"]["steps"] = steps
    cfg["log"]["every"] = 1
    cfg["ckpt"]["every"] = ckpt_every
    cfg["debug"] = {**RUNWAY, "straggler_delay_s": step_s, "straggler_steps": list(range(1, steps + 1))}
    cm["data"]["job.yaml"] = yaml.safe_dump(cfg)
    return docs


def _metrics(trainer_status: dict) -> dict[str, str]:
    return {m["name"]: m["value"] for m in trainer_status.get("metrics") or []}


def _token_at(issued: list[tuple[float, str]], t: float) -> tuple[str, str | None]:
    """The pod's token at time ``t`` and the one before it (still valid for the last 20 % of its life)."""
    before = [tok for when, tok in issued if when <= t]
    return before[-1], (before[-2] if len(before) > 1 else None)


def test_trainjob_status_follows_the_run(tmp_path: Path) -> None:
    """The gate on, a run of 40 steps: only rank 0 reports, every request is accepted; the status the controller
    holds shows the percentage rising to 100, an ETA that ends at 0, the newest checkpoint step and its age;
    requests are at least the throttle apart; the token rotated during the run and each request carried the
    pod's current one (or the one before, in its last 20 %)."""
    steps, rotate_s = 40, 3.0
    with ts.TrainJobSimulation(_progress_docs(steps), tmp_path, trainjob_status=True, token_rotate_s=rotate_s) as sim:
        sim.start()
        condition = sim.wait(TIMEOUT)
    server, log0 = sim.status_server, sim.log(NODE0)
    assert condition == ts.COMPLETE and server is not None, log0[-3000:]
    assert re.search(rf"progress reports to: .*{SINK}", log0) and f"progress report to {SINK} failed" not in log0
    reqs = server.requests
    assert reqs and all(r.code == 200 for r in reqs), [(r.code, r.answer) for r in reqs if r.code != 200]
    assert {r.claims()["kubernetes.io"]["pod"]["name"] for r in reqs} == {NODE0}, "only rank 0 reports"
    held = [h for _, h in server.history]
    print(f"\n{len(reqs)} requests; the status as the controller held it at the end:")
    print(json.dumps(server.trainer_status, indent=1))

    pcts = [h["progressPercentage"] for h in held]
    assert pcts == sorted(pcts) and pcts[-1] == 100 and pcts[0] < 50 and len(set(pcts)) >= 4, pcts
    # The ETA is the remaining steps times the measured step time (its formula is checked status by status in
    # tests/test_report.py); whether it falls between two reports here depends on how fast the shared CPU ran
    # each step, so only what holds at any speed is checked: an estimate from the first report on (the first
    # comes with most of the run left), never negative, 0 at the end.
    etas = [h["estimatedRemainingSeconds"] for h in held if "estimatedRemainingSeconds" in h]
    assert len(etas) >= 3 and etas[0] > 0 and etas[-1] == 0 and min(etas) >= 0, etas
    ckpts = [int(_metrics(h)["last_checkpoint_step"]) for h in held if "last_checkpoint_step" in _metrics(h)]
    assert ckpts == sorted(ckpts) and len(set(ckpts)) >= 3 and all(s % CKPT_EVERY == 0 for s in ckpts), ckpts
    final = _metrics(held[-1])
    assert final["last_checkpoint_step"] == str(steps) and float(final["checkpoint_age_s"]) >= 0
    assert {"train/loss", "checkpoint_age_s"} <= final.keys()
    assert _checkpoint(sim, steps).is_dir(), "the final status names the checkpoint on storage"

    # The throttle: the server's receive times carry each connection's own latency, hence 0.8 x the interval;
    # unthrottled, a status goes out every step (under a second apart here). The final one is sent at once.
    gaps = [b.time - a.time for a, b in itertools.pairwise(reqs[:-1])]
    assert gaps and min(gaps) > 0.8 * MIN_INTERVAL_S, gaps
    assert len(reqs) <= (reqs[-1].time - reqs[0].time) / MIN_INTERVAL_S + 2

    issued = sim.tokens[f"{NODE0}.0"]
    assert len({r.token for r in reqs}) >= 2 and len(issued) >= 3, "the token rotated during the run"
    for r in reqs:
        assert r.token in _token_at(issued, r.time), f"request at {r.time} carried a token the kubelet had replaced"


def _wait_or_finished(sim: ts.TrainJobSimulation, what: str, cond: Callable[[], bool]) -> None:
    """Wait for ``cond``; a run that ended first fails the test (it was too short for the phases)."""
    _wait_for(what, lambda: cond() or sim.condition in (ts.COMPLETE, ts.FAILED), 180)
    assert cond(), f"the run ended before {what}"


def _accepted_after(server: tjs.StatusServer, t: float) -> bool:
    return any(r.code == 200 and r.time > t for r in server.requests)


def test_run_goes_on_when_the_endpoint_fails(tmp_path: Path) -> None:
    """One run through every fault, each followed by a recovery: the endpoint down when the run starts
    (connections refused), then answering after the client's timeout, then answering 500, then the token file
    removed. Each failure is logged with its reason, reports resume once it is cleared, and the run finishes
    (exit 0, FINAL line)."""
    with ts.TrainJobSimulation(
        _progress_docs(FAULT_STEPS, FAULT_STEP_S, ckpt_every=20), tmp_path, trainjob_status=True
    ) as sim:
        server = sim.status_server
        assert server is not None
        server.down()
        sim.start()
        faults = {
            "ConnectionRefusedError": (server.down, server.up),
            "TimeoutError: The read operation timed out": (
                lambda: setattr(server, "fault", "slow"),
                lambda: setattr(server, "fault", None),
            ),
            "HTTP 500 Internal Server Error: Internal error": (
                lambda: setattr(server, "fault", "error"),
                lambda: setattr(server, "fault", None),
            ),
            "token file /var/run/secrets/kubeflow/trainer/token": (sim.remove_token, sim.restore_token),
        }
        for reason, (inject, clear) in faults.items():
            inject()
            _wait_or_finished(sim, f"a report failing with {reason!r}", lambda r=reason: r in sim.log(NODE0))
            t_clear = time.time()
            clear()
            _wait_or_finished(sim, f"an accepted report after {reason!r}", lambda t=t_clear: _accepted_after(server, t))
        condition = sim.wait(TIMEOUT)
    log0 = sim.log(NODE0)
    assert condition == ts.COMPLETE and all(p.exit_codes == [0] for p in sim.pods.values()), log0[-3000:]
    assert int(re.findall(r"^FINAL step=(\d+)", log0, re.M)[-1]) == FAULT_STEPS
    failures = re.findall(rf"progress report to {SINK} failed: (.*)", log0)
    assert [next(r for r in faults if r in f) for f in failures] == list(faults), failures
    assert log0.count(f"progress report to {SINK} recovered") == len(faults)
    assert server.trainer_status is not None and server.trainer_status["progressPercentage"] == 100


def test_gate_off_no_variables_no_reports(reference: dict) -> None:
    """The reference run has the gate off (the default): no controller endpoint, none of the three variables
    in any pod, and the trainer reports only to its other places."""
    sim = reference["sim"]
    assert not sim.trainjob_status and sim.status_server is None and sim.controller is None
    for name in (NODE0, NODE1, f"{NODE1}/local-rank-1"):
        assert not [k for k in reference["envs"][name] if k.startswith("KUBEFLOW_TRAINER_SERVER_")], name
    reports = re.findall(r"progress reports to: (.*)", sim.log(NODE0))
    assert reports and all(SINK not in line for line in reports), reports
