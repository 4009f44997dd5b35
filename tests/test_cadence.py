"""ckpt.every=auto: Daly's interval, its inputs (the failures among the restarts, the save's cost with its
background write), the restart counts, and the bad inputs it refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from torch import nn

from job.checkpoint.cadence import (
    Auto,
    check_grace,
    daly_interval,
    expected_loss_s,
    failures,
    refine_mtbf,
    save_cost_s,
)
from job.checkpoint.checkpointer import STOP_SAVES, Checkpointer
from job.checkpoint.states import States
from job.checkpoint.store import CheckpointManager, find_latest
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
    assert reported[0]["ckpt/save_cost_s"] == 2.0 and reported[0]["ckpt/interval_s"] == pytest.approx(tau)


def auto_at(clock: list[float], restarts: int = 0) -> Auto:
    return Auto(100.0, restarts, 0.0, lambda values: values, lambda _s, _d: None, clock=lambda: clock[0])


def five_steps(auto: Auto, clock: list[float], first: int = 1) -> None:
    for step in range(first, first + 5):
        clock[0] += 0.1
        auto.step_done(step)


def test_restarts_after_a_stop_save_are_not_failures() -> None:
    assert [failures(3, 0), failures(3, 2), failures(1, 2)] == [3, 1, 0]  # a stop resumed by hand: none below 0
    clock = [0.0]
    auto = auto_at(clock, restarts=3)
    auto.start(40, 900.0, stop_saves=2)  # 3 restarts, 2 of them after a stop save: 1 failure in 900 s
    five_steps(auto, clock, first=41)
    auto.saved(45, 2.0, 0.0)
    assert auto.choice is not None
    assert auto.choice.mtbf_s == pytest.approx((100.0 + 900.5) / 2)  # not (100 + 900.5) / 4 = 250.1
    assert auto.choice.interval_s == pytest.approx(daly_interval(2.0, 500.25))


def test_an_async_saves_cost_holds_its_background_write() -> None:
    assert save_cost_s(0.5, 1.5) == 2.0 and save_cost_s(2.0, 0.0) == 2.0
    clock = [0.0]
    auto = auto_at(clock)
    auto.start(0, 0.0)
    five_steps(auto, clock)
    auto.saved(5, 0.5, 1.5)  # stall 0.5 s, background write 1.5 s: delta 2 s
    assert auto.choice is not None and auto.choice.delta_s == 2.0
    assert auto.choice.interval_s == pytest.approx(daly_interval(2.0, 100.0))
    assert auto.choice.interval_steps == round(daly_interval(2.0, 100.0) / 0.1)  # 187, not 97 for the stall alone


class Recording:
    """A cadence that saves at the given steps and keeps what ``Checkpointer`` tells it."""

    def __init__(self, steps: set[int]) -> None:
        self.steps, self.stop_saves = steps, -1
        self.saves: list[tuple[int, float, float]] = []

    def start(self, step: int, run_time_s: float, stop_saves: int = 0) -> None:
        self.stop_saves = stop_saves

    def step_done(self, step: int) -> None:
        pass

    def due(self, step: int) -> bool:
        return step in self.steps

    def saved(self, step: int, stall_s: float, write_s: float) -> None:
        self.saves.append((step, stall_s, write_s))

    def run_time_s(self) -> float:
        return 0.0


def checkpointer(run_dir: Path, async_save: bool, cadence: Recording, delay_s: float = 0.0) -> Checkpointer:
    states = States()
    states.add("model", nn.Linear(2, 2))
    manager = CheckpointManager(run_dir, 10, async_save, True, delay_s)
    return Checkpointer(manager, states, cadence, 100, dict)  # type: ignore[arg-type]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_the_checkpointer_hands_auto_the_background_write(tmp_path: Path, async_save: bool) -> None:
    cadence = Recording({2, 4})
    ckpt = checkpointer(tmp_path, async_save, cadence, delay_s=0.3)
    ckpt.start(0)
    for step in (1, 2, 3, 4):
        if step == 4:
            ckpt.manager.wait()  # step 2's write is done: the newest finished one at step 4's save
        ckpt.after_step(step)
    ckpt.finish(4)
    (_, stall2, write2), (_, stall4, write4) = cadence.saves
    if async_save:
        assert write2 == 0.0  # no write finished yet
        assert write4 >= 0.3  # step 2's background write, its injected delay included
    else:
        assert write2 == write4 == 0.0 and stall2 >= 0.3 and stall4 >= 0.3  # the stall holds the write


def test_stop_saves_are_counted_across_attempts_in_the_manifest(tmp_path: Path) -> None:
    first = Recording({2})
    ckpt = checkpointer(tmp_path, False, first)
    ckpt.start(0)
    ckpt.after_step(2)
    ckpt.save(3, stop=True)  # the attempt ends with a stop save
    found = find_latest(tmp_path)
    assert found is not None and found.step == 3 and found.manifest[STOP_SAVES] == 1
    resumed = Recording({5})
    again = checkpointer(tmp_path, False, resumed)
    again.restore(found)
    again.start(3)
    assert resumed.stop_saves == 1
    again.after_step(5)  # a periodic save carries the count on
    again.save(6, stop=True)
    found = find_latest(tmp_path)
    assert found is not None and found.step == 6 and found.manifest[STOP_SAVES] == 2


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
