"""ckpt.every=auto in real training runs: a slower store makes the chosen interval longer, by the formula; two
ranks whose saves stall differently still save at the same steps (rank 0's choice, broadcast)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.cli import base_env, make_data, run_cli, torchrun
from support.runs import tiny_args

from job.checkpoint.cadence import daly_interval
from job.checkpoint.store import scan

pytestmark = pytest.mark.integration

DELAY = 5.0
"""Far above the stall of a sync save of the small model (0.3 s idle, up to 1.6 s measured on a loaded machine)."""
RANK_DELAY = 3.0
"""Rank 1's extra stall in each save: rank 1 alone would choose a longer interval than rank 0."""
NEXT_SAVE = re.compile(r"\[rank (\d)/2\] INFO ckpt.every=auto: next save at step (\d+) .*?save cost ([\d.]+) s")
CHOICE = re.compile(r"every (\d+) steps, ([\d.]+) s of work\): save cost ([\d.]+) s .*?MTBF (\d+) s.*?step ([\d.]+) s")


def _choices(tmp_path: Path, name: str, delay: float) -> list[tuple[float, ...]]:
    data = make_data(tmp_path / "data")
    args = ["--data.path", str(data), "--data.num-classes", "4", "--data.image-size", "16", "--data.num-workers", "0"]
    args += ["--model.name", "resnet18", "--train.steps", "40", "--train.global-batch-size", "16"]
    args += ["--run.output-dir", str(tmp_path / "runs"), "--run.name", name, "--log.progress", "off"]
    args += ["--ckpt.every", "auto", "--ckpt.mtbf", "20s", "--debug.ckpt-write-delay-s", str(delay)]
    r = run_cli(["train", *args, "--doctor.enabled", "false"], env=base_env(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    found = [tuple(float(x) for x in m) for m in CHOICE.findall(r.stdout)]
    assert found, r.stdout[-2000:]
    return found


def test_a_slower_store_gets_a_longer_interval_by_the_formula(tmp_path: Path) -> None:
    fast = _choices(tmp_path, "fast", 0.0)
    slow = _choices(tmp_path, "slow", DELAY)
    for _steps, tau, delta, mtbf, _step_s in fast + slow:
        assert tau == pytest.approx(daly_interval(delta, mtbf), abs=0.06)  # tau logged to 0.1 s, delta to 1 ms
    fast_stalls = [c[2] for c in fast]
    for _steps, tau, delta, mtbf, _step_s in slow:
        # the injected delay is part of every stall measured (a sync save on CPU)
        assert delta >= DELAY and delta > max(fast_stalls)
        assert tau > max(c[1] for c in fast)
        assert tau >= daly_interval(DELAY, mtbf)


def test_two_ranks_with_different_save_stalls_save_at_the_same_steps(tmp_path: Path) -> None:
    """Each rank measures its own save cost (rank 1's is 3 s longer); the interval is rank 0's, broadcast at
    every save, so both ranks log the same next steps and the checkpoints are exactly at those steps."""
    steps = 40
    args = [*tiny_args(), "--train.steps", str(steps), "--train.global-batch-size", "8", "--log.progress", "off"]
    args += ["--run.output-dir", str(tmp_path / "runs"), "--run.name", "r", "--doctor.enabled", "false"]
    args += ["--ckpt.every", "auto", "--ckpt.mtbf", "4s", "--ckpt.keep-last", "100", "--log.tensorboard", "false"]
    args += ["--debug.ckpt-save-delay-s-by-rank", f"[0,{RANK_DELAY}]", "--dist.train-timeout-s", "60"]
    r = torchrun(2, args, env=base_env(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    decisions: dict[int, list[int]] = {0: [], 1: []}
    for rank, next_step, cost in NEXT_SAVE.findall(r.stdout):
        decisions[int(rank)].append(int(next_step))
        if rank == "1":
            assert float(cost) >= RANK_DELAY  # rank 1 measured its own, longer stall
    assert decisions[0] and decisions[1] == decisions[0], decisions
    saved = sorted(step for step, _ in scan(tmp_path / "runs" / "r"))
    periodic = [n for n in decisions[0] if n < steps]
    assert saved == [5, *periodic, steps], (saved, decisions[0])  # the probe save, each one chosen, the end
