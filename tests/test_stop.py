"""The stop protocol (job.cluster.stop): the STOP file's states, the stop record, and what a real training run
does with each.

A request made before the trainer started is kept and honoured after the first step; the honoured mark
makes the next start discard it and train on; nothing re-touches the file. Every stop save leaves the stop
record (step and reason) that launchers act on; train.max_time is one more reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ci import require
from support.cli import make_data
from support.runs import tiny_args

from job.checkpoint.checkpointer import STOP_SAVES
from job.checkpoint.store import find_latest
from job.cluster import stop
from job.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED
from job.observe.metrics import METRICS_JSONL

TINY = [
    *tiny_args(),
    "--train.global-batch-size",
    "8",
    "--train.steps",
    "4",
    "--log.every",
    "1",
    "--doctor.enabled",
    "false",
    "--log.tensorboard",
    "false",
]


def test_states_and_transitions(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert not stop.is_honoured(run_dir) and not stop.discard_honoured(run_dir)
    stop.request(run_dir)
    assert stop.stop_file(run_dir).exists() and not stop.is_honoured(run_dir)
    assert not stop.discard_honoured(run_dir) and stop.stop_file(run_dir).exists()  # a request is never discarded
    stop.mark_honoured(run_dir, 12)
    assert stop.is_honoured(run_dir) and "step=12" in stop.stop_file(run_dir).read_text()
    stop.request(run_dir)  # a new request after an honoured one is a request again
    assert not stop.is_honoured(run_dir)
    stop.mark_honoured(run_dir, 13)
    assert stop.discard_honoured(run_dir) and not stop.stop_file(run_dir).exists()
    stop.request(run_dir)
    stop.write_record(run_dir, 13, "stop-file")
    stop.begin_attempt(run_dir)  # a launcher's new attempt: gone whatever its state, and so is the record
    assert not stop.stop_file(run_dir).exists() and stop.read_record(run_dir) is None


def test_record_and_requests_by_whom(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert stop.read_record(run_dir) is None and stop.requested_by(run_dir) is None
    stop.request(run_dir)
    assert stop.requested_by(run_dir) == "stop-file"  # a person's touch
    stop.request(run_dir, stop.SCHEDULER)
    assert stop.requested_by(run_dir) == "scheduler"
    stop.mark_honoured(run_dir, 3)
    assert stop.requested_by(run_dir) is None
    for reason in stop.REASONS:
        stop.write_record(run_dir, 9, reason)
        assert stop.read_record(run_dir) == stop.Record(9, reason)
    with pytest.raises(ValueError, match="not one of"):
        stop.write_record(run_dir, 9, "tired")
    stop.record_file(run_dir).write_text("garbage\n")
    assert stop.read_record(run_dir) is None


def train(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    args = [*TINY, "--run.output-dir", str(tmp_path / "runs"), "--run.name", "r", *extra]
    return subprocess.run(
        [sys.executable, "-m", "job", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )


def test_request_before_start_is_honoured_after_the_first_step_then_discarded(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    stop.request(run_dir)  # e.g. a launcher's signal trap fired while the trainer was still importing torch
    first = train(tmp_path, "--train.eval-every", "1", "--log.jsonl", "true")
    assert first.returncode == EXIT_PREEMPTED, first.stdout[-2000:] + first.stderr[-2000:]
    assert "saving at step 1" in first.stdout and (run_dir / "step-0000001").is_dir()
    assert stop.is_honoured(run_dir) and "step=1" in stop.stop_file(run_dir).read_text()
    assert stop.read_record(run_dir) == stop.Record(1, "stop-file")
    assert "run the same command again to resume from it" in first.stdout  # no launcher requeues it
    (record,) = [json.loads(line) for line in (run_dir / METRICS_JSONL).read_text().splitlines()]
    assert record["step"] == 1 and not any(k.startswith("val/") for k in record), "the stop defers the evaluation"
    stopped = find_latest(run_dir)
    assert stopped is not None and stopped.manifest[STOP_SAVES] == 1  # ckpt.every=auto's restart is no failure
    second = train(tmp_path)  # the same command again: the honoured request does not stop it
    assert second.returncode == EXIT_OK, second.stdout[-2000:] + second.stderr[-2000:]
    assert "resumed from" in second.stdout and "FINAL step=4" in second.stdout
    assert not stop.stop_file(run_dir).exists()
    assert stop.read_record(run_dir) is None, "a finished attempt leaves no stop record"


def test_time_budget_stops_every_rank_at_one_step_saves_and_records_it(tmp_path: Path) -> None:
    """train.max_time counts from process start: a budget spent before the first step (a millisecond) stops
    both ranks after the first step they start, agreed by the stop vote; the save and the record follow, and
    the next attempt (the launcher's requeue) resumes from it."""
    run_dir = tmp_path / "runs" / "r"
    launch = [sys.executable, "-m", "job", "launch", "--standalone", "--nproc-per-node", "2", "--"]
    args = [*TINY, "--run.output-dir", str(tmp_path / "runs"), "--run.name", "r", "--train.global-batch-size", "8"]
    first = subprocess.run([*launch, *args, "--train.max-time", "0.001"], capture_output=True, text=True, timeout=300)
    out = first.stdout + first.stderr
    assert first.returncode == EXIT_PREEMPTED, out[-3000:]
    assert len(re.findall(r"stop requested \(time budget: train.max_time spent\): saving at step 1 ", out)) == 2, out
    assert stop.read_record(run_dir) == stop.Record(1, "time-budget")
    assert "stop save of step 1 (time-budget); exit code 143" in out, out[-2000:]
    assert not stop.stop_file(run_dir).exists(), "nobody asked with the STOP file: no honoured mark appears"
    assert "run the same command again" not in out  # the launcher (its requeue) resumes it
    second = subprocess.run([*launch, *args, "--train.max-time", "1h30m"], capture_output=True, text=True, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == EXIT_OK, out[-3000:]
    assert "resumed from" in out and "FINAL step=4" in out


def test_a_stop_agreed_on_the_last_step_finishes_the_run(tmp_path: Path) -> None:
    """The budget is spent before the only step: the ranks agree to stop after it, and since nothing is left to
    train the run finishes (final evaluation, the step's one metrics record, exit 0) instead of saving to resume."""
    run_dir = tmp_path / "runs" / "r"
    done = train(tmp_path, "--train.steps", "1", "--train.max-time", "0.001", "--log.jsonl", "true")
    out = done.stdout + done.stderr
    assert done.returncode == EXIT_OK, out[-3000:]
    assert "FINAL step=1" in done.stdout and "stop requested" not in out
    assert stop.read_record(run_dir) is None and not stop.stop_file(run_dir).exists()
    records = [json.loads(line) for line in (run_dir / METRICS_JSONL).read_text().splitlines()]
    assert [r["step"] for r in records] == [1], records
    assert any(k.startswith("val/") for k in records[0]), "the one record holds the final evaluation"


def test_bad_input_met_after_training_started_exits_1_not_2(tmp_path: Path) -> None:
    """Images truncated after the first save: the error names the file, but checkpoints are on storage, so the run
    ends as a failure a launcher retries (1), never as "bad input, nothing written" (2)."""
    data = make_data(tmp_path / "data", classes=2, per_class=8, size=16)
    run_dir = tmp_path / "runs" / "r"
    args = [*tiny_args(data, classes=2), *TINY[len(tiny_args()) :], "--train.steps", "1000", "--ckpt.every", "1"]
    args += ["--run.output-dir", str(tmp_path / "runs"), "--run.name", "r"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "job", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the first save is on storage: training has started
        seen.append(line)
        if "saved checkpoint" in line:
            break
    for image in (data / "train").rglob("*.*"):
        image.write_bytes(image.read_bytes()[:20])
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=300) == EXIT_FAILURE, out[-3000:]
    assert "cannot read image file" in out and "met after training started" in out, out[-3000:]
    assert find_latest(run_dir) is not None


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs of this test's own with 1 MiB free (root needed; in CI a missing capability fails)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True, text=True)
    require(r.returncode == 0, f"cannot mount a tmpfs (root needed): {r.stderr.strip()}")
    try:
        with (mnt / "filler").open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(mnt).free - (1 << 20))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_stop_save_that_fails_leaves_no_record_and_exits_1(full_disk: Path) -> None:
    """The stop record comes only after the stop save is on storage: a save that fails (ENOSPC) leaves none, and
    the run exits 1, never 143 (a launcher would requeue a run whose save was lost)."""
    run_dir = full_disk / "r"
    stop.request(run_dir)
    args = [*TINY, "--run.output-dir", str(full_disk), "--run.name", "r", "--ckpt.async-save", "off"]
    failed = subprocess.run(
        [sys.executable, "-m", "job", "train", *args], capture_output=True, text=True, timeout=300, cwd=full_disk
    )
    out = failed.stdout + failed.stderr
    assert failed.returncode == EXIT_FAILURE, out[-3000:]
    assert "saving at step 1" in out, out[-3000:]
    assert stop.read_record(run_dir) is None and not stop.is_honoured(run_dir)
    assert find_latest(run_dir) is None


def test_the_time_budget_counts_from_the_attempts_start(tmp_path: Path) -> None:
    """An attempt its launcher started an hour ago (start-up, a slow rendezvous, an earlier worker group of a
    torchrun restart) has spent an hour of a 30-minute budget: the run stops after its first step, whatever the
    age of its own process."""
    env = {**os.environ, stop.ATTEMPT_START_VAR: f"{time.time() - 3600:.3f}"}
    first = train(tmp_path, "--train.max-time", "30m", env=env)
    out = first.stdout + first.stderr
    assert first.returncode == EXIT_PREEMPTED, out[-3000:]
    assert stop.read_record(tmp_path / "runs" / "r") == stop.Record(1, "time-budget")
