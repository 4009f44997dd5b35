"""A stop request during an evaluation: the ranks agree at a batch boundary, discard the partial evaluation, save
the step and exit 143 (job.train.evaluate.StopPoll); during the final evaluation of a finished run, the last step
is saved and the next attempt only evaluates (job.train.loop.finish)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from support import ROOT
from support.cli import base_env
from support.runs import tiny_args

from job.checkpoint.store import find_latest
from job.cluster import stop
from job.errors import EXIT_OK, EXIT_PREEMPTED
from job.observe.metrics import METRICS_JSONL

VAL_ITEMS = 256
"""The validation set: 32 batches of 4 on each of 2 ranks, far more than a stopped evaluation reaches."""
STOPPED = re.compile(
    r"\[rank (\d)/\d\] INFO stop requested during the evaluation after step (\d+): stopped after (\d+) validation "
    r"batch\(es\) of this rank's (\d+) item"
)


def args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *tiny_args(val_size=VAL_ITEMS),
        "--run.output-dir",
        str(tmp_path / "runs"),
        "--run.name",
        "r",
        "--train.global-batch-size",
        "8",
        "--ckpt.every",
        "0",
        "--log.every",
        "1",
        "--log.jsonl",
        "true",
        "--log.tensorboard",
        "false",
        "--log.progress",
        "off",
        "--doctor.enabled",
        "false",
        *extra,
    ]


def start(cmd: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=base_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def lines_until(proc: subprocess.Popen[str], pattern: str, seen: list[str]) -> re.Match[str]:
    """Read the job's output into ``seen`` up to the first line matching ``pattern``."""
    assert proc.stdout is not None
    rx = re.compile(pattern)
    for line in proc.stdout:
        seen.append(line)
        if m := rx.search(line):
            return m
    raise AssertionError(f"no line matching {pattern!r} (exit {proc.wait()}):\n{''.join(seen[-60:])}")


def finish(proc: subprocess.Popen[str], seen: list[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(seen) + out


def records(run_dir: Path) -> Iterator[dict[str, float]]:
    for line in (run_dir / METRICS_JSONL).read_text().splitlines():
        yield json.loads(line)


def test_a_signal_to_one_rank_stops_the_evaluation_of_both_at_one_batch_boundary(tmp_path: Path) -> None:
    """Rank 1 sleeps before the first forward of the evaluation after step 2; the SIGTERM goes to rank 0 alone
    once rank 1 says so. Rank 0 is then in its first batch or waiting before its second: each rank evaluates
    at most one batch more (the vote before each batch carries rank 0's flag to rank 1), then step 2 is saved."""
    run_dir = tmp_path / "runs" / "r"
    cmd = [sys.executable, "-m", "job", "launch", "--standalone", "--nproc-per-node", "2", "--"]
    straggle = ["--debug.straggler-delay-s", "5", "--debug.straggler-rank", "1", "--debug.straggler-in", "eval"]
    cmd += args(tmp_path, "--train.steps", "4", "--train.eval-every", "2", *straggle, "--debug.straggler-steps", "3")
    proc, seen = start(cmd, tmp_path), []
    try:
        rank0 = int(lines_until(proc, r"\brank 0/2 .*pid=(\d+)", seen)[1])
        lines_until(proc, r"\[rank 1/2\] INFO debug.straggler: sleeping 5 s before the first forward of the eval", seen)
        os.kill(rank0, signal.SIGTERM)
        code, out = finish(proc, seen)
    finally:
        proc.kill()
    assert code == EXIT_PREEMPTED, out[-4000:]
    stopped = {int(m[1]): (int(m[2]), int(m[3]), int(m[4])) for m in STOPPED.finditer(out)}
    assert sorted(stopped) == [0, 1], out[-4000:]
    (step, batches, items), other = stopped[0], stopped[1]
    assert step == 2 and other[:2] == (2, batches), f"the ranks stopped at different boundaries: {stopped}"
    assert 1 <= batches <= 2 and items == VAL_ITEMS // 2, f"{batches} batch(es) evaluated: {stopped}"
    assert "stop requested (another rank's request): saving at step 2" in out, "rank 1 stopped by the vote alone"
    assert "VAL step=2" not in out, "the partial evaluation is discarded"
    assert stop.read_record(run_dir) == stop.Record(2, "signal")
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-0000002"]
    assert [sorted(k for k in r if k.startswith("val/")) for r in records(run_dir)] == [[], []], "no val record"


def test_a_stop_during_the_final_evaluation_saves_the_last_step_and_the_rerun_only_evaluates(tmp_path: Path) -> None:
    """The STOP file appears while the final evaluation waits (the straggler aid, one process): the run has
    trained to the end but has not evaluated, so it saves step 2 and exits 143; the same command then resumes at
    step 2, trains nothing, evaluates and exits 0."""
    run_dir = tmp_path / "runs" / "r"
    straggle = ["--debug.straggler-delay-s", "5", "--debug.straggler-rank", "0", "--debug.straggler-in", "eval"]
    cmd = [sys.executable, "-m", "job", "train", *args(tmp_path, "--train.steps", "2")]
    proc, seen = start([*cmd, *straggle], tmp_path), []
    try:
        lines_until(
            proc, r"debug.straggler: sleeping 5 s before the first forward of the evaluation after step 2", seen
        )
        stop.request(run_dir)
        code, out = finish(proc, seen)
    finally:
        proc.kill()
    assert code == EXIT_PREEMPTED, out[-4000:]
    assert [m[2] for m in STOPPED.finditer(out)] == ["2"] and "FINAL" not in out, out[-4000:]
    assert stop.read_record(run_dir) == stop.Record(2, "stop-file")
    saved = find_latest(run_dir)
    assert saved is not None and saved.step == 2
    again = subprocess.run(cmd, cwd=ROOT, env=base_env(tmp_path), capture_output=True, text=True, timeout=300)
    out = again.stdout + again.stderr
    assert again.returncode == EXIT_OK, out[-4000:]
    assert "resumed from" in out and "FINAL step=2" in out and not re.search(r"INFO step \d+/2 ", out), out[-4000:]
    evaluated = [r["step"] for r in records(run_dir) if any(k.startswith("val/") for k in r)]
    assert evaluated == [2], "one evaluation of step 2: the rerun's"
