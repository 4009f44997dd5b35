"""ckpt.every=auto in real training runs: a slower store makes the chosen interval longer, by the formula."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.cli import base_env, make_data, run_cli

from job.checkpoint.cadence import daly_interval

pytestmark = pytest.mark.integration

DELAY = 5.0
"""Far above the stall of a sync save of the small model (0.3 s idle, up to 1.6 s measured on a loaded machine)."""
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
