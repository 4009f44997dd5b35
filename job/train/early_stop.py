"""Early stopping (``train.early_stop``): the run ends, as a finished run does, once a validation metric has not
improved for ``patience`` evaluations in a row.

The rule is pure (``improved``, ``counted``, ``exhausted``) and is Lightning's ``EarlyStopping`` with
``check_finite=False``: an improvement is a change beyond ``min_delta`` over the best value so far, and a
non-finite value is never one, so it counts toward the patience (Lightning's default ends the fit on it at once;
here non-finite training is the guard's, ``train.max_nonfinite_skips``). Every rank applies it
to the same value, rank 0's (``agree``: a broadcast): the evaluator's result is reduced over all ranks already
(job.train.evaluate), and the broadcast makes the ranks' agreement hold by construction, whatever the backend's
rounding, for one number per evaluation. So the ranks end after the same step; the loop ends with
``End.EARLY_STOP`` (job.train.loop) and finishes: the final evaluation, the final checkpoint, the FINAL line, exit 0.

The count (the best value and its step, the evaluations without improvement since, the step of the newest
evaluation counted) is in every checkpoint (the ``"early_stop"`` entry, job.train.run), so a resumed run goes on
counting. A stop save comes before its step's evaluation (job.train.loop), so the run it resumes makes that
evaluation first (``missed``), as the uninterrupted run made it; a run that stopped early and is run again
finishes at once (``stopped``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from job.config import JobConfig
from job.config.schema import EarlyStopConfig
from job.errors import BadInput
from job.tasks.contract import Bound
from job.train.evaluate import console_name

log = logging.getLogger("job")

SETTING = "train.early_stop.metric"


@dataclass(frozen=True)
class Count:
    """Where early stopping stands after the evaluations so far."""

    best: float | None = None
    """The best value so far (None: no finite value yet)."""
    best_step: int = 0
    """The step whose evaluation gave ``best``."""
    bad: int = 0
    """Evaluations in a row, since ``best``, that did not improve on it."""
    step: int = 0
    """The step of the newest evaluation counted (0: none)."""


def improved(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    """Whether ``value`` improves on ``best`` by more than ``min_delta``, lower for mode ``min``, higher for ``max``
    (any finite value improves on none; a non-finite one never improves)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    if mode == "min":
        return value < best - min_delta
    return value > best + min_delta


def counted(count: Count, value: float, step: int, rule: EarlyStopConfig) -> Count:
    """``count`` after the evaluation of ``step`` gave ``value``."""
    if improved(value, count.best, rule.mode, rule.min_delta):
        return Count(value, step, 0, step)
    return Count(count.best, count.best_step, count.bad + 1, step)


def exhausted(count: Count, rule: EarlyStopConfig) -> bool:
    """Whether the run ends: ``patience`` evaluations in a row without improvement (never while off)."""
    return rule.metric is not None and count.bad >= rule.patience


def reported(keys: Iterable[str]) -> dict[str, str]:
    """The evaluator's result keys by the names the VAL and FINAL lines give them (``val_loss``: ``val/loss``): the
    model's validation metrics, the counts and the EMA's left out."""
    return {console_name(k): k for k in keys if k.startswith("val/") and k != "val/count"}


def require_metric(metric: str, keys: Iterable[str], task_name: str) -> str:
    """The result key of ``metric`` among the evaluation's ``keys``.

    Raises:
        BadInput: the evaluation reports no such metric; the error lists those it reports.
    """
    names = reported(keys)
    if metric in names:
        return names[metric]
    raise BadInput(
        f"{SETTING}={metric!r}: the evaluation of task.name={task_name!r} reports no such metric; it reports "
        f"{', '.join(names)}.",
        f"set {SETTING} (--train.early-stop.metric, JOB_TRAIN__EARLY_STOP__METRIC) to one of {', '.join(names)}, "
        "or leave it unset to train to train.steps.",
        setting=SETTING,
        value=metric,
    )


def evaluation_keys(task: Bound, metric_names: Iterable[str]) -> list[str] | None:
    """The result keys an evaluation of ``task`` will have: its metrics and what its ``summarize`` derives from
    them (asked with placeholder values); None where ``summarize`` fails on those: only a real evaluation tells."""
    keys = [f"val/{name}" for name in metric_names]
    try:
        derived = task.summarize({**dict.fromkeys(keys, 1.0), "val/count": 1.0})
    except Exception:  # the user's summarize may need real values: the first evaluation checks the metric
        return None
    return [*keys, *derived]


def check(cfg: JobConfig, task: Bound, metric_names: tuple[str, ...]) -> None:
    """Preflight, before anything is written: early stopping needs periodic evaluations, and a metric the task's
    evaluation reports, where ``metrics`` ran (``metric_names``; empty on the meta device until the model is
    materialised: job.train.run checks again then) and the task's ``summarize`` names what it derives; otherwise
    the first evaluation checks it (``EarlyStop.judge``).

    Raises:
        BadInput: naming the setting, its value and the fix.
    """
    rule = cfg.train.early_stop
    if rule.metric is None:
        return
    if cfg.train.eval_every == 0:
        raise BadInput(
            f"{SETTING}={rule.metric!r} needs periodic evaluations, but train.eval_every=0 evaluates only at the end.",
            "set train.eval_every (--train.eval-every) to the steps between evaluations; "
            "train.early_stop.patience counts evaluations.",
            setting="train.eval_every",
            value=0,
        )
    if not metric_names:  # the meta device (job.parallel.meta_init): known once the model is materialised
        return
    keys = evaluation_keys(task, metric_names)
    if keys is not None:
        require_metric(rule.metric, keys, task.name)


class EarlyStop:
    """The run's count: every rank keeps its own, the same on each; a checkpoint entry (``state_dict``)."""

    def __init__(
        self,
        rule: EarlyStopConfig,
        total_steps: int,
        task_name: str,
        console: bool = False,
        agree: Callable[[list[float]], list[float]] = list,
    ) -> None:
        """``console``: this rank logs each evaluation's count (rank 0); every rank logs the end. ``agree``: rank 0's
        values on every rank (job.parallel.distributed.broadcast_from_main; one process: as they are)."""
        self.rule, self.total_steps, self.task_name, self.console = rule, total_steps, task_name, console
        self.agree = agree
        self.count = Count()

    @property
    def enabled(self) -> bool:
        return self.rule.metric is not None

    @property
    def stopped(self) -> bool:
        """Whether the count is spent (after the evaluation that spent it, or restored so: the run ends)."""
        return exhausted(self.count, self.rule)

    def missed(self, step: int) -> bool:
        """Whether the evaluation of ``step``, the step a run resumed at, was not counted (its stop save came before
        it): the caller makes it where one was due at ``step``."""
        return self.enabled and self.count.step < step

    def judge(self, step: int, results: Mapping[str, float]) -> bool:
        """Count the evaluation of ``step``; whether the run ends after it.

        Raises:
            BadInput: the evaluation does not report the metric (``require_metric``).
        """
        metric = self.rule.metric
        if metric is None:
            return False
        (value,) = self.agree([results[require_metric(metric, results, self.task_name)]])
        self.count = counted(self.count, value, step, self.rule)
        if self.stopped:
            log.info("early stop: %s; the run ends at step %d of %d", self.describe(), step, self.total_steps)
        elif self.console:
            log.info("early stop: %s=%.6g; %s", metric, value, self.describe())
        return self.stopped

    def describe(self) -> str:
        """The count in words, e.g. ``best val_loss=0.41 at step 20; 2 of 3 evaluations without improvement``."""
        best = "none finite"
        if self.count.best is not None:
            best = f"{self.count.best:.6g} at step {self.count.best_step}"
        delta = ""
        if self.rule.min_delta:
            delta = f" by more than {self.rule.min_delta:g}"
        return (
            f"best {self.rule.metric}={best}; {self.count.bad} of {self.rule.patience} evaluations without "
            f"improvement{delta} ({self.rule.mode})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.rule.metric, "mode": self.rule.mode, **asdict(self.count)}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """The saved count, unless the checkpoint has none (written before early stopping existed) or counted
        another metric or mode: then counting starts afresh."""
        if saved is None:
            return
        if (saved.get("metric"), saved.get("mode")) != (self.rule.metric, self.rule.mode):
            if self.enabled:
                log.info(
                    "early stop: the checkpoint counted %s (%s), this run %s (%s): counting afresh",
                    saved.get("metric"),
                    saved.get("mode"),
                    self.rule.metric,
                    self.rule.mode,
                )
            return
        best = saved["best"]
        if best is not None:
            best = float(best)
        self.count = Count(best, int(saved["best_step"]), int(saved["bad"]), int(saved["step"]))
