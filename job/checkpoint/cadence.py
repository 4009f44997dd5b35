"""When to save: a fixed ``ckpt.every`` N, or ``auto``, the interval that wastes least (docs/checkpoint-interval.md).

``auto`` uses Daly's optimum (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 22, 2006), which refines Young's ``sqrt(2 delta M)``:

    tau = sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + delta / 18M) - delta     for delta < 2M, else tau = M

where ``tau`` is the work between saves, ``delta`` the cost of a save and ``M`` the mean time between
failures. ``delta`` is measured on this run at every save (the median of the recent ones): the time the save
stops training plus, for an async save, its background write, because a checkpoint protects the work before it
only once it is written. ``M`` starts at ``ckpt.mtbf`` and is refined from the failures: the restarts the
launchers counted, less those that followed a stop save (a graceful stop loses nothing but its save). The
interval is turned into steps with the measured step time.

Only rank 0 measures (it is the rank that writes); the next save step is decided there and broadcast at each
save, so every rank saves at the same step. The formulae are pure functions here, with their own tests.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from job.errors import BadInput

log = logging.getLogger("job")

PROBE_STEPS = 5
"""ckpt.every=auto saves this many steps into an attempt to measure its first save stall."""
WINDOW = 5
"""Saves (and, x10, steps) in the medians of the save stall and the step time."""


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's optimum work between saves (seconds) for a save stall ``delta_s`` and an MTBF ``mtbf_s``."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    root = math.sqrt(delta_s / (2 * mtbf_s))
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + root / 3 + delta_s / (18 * mtbf_s)) - delta_s


def expected_loss_s(tau_s: float, delta_s: float) -> float:
    """Work lost by one interruption, on average: it lands uniformly in a segment of work plus save."""
    return (tau_s + delta_s) / 2


def refine_mtbf(prior_s: float, failures: int, run_time_s: float) -> float:
    """The MTBF after ``failures`` in ``run_time_s`` of running, with ``prior_s`` counted as one more
    failure-free span that ended in one (a Gamma prior): the configured value until the job failed, then
    tending to run time / failures."""
    if failures <= 0:
        return prior_s
    return (prior_s + run_time_s) / (1 + failures)


def failures(restarts: int, stop_saves: int) -> int:
    """The restarts that lost work: every launcher's restart count (``restarts``) less the attempts that ended
    with a stop save (``stop_saves``), whose restart resumes at the step it stopped at. Never below 0: a run
    resumed by hand after a stop has no restart to subtract it from."""
    return max(0, restarts - stop_saves)


def save_cost_s(stall_s: float, write_s: float) -> float:
    """``delta``: what a save costs the run, its stall plus its background write (``write_s``, 0 for a sync
    save, whose stall holds the write). Until the write is done an interruption loses the work since the
    previous checkpoint, so an async save is exposed for as long as a sync one of the same write."""
    return stall_s + write_s


def check_grace(grace_s: float, source: str, write_delay_s: float) -> None:
    """``auto`` with a notice known (``source``: ``ckpt.grace_s`` or the launcher's variable) that a save known
    from the config to be longer cannot fit."""
    if grace_s and write_delay_s >= grace_s:
        raise BadInput(
            f"ckpt.every=auto with {source}={grace_s:g}: every save takes at least debug.ckpt_write_delay_s="
            f"{write_delay_s:g} s, so no save fits in the launcher's notice and a preemption always loses work.",
            f"set {source} to the launcher's real notice (above the save time), lower debug.ckpt_write_delay_s, "
            "or set a fixed ckpt.every.",
            setting=source,
            value=grace_s,
        )


@dataclass(frozen=True)
class Choice:
    """One decision of ``auto``: what it measured and the interval it chose."""

    next_step: int
    interval_steps: int
    interval_s: float
    delta_s: float
    mtbf_s: float
    step_s: float

    def scalars(self) -> dict[str, float]:
        return {
            "ckpt/interval_steps": float(self.interval_steps),
            "ckpt/interval_s": self.interval_s,
            "ckpt/save_cost_s": self.delta_s,
            "ckpt/mtbf_s": self.mtbf_s,
            "ckpt/expected_loss_s": expected_loss_s(self.interval_s, self.delta_s),
        }


class Fixed:
    """``ckpt.every`` N: every N steps (0: never; the end and a stop request save anyway)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def start(self, step: int, run_time_s: float, stop_saves: int = 0) -> None:
        pass

    def step_done(self, step: int) -> None:
        pass

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def saved(self, step: int, stall_s: float, write_s: float) -> None:
        pass

    def run_time_s(self) -> float:
        return 0.0


class Auto:
    """``ckpt.every: auto``. ``restarts``: every launcher's restart count (job.cluster.env.interruptions);
    ``agree`` broadcasts rank 0's numbers to every rank (a collective: every rank calls ``saved`` at the same
    step); ``report`` takes each decision's scalars (TensorBoard)."""

    def __init__(
        self,
        mtbf_s: float,
        restarts: int,
        grace_s: float,
        agree: Callable[[list[float]], list[float]],
        report: Callable[[int, dict[str, float]], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.prior_s, self.restarts, self.grace_s = mtbf_s, restarts, grace_s
        self.failures = restarts
        self.agree, self.report, self.clock = agree, report, clock
        self.costs: deque[float] = deque(maxlen=WINDOW)
        self.steps: deque[float] = deque(maxlen=10 * WINDOW)
        self.next_step = 0
        self.choice: Choice | None = None
        self._earlier_s = 0.0  # run time of the attempts before this one (from the checkpoint resumed)
        self._t0 = self._last = 0.0
        self._warned_grace = False
        self._first = True

    def start(self, step: int, run_time_s: float, stop_saves: int = 0) -> None:
        """The attempt begins after ``step``; ``run_time_s``: the run's time when that step was saved;
        ``stop_saves``: the earlier attempts that ended with a stop save (not failures)."""
        self._earlier_s = run_time_s
        self.failures = failures(self.restarts, stop_saves)
        self._t0 = self._last = self.clock()
        self.next_step = step + PROBE_STEPS
        self._first = True

    def step_done(self, step: int) -> None:
        now = self.clock()
        if not self._first:  # the attempt's first step carries the warm-up (compile, allocator, workers)
            self.steps.append(now - self._last)
        self._first = False
        self._last = now

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def run_time_s(self) -> float:
        return self._earlier_s + self.clock() - self._t0

    def mtbf_s(self) -> float:
        return refine_mtbf(self.prior_s, self.failures, self.run_time_s())

    def saved(self, step: int, stall_s: float, write_s: float) -> None:
        """After the save of ``step`` on every rank: measure, choose the next save step, agree on it.
        ``write_s``: the newest finished background write (0 for sync saves, whose stall holds the write)."""
        self.costs.append(save_cost_s(stall_s, write_s))
        self._last = self.clock()  # the save's stall is not step time
        delta = statistics.median(self.costs)
        step_s = statistics.median(self.steps) if self.steps else 0.0
        mtbf = self.mtbf_s()
        tau = daly_interval(delta, mtbf)
        interval = max(1, round(tau / step_s)) if step_s > 0 else PROBE_STEPS
        next_step, interval = (int(v) for v in self.agree([float(step + interval), float(interval)]))
        self.next_step = next_step
        self.choice = Choice(next_step, interval, tau, delta, mtbf, step_s)
        self._log(step, self.choice)

    def _log(self, step: int, c: Choice) -> None:
        log.info(
            "ckpt.every=auto: next save at step %d (every %d steps, %.1f s of work): save cost %.3f s (median of "
            "%d, stall and background write), MTBF %.0f s (ckpt.mtbf %.0f s, %d failure(s) seen: %d restart(s), "
            "less %d after a stop save), step %.4f s, expected work lost per failure %.1f s",
            c.next_step,
            c.interval_steps,
            c.interval_s,
            c.delta_s,
            len(self.costs),
            c.mtbf_s,
            self.prior_s,
            self.failures,
            self.restarts,
            self.restarts - self.failures,
            c.step_s,
            expected_loss_s(c.interval_s, c.delta_s),
        )
        self.report(step, c.scalars())
        need = 2 * c.step_s + c.delta_s
        if self.grace_s and need > self.grace_s and not self._warned_grace:
            self._warned_grace = True  # once: the same fact at every save would drown the log
            log.warning(
                "a stop needs about %.1f s (two steps, the save stall and the write) but ckpt.grace_s=%.1f: a "
                "preemption save may be cut off, so the periodic saves carry the run; give the launcher a longer "
                "notice (Slurm --signal, terminationGracePeriodSeconds) or a faster store",
                need,
                self.grace_s,
            )
