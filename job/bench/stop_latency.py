"""Stop latency: the time from a SIGTERM to ``ddp-job launch`` (what Kubernetes, ``scancel`` and torchrun send)
to the launcher's exit, at a moment drawn uniformly over a run's training time, over many short 2-process runs;
beside it, the step time and the stop save's time of the same runs. The bound it is checked against is the stop
contract's (docs/design.md, Preemption): the rest of the step in flight, one more step (the stop vote of a step is
taken as it starts), one save and the processes' exit; an evaluation in progress stops at its next batch.

    ddp-job bench stop-latency [--quick] [--trials 20] [--steps 60]

First one uninterrupted run measures the training time (its first to its last step line); each trial then waits
for step 1 and signals after ``uniform(0, that time)``. Times are read on this side: the signal and the exit by
the clock of this process, the save from the arrival of rank 0's ``stop requested`` and ``saved checkpoint``
lines, the step time from the trainer's own samples/s (global batch / samples per second).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from job.bench import common

STEP_LINE = re.compile(r"\[rank 0/\d+\] INFO step (\d+)/\d+ loss \S+ lr \S+ ([\d.]+) samples/s")
STOP_LINE = re.compile(r"\[rank 0/\d+\] INFO stop requested \(([^)]*)\)")
SAVED_LINE = re.compile(r"\[rank 0/\d+\] INFO saved checkpoint ")
EVAL_STOPPED = re.compile(r"\[rank 0/\d+\] INFO stop requested during the evaluation")


class Launch:
    """``ddp-job launch`` of 2 processes in its own session; every output line with the time it arrived."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "job", "launch", "--standalone", "--nproc-per-node", "2", "--", *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=common.ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            with self.cond:
                self.lines.append((time.monotonic(), line))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, rx: re.Pattern[str], timeout: float) -> float | None:
        """The arrival time of the first line matching ``rx``; None if the job ended (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, line in self.lines:
                    if rx.search(line):
                        return t
                if self.proc.poll() is not None and not self.reader.is_alive():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.5))

    def end(self, timeout: float) -> tuple[int, float]:
        """(exit code, the time the exit was seen)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        seen = time.monotonic()
        self.reader.join(timeout=30)
        return code, seen

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def matches(self, rx: re.Pattern[str]) -> list[tuple[float, re.Match[str]]]:
        with self.cond:
            return [(t, m) for t, line in self.lines if (m := rx.search(line))]

    def tail(self) -> str:
        with self.cond:
            return "".join(line for _, line in self.lines[-40:])


@dataclass
class Trial:
    delay_s: float
    """When the signal was sent, after step 1's line."""
    exit_code: int
    latency_s: float
    """The signal to the launcher's exit."""
    step_s: float
    """The median step of this run: global batch / the trainer's samples/s."""
    save_s: float
    """Rank 0's ``stop requested`` line to its ``saved checkpoint`` line (0: no stop save, the run finished)."""
    until_save_s: float
    """The signal to rank 0's ``stop requested`` line: the rest of the step, the next one (or one batch)."""
    exit_s: float
    """Rank 0's ``saved checkpoint`` line to the launcher's exit: the record, the barrier, the processes' exit."""
    stopped_step: int
    in_evaluation: bool
    """The signal stopped a periodic evaluation at a batch boundary."""
    bound_s: float
    """Two steps + the save: the rest of the step in flight (at most one), the next one, the save."""


def train_args(run_dir: Path, a: argparse.Namespace) -> list[str]:
    extra = ["--train.eval-every", str(a.eval_every), "--data.synthetic-val-size", str(a.val_size)]
    extra += ["--doctor.enabled", "false", "--log.tensorboard", "false"]
    return common.job_train_args(
        run_dir, model=a.model, image_size=a.image_size, batch=a.batch, steps=a.steps, extra=extra
    )


def step_s(job: Launch, batch: int) -> float:
    """The run's median step time from its step lines (from step 3 on: the first two carry the warm-up)."""
    rates = [float(m[2]) for _, m in job.matches(STEP_LINE) if int(m[1]) >= 3 and float(m[2]) > 0]
    if not rates:
        return float("nan")
    return batch / statistics.median(rates)


def training_time_s(tmp: Path, env: dict[str, str], a: argparse.Namespace) -> float:
    """The time from step 1's line to the last step's line of an uninterrupted run."""
    job = Launch(train_args(tmp / "runs" / "calibrate", a), env)
    try:
        code, _ = job.end(a.timeout)
    finally:
        job.kill()
    steps = job.matches(STEP_LINE)
    if code != 0 or len(steps) < 2:
        raise RuntimeError(f"the calibration run failed (exit {code}):\n{job.tail()}")
    return steps[-1][0] - steps[0][0]


def trial(tmp: Path, env: dict[str, str], a: argparse.Namespace, i: int, train_s: float, rng: random.Random) -> Trial:
    job = Launch(train_args(tmp / "runs" / f"trial-{i}", a), env)
    try:
        first = job.wait_for(STEP_LINE, a.timeout)
        if first is None:
            raise RuntimeError(f"trial {i}: no step line:\n{job.tail()}")
        delay = rng.uniform(0, train_s)
        time.sleep(max(0.0, first + delay - time.monotonic()))
        sent = time.monotonic()
        os.kill(job.proc.pid, signal.SIGTERM)
        code, ended = job.end(a.timeout)
    finally:
        job.kill()
    nan = float("nan")
    save, until, exit_s, stopped = 0.0, nan, nan, 0
    stops = job.matches(STOP_LINE)
    if stops:
        asked, line = stops[0][0], stops[0][1].string
        stopped = int(m[1]) if (m := re.search(r"saving at step (\d+)", line)) else 0
        saved = [t for t, _ in job.matches(SAVED_LINE) if t >= asked]
        until = asked - sent
        if saved:
            save, exit_s = saved[0] - asked, ended - saved[0]
    step = step_s(job, a.batch)
    in_eval = bool(job.matches(EVAL_STOPPED))
    return Trial(delay, code, ended - sent, step, save, until, exit_s, stopped, in_eval, 2 * step + save)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) by linear interpolation between the order statistics."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float]:
    return {**common.median_spread(values), "p90": percentile(values, 0.9)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench stop-latency", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="1 trial of a 12-step run: proves the tool works (CI)")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None, help="periodic evaluations the signal may land in")
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    a.trials = a.trials or (1 if a.quick else 20)
    a.steps = a.steps or (12 if a.quick else 60)
    a.eval_every = a.eval_every or max(1, a.steps // 3)
    rng = random.Random(a.seed)
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = common.child_env(tmp)
        train_s = training_time_s(tmp, env, a)
        for i in range(a.trials):
            t = trial(tmp, env, a, i, train_s, rng)
            trials.append(t)
            common.emit_point("stop-latency", {"trial": i, **asdict(t)})
    report(a, train_s, trials)
    return 0


def report(a: argparse.Namespace, train_s: float, trials: list[Trial]) -> None:
    stopped = [t for t in trials if t.exit_code == 143]
    rows = [
        (
            i,
            f"{t.delay_s:.2f}",
            t.exit_code,
            t.stopped_step,
            "yes" if t.in_evaluation else "",
            f"{t.latency_s:.2f}",
            f"{t.until_save_s:.2f}",
            f"{t.save_s:.2f}",
            f"{t.exit_s:.2f}",
            f"{t.step_s:.3f}",
            f"{t.bound_s:.2f}",
        )
        for i, t in enumerate(trials)
    ]
    header = (
        "trial",
        "signal at s",
        "exit",
        "saved step",
        "in eval",
        "latency s",
        "to save s",
        "save s",
        "exit s",
        "step s",
        "2 steps+save s",
    )
    common.table(
        f"stop latency: SIGTERM to ddp-job launch's exit, {a.model} {a.image_size} px, 2 processes", header, rows
    )
    result: dict[str, Any] = {
        "quick": a.quick,
        "trials": len(trials),
        "stopped": len(stopped),
        "finished": sum(t.exit_code == 0 for t in trials),
        "training_time_s": train_s,
        "latency_s": summary([t.latency_s for t in stopped]),
        "step_s": summary([t.step_s for t in trials]),
        "save_s": summary([t.save_s for t in stopped]),
        "until_save_s": summary([t.until_save_s for t in stopped]),
        "exit_s": summary([t.exit_s for t in stopped]),
        "until_save_over_two_steps": summary([t.until_save_s / (2 * t.step_s) for t in stopped if t.step_s > 0]),
        "latency_over_bound": summary([t.latency_s / t.bound_s for t in stopped if t.bound_s > 0]),
        "in_evaluation": sum(t.in_evaluation for t in stopped),
        "config": {
            k: getattr(a, k) for k in ("steps", "eval_every", "val_size", "model", "image_size", "batch", "seed")
        },
        "per_trial": [asdict(t) for t in trials],
    }
    lat, ratio = result["latency_s"], result["latency_over_bound"]
    print(
        f"\n{len(stopped)} of {len(trials)} trials stopped with a save: latency median {lat['median']:.2f} s, "
        f"p90 {lat['p90']:.2f} s, max {lat['max']:.2f} s; latency / (2 steps + save) median {ratio['median']:.2f}, "
        f"max {ratio['max']:.2f}"
    )
    common.emit("stop-latency", result)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
