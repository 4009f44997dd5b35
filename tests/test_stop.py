"""The stop protocol (job.cluster.stop): the STOP file's states, and what a real training run does with each.

A request made before the trainer started is kept and honoured after the first step; the honoured mark
makes the next start discard it and train on; nothing re-touches the file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.runs import tiny_args

from job.checkpoint.checkpointer import STOP_SAVES
from job.checkpoint.store import find_latest
from job.cluster import stop
from job.errors import EXIT_OK, EXIT_PREEMPTED

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
    stop.begin_attempt(run_dir)  # a launcher's new attempt: gone whatever its state
    assert not stop.stop_file(run_dir).exists()


def train(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    args = [*TINY, "--run.output-dir", str(tmp_path / "runs"), "--run.name", "r"]
    return subprocess.run(
        [sys.executable, "-m", "job", "train", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_request_before_start_is_honoured_after_the_first_step_then_discarded(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    stop.request(run_dir)  # e.g. a launcher's signal trap fired while the trainer was still importing torch
    first = train(tmp_path)
    assert first.returncode == EXIT_PREEMPTED, first.stdout[-2000:] + first.stderr[-2000:]
    assert "saving at step 1" in first.stdout and (run_dir / "step-0000001").is_dir()
    assert stop.is_honoured(run_dir) and "step=1" in stop.stop_file(run_dir).read_text()
    stopped = find_latest(run_dir)
    assert stopped is not None and stopped.manifest[STOP_SAVES] == 1  # ckpt.every=auto's restart is no failure
    second = train(tmp_path)  # the same command again: the honoured request does not stop it
    assert second.returncode == EXIT_OK, second.stdout[-2000:] + second.stderr[-2000:]
    assert "resumed from" in second.stdout and "FINAL step=4" in second.stdout
    assert not stop.stop_file(run_dir).exists()
