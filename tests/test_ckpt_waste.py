"""The checkpoint-waste simulation: it agrees with Daly's model, and auto's interval wastes least."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from support.cli import base_env, run_cli

from job.bench import ckpt_waste as cw
from job.checkpoint.cadence import daly_interval


def test_simulation_agrees_with_dalys_wall_time_model() -> None:
    # The simulator is checked against the closed form it is compared with, at intervals far from the optimum too.
    s = cw.Scenario(60.0, 3600.0)
    for tau in (200.0, 600.0, 2400.0):
        fracs = cw.waste_fracs(tau, s, 600, seed=1)
        mean = sum(fracs) / len(fracs)
        stderr = (sum((f - mean) ** 2 for f in fracs) / (len(fracs) - 1) / len(fracs)) ** 0.5
        assert mean == pytest.approx(cw.model_wall_s(tau, s) / s.work_s - 1, abs=5 * stderr)


def test_a_job_without_interruptions_wastes_only_its_saves() -> None:
    s = cw.Scenario(10.0, 1e15)
    tau = 1000.0
    wall = cw.simulate_wall_s(tau, s, random.Random(0))
    assert wall == pytest.approx(s.work_s + s.delta_s * s.work_s / tau)


def test_dalys_interval_is_the_models_optimum() -> None:
    for d, m in cw.SCENARIOS:
        assert cw.model_optimum(cw.Scenario(d, m)) == pytest.approx(daly_interval(d, m), rel=1e-3)


@pytest.mark.parametrize(("delta", "mtbf"), cw.SCENARIOS)
def test_auto_interval_wastes_least(delta: float, mtbf: float) -> None:
    r = cw.compare(cw.Scenario(delta, mtbf), 300, seed=2)
    assert cw.verdict(r) == {"within_10pct_of_optimum": True, "beats_half": True, "beats_double": True}
    # The 10 % bound discriminates: 2x the interval is more than 10 % off the optimum in every scenario.
    assert r["intervals"]["double"]["waste"] > 1.10 * r["model_best_waste"]


def test_bench_ckpt_waste_quick_prints_a_table_and_json(tmp_path: Path) -> None:
    r = run_cli(["bench", "ckpt-waste", "--quick"], env=base_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["benchmark"] == "ckpt-waste" and result["quick"] is True
    assert len(result["results"]) == len(cw.SCENARIOS)
    assert all(all(r["verdict"].values()) for r in result["results"])
    assert "model optimum" in out
