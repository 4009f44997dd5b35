"""ckpt.every=auto: Daly's interval, the MTBF refinement, the restart counts, and the bad inputs it refuses."""

from __future__ import annotations

import math

import pytest

from job.checkpoint.cadence import Auto, check_grace, daly_interval, expected_loss_s, refine_mtbf
from job.cluster.env import NOTICE_VAR, interruptions, launcher_notice_s
from job.config import load_config
from job.errors import BadInput
from job.train.run import grace


def test_daly_refines_young_and_stays_below_mtbf() -> None:
    mtbf = 3600.0
    for delta in (0.1, 1.0, 10.0, 60.0):
        young = math.sqrt(2 * delta * mtbf)
        tau = daly_interval(delta, mtbf)
        # Daly's terms: the correction is positive, minus the save itself
        assert tau == pytest.approx(young * (1 + math.sqrt(delta / (2 * mtbf)) / 3 + delta / (18 * mtbf)) - delta)
        assert 0 < tau < mtbf
    assert daly_interval(7200.0, mtbf) == mtbf  # delta >= 2M: save once per MTBF
    assert daly_interval(4.0, 100.0) > daly_interval(1.0, 100.0)  # slower saves, longer interval


def test_expected_loss_and_mtbf_refinement() -> None:
    assert expected_loss_s(10.0, 2.0) == 6.0
    assert refine_mtbf(86400.0, 0, 1e6) == 86400.0
    assert refine_mtbf(100.0, 3, 900.0) == 250.0


def test_interruptions_sum_every_launchers_count() -> None:
    env = {"SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RESTART_COUNT": "1", "JOBSET_RESTART_ATTEMPT": "x"}
    assert interruptions(env) == 3
    assert interruptions({}) == 0


def test_auto_chooses_the_formulas_interval_in_steps_and_agrees_on_it() -> None:
    now = [0.0]
    reported: list[dict[str, float]] = []
    agreed: list[list[float]] = []

    def agree(values: list[float]) -> list[float]:
        agreed.append(values)
        return values

    auto = Auto(100.0, 0, 0.0, agree, lambda _s, d: reported.append(d), clock=lambda: now[0])
    auto.start(0, 0.0)
    for step in range(1, 6):
        now[0] += 0.1
        auto.step_done(step)
    assert auto.due(5)
    auto.saved(5, 2.0, 0.0)
    tau = daly_interval(2.0, 100.0)
    assert auto.choice is not None and auto.choice.interval_steps == round(tau / 0.1)
    assert auto.next_step == 5 + round(tau / 0.1) and agreed[0][0] == auto.next_step
    assert reported[0]["ckpt/save_stall_s"] == 2.0 and reported[0]["ckpt/interval_s"] == pytest.approx(tau)


def test_mtbf_must_be_a_positive_duration() -> None:
    assert load_config(["--ckpt.mtbf", "90m"]).ckpt.mtbf_s == 5400.0
    for bad in ("0", "abc", "5x", "inf"):
        with pytest.raises(BadInput) as e:
            load_config(["--ckpt.mtbf", bad])
        assert e.value.setting == "ckpt.mtbf" and e.value.value == bad and e.value.exit_code == 2


def test_every_is_steps_or_auto() -> None:
    assert load_config(["--ckpt.every", "auto"]).ckpt.every == "auto"
    assert load_config(["--ckpt.every", "50"]).ckpt.every == 50
    with pytest.raises(BadInput) as e:
        load_config(["--ckpt.every=-1"])
    assert e.value.setting == "ckpt.every"


def test_auto_refuses_a_grace_period_no_save_fits() -> None:
    check_grace(0.0, "ckpt.grace_s", 5.0)
    check_grace(10.0, "ckpt.grace_s", 5.0)
    for source in ("ckpt.grace_s", NOTICE_VAR):
        with pytest.raises(BadInput) as e:
            check_grace(5.0, source, 5.0)
        assert e.value.setting == source and e.value.value == 5.0 and e.value.exit_code == 2


def test_the_configured_grace_wins_over_the_launchers_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NOTICE_VAR, "300")
    assert grace(load_config([])) == (300.0, NOTICE_VAR)
    assert grace(load_config(["--ckpt.grace-s", "90"])) == (90.0, "ckpt.grace_s")
    monkeypatch.delenv(NOTICE_VAR)
    assert grace(load_config([])) == (0.0, NOTICE_VAR)


def test_a_launcher_notice_that_is_not_seconds_exits_2() -> None:
    assert launcher_notice_s({NOTICE_VAR: " 120 "}) == 120.0
    for bad in ("soon", "-5", "nan"):
        with pytest.raises(BadInput) as e:
            launcher_notice_s({NOTICE_VAR: bad})
        assert e.value.setting == NOTICE_VAR and e.value.value == bad and e.value.exit_code == 2
