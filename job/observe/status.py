"""What rank 0 tells the world about the run, and the protocol of the places it tells it to.

A ``Status`` is a snapshot taken at a log step on the training thread (no device access: every number in it
is already on the host). Sinks (the run directory's status file, the Slurm job's comment, a TrainJob's
progress endpoint) receive it off the training thread, each at its own minimum interval; a failing sink
raises ``job.errors.ReportFailed`` and training goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

COMPLETED = "completed"
"""``Status.end_reason`` of a run that trained to ``train.steps``."""
EARLY_STOP = "early-stop"
"""``Status.end_reason`` of a run that ``train.early_stop`` ended before ``train.steps`` (job.train.early_stop)."""


@dataclass(frozen=True)
class Status:
    """One report. Times are seconds; ``wall_time`` is Unix time (UTC) of the snapshot."""

    step: int
    total_steps: int
    wall_time: float
    step_time_s: float
    """Seconds per optimizer step as measured on this attempt, evaluations and saves included (what the remaining
    steps will take; 0 before the first measured step)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The latest training (and validation, once evaluated) metrics, e.g. ``train/loss``."""
    last_checkpoint_step: int | None = None
    """The newest step whose checkpoint is complete on storage (None: none yet in this run directory)."""
    checkpoint_age_s: float | None = None
    """Seconds of training since that checkpoint: the work a preemption now would cost."""
    finished: bool = False
    end_reason: str | None = None
    """Why the run finished: ``COMPLETED`` or ``EARLY_STOP``; None while it runs (and after a preemption)."""

    @property
    def progress_percentage(self) -> int:
        """0-100, rounded down; 100 only when finished."""
        if self.total_steps <= 0:
            return 0
        pct = int(100 * self.step // self.total_steps)
        if self.finished:
            return 100
        return min(pct, 99)

    @property
    def estimated_remaining_s(self) -> int | None:
        """From the measured step time; None until a step time is known."""
        if self.finished:
            return 0
        if self.step_time_s <= 0:
            return None
        return round(max(self.total_steps - self.step, 0) * self.step_time_s)


class Sink(Protocol):
    """A place a status goes. ``send`` runs on the reporter's thread and may block up to its own timeout."""

    name: str
    min_interval_s: float
    """At most one ``send`` per this many seconds (the final status is always sent)."""

    def send(self, status: Status) -> None:
        """Deliver ``status``; raise ``ReportFailed`` when it could not be delivered."""
        ...
