"""ddp-job on a real two-node Slurm 22.05 cluster (tests/infra/slurm-cluster.sh): sbatch and submitit.

CPU + gloo, a small model on generated data. To keep the wall time down the sbatch jobs run side by
side: a module fixture submits the uninterrupted references (the image task and the language model), the
preempted job (the language model), the time-limit job (the image task) and the time-budget job at once, and
drives each in a background thread; the tests then check what happened.
Timings are printed as ``TIMING ...`` lines (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support import lm
from support.ci import require
from support.cli import make_data
from support.runs import rank_pids, tfevents_writer

from job.cluster.env import LAUNCHER_VAR_PREFIXES
from job.errors import ReportFailed
from job.observe.report import SlurmComment
from job.observe.status import Status

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "infra" / "slurm-cluster.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"
BASE = Path(os.environ.get("DDP_SLURM_BASE", "/tmp/ddp-job-slurm"))
STEPS = 12
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def need(msg: str) -> None:
    """A missing prerequisite fails in CI (no integration test may skip there) and skips elsewhere."""
    require(False, msg)


def timing(what: str, seconds: float) -> None:
    print(f"TIMING {what}: {seconds:.1f} s", flush=True)


# ------------------------------------------------------------------ cluster, data, environment
@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        need("the Slurm tests start slurmctld/slurmd and must run as root")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        need("Slurm is not installed and apt-get is missing: run tests/infra/slurm-cluster.sh install")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        need(f"tests/infra/slurm-cluster.sh start failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    timing("cluster start (install if needed + daemons + nodes idle)", time.monotonic() - t0)
    tmp = tmp_path_factory.mktemp("slurm-tmp")
    drop = ("JOB_", *LAUNCHER_VAR_PREFIXES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        OMP_NUM_THREADS="1",
        SLURM_CONF=str(BASE / "etc" / "slurm.conf"),
        TMPDIR=str(tmp),  # torchrun's torchelastic_* files
        GLOO_SOCKET_IFNAME="lo",  # traffic stays on loopback
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("DDP_JOB_VENV", sys.prefix)
    try:
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def shapes(tmp_path_factory: pytest.TempPathFactory, slurm_env: dict[str, str]) -> Path:
    return make_data(tmp_path_factory.mktemp("data") / "shapes", classes=4, per_class=16, size=32)


def train_args(data: Path, steps: int = STEPS, *extra: str) -> list[str]:
    """The core's bitwise-exact recipe (GroupNorm, no augmentation, no dropout, constant LR), tiny."""
    return [
        "--data.path",
        str(data),
        "--data.num-classes",
        "4",
        "--data.image-size",
        "16",
        "--data.augment",
        "false",
        "--data.num-workers",
        "0",
        "--model.name",
        "resnet18",
        "--model.norm",
        "group",
        "--optim.lr",
        "0.05",
        "--sched.name",
        "constant",
        "--train.steps",
        str(steps),
        "--train.global-batch-size",
        "8",
        "--ckpt.every",
        "2",
        "--log.every",
        "1",
        "--log.progress",
        "off",
        *extra,
    ]


@pytest.fixture(scope="session")
def pycorpus(tmp_path_factory: pytest.TempPathFactory, slurm_env: dict[str, str]) -> Path:
    return lm.make_corpus(tmp_path_factory.mktemp("corpus") / "pycorpus")


def lm_args(corpus: Path) -> list[str]:
    """The causal language-model task at its smallest (support.lm), as the image job trains: 12 steps of a
    global batch of 8, a checkpoint every 2."""
    options = {"path": str(corpus), **lm.OPTIONS}
    return [
        *("--task.name", "causal_lm", "--task.options", json.dumps(options)),
        *("--data.num-workers", "0", "--optim.name", "adamw", "--optim.lr", "0.003", "--sched.name", "constant"),
        *("--train.steps", str(STEPS), "--train.global-batch-size", "8", "--ckpt.every", "2"),
        *("--log.every", "1", "--log.progress", "off", "--log.tensorboard", "false"),
    ]


def slow_steps(seconds: float, first: int = 3) -> list[str]:
    """Rank 0 sleeps before these steps (a testing aid that does not change the math; resume ignores it):
    runway so a signal sent after the first checkpoint lands mid-run however fast the machine is."""
    steps = ",".join(str(s) for s in range(first, STEPS + 1))
    return ["--debug.straggler-delay-s", str(seconds), "--debug.straggler-rank", "0", "--debug.straggler-steps", steps]


# ------------------------------------------------------------------ Slurm helpers
def sh(env: dict[str, str], *cmd: str, check: bool = True) -> str:
    proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
    return proc.stdout


def job_info(env: dict[str, str], jid: str) -> dict[str, str]:
    out = sh(env, "scontrol", "show", "job", "-o", jid, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(pred: Callable[[], object], timeout: float, what: str, poll: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def steps_saved(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in run_dir.glob("step-[0-9]*") if p.is_dir() and ".tmp" not in p.name)


@dataclass
class SbatchJob:
    env: dict[str, str]
    workdir: Path
    jid: str
    submitted: float
    events: dict[str, float] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / f"ddp-job-{self.jid}"

    @property
    def log(self) -> str:
        path = self.workdir / "logs" / f"ddp-job-{self.jid}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def info(self) -> dict[str, str]:
        return job_info(self.env, self.jid)

    def wait_done(self, timeout: float) -> dict[str, str]:
        info = wait_for(
            lambda: (i := self.info()).get("JobState") in TERMINAL and i, timeout, f"job {self.jid} to finish", poll=0.5
        )
        self.events["done"] = time.monotonic()
        return info  # type: ignore[return-value]

    def wait_attempt_training(self, attempt: int, timeout: float) -> None:
        """Wait until attempt N (0 = first) has saved a checkpoint past the ones it started from."""

        def ready() -> bool:
            log = self.log
            marker = f"attempt {attempt}:"
            return marker in log and bool(steps_saved(self.run_dir)) and "saved checkpoint" in log.split(marker, 1)[1]

        wait_for(ready, timeout, f"attempt {attempt} of job {self.jid} to save a checkpoint")

    def wait_resumed(self, attempt: int, timeout: float) -> None:
        def resumed() -> bool:
            marker = f"attempt {attempt}:"
            return marker in (log := self.log) and "resumed from" in log.split(marker, 1)[1]

        wait_for(resumed, timeout, f"attempt {attempt} of job {self.jid} to resume")


def sbatch(env: dict[str, str], workdir: Path, args: list[str], *opts: str) -> SbatchJob:
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    job_env = dict(env, DDP_JOB_NPROC_PER_NODE="2")
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", *opts, str(SBATCH), *args]
    out = subprocess.run(cmd, cwd=workdir, env=job_env, capture_output=True, text=True, timeout=60, check=True).stdout
    return SbatchJob(env, workdir, out.strip().split(";")[0], time.monotonic())


def final_params(run_dir: Path) -> tuple[int, dict]:
    from job.checkpoint import store as ckpt

    found = ckpt.find_latest(run_dir)
    assert found is not None, f"no complete checkpoint in {run_dir}"
    return found.step, ckpt.read_checkpoint(found.path)["model"]


def assert_same_params(a: Path, b: Path) -> None:
    """Bitwise equal: the resumed run took the same steps on the same samples with the same all-reduce
    summation order (DDP's buckets settle at start-up, job.parallel.ddp.settle_buckets, so the step right
    after a resume uses the layout the uninterrupted run used)."""
    import torch

    step_a, pa = final_params(a)
    step_b, pb = final_params(b)
    assert step_a == step_b == STEPS
    assert pa.keys() == pb.keys()
    worst = max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)
    print(f"max abs parameter difference resumed vs uninterrupted: {worst:.2e}", flush=True)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), f"{k}: resumed and uninterrupted differ (max abs {worst:.2e})"


# ------------------------------------------------------------------ the sbatch jobs, side by side
def drive_reference(job: SbatchJob) -> dict[str, str]:
    return job.wait_done(360)


def drive_preempted(job: SbatchJob) -> dict[str, str]:
    """USR2 to the batch shell (what --signal=B:USR2@T sends) mid-run; then, in the resumed attempt,
    `scontrol requeue` from outside (SIGTERM path); the third attempt completes."""
    job.wait_attempt_training(0, 300)
    job.events["signal"] = time.monotonic()
    sh(job.env, "scancel", "--batch", "--signal=USR2", job.jid)
    job.wait_resumed(1, 240)
    job.events["resumed"] = time.monotonic()
    job.events["steps_before_requeue"] = max(steps_saved(job.run_dir))
    job.wait_attempt_training(1, 240)
    job.events["requeue"] = time.monotonic()
    sh(job.env, "scontrol", "requeue", job.jid)
    job.wait_resumed(2, 240)
    job.events["resumed2"] = time.monotonic()
    return job.wait_done(300)


def drive_time_limit(job: SbatchJob) -> dict[str, str]:
    """Submitted with --time=20 --signal=B:USR2@600. Once training runs, the test shortens the time limit
    so that less than 600 s remain: Slurm's own timer (checked every 30 s) then sends the signal, mid-run
    whatever the start-up took. Once requeued, the limit goes back up so the resumed attempt finishes."""
    job.wait_attempt_training(0, 300)
    elapsed = sum(int(x) * m for x, m in zip(reversed(job.info()["RunTime"].split(":")), (1, 60, 3600)))
    job.events["limit_shortened"] = time.monotonic()
    sh(job.env, "scontrol", "update", f"JobId={job.jid}", f"TimeLimit={elapsed // 60 + 10}")
    wait_for(lambda: "got SIGUSR2" in job.log, 120, f"Slurm's time-limit signal to job {job.jid}", poll=0.5)
    job.events["signal"] = time.monotonic()
    wait_for(
        lambda: "attempt 1:" in job.log, 240, f"job {job.jid} to be requeued after its time-limit signal", poll=0.5
    )
    sh(job.env, "scontrol", "update", f"JobId={job.jid}", "TimeLimit=30")
    return job.wait_done(300)


@pytest.fixture(scope="module")
def sbatch_jobs(
    slurm_env: dict[str, str], shapes: Path, pycorpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[SbatchJob, Future]]]:
    work = tmp_path_factory.mktemp("sbatch")
    args, lm = train_args(shapes), lm_args(pycorpus)
    jobs = {
        "reference": sbatch(slurm_env, work / "ref", args),
        "time_limit": sbatch(slurm_env, work / "tl", [*args, *slow_steps(4.0)], "--time=20", "--signal=B:USR2@600"),
        # the preempted job trains the language model (dropout, a random window shift: RNG state the checkpoint
        # must carry) against an uninterrupted run of its own
        "lm_reference": sbatch(slurm_env, work / "lm-ref", lm),
        "preempted": sbatch(slurm_env, work / "lm-pre", [*lm, *slow_steps(0.5)]),
        # a budget spent before the first step: attempt 1 trains a step, saves it and is requeued; the second
        # attempt's stop is agreed on the last step, which finishes the run
        "max_time": sbatch(slurm_env, work / "mt", [*train_args(shapes, 2), "--train.max-time", "0.001"]),
    }
    drivers = {
        "reference": drive_reference,
        "time_limit": drive_time_limit,
        "lm_reference": drive_reference,
        "preempted": drive_preempted,
        "max_time": drive_reference,
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        yield {name: (job, pool.submit(drivers[name], job)) for name, job in jobs.items()}
        for job in jobs.values():
            subprocess.run(["scancel", job.jid], env=slurm_env, capture_output=True)


def outcome(sbatch_jobs: dict[str, tuple[SbatchJob, Future]], name: str) -> tuple[SbatchJob, dict[str, str]]:
    job, fut = sbatch_jobs[name]
    try:
        info = fut.result(timeout=900)
    except Exception as err:
        raise AssertionError(f"{name} job {job.jid}: {err}\n--- log ---\n{job.log[-6000:]}") from err
    return job, info


def test_two_node_job_completes(sbatch_jobs: dict[str, tuple[SbatchJob, Future]]) -> None:
    job, info = outcome(sbatch_jobs, "reference")
    assert info["JobState"] == "COMPLETED", job.log[-4000:]
    timing("2-node job, sbatch to completion", job.events["done"] - job.submitted)
    log = job.log
    assert "node name n1 does not resolve: using its NodeAddr 127.0.0.1" in log
    assert "2 node(s) x 2 process(es)" in log
    ranks = set(re.findall(r"rank (\d)/4 local (\d)/2 node (\d)/2", log))
    assert ranks == {("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")}, ranks
    assert f"FINAL step={STEPS}" in log
    assert "doctor: 0 FAIL" in log  # train's quick preflight phase ran on the 4 ranks first
    assert steps_saved(job.run_dir)[-1] == STEPS
    events = list((job.run_dir / "tb").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard events"
    # rank 0 only: every event file was written by rank 0's process (both nodes share this host's pid space)
    pids = rank_pids(log)
    assert set(pids) == {0, 1, 2, 3}, log[-4000:]
    writers = {tfevents_writer(p)[1] for p in events}
    assert writers == pids[0], (writers, pids, [p.name for p in events])
    assert info["Restarts"] == "0"


def test_preemption_signal_requeues_and_resumes(sbatch_jobs: dict[str, tuple[SbatchJob, Future]]) -> None:
    """The language-model task through two preemptions (USR2 to the batch shell, then `scontrol requeue` from
    outside): each requeued attempt resumes from the step the previous one saved, and the run ends bitwise where
    the uninterrupted one does, parameters and validation metrics."""
    ref, ref_info = outcome(sbatch_jobs, "lm_reference")
    assert ref_info["JobState"] == "COMPLETED", ref.log[-4000:]
    job, info = outcome(sbatch_jobs, "preempted")
    assert info["JobState"] == "COMPLETED", job.log[-6000:]
    assert info["Restarts"] == "2"
    log = job.log
    before, after = log.split("attempt 1:", 1)
    assert "got SIGUSR2" in before and "requeueing job" in before
    stopped_at = job.events["steps_before_requeue"]
    assert 0 < stopped_at < STEPS, "the signal did not arrive mid-run"
    # every rank logs its resume: one step per attempt, the one the previous attempt saved on its stop
    first, second = after.split("attempt 2:", 1)
    resumed = [{int(m) for m in re.findall(r"resumed from \S+ \(step (\d+)\)", a)} for a in (first, second)]
    assert resumed[0] == {stopped_at} and len(resumed[1]) == 1, (resumed, stopped_at)
    assert 0 < stopped_at < min(resumed[1]) < STEPS, (resumed, stopped_at)
    timing(
        "USR2 signal to resumed job running (attempt 1 loaded its checkpoint)",
        job.events["resumed"] - job.events["signal"],
    )
    timing("language model, 2 preemptions, sbatch to completion", job.events["done"] - job.submitted)
    assert_same_params(job.run_dir, ref.run_dir)
    final = re.compile(r"^.*FINAL step=.* val_loss=(\S+) .*$", re.M)
    assert final.findall(job.log)[-1:] == final.findall(ref.log)[-1:] != [], "validation differs"


def test_scontrol_requeue_from_outside_resumes(sbatch_jobs: dict[str, tuple[SbatchJob, Future]]) -> None:
    job, info = outcome(sbatch_jobs, "preempted")
    assert info["JobState"] == "COMPLETED"
    second = job.log.split("attempt 1:", 1)[1].split("attempt 2:", 1)
    assert len(second) == 2, "no third attempt after scontrol requeue"
    assert "requeueing job" not in second[0], "the script must not requeue on SIGTERM: Slurm does"
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", second[1])
    assert resumed and int(resumed.group(1)) > job.events["steps_before_requeue"], (
        "attempt 2 did not resume from attempt 1's checkpoint"
    )
    timing("scontrol requeue to resumed job running", job.events["resumed2"] - job.events["requeue"])
    sacct = sh(job.env, "sacct", "-n", "-P", "-D", "-X", "-j", job.jid, "-o", "State")
    assert sacct.split().count("REQUEUED") == 2, sacct


def test_time_limit_signal_requeues_and_resumes(sbatch_jobs: dict[str, tuple[SbatchJob, Future]]) -> None:
    ref, _ = outcome(sbatch_jobs, "reference")
    job, info = outcome(sbatch_jobs, "time_limit")
    assert info["JobState"] == "COMPLETED", job.log[-6000:]
    first, rest = job.log.split("attempt 1:", 1)
    assert "got SIGUSR2" in first and "requeueing job" in first
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", rest)
    assert resumed and 2 <= int(resumed.group(1)) < STEPS, "attempt 1 did not resume mid-run"
    timing("time limit shortened to Slurm's signal", job.events["signal"] - job.events["limit_shortened"])
    assert_same_params(job.run_dir, ref.run_dir)


def test_time_budget_requeues_each_attempt_until_done(sbatch_jobs: dict[str, tuple[SbatchJob, Future]]) -> None:
    """train.max_time spent: no signal reaches the batch shell, yet the script requeues on the stop record
    (reason time-budget) and the next attempt resumes from the step the previous one saved; its stop, agreed on
    the last step, finishes the run (COMPLETED, not requeued again)."""
    job, info = outcome(sbatch_jobs, "max_time")
    assert info["JobState"] == "COMPLETED", job.log[-6000:]
    assert info["Restarts"] == "1", job.log[-6000:]
    first, second = re.split(r"attempt 1:", job.log)
    assert "got SIG" not in first and "saved step 1 after a stop (time-budget): requeueing job" in first
    assert "(step 1)" in second and "FINAL step=2" in second and "requeueing job" not in second


def test_doctor_through_the_sbatch_script(slurm_env: dict[str, str], shapes: Path, tmp_path: Path) -> None:
    """DDP_JOB_COMMAND=doctor: the same script, srun, ddp-job launch and c10d rendezvous as training run the
    full preflight checks on both nodes; the job's exit code is the doctor's."""
    args = [*train_args(shapes), "--doctor.comm-sizes-kb", "4,256", "--doctor.comm-iters", "3"]
    job = sbatch(dict(slurm_env, DDP_JOB_COMMAND="doctor"), tmp_path, args)
    info = job.wait_done(300)
    log = job.log
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-6000:]
    assert "attempt 0: doctor on 2 node(s) x 2 process(es)" in log and "job step exited with 0" in log, log[-6000:]
    assert "FAIL " not in log and re.search(r"doctor: 0 FAIL, \d+ WARN, \d+ PASS", log), log[-6000:]
    for line in (
        r"PASS topology\.launcher\s+launcher=torchrun: world size 4 = 2 node\(s\) x 2 process\(es\) per node",
        r"PASS topology\.layout\s+4 ranks unique, 2 node\(s\) x 2 as declared",
        r"PASS rendezvous\s+MASTER_ADDR=\S+ MASTER_PORT=\d+ resolves to ",
        r"PASS communication\.allreduce\s+all-reduce on gloo across 4 rank",
        r"PASS communication\.bandwidth\s+peak busbw",
    ):
        assert re.search(line, log), (line, log[-6000:])
    report = json.loads((job.run_dir / "doctor.json").read_text())
    assert report["world_size"] == 4 and report["launcher"] == "torchrun"
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1, 2, 3]
    assert sorted(r["env"]["node_rank"] for r in report["ranks"]) == [0, 0, 1, 1]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["rendezvous"]["status"] == "PASS" and checks["rendezvous"]["ranks"] == [0, 1, 2, 3]
    rows = checks["communication.bandwidth"]["data"]["rows"]
    assert [r["size_bytes"] for r in rows] == [4096, 262144] and all(r["busbw_GBps"] > 0 for r in rows)
    timing("2-node doctor job (2 x 2 processes), sbatch to completion", job.events["done"] - job.submitted)
    print(
        f"doctor on Slurm: checks {report['wall_s']:.1f} s, rank 0 total {report['wall_s_total']:.1f} s; gloo busbw "
        + ", ".join(f"{r['size_bytes'] // 1024} KiB {r['busbw_GBps']:.3f} GB/s" for r in rows),
        flush=True,
    )


# ------------------------------------------------------------------ submitit
def submit(env: dict[str, str], workdir: Path, *args: str) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "job.launchers.submit",
        "--log-folder",
        str(workdir / "submitit"),
        "--output-dir",
        str(workdir / "runs"),
        "--time",
        "10",
        "--wait",
        *args,
    ]
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_submitted(proc: subprocess.Popen, count: int) -> list[tuple[str, Path, Path]]:
    found = []
    assert proc.stdout is not None
    while len(found) < count:
        line = proc.stdout.readline()
        assert line, f"ddp-job submit exited ({proc.wait()}) before printing {count} job id(s)"
        if m := re.match(r"submitted job (\S+) run_dir=(\S+) log=(\S+)", line):
            found.append((m.group(1), Path(m.group(2)), Path(m.group(3))))
    return found


def test_submitit_submit_requeue_on_signal_wait_result(slurm_env: dict[str, str], shapes: Path, tmp_path: Path) -> None:
    import submitit

    t0 = time.monotonic()
    proc = submit(
        slurm_env,
        tmp_path,
        "--nodes",
        "2",
        "--gpus-per-node",
        "0",
        "--tasks-per-node",
        "1",
        "--name",
        "s1",
        "--",
        *train_args(shapes),
        *slow_steps(0.5),
    )
    [(jid, run_dir, log)] = read_submitted(proc, 1)
    wait_for(lambda: steps_saved(run_dir), 300, "the submitit job's first checkpoint")
    t_sig = time.monotonic()
    sh(slurm_env, "scancel", "--signal=USR2", jid)  # submitit's signal, as Slurm sends it before the time limit
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, out
    assert f"job {jid} done: exit=0" in out
    wait_for(
        lambda: "COMPLETED" in sh(slurm_env, "sacct", "-n", "-P", "-X", "-j", jid, "-o", "State").split(),
        60,
        "sacct to show COMPLETED",
    )
    timing("submitit job with one requeue, submit to done", time.monotonic() - t0)
    results = submitit.SlurmJob(folder=tmp_path / "submitit", job_id=jid, tasks=(0, 1)).results()
    assert results == [0, 0]
    text = "".join(p.read_text() for p in log.parent.glob(f"{jid}_*_log.*"))
    assert "got SIGUSR2: asking training to save" in text and "Requeued job" in text
    sacct = sh(slurm_env, "sacct", "-n", "-P", "-D", "-X", "-j", jid, "-o", "State")
    assert "REQUEUED" in sacct.split(), sacct
    m = re.search(r"resumed from \S+ \(step (\d+)\)", text)
    assert m and 0 < int(m.group(1)) < STEPS, "the resubmitted job did not resume mid-run"
    assert max(steps_saved(run_dir)) == STEPS
    print(f"TIMING submitit USR2 to end: {time.monotonic() - t_sig:.1f} s")


def test_submitit_sweep_is_a_job_array(slurm_env: dict[str, str], shapes: Path, tmp_path: Path) -> None:
    proc = submit(
        slurm_env,
        tmp_path,
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--tasks-per-node",
        "1",
        "--name",
        "sw",
        "--sweep",
        "optim.lr=0.05,0.2",
        "--",
        *train_args(shapes, steps=4),
    )
    jobs = read_submitted(proc, 2)
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, out
    ids = [j for j, _, _ in jobs]
    assert len({i.split("_")[0] for i in ids}) == 1 and {i.split("_")[1] for i in ids} == {"0", "1"}, ids
    lrs = set()
    for _, run_dir, _ in jobs:
        assert steps_saved(run_dir)[-1] == 4
        lrs.add(re.search(r"^\s+lr: (\S+)", (run_dir / "config.yaml").read_text(), re.M).group(1))  # type: ignore[union-attr]
    assert lrs == {"0.05", "0.2"}
    assert out.count("done: exit=0") == 2, out


# ------------------------------------------------------------------ progress in the job's comment
COMMENT = re.compile(r"ddp-job (step|done) (\d+)/(\d+) (\d+)%")


def comment_of(env: dict[str, str], jid: str) -> str | None:
    """The job's comment as `scontrol show job` prints it (a line of its own: it may hold spaces)."""
    out = sh(env, "scontrol", "show", "job", jid, check=False)
    m = re.search(r"^\s*Comment=(.*?) ?$", out, re.M)
    return m.group(1) if m else None


def test_job_comment_shows_progress(slurm_env: dict[str, str], shapes: Path, tmp_path: Path) -> None:
    """Rank 0 of a two-node sbatch job keeps the job's comment current: `scontrol show job` shows the step while
    it runs, and the final status (done, 100 %, the last checkpoint) after it completed."""
    args = [*train_args(shapes), "--report.slurm-every-s", "1", *slow_steps(1.0, first=1)]
    job = sbatch(slurm_env, tmp_path, args)
    while_running: list[str] = []

    def finished() -> dict[str, str] | None:
        info = job.info()
        comment = comment_of(job.env, job.jid)
        if info.get("JobState") == "RUNNING" and comment and comment not in while_running:
            while_running.append(comment)
        return info if info.get("JobState") in TERMINAL else None

    info = wait_for(finished, 360, f"job {job.jid} to finish", poll=0.5)
    assert info["JobState"] == "COMPLETED", job.log[-4000:]  # type: ignore[index]
    running = [m for c in while_running if (m := COMMENT.match(c)) and m[1] == "step"]
    assert any(0 < int(m[2]) < STEPS and int(m[3]) == STEPS for m in running), while_running
    final = comment_of(job.env, job.jid)
    assert final is not None and final.startswith(f"ddp-job done {STEPS}/{STEPS} 100% ckpt@{STEPS} age "), final
    status = json.loads((job.run_dir / "status.json").read_text())
    assert status["finished"] and status["last_checkpoint_step"] == STEPS
    assert "progress reports to: status file, slurm comment" in job.log
    assert "progress report to slurm comment failed" not in job.log


def test_a_run_goes_on_when_scontrol_update_fails(slurm_env: dict[str, str], shapes: Path, tmp_path: Path) -> None:
    """The job id does not exist (slurmctld answers "Invalid job id specified"): reported, retried at the
    throttle with rate-limited messages, and the run completes."""
    out = tmp_path / "runs"
    args = [*train_args(shapes, 6), "--run.output-dir", str(out), "--report.slurm-every-s", "1"]
    args += slow_steps(0.5, first=1)
    env = dict(slurm_env, SLURM_JOB_ID="999999")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ddp-job"), "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    warned = [line for line in proc.stdout.splitlines() if "progress report to slurm comment" in line]
    assert len(warned) == 1 and "Invalid job id specified" in warned[0], warned
    assert "not trying again" not in warned[0]
    assert json.loads((out / "default" / "status.json").read_text())["finished"]


def test_only_the_jobs_own_user_may_set_its_comment(
    slurm_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm 22.05 lets a job's own user update its comment; another user's update is refused ("Invalid user
    id"), which the sink reports as permanent (no more tries). The other user is the real scontrol run as nobody."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])  # the sink's scontrol inherits this process's env
    as_nobody = tmp_path / "scontrol-as-nobody"
    as_nobody.write_text('#!/bin/sh\nexec runuser -u nobody -- scontrol "$@"\n')
    as_nobody.chmod(0o755)
    out = sh(
        slurm_env, "sbatch", "--parsable", f"--chdir={tmp_path}", "--cpus-per-task=1", "--time=5", "--wrap", "sleep 300"
    )
    jid = out.strip().split(";")[0]
    status = Status(3, 12, 0.0, 1.0, {}, 2, 5.0)
    try:
        wait_for(lambda: job_info(slurm_env, jid).get("JobState") == "RUNNING", 120, f"job {jid} to run")
        with pytest.raises(ReportFailed) as refused:
            SlurmComment(jid, 60.0, scontrol=str(as_nobody)).send(status)
        assert refused.value.permanent and "Invalid user id" in refused.value.reason, refused.value.reason
        assert comment_of(slurm_env, jid) is None
        SlurmComment(jid, 60.0).send(status)  # this process's user submitted the job
        assert comment_of(slurm_env, jid) == "ddp-job step 3/12 25% eta 9s ckpt@2 age 5s"
    finally:
        subprocess.run(["scancel", jid], env=slurm_env, capture_output=True)
