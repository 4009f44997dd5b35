"""Faults end in exact continuation or a clear error: real torchrun agents, real worker processes, real signals.

* exact resume: one uninterrupted 2-process run against a chain of interrupted attempts on the same run
  directory, each stopped differently (SIGTERM to the agent landing during gradient accumulation, plus a
  second SIGTERM to the workers while they save; SIGTERM while an async save is in flight; SIGUSR1 to the
  agent only; kill -9 of a worker under --max-restarts 1). DataLoader workers > 0, stops in the middle of
  epochs. The final parameters, optimizer, scheduler and trainer state must be bitwise identical.
* exact resume at 4 processes, where the all-reduce's summation order depends on DDP's bucket layout:
  SIGTERM, resume, bitwise equal to an uninterrupted 4-process run.
* a group SIGTERM while a loader's workers start (the validation loader's at the first evaluation, the
  training loader's at the first step): every worker lives, the ranks save the stop step and exit 143;
* a full disk freed (a tmpfs of the test's own): the storage check counts the run's own checkpoints, a
  shortage exits 1 (it may heal), and once enough is freed the rerun resumes;
* hung peer (SIGSTOP of one worker): the other's watchdog reports the stalled rank and exits 124 before
  dist.train_timeout_s
  plus slack;
* NaN injection: the update is skipped, no checkpoint holds a non-finite value, too many skips stop the run
  with an error naming the step;
* a table of bad inputs: exit 2, a message naming the setting, no traceback, nothing written.

Measured numbers are printed (run pytest with -s): recomputed steps after kill -9, time from hang to error.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support import EXAMPLE, ROOT
from support.ci import bin_path, require
from support.cli import base_env, make_data, user_code_env
from support.runs import assert_bitwise_equal, tiny_args

from job.checkpoint import store
from job.cluster.env import LAUNCHER_VAR_PREFIXES

STEPS = 14  # 64 train images / global batch 16 = 4 steps per epoch: stops below fall mid-epoch
FOUR_STEPS = 8  # the 4-rank run (global batch 32: 2 steps per epoch)


def train_args(data: Path, out: Path, name: str, *extra: str) -> list[str]:
    """Small but complete: resnet18 at 16 px, 2 ranks x micro 4 x 2 accumulation steps, 2 DataLoader workers,
    augmentation on (per-sample seeded), SGD with momentum, cosine schedule with warmup."""
    return [
        "--run.output-dir",
        str(out),
        "--run.name",
        name,
        *tiny_args(data, workers=2),
        "--model.norm",
        "group",
        "--train.steps",
        str(STEPS),
        "--train.global-batch-size",
        "16",
        "--train.micro-batch-size",
        "4",
        "--sched.warmup-steps",
        "2",
        "--ckpt.keep-last",
        "3",
        "--log.every",
        "1",
        "--log.tensorboard",
        "false",
        "--log.progress",
        "off",
        *extra,
    ]


class Job:
    """``ddp-job launch`` (the torchrun agent) in its own session; its output is read line by line."""

    def __init__(self, tmp: Path, launch_opts: list[str], args: list[str], nproc: int = 2) -> None:
        self.t0 = time.monotonic()
        self.nproc = nproc
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        cmd = [bin_path("ddp-job"), "launch", "--standalone", "--nproc-per-node", str(nproc), *launch_opts, "--", *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=base_env(tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            with self.cond:
                self.lines.append((time.monotonic(), line))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    @property
    def text(self) -> str:
        with self.cond:
            return "".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float = 300) -> tuple[float, re.Match[str]]:
        """(time seen, match) of the first output line matching ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = 0
        with self.cond:
            while True:
                for t, line in self.lines[i:]:
                    if m := rx.search(line):
                        return t, m
                i = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.cond.wait(0.5) and i == len(self.lines)):
                    raise AssertionError(f"no line matching {pattern!r} (exit {self.proc.poll()}):\n{self.tail()}")
                self.cond.wait(min(left, 1.0))

    def worker_pid(self, rank: int) -> int:
        return int(self.wait_for(rf"\brank {rank}/{self.nproc} .*pid=(\d+)")[1][1])

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = 300) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not finish in {timeout} s:\n{self.tail()}") from None
        # every line the job wrote, read: the reader ends at the output's end (bounded: a stray worker
        # that outlived the agent could hold the pipe open)
        self.reader.join(timeout=60)
        return rc

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in _descendants(self.proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def tail(self, n: int = 60) -> str:
        return "".join(self.text.splitlines(keepends=True)[-n:])


def _descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        for k in kids:
            out += [k, *_descendants(k)]
    return out


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for job in started:  # never leave workers behind, whatever failed
        job.kill()


def final_state(run_dir: Path, steps: int = STEPS) -> dict:
    path = run_dir / f"step-{steps:07d}"
    assert (path / "state.pt").is_file(), f"missing {path}: {sorted(p.name for p in run_dir.iterdir())}"
    return store.read_checkpoint(path)


# --- exact resume through every kind of interruption ------------------------------------------------------


def test_interrupted_runs_end_bitwise_identical_to_an_uninterrupted_one(
    tmp_path: Path, tiny_data: Path, jobs: list[Job]
) -> None:
    out = tmp_path / "runs"
    # The reference runs alongside the first attempt (overlapping the start-up of both).
    ref = Job(tmp_path, [], train_args(tiny_data, out, "ref"))
    jobs.append(ref)
    chain = train_args(tiny_data, out, "chain")
    run_dir = out / "chain"

    # 1. SIGTERM to the agent (what Kubernetes and scancel do) right after step 3 is logged: it lands during
    #    step 4's first micro-batch, i.e. in the middle of gradient accumulation; step 4's stop vote was taken
    #    when it started, so the run stops after step 5 (mid-epoch; after step 4 where rank 1 got the signal before
    #    its step 4 began, checked below). A second SIGTERM, sent to the workers
    #    themselves while they save, must change nothing.
    #    Rank 0 sleeps 10 s before step 4's first forward (the straggler aid) and the signal is sent once it
    #    says so: after step 4 started (sent after step 3's line alone, it can land before), inside
    #    micro-batch 1/2. A sleep changes no number.
    a1 = Job(
        tmp_path,
        [],
        [
            *chain,
            "--ckpt.every",
            "0",
            "--debug.straggler-delay-s",
            "10",
            "--debug.straggler-rank",
            "0",
            "--debug.straggler-steps",
            "4",
        ],
    )
    jobs.append(a1)
    a1.wait_for(rf"\[rank 1/2\] INFO step 3/{STEPS} ")  # both ranks are past step 3
    a1.wait_for(r"\[rank 0/2\] INFO debug.straggler: sleeping 10 s before step 4's first forward")
    a1.signal(signal.SIGTERM)
    _, m = a1.wait_for(r"stop requested \(signal SIGTERM, received during ([^)]*)\): saving at step (\d+)")
    for rank in (0, 1):
        os.kill(a1.worker_pid(rank), signal.SIGTERM)
    assert a1.finish() == 143, a1.tail()
    landed = re.findall(r"received during (step \d+ micro-batch \d/2)", a1.text)
    assert any(w.endswith("1/2") for w in landed), f"the signal did not land during accumulation: {m[0]}\n{a1.tail()}"
    stop1 = int(m[2])
    # Where each rank was when the signal reached it. Rank 1 is not held back: after its step 3 line it may still be
    # in step 3's bookkeeping when the agent's SIGTERM arrives (seen on a loaded machine), before its step 4 vote
    # took its flag; then step 4's vote carries the request and the run stops after step 4.
    during = dict(
        re.findall(r"\[rank (\d)/2\] INFO stop requested \(signal SIGTERM, received during ([^)]*)\)", a1.text)
    )
    assert sorted(during) == ["0", "1"], a1.tail()
    if all(w.startswith("step 4 micro-batch") for w in during.values()):
        assert stop1 == 5, f"a request during step 4 on every rank stops the run after step 5: {during}"
    else:  # a rank got it before step 4's first micro-batch, around its vote: step 4's or step 5's carries it
        assert stop1 in (4, 5), f"a request before step 4's first micro-batch on a rank: {during}"
    assert sorted(int(p.name[5:]) for p in run_dir.glob("step-???????")) == [stop1]

    # 2. Async saving on; SIGTERM while the background write of step 6 is in flight.
    # The writer waits 5 s before writing, so the signal lands while the write is in flight however fast
    # the (tiny) state is written.
    a2 = Job(tmp_path, [], [*chain, "--ckpt.every", "6", "--ckpt.async-save", "on", "--debug.ckpt-write-delay-s", "5"])
    jobs.append(a2)
    a2.wait_for(rf"resumed from .*step-{stop1:07d}")
    a2.wait_for(r"writing checkpoint .*step-0000006 in the background")
    a2.signal(signal.SIGTERM)
    a2.wait_for(
        r"\[rank 0/2\] INFO stop requested \(signal SIGTERM, received during [^)]*a checkpoint write was in flight\)"
    )
    assert a2.finish() == 143, a2.tail()

    # 3. SIGUSR1 to the agent only (Slurm's --signal=B:USR1 reaches the launching process, not the workers).
    a3 = Job(tmp_path, [], chain)
    jobs.append(a3)
    _, m = a3.wait_for(r"resumed from .*step-(\d+)")
    resumed3 = int(m[1])
    a3.wait_for(rf"\[rank 0/2\] INFO step {resumed3 + 1}/{STEPS} ")
    a3.signal(signal.SIGUSR1)
    _, m = a3.wait_for(r"stop requested \(signal SIGUSR1[^)]*\): saving at step (\d+)")
    assert a3.finish() == 143, a3.tail()
    stop3 = int(m[1])
    assert stop3 < STEPS - 1, "leave room for the kill -9 attempt"

    # 4. kill -9 of rank 1 under --max-restarts 1: the agent restarts the group, which resumes and completes.
    a4 = Job(tmp_path, ["--max-restarts", "1"], [*chain, "--ckpt.every", "0"])
    jobs.append(a4)
    a4.wait_for(rf"resumed from .*step-{stop3:07d}")
    victim = a4.worker_pid(1)
    a4.wait_for(rf"\[rank 0/2\] INFO step {stop3 + 1}/{STEPS} ")
    os.kill(victim, signal.SIGKILL)
    assert a4.finish() == 0, a4.tail()
    resumes = [m.start() for m in re.finditer(r"\[rank 0/2\] INFO resumed from \S+ \(step (\d+)", a4.text)]
    assert len(resumes) == 2, f"expected a start and one restart, each resuming:\n{a4.tail()}"
    assert re.findall(r"\[rank 0/2\] INFO resumed from \S+ \(step (\d+)", a4.text) == [str(stop3)] * 2
    before_restart = a4.text[: resumes[1]]
    last_logged = max(int(s) for s in re.findall(rf"\[rank 0/2\] INFO step (\d+)/{STEPS} ", before_restart))
    print(
        f"\nkill -9 of a worker after step {last_logged} was logged: restarted from step {stop3}, "
        f"{last_logged - stop3} completed step(s) recomputed (plus the step in flight)"
    )
    assert f"FINAL step={STEPS}" in a4.text

    assert ref.finish() == 0, ref.tail()
    want, got = final_state(out / "ref"), final_state(run_dir)
    for key in ("model", "optimizer", "scheduler", "scaler"):
        assert_bitwise_equal(want[key], got[key], key)
    for key in ("step", "epoch", "micro_batches_in_epoch", "samples_seen"):
        assert want["trainer"][key] == got["trainer"][key], key
    for step_dir in run_dir.glob("step-*"):
        assert ".tmp" not in step_dir.name, f"torn save left behind: {step_dir}"


@pytest.mark.parametrize("loader", ["val", "train"])
def test_group_signal_while_loader_workers_start_saves_and_exits_143(
    tmp_path: Path, tiny_data: Path, jobs: list[Job], loader: str
) -> None:
    """A SIGTERM to each rank's process group (what torchrun's agent sends) while a loader's workers start: the
    first worker of that loader (the validation loader's start at the first evaluation, after step 3) signals
    its own group after torch installed its worker signal handlers and before ours ran, the window where
    torch's handler kills a worker on a signal its parent did not send. Every worker must live, the ranks
    stop at the same step, save it, and the launch exits 143."""
    out = tmp_path / "runs"
    args = train_args(tiny_data, out, "r", "--train.eval-every", "3", "--debug.signal-group-at-worker-start", loader)
    job = Job(tmp_path, [], args)
    jobs.append(job)
    rc = job.finish()
    print(job.tail(25))
    assert "is killed by signal" not in job.text, job.tail()
    assert rc == 143, job.tail()
    _, m = job.wait_for(r"\[rank 0/2\] INFO stop requested \(signal SIGTERM, [^)]*\): saving at step (\d+)")
    step = int(m[1])
    if loader == "val":
        # Signalled as the evaluation after step 3 starts: the evaluation stops at a batch boundary and step 3 is
        # saved; when the signal lands after the evaluation's last batch began, step 4 is the stop step.
        assert step in (3, 4), step
    assert sorted(int(p.name[5:]) for p in (out / "r").glob("step-???????")) == [step]


def test_resumed_four_process_run_is_bitwise_identical_to_an_uninterrupted_one(
    tmp_path: Path, tiny_data: Path, jobs: list[Job]
) -> None:
    """At 4 ranks the order in which the ring all-reduce sums a gradient element over the ranks depends on the
    element's offset in its DDP bucket, and float addition of 4 values is not associative (at 2 ranks a+b == b+a
    hides this). So every step of a fresh and of a resumed run must use the same bucket layout; otherwise a
    resumed run's first step uses DDP's initial layout where the uninterrupted run uses its rebuilt one.
    4 ranks x micro 4 x 2 accumulation steps (no_sync on the first), no DataLoader workers (covered above);
    FOUR_STEPS steps: the layout is rebuilt after the first, so a few steps after the resume show it."""
    out = tmp_path / "runs"
    args = [*train_args(tiny_data, out, "ref"), "--train.global-batch-size", "32", "--data.num-workers", "0"]
    args[args.index("--train.steps") + 1] = str(FOUR_STEPS)
    ref = Job(tmp_path, [], args, nproc=4)  # alongside the interrupted attempt: start-ups overlap
    jobs.append(ref)
    args[args.index("ref")] = "chain"
    a1 = Job(tmp_path, [], args, nproc=4)
    jobs.append(a1)
    a1.wait_for(rf"\[rank 0/4\] INFO step 2/{FOUR_STEPS} ")
    a1.signal(signal.SIGTERM)
    _, m = a1.wait_for(r"stop requested \(signal SIGTERM[^)]*\): saving at step (\d+)")
    assert a1.finish() == 143, a1.tail()
    assert int(m[1]) < FOUR_STEPS, "the stop must leave steps for the resumed run"
    a2 = Job(tmp_path, [], args, nproc=4)
    jobs.append(a2)
    a2.wait_for(rf"resumed from .*step-{int(m[1]):07d}")
    assert a2.finish() == 0, a2.tail()
    assert ref.finish() == 0, ref.tail()
    want, got = final_state(out / "ref", FOUR_STEPS), final_state(out / "chain", FOUR_STEPS)
    worst = max((want["model"][k].double() - v.double()).abs().max().item() for k, v in got["model"].items())
    print(f"\n4 ranks, stopped at step {m[1]} of {FOUR_STEPS} and resumed: largest parameter difference {worst:.3g}")
    for key in ("model", "optimizer", "scheduler", "scaler"):
        assert_bitwise_equal(want[key], got[key], key)
    assert want["trainer"] == got["trainer"]


# --- a rank that stops participating ------------------------------------------------------------------------


def test_hung_peer_ends_in_a_timeout_error(tmp_path: Path, tiny_data: Path, jobs: list[Job]) -> None:
    timeout_s = 10
    job = Job(
        tmp_path,
        [],
        train_args(
            tiny_data,
            tmp_path / "runs",
            "hang",
            "--train.steps",
            "200",
            "--dist.train-timeout-s",
            str(timeout_s),
            "--data.num-workers",
            "0",
            # rank 1 sleeps before step 3's forward, so the stop below lands there, never inside an all-reduce
            # (stopped in one, it would look like rank 0, and no report could name it)
            "--debug.straggler-rank",
            "1",
            "--debug.straggler-steps",
            "3",
            "--debug.straggler-delay-s",
            "20",
        ),
    )
    jobs.append(job)
    peer = job.worker_pid(1)
    job.wait_for(r"\[rank 0/2\] INFO step 2/200 ")  # step 2's all-reduce is over on both ranks
    os.kill(peer, signal.SIGSTOP)  # alive, holding its sockets, never answering: a hung peer
    t_hang = time.monotonic()
    t_err, m = job.wait_for(r"\[rank 0/2\] ERROR (watchdog: [^\n]*)", timeout=timeout_s + 120)
    took = t_err - t_hang
    print(f"\nhung peer -> watchdog report on the survivor after {took:.1f} s (dist.train_timeout_s={timeout_s})")
    assert "timed out" in m[1] and "dist.train_timeout_s" in m[1], m[1]
    assert "stalled: rank(s) [1]" in m[1] and "rank 0 made no progress" in m[1], m[1]
    os.kill(peer, signal.SIGCONT)  # let the agent's shutdown proceed without waiting for its SIGKILL
    rc = job.finish(timeout=180)
    assert rc == 124, job.tail()
    # The in-job watchdog reported before the collective timeout (NCCL would abort the process without a word):
    # it ends the process as it reports, so the survivor never reached the collective's own timeout error.
    # (Judged by what rank 0 wrote, not by the test's clock, which a loaded machine's log relay delays.)
    assert "collective timed out on rank 0" not in job.text, job.tail()
    print(f"launcher exited {rc} {time.monotonic() - t_hang:.1f} s after the hang")


# --- non-finite loss ------------------------------------------------------------------------------------------


def test_nan_loss_skips_the_update_and_is_never_saved(tmp_path: Path, tiny_data: Path) -> None:
    out = tmp_path / "runs"
    common = train_args(
        tiny_data,
        out,
        "nan",
        "--train.steps",
        "4",
        "--ckpt.every",
        "1",
        "--ckpt.keep-last",
        "10",
        "--train.micro-batch-size",
        "0",
        "--data.num-workers",
        "0",
    )
    # Both runs at once (one skips twice and completes, one is allowed a single skip): start-up overlaps.
    env = base_env(tmp_path)
    procs = [
        subprocess.Popen(
            [bin_path("ddp-job"), "train", *common, *extra],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for extra in (
            ["--debug.nan-at-steps", "[2,3]"],
            ["--run.name", "nan-stop", "--debug.nan-at-steps", "[2,3]", "--train.max-nonfinite-skips", "1"],
        )
    ]
    (out1, err1), (out2, err2) = (p.communicate(timeout=600) for p in procs)
    r = subprocess.CompletedProcess([], procs[0].returncode, out1, err1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"step [23]: non-finite loss or gradient norm; update skipped", r.stderr + r.stdout)) == 2
    states = {int(p.name[5:]): store.read_checkpoint(p) for p in (out / "nan").glob("step-???????")}
    assert sorted(states) == [1, 2, 3, 4]
    for step, st in states.items():
        for name, t in st["model"].items():
            assert torch.isfinite(t).all(), f"step {step}: {name}"
    for name in states[1]["model"]:  # steps 2 and 3 changed nothing
        assert torch.equal(states[1]["model"][name], states[3]["model"][name]), name
    assert any(not torch.equal(states[3]["model"][n], states[4]["model"][n]) for n in states[1]["model"])
    assert states[4]["trainer"]["nonfinite_skips"] == 2

    r = subprocess.CompletedProcess([], procs[1].returncode, out2, err2)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "step 3: more than train.max_nonfinite_skips=1" in r.stderr + r.stdout
    saved = sorted(int(p.name[5:]) for p in (out / "nan-stop").glob("step-???????"))
    assert saved == [1, 2]
    st = store.read_checkpoint(out / "nan-stop" / "step-0000002")
    assert all(torch.isfinite(t).all() for t in st["model"].values())


# --- bad input: exit 2, the setting named, no traceback, nothing written ---------------------------------------


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _fake_checkpoint(run_dir: Path, argv: list[str], world_size: int) -> None:
    """A checkpoint manifest as a run with ``argv`` would have written it (the refusals read only this)."""
    import json

    from job.config import config_to_dict, load_config

    d = run_dir / "step-0000004"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(
        json.dumps({"step": 4, "world_size": world_size, "files": {}, "config": config_to_dict(load_config(argv, {}))})
    )


# (id, extra argv, extra env, setup(tmp, data) -> None, what the message must name)
BAD_INPUTS = [
    ("steps-zero", ["--train.steps", "0"], {}, None, "train.steps"),
    ("lr-env-not-a-number", [], {"JOB_OPTIM__LR": "fast"}, None, "optim.lr"),
    ("lr-negative", ["--optim.lr", "-1"], {}, None, "optim.lr"),
    ("optimizer-unknown", ["--optim.name", "adamx"], {}, None, "optim.name"),
    ("unknown-setting", ["--train.stepz", "5"], {}, None, "stepz"),
    (
        "batch-not-divisible",
        ["--train.global-batch-size", "10", "--train.micro-batch-size", "4"],
        {},
        None,
        "train.global_batch_size",
    ),
    ("image-size-tiny", ["--data.image-size", "4"], {}, None, "data.image_size"),
    ("keep-last-zero", ["--ckpt.keep-last", "0"], {}, None, "ckpt.keep_last"),
    ("signal-unknown", ["--train.stop-signals", "[SIGFOO]"], {}, None, "stop_signals"),
    ("run-name-slash", ["--run.name", "a/b"], {}, None, "run.name"),
    ("sync-bn-on-cpu", ["--model.sync-bn", "true"], {}, None, "model.sync_bn"),
    ("fp16-on-cpu", ["--train.precision", "fp16"], {}, None, "train.precision"),
    ("nccl-on-cpu", ["--dist.backend", "nccl"], {}, None, "dist.backend"),
    # the image task names no units: nothing to checkpoint
    ("checkpointing-without-units", ["--train.activation-checkpointing", "true"], {}, None, "fsdp.units"),
    ("config-missing", ["--config", "/nonexistent/x.yaml"], {}, None, "--config"),
    (
        "config-bad-section",
        ["--config", "{tmp}/bad-section.yaml"],
        {},
        lambda tmp, data: _write(tmp / "bad-section.yaml", "trian:\n  steps: 3\n"),
        "trian",
    ),
    (
        "config-bad-yaml",
        ["--config", "{tmp}/bad.yaml"],
        {},
        lambda tmp, data: _write(tmp / "bad.yaml", "train: [1,\n"),
        "YAML",
    ),
    ("data-path-missing", ["--data.path", "/nonexistent/data"], {}, None, "data.path"),
    # needs no process group, so refused before the doctor's checks (doctor.json) and config.yaml are written:
    (
        "data-smaller-than-a-batch",
        ["--train.global-batch-size", "128"],
        {},
        None,
        "64 samples, fewer than one global batch",
    ),
    (
        "synthetic-smaller-than-a-batch",
        ["--data.source", "synthetic", "--data.synthetic-train-size", "4"],
        {},
        None,
        "data.synthetic_train_size=4",
    ),
    ("model-unknown", ["--model.name", "resnet19"], {}, None, "model.name='resnet19'"),
    (
        "model-norm-unsupported",
        ["--model.name", "mobilenet_v2", "--model.norm", "group", "--doctor.enabled", "false"],
        {},
        None,
        "model.norm",
    ),
    ("env-unknown-section", [], {"JOB_OPTIMX__LR": "0.1"}, None, "JOB_OPTIMX__LR"),
    ("decode-gpu-without-cuda", ["--data.decode", "gpu"], {}, None, "data.decode=gpu: CUDA is not available"),
    ("decode-device-not-jpeg", ["--data.decode", "device"], {}, None, ".png is not a JPEG file"),
    ("config-is-a-directory", ["--config", "{tmp}"], {}, None, "is a directory"),
    ("data-classes-mismatch", ["--data.num-classes", "5"], {}, None, "data.num_classes"),
    (
        "data-empty-class",
        ["--data.path", "{tmp}/holey"],
        {},
        lambda tmp, data: [
            _write(tmp / "holey" / s / c / ("x.png" if c != "c1" or s == "val" else "notes.txt"), "x")
            for s in ("train", "val")
            for c in ("c0", "c1", "c2", "c3")
        ],
        "class folder",
    ),
    ("env-rank-out-of-range", [], {"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, None, "RANK"),
    ("env-world-size-not-int", [], {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}, None, "WORLD_SIZE"),
    (
        "env-bad-port",
        [],
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "99999",
        },
        None,
        "MASTER_PORT",
    ),
    (
        "output-dir-is-a-file",
        ["--run.output-dir", "{tmp}/afile"],
        {},
        lambda tmp, data: _write(tmp / "afile", "x"),
        "run.output_dir",
    ),
    ("output-dir-read-only", ["--run.output-dir", "{tmp}/ro"], {}, "readonly", "run.output_dir"),
    ("resume-config-changed", ["--optim.lr", "0.5"], {}, "checkpoint-lr", "optim.lr"),
    ("resume-world-size-changed", [], {}, "checkpoint-ws2", "world_size=2"),
]


@pytest.mark.parametrize(("case", "argv", "env", "setup", "names"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_exits_2_naming_the_setting(
    tmp_path: Path,
    tiny_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    case: str,
    argv: list[str],
    env: dict[str, str],
    setup,
    names: str,
) -> None:
    """In-process (one torch import for the whole table) through the real CLI entry point."""
    import torch.distributed as dist

    from job import cli

    out = tmp_path / "runs"
    base = [
        "--run.output-dir",
        str(out),
        "--run.name",
        "bad",
        "--data.path",
        str(tiny_data),
        "--data.num-classes",
        "4",
        "--data.image-size",
        "16",
        "--data.num-workers",
        "0",
        "--train.steps",
        "2",
        "--train.global-batch-size",
        "8",
        "--log.tensorboard",
        "false",
    ]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    run_dir = out / "bad"
    if setup == "readonly":
        ro = tmp_path / "ro"
        ro.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], capture_output=True, text=True
        )
        require(r.returncode == 0, f"mount a read-only tmpfs: {r.stderr.strip()}")
        run_dir = ro / "bad"
    elif setup in ("checkpoint-lr", "checkpoint-ws2"):
        _fake_checkpoint(run_dir, base, 2 if setup == "checkpoint-ws2" else 1)
    elif setup is not None:
        setup(tmp_path, tiny_data)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) if run_dir.exists() else None
    for k in [k for k in os.environ if k.startswith(("JOB_", *LAUNCHER_VAR_PREFIXES))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def no_process_group(*a: object, **kw: object) -> None:
        raise AssertionError("a process group was started before the input was checked")

    monkeypatch.setattr(dist, "init_process_group", no_process_group)
    try:
        rc = cli.main(["train", *base, *argv])
        err = capfd.readouterr().err
    finally:
        if setup == "readonly":
            subprocess.run(["umount", "-l", str(tmp_path / "ro")], check=False)
    assert rc == 2, err[-2000:]
    assert names in err, err
    assert "Fix" in err or "Valid sections" in err or "--help" in err, err  # the last two: job.config's wording
    assert "Traceback" not in err
    after = sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) if run_dir.exists() else None
    assert after == before, f"the run directory changed: {before} -> {after}"


@pytest.mark.parametrize(
    ("command", "setting", "url"),
    [
        (["train", "--run.output-dir"], "run.output_dir", "s3://ckpt/runs"),
        (["train", "--model.weights"], "model.weights", "gs://bucket/weights.pt"),
        (["evaluate", "--ckpt.path"], "ckpt.path", "s3://ckpt/runs/default/step-0000002"),
        (["export", "--checkpoint", "runs", "--out"], "--out", "s3://ckpt/model.safetensors"),
        (["export", "--out", "model.safetensors", "--checkpoint"], "--checkpoint", "s3://ckpt/runs/default"),
        (["make-data", "--out"], "--out", "s3://data/shapes"),
    ],
    ids=["output_dir", "weights", "ckpt_path", "export_out", "export_checkpoint", "make_data"],
)
def test_an_object_store_url_where_a_path_is_read_is_exit_2_and_writes_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    command: list[str],
    setting: str,
    url: str,
) -> None:
    """Path("s3://ckpt/runs") is "s3:/ckpt/runs": taken as a path, the run would write its checkpoints into a local
    directory named "s3:", which a pod loses with its disk. Refused before anything is written, naming the setting,
    the URL and the fix (a mounted bucket or a shared file system)."""
    from job import cli

    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("JOB_")]:
        monkeypatch.delenv(k)
    try:
        rc = cli.main([*command, url])
    except SystemExit as e:  # argparse (export's options) exits itself
        rc = e.code
    err = capfd.readouterr().err
    assert rc == 2, err
    assert setting in err and url in err and "not a file system path" in err and "shared POSIX file system" in err, err
    assert list(tmp_path.iterdir()) == [], "nothing is written, no directory named s3: or gs:"


def test_bad_input_from_the_console_script_and_traceback_flag(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    cmd = [bin_path("ddp-job"), "train", "--run.output-dir", str(tmp_path / "runs"), "--train.steps", "0"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "train.steps" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*cmd, "--traceback"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def test_launch_forwards_usr1_and_usr2_unless_the_user_chose_the_signals() -> None:
    from job.launchers.torchrun import build_torchrun_args, with_stop_signals

    default = build_torchrun_args(["--nproc-per-node", "2", "--", "--train.steps", "1"]).signals_to_handle
    assert with_stop_signals(default).split(",") == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"]
    assert with_stop_signals("SIGTERM,SIGUSR2") == "SIGTERM,SIGUSR2"


# --- a DataLoader worker that never delivers ----------------------------------------------------------------


def test_stalled_data_worker_ends_in_an_error_naming_the_setting(tmp_path: Path) -> None:
    """After step 1 every training image becomes a FIFO nobody writes: the worker's next open() blocks forever,
    as on a hung network mount. Once the prefetched batches are used up the run must end with exit 1 and an
    error naming data.loader_timeout_s: no hang, no blaming the network, the worker not left behind."""
    data = make_data(tmp_path / "data", classes=4, per_class=16, size=16)  # 8 steps per epoch at batch 8
    out = tmp_path / "runs"
    cmd = [
        bin_path("ddp-job"),
        "train",
        "--run.output-dir",
        str(out),
        "--run.name",
        "stall",
        *tiny_args(data, workers=1),
        "--data.loader-timeout-s",
        "5",
        "--train.steps",
        "40",
        "--train.global-batch-size",
        "8",
        "--log.every",
        "1",
        "--log.tensorboard",
        "false",
        "--log.progress",
        "off",
        "--doctor.enabled",
        "false",
        "--ckpt.every",
        "0",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=base_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "INFO step 1/40" in line:
                break
        workers = [
            int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir() for c in (t / "children").read_text().split()
        ]
        assert len(workers) == 1, workers  # the one training-loader worker (val workers start only at evaluation)
        for image in (data / "train").rglob("*.png"):
            image.unlink()
            os.mkfifo(image)
        t0 = time.monotonic()
        rest, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + rest
    print(f"\nstalled data worker: exit {proc.returncode} {time.monotonic() - t0:.1f} s after the images became FIFOs")
    assert proc.returncode == 1, text[-3000:]
    assert "data.loader_timeout_s=5" in text and "Fix:" in text, text[-3000:]
    assert "collective timed out" not in text, text[-3000:]
    state = Path(f"/proc/{workers[0]}/stat").read_text().split()[2] if Path(f"/proc/{workers[0]}").exists() else "gone"
    assert state in ("gone", "Z"), f"the stalled worker was left behind (state {state})"


def test_flight_recorder_is_on_by_default_unless_set(tmp_path: Path) -> None:
    from job.parallel.distributed import FLIGHT_RECORDER_ENTRIES, flight_recorder_env

    got = flight_recorder_env({}, tmp_path)
    assert got == {
        "TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl_trace_rank_"),
    }
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "0"}, tmp_path)
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}, tmp_path)
    assert flight_recorder_env({"TORCH_FR_DUMP_TEMP_FILE": "/x/"}, tmp_path).get("TORCH_FR_DUMP_TEMP_FILE") is None


def test_flight_recorder_defaults_draw_no_deprecation_warning(tmp_path: Path) -> None:
    """A process group created under the job's flight-recorder defaults is quiet: torch warns on every group
    created while a deprecated name of one of these variables is set."""
    from job.parallel.distributed import flight_recorder_env

    env = {k: v for k, v in base_env().items() if not k.startswith(("TORCH_NCCL_", "TORCH_FR_"))}
    env.update(flight_recorder_env(env, tmp_path))
    code = (
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "dist.all_reduce(torch.ones(1)); dist.destroy_process_group(); print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr, proc.stderr[-3000:]


# --- a full disk, freed ---------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 64 MiB tmpfs of this test's own (root needed; in CI a missing capability fails instead of skipping)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    require(r.returncode == 0, f"cannot mount a tmpfs (root needed): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_to(disk: Path, free: int) -> None:
    """Leave ``free`` bytes free on ``disk`` (one filler file, replaced)."""
    filler = disk / "filler"
    filler.unlink(missing_ok=True)
    size = shutil.disk_usage(disk).free - free
    assert size > 0, f"the disk has less than {free} bytes free"
    with filler.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)


def test_rerun_after_a_full_disk_is_freed_resumes(
    tmp_path: Path, tiny_data: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run holding checkpoints on a nearly full disk: the storage check counts them (pruning reuses their
    space). Too little space even so is a shortage that heals (exit 1, naming storage.space), not bad input
    (2); once enough is freed for the checkpoints still to come, though not for keep_last + 1 whole ones,
    the rerun resumes."""
    from job.config import load_config
    from job.doctor.checks import checkpoint_bytes
    from job.tasks.image.model import build_model

    args = [
        "--run.output-dir",
        str(small_disk),
        "--run.name",
        "r",
        *tiny_args(tiny_data),
        "--model.name",
        "tinyshapes.model:tiny_cnn",
        "--model.options",
        '{"width": 96}',
        "--train.global-batch-size",
        "8",
        "--ckpt.every",
        "1",
        "--ckpt.keep-last",
        "2",
        "--log.tensorboard",
        "false",
        "--log.progress",
        "off",
    ]
    env = user_code_env(tmp_path)

    def train(steps: int) -> subprocess.CompletedProcess[str]:
        cmd = [bin_path("ddp-job"), "train", *args, "--train.steps", str(steps)]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    first = train(4)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = small_disk / "r"
    assert [p.name for p in sorted(run_dir.glob("step-???????"))] == ["step-0000003", "step-0000004"]
    held = sum(f.stat().st_size for f in run_dir.glob("step-*/**/*") if f.is_file())  # shards/ too
    monkeypatch.syspath_prepend(str(EXAMPLE))
    cfg = load_config(args, {})
    whole = checkpoint_bytes(cfg, build_model(cfg.model, 4)) * (2 + 1)  # keep_last + 1 being written
    assert held > whole / 3, "the run's own checkpoints are a third of what the check asks for"

    _fill_to(small_disk, (whole - held) // 2)  # short even counting them: may heal, so exit 1
    short = train(6)
    out = short.stdout + short.stderr
    print("\n".join(line for line in out.splitlines() if "storage.space" in line or "exit" in line.lower()))
    assert short.returncode == 1, out[-3000:]
    assert "storage.space" in out and "step-0000005" not in out, out[-3000:]

    _fill_to(small_disk, whole - held // 2)  # enough counting the held checkpoints, too little without
    rerun = train(6)
    out = rerun.stdout + rerun.stderr
    print(out[-1500:])
    assert rerun.returncode == 0, out[-3000:]
    assert re.search(r"resumed from \S*step-0000004", out), out[-3000:]
    assert re.search(r"^FINAL step=6 ", rerun.stdout, re.M), out[-3000:]
