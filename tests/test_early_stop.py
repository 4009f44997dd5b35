"""Early stopping (job.train.early_stop): the rule as pure functions, the nested settings, the refusal of a metric
the evaluation does not report, and real runs: two ranks ending together at the step the patience and the
evaluation cadence give, as a finished run, and a run stopped and resumed that goes on counting."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import run_cli, user_code_env
from support.runs import load_final_state

from job.checkpoint.store import find_latest, read_checkpoint
from job.cluster import stop
from job.cluster.env import detect_env
from job.config import load_config
from job.config.schema import EarlyStopConfig
from job.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_PREEMPTED, BadInput
from job.observe.metrics import METRICS_JSONL
from job.observe.report import STATUS_FILE
from job.train.early_stop import Count, EarlyStop, counted, exhausted, improved

PLATEAU = "support.user_tasks:Plateau"
RUN = [
    *("--task.name", PLATEAU, "--train.global-batch-size", "8", "--train.steps", "20"),
    *("--log.tensorboard", "false", "--log.jsonl", "true", "--doctor.enabled", "false", "--data.num-workers", "0"),
]


def plateau_stop_step(eval_every: int, patience: int) -> int:
    """Where a run on a plateau ends: its first evaluation sets the best value, each later one fails to improve on
    it, and the ``patience``-th of those ends the run."""
    return eval_every * (1 + patience)


def stop_index(values: list[float], rule: EarlyStopConfig) -> int | None:
    """The index of the evaluation after which the run ends, None if it trains on."""
    count = Count()
    for i, value in enumerate(values):
        count = counted(count, value, i + 1, rule)
        if exhausted(count, rule):
            return i
    return None


def test_the_rule_min_max_min_delta_patience_and_non_finite_values() -> None:
    assert improved(5.0, None, "min", 0.0) and improved(5.0, None, "max", 9.0)  # any finite value beats none
    assert improved(0.9, 1.0, "min", 0.0) and not improved(1.0, 1.0, "min", 0.0)  # equal is no improvement
    assert improved(1.1, 1.0, "max", 0.0) and not improved(0.9, 1.0, "max", 0.0)
    assert not improved(0.95, 1.0, "min", 0.05) and improved(0.94, 1.0, "min", 0.05)  # beyond min_delta only
    assert not improved(1.05, 1.0, "max", 0.05) and improved(1.06, 1.0, "max", 0.05)
    assert not any(
        improved(v, b, m, 0.0) for v in (math.nan, math.inf, -math.inf) for b in (None, 1.0) for m in ("min", "max")
    )

    def rule(mode: str = "min", patience: int = 2, min_delta: float = 0.0) -> EarlyStopConfig:
        return EarlyStopConfig(metric="val_loss", mode=mode, patience=patience, min_delta=min_delta)

    # an improvement starts the count afresh: .95 (1), .85 best, .9 (1), .9 (2): ends after the sixth
    assert stop_index([1.0, 0.9, 0.95, 0.85, 0.9, 0.9], rule()) == 5
    assert stop_index([1.0, 0.9, 0.95, 0.85, 0.9, 0.9], rule(patience=3)) is None
    assert stop_index([0.1, 0.2, 0.2, 0.15], rule("max")) == 3
    assert stop_index([0.1, 0.2, 0.3, 0.4], rule("max")) is None
    assert stop_index([0.1, 0.2, 0.3, 0.4], rule("min")) == 2
    assert stop_index([1.0, 0.95, 0.91, 0.89], rule(min_delta=0.1)) == 2  # .95 and .91 are within min_delta
    assert stop_index([1.0, 0.95, 0.91, 0.89], rule(patience=3, min_delta=0.1)) is None  # .89 is not
    assert stop_index([1.0, math.nan, math.nan], rule()) == 2
    after = counted(counted(Count(), 1.0, 2, rule()), math.nan, 4, rule())
    assert after == Count(best=1.0, best_step=2, bad=1, step=4)
    assert stop_index([1.0] * 10, EarlyStopConfig()) is None  # off: never


def test_the_count_is_saved_and_resumed_afresh_for_another_metric_or_mode() -> None:
    rule = EarlyStopConfig(metric="val_loss", patience=2)
    a = EarlyStop(rule, 100, "t")
    assert not a.judge(10, {"val/loss": 1.0, "val/count": 8}) and not a.judge(20, {"val/loss": 1.5, "val/count": 8})
    saved = a.state_dict()
    b = EarlyStop(rule, 100, "t")
    b.load_state_dict(saved)
    assert b.count == Count(1.0, 10, 1, 20) and not b.missed(20) and b.missed(30)
    assert b.judge(30, {"val/loss": 1.0, "val/count": 8}) and b.stopped  # goes on counting: the second in a row
    for other in (EarlyStopConfig(metric="val_acc", patience=2), EarlyStopConfig(metric="val_loss", mode="max")):
        c = EarlyStop(other, 100, "t")
        c.load_state_dict(saved)
        assert c.count == Count()
    d = EarlyStop(rule, 100, "t")
    d.load_state_dict(None)  # a checkpoint written before early stopping existed
    assert d.count == Count()
    with pytest.raises(BadInput) as e:
        a.judge(40, {"val/acc": 0.5, "val/count": 8})
    assert e.value.setting == "train.early_stop.metric" and e.value.value == "val_loss" and "val_acc" in str(e.value)


def test_nested_settings_from_flags_env_and_yaml(tmp_path: Path) -> None:
    want = EarlyStopConfig(metric="val_top1", mode="max", patience=2, min_delta=0.01)
    flags = ["--train.early-stop.metric", "val_top1", "--train.early-stop.mode", "max"]
    flags += ["--train.early_stop.patience", "2", "--train.early-stop.min-delta", "0.01"]
    assert load_config(flags, {}).train.early_stop == want
    env = {"JOB_TRAIN__EARLY_STOP__METRIC": "val_top1", "JOB_TRAIN__EARLY_STOP__MODE": "max"}
    env |= {"JOB_TRAIN__EARLY_STOP__PATIENCE": "2", "JOB_TRAIN__EARLY_STOP__MIN_DELTA": "0.01"}
    assert load_config([], env).train.early_stop == want
    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        "train:\n  eval_every: 5\n  early_stop: {metric: val_top1, mode: max, patience: 2, min_delta: 0.01}\n"
    )
    cfg = load_config(["--config", str(yaml), "--train.early-stop.patience", "4"], {})
    assert cfg.train.early_stop == want.model_copy(update={"patience": 4}) and cfg.train.eval_every == 5
    assert load_config([], {}).train.early_stop.metric is None  # off by default
    with pytest.raises(BadInput) as e:
        load_config(["--train.early-stop.patience", "0"], {})
    assert e.value.setting == "train.early_stop.patience" and "JOB_TRAIN__EARLY_STOP__PATIENCE" in str(e.value)
    with pytest.raises(BadInput) as e:
        load_config([], {"JOB_TRAIN__EARLY_STOP__METRIK": "val_loss"})
    assert e.value.setting == "train.early_stop.metrik"


def test_a_metric_the_evaluation_does_not_report_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Preflight knows the evaluation's metrics (the task's ``metrics`` on one batch, and what ``summarize`` derives
    from them): a name among them passes, any other is bad input naming the setting, its value and the choices."""
    from job.train.run import preflight

    base = [*RUN, "--run.output-dir", str(tmp_path / "runs"), "--train.eval-every", "2"]
    preflight(load_config([*base, "--train.early-stop.metric", "val_rmse"], {}), detect_env({}))  # derived
    with pytest.raises(BadInput) as e:
        preflight(load_config([*base, "--train.early-stop.metric", "val_loss"], {}), detect_env({}))
    err = e.value
    assert err.exit_code == EXIT_BAD_INPUT and err.setting == "train.early_stop.metric" and err.value == "val_loss"
    assert "it reports val_mse, val_mae, val_rmse" in err.what and "--train.early-stop.metric" in err.fix
    with pytest.raises(BadInput) as e:  # no periodic evaluation to count
        preflight(
            load_config([*RUN, "--run.output-dir", str(tmp_path / "runs"), "--train.early-stop.metric", "val_mse"], {}),
            detect_env({}),
        )
    assert e.value.setting == "train.eval_every" and e.value.value == 0
    assert not (tmp_path / "runs").exists()


def test_two_ranks_stop_early_together_and_finish(tmp_path: Path) -> None:
    """On a plateau, eval every 2 steps, patience 2: both ranks end after step 6 as a finished run: exit 0, the
    final evaluation and checkpoint of step 6, status.json's end_reason, no stop record (nothing to requeue)."""
    runs = tmp_path / "runs"
    run_dir = runs / "r"
    args = [*RUN, "--run.output-dir", str(runs), "--run.name", "r", "--train.eval-every", "2"]
    args += ["--train.early-stop.metric", "val_rmse", "--train.early-stop.patience", "2"]
    launch = [sys.executable, "-m", "job", "launch", "--standalone", "--nproc-per-node", "2", "--"]
    done = subprocess.run([*launch, *args], capture_output=True, text=True, timeout=300, env=user_code_env(tmp_path))
    out = done.stdout + done.stderr
    step = plateau_stop_step(2, 2)
    assert done.returncode == EXIT_OK, out[-3000:]
    ends = re.findall(
        r"\[rank (\d)/2\] INFO early stop: best val_rmse=\S+ at step 2; 2 of 2 .* ends at step (\d+) of 20", out
    )
    assert sorted(ends) == [("0", str(step)), ("1", str(step))], out[-3000:]
    assert f"FINAL step={step} " in out and "stop requested" not in out
    latest = find_latest(run_dir)
    assert latest is not None and latest.step == step
    saved = load_final_state(run_dir)["early_stop"]
    assert saved == {"metric": "val_rmse", "mode": "min", "best": saved["best"], "best_step": 2, "bad": 2, "step": step}
    records = [json.loads(line) for line in (run_dir / METRICS_JSONL).read_text().splitlines()]
    assert [r["step"] for r in records if "val/rmse" in r] == [2, 4, step]
    assert {r["val/rmse"] for r in records if "val/rmse" in r} == {saved["best"]}  # the plateau
    assert max(r["step"] for r in records) == step
    status = json.loads((run_dir / STATUS_FILE).read_text())
    assert status["finished"] and status["end_reason"] == "early-stop" and status["step"] == step
    assert stop.read_record(run_dir) is None


def test_a_stopped_run_resumes_counting_and_stops_where_the_uninterrupted_run_does(tmp_path: Path) -> None:
    """Eval every 2 steps, patience 3: the uninterrupted run ends after step 8. Here the task asks for a stop as
    step 5 begins: the run saves step 6 (its evaluation deferred by the stop) with one evaluation without
    improvement counted, and exits 143. The resumed run makes step 6's evaluation first and ends after step 8. Run
    again, it finishes at once, without a step."""
    runs = tmp_path / "runs"
    run_dir = runs / "r"
    options = json.dumps({"stop_file": str(run_dir / stop.STOP_FILE), "stop_before_step": 5})
    args = ["train", *RUN, "--run.output-dir", str(runs), "--run.name", "r", "--train.eval-every", "2"]
    args += ["--task.options", options, "--train.early-stop.metric", "val_mse", "--train.early-stop.patience", "3"]
    env = user_code_env(tmp_path)
    first = run_cli(args, env=env, cwd=tmp_path)
    assert first.returncode == EXIT_PREEMPTED, (first.stdout + first.stderr)[-3000:]
    assert stop.read_record(run_dir) == stop.Record(6, "stop-file")
    at_stop = read_checkpoint(run_dir / "step-0000006")["early_stop"]
    assert at_stop == {"metric": "val_mse", "mode": "min", "best": at_stop["best"], "best_step": 2, "bad": 1, "step": 4}

    second = run_cli(args, env=env, cwd=tmp_path)
    out = second.stdout + second.stderr
    step = plateau_stop_step(2, 3)
    assert second.returncode == EXIT_OK, out[-3000:]
    assert "resumed from" in out and f"3 of 3 evaluations without improvement (min); the run ends at step {step}" in out
    assert f"FINAL step={step} " in out
    assert load_final_state(run_dir)["early_stop"] == {**at_stop, "bad": 3, "step": step}

    third = run_cli(args, env=env, cwd=tmp_path)
    out = third.stdout + third.stderr
    assert third.returncode == EXIT_OK, out[-3000:]
    assert f"FINAL step={step} " in out and not stop.trained(run_dir), "an early-stopped run trains no further"
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-0000006", f"step-{step:07d}"]
    assert json.loads((run_dir / STATUS_FILE).read_text())["end_reason"] == "early-stop"
