"""Rank 0's progress reports, sent off the training thread: the reporter, the status it is given, its sinks (the
run directory's status file, the Slurm job's comment; a TrainJob's status is ``job.observe.trainjob``) and which
of them a run gets (``sinks``).

The training thread calls ``update(status)`` at each log step: it only replaces each sink's latest-value slot and
sets an event (no I/O, no device access). One daemon thread per sink sends the newest status no more often than
the sink's ``min_interval_s``; a status the throttle held back goes out when the interval has passed, so the
newest one is never lost, and a slow or failing sink delays neither training nor the other sinks. ``close(final)``
sends the final status to every sink, waiting a bounded time. A failure is logged once at WARNING with its reason,
repeats at most every ``FAILURE_REPEAT_S`` with their count, and a later success says "recovered"; training goes
on. This module never reads the device, the checkpoint store or the loop: the loop hands it host numbers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from job.cluster.env import DistEnv
from job.config import JobConfig
from job.errors import ReportFailed
from job.observe.status import EARLY_STOP, Sink, Status
from job.observe.trainjob import TrainJobProgress

log = logging.getLogger("job")

FAILURE_REPEAT_S = 300.0
"""A sink that keeps failing is logged again at most this often (with the count of failures in between)."""
CLOSE_WAIT_S = 15.0
"""How long ``close`` waits for every sink's final send, all sinks together (each sink has its own timeout
below it): a preempted job has a grace period to fit in, so the exit is never held longer."""
REPORTED_TRAIN = ("train/loss", "train/lr")
"""The training scalars of a log step that a status carries (with every validation metric once evaluated)."""


def reported_metrics(train: Mapping[str, float], evaluated: Mapping[str, float]) -> dict[str, float]:
    """What a status carries: ``REPORTED_TRAIN`` of the latest log step and the latest validation results
    (counts left out: they are not metrics)."""
    out = {k: float(train[k]) for k in REPORTED_TRAIN if k in train}
    out.update({k: float(v) for k, v in evaluated.items() if not k.endswith("/count")})
    return out


class Pace:
    """Turns the loop's host numbers at a log step into a ``Status``. The step time is the wall time from the
    first log step of this attempt to now over the steps in between, evaluations and saves included: what the
    remaining steps will take (the first window, with start-up and warm-up, only until a second log step)."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self._first: tuple[int, float] | None = None

    def status(
        self,
        step: int,
        window_step_s: float,
        metrics: dict[str, float],
        checkpoint: tuple[int, float] | None,
        end: str | None = None,
    ) -> Status:
        """``window_step_s``: the log window's mean step time; ``checkpoint``: (step, ``time.monotonic()`` when
        its state was taken) of the newest checkpoint on storage, or None; ``end``: why the run finished
        (``Status.end_reason``), None while it runs."""
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        first_step, first_t = self._first
        step_time_s = window_step_s
        if step > first_step:
            step_time_s = (now - first_t) / (step - first_step)
        last_step, age = None, None
        if checkpoint is not None:
            last_step, age = checkpoint[0], max(now - checkpoint[1], 0.0)
        return Status(step, self.total_steps, time.time(), step_time_s, metrics, last_step, age, end is not None, end)


class _Failures:
    """One sink's failure log: the first failure at WARNING, repeats rate-limited with a count, the recovery."""

    def __init__(self, name: str, repeat_s: float) -> None:
        self.name, self.repeat_s = name, repeat_s
        self.failing = False
        self.total = 0
        self._unlogged = 0
        self._logged_at = 0.0

    def failed(self, reason: str, permanent: bool) -> None:
        self.total += 1
        now = time.monotonic()
        if permanent:
            log.warning("progress report to %s failed: %s; not trying again in this run", self.name, reason)
        elif not self.failing:
            log.warning(
                "progress report to %s failed: %s (training goes on; repeats are logged at most every %.0f s)",
                self.name,
                reason,
                self.repeat_s,
            )
        elif now - self._logged_at >= self.repeat_s:
            log.warning(
                "progress report to %s still failing: %s (%d failures since the last message)",
                self.name,
                reason,
                self._unlogged + 1,
            )
        else:
            self._unlogged += 1
            return
        self.failing, self._logged_at, self._unlogged = True, now, 0

    def succeeded(self) -> None:
        if self.failing:
            log.info("progress report to %s recovered after %d failed attempt(s)", self.name, self.total)
        self.failing, self.total, self._unlogged = False, 0, 0


class _SinkWorker:
    """One sink's latest-value slot and the daemon thread that sends it at the sink's pace."""

    def __init__(self, sink: Sink, repeat_s: float) -> None:
        self.sink = sink
        self.failures = _Failures(sink.name, repeat_s)
        self._latest: Status | None = None
        self._sent: Status | None = None
        self._next_send = 0.0
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"report-{sink.name}", daemon=True)
        self._thread.start()

    def offer(self, status: Status) -> None:
        self._latest = status
        self._wake.set()

    def close(self, final: Status | None) -> None:
        if final is not None:
            self._latest = final
        self._closing.set()
        self._wake.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(max(timeout, 0.0))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            delay = self._next_send - time.monotonic()
            if delay > 0:
                self._closing.wait(delay)  # close() cuts the throttle short: the final status goes out at once
            self._wake.clear()  # before reading the slot: an update after the read wakes the next round
            status = self._latest
            if status is not None and status is not self._sent and not self._deliver(status):
                return  # refused for good
            if self._closing.is_set() and self._latest is self._sent:
                return

    def _deliver(self, status: Status) -> bool:
        """Send once; False when the sink refused for good (the thread ends)."""
        self._sent = status
        self._next_send = time.monotonic() + self.sink.min_interval_s
        try:
            self.sink.send(status)
        except ReportFailed as e:
            self.failures.failed(e.reason, e.permanent)
            return not e.permanent
        except Exception as e:  # a sink's bug must not end the reports of the others, nor training
            self.failures.failed(f"{type(e).__name__}: {e}", False)
            return True
        self.failures.succeeded()
        return True


class NullReporter:
    """What ranks other than 0, and runs with ``report.enabled`` off, get."""

    def update(self, status: Status) -> None:
        pass

    def close(self, final: Status | None = None, wait_s: float = CLOSE_WAIT_S) -> list[str]:
        return []


class StatusReporter(NullReporter):
    """Rank 0's reporter: ``update`` from the training thread, one sending thread per sink."""

    def __init__(self, sinks: list[Sink], repeat_s: float = FAILURE_REPEAT_S) -> None:
        self.names = [s.name for s in sinks]
        self._workers = [_SinkWorker(s, repeat_s) for s in sinks]
        self._closed = False

    def update(self, status: Status) -> None:
        """The newest status; returns at once (each sink's thread picks it up at its own pace)."""
        for w in self._workers:
            w.offer(status)

    def close(self, final: Status | None = None, wait_s: float = CLOSE_WAIT_S) -> list[str]:
        """Send ``final`` (else the newest status not yet sent) to every sink, waiting at most ``wait_s`` for all
        of them; returns the names of the sinks still sending when the wait ran out (their daemon threads die
        with the process). A second call does nothing."""
        if self._closed:
            return []
        self._closed = True
        for w in self._workers:
            w.close(final)
        deadline = time.monotonic() + wait_s
        late = [w.sink.name for w in self._workers if not w.join(deadline - time.monotonic())]
        if late:
            log.warning("progress report: %s still sending after %.0f s; exiting without it", ", ".join(late), wait_s)
        return late


# ------------------------------------------------------------------ the status file
STATUS_FILE = "status.json"
STATUS_SCHEMA = 1
"""The status file's ``schema`` field: raised when a field changes meaning or goes away (never for a new field)."""
FILE_EVERY_S = 1.0
"""The status file is rewritten at most once a second: every log step of a slow run, a bounded rate of a fast one."""


def status_record(status: Status) -> dict[str, Any]:
    """The status file's JSON object (docs/progress.md):

    - ``schema``: ``STATUS_SCHEMA``; ``time``: the snapshot's time, ISO 8601 UTC; ``wall_time``: the same as Unix
      seconds;
    - ``step``, ``total_steps``: optimizer steps done and planned; ``progress_percentage`` (0-100, 100 only when
      finished) and ``estimated_remaining_s`` (null until a step time is measured; 0 when finished);
    - ``step_time_s``: seconds per step measured over this attempt, evaluations and saves included;
    - ``metrics``: ``train/loss``, ``train/lr`` of the latest log step, and every validation metric once
      evaluated (``val/...``, ``ema/val/...``); a non-finite value is null;
    - ``last_checkpoint_step``: the newest step whose checkpoint is complete on storage (null: none yet);
      ``checkpoint_age_s``: seconds since that checkpoint's state was taken, the work a preemption now costs;
    - ``finished``: true once the run completed (false after a preemption: it resumes);
    - ``end_reason``: why it completed: ``completed`` (``train.steps`` reached) or ``early-stop``
      (``train.early_stop``); null while it runs and after a preemption.
    """
    return {
        "schema": STATUS_SCHEMA,
        "time": datetime.fromtimestamp(status.wall_time, timezone.utc).isoformat(timespec="milliseconds"),
        "wall_time": status.wall_time,
        "step": status.step,
        "total_steps": status.total_steps,
        "progress_percentage": status.progress_percentage,
        "estimated_remaining_s": status.estimated_remaining_s,
        "step_time_s": status.step_time_s,
        "metrics": {k: v if math.isfinite(v) else None for k, v in status.metrics.items()},
        "last_checkpoint_step": status.last_checkpoint_step,
        "checkpoint_age_s": status.checkpoint_age_s,
        "finished": status.finished,
        "end_reason": status.end_reason,
    }


class StatusFile:
    """``<run_dir>/status.json``, replaced atomically (a temporary file in the same directory, fsynced, then
    ``os.replace``): a reader sees the previous status or the new one, never a torn file."""

    name = "status file"
    min_interval_s = FILE_EVERY_S

    def __init__(self, path: Path) -> None:
        self.path = path

    def send(self, status: Status) -> None:
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        text = json.dumps(status_record(status), indent=1, allow_nan=False)
        try:
            with tmp.open("w") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise ReportFailed(self.name, f"writing {self.path} failed: {e.strerror or e}") from e


# ------------------------------------------------------------------ the Slurm job's comment
COMMENT_MAX = 1024
"""slurmctld refuses a job comment longer than 1024 bytes (job_mgr.c ``_test_strlen(..., "comment", 1024)``)."""
SCONTROL_TIMEOUT_S = 10.0
"""``scontrol update`` is one RPC to slurmctld; a controller that does not answer in this time is reported."""
SLURM_DENIED = ("Invalid user id", "Access/permission denied")
"""How scontrol reports that this user may not update the job (slurm_strerror of ESLURM_USER_ID_MISSING and
ESLURM_ACCESS_DENIED, the latter from a job_submit plugin): scontrol exits 1 for every error, so its message is
the only thing that tells a refusal that will never change from a passing one."""


def comment_text(status: Status) -> str:
    """The one-line summary, e.g. ``ddp-job step 40/100 40% eta 120s ckpt@30 age 12s loss 0.41``."""
    state = "done" if status.finished else "step"
    parts = [f"ddp-job {state} {status.step}/{status.total_steps} {status.progress_percentage}%"]
    if status.end_reason == EARLY_STOP:
        parts.append(EARLY_STOP)
    eta = status.estimated_remaining_s
    if eta is not None and not status.finished:
        parts.append(f"eta {eta}s")
    if status.last_checkpoint_step is not None and status.checkpoint_age_s is not None:
        parts.append(f"ckpt@{status.last_checkpoint_step} age {status.checkpoint_age_s:.0f}s")
    loss = status.metrics.get("train/loss")
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    return " ".join(parts)[:COMMENT_MAX]


class SlurmComment:
    """The job's comment (``scontrol show job`` shows ``Comment=...``), set with ``scontrol update``. The job's own
    user may set it; a refusal (another user, a site plugin) or a missing scontrol ends the tries for the run."""

    name = "slurm comment"

    def __init__(self, job_id: str, every_s: float, scontrol: str = "scontrol") -> None:
        self.job_id, self.min_interval_s, self.scontrol = job_id, every_s, scontrol

    def send(self, status: Status) -> None:
        cmd = [self.scontrol, "update", f"JobId={self.job_id}", f"Comment={comment_text(status)}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
        except FileNotFoundError:
            raise ReportFailed(self.name, f"{self.scontrol} is not on PATH", permanent=True) from None
        except subprocess.TimeoutExpired:
            raise ReportFailed(self.name, f"scontrol update did not answer in {SCONTROL_TIMEOUT_S:.0f} s") from None
        except OSError as e:
            raise ReportFailed(self.name, f"running {self.scontrol} failed: {e.strerror or e}") from None
        if proc.returncode != 0:
            message = " ".join((proc.stderr or proc.stdout).split())[-300:]
            denied = any(text in message for text in SLURM_DENIED)
            raise ReportFailed(
                self.name, f"scontrol update JobId={self.job_id} exited {proc.returncode}: {message}", permanent=denied
            )


# ------------------------------------------------------------------ which sinks a run gets
def sinks(cfg: JobConfig, env: DistEnv, environ: Mapping[str, str]) -> list[Sink]:
    """The places this run reports to: the status file, the Slurm job's comment under Slurm, the TrainJob's status
    where its controller set the endpoint's variables. ``env`` and ``environ`` tell where the run is (a launcher's
    own place for it needs its variables)."""
    rc = cfg.report
    out: list[Sink] = []
    if rc.file:
        out.append(StatusFile(cfg.run_dir / STATUS_FILE))
    job_id = environ.get("SLURM_JOB_ID", "")
    if rc.slurm_comment and job_id:
        out.append(SlurmComment(job_id, rc.slurm_every_s))
    if rc.trainjob:
        try:
            trainjob = TrainJobProgress.from_environ(environ)
        except ValueError as e:  # a variable only the controller sets, so never the user's bad input
            log.warning("progress reports to the TrainJob left out: %s", e)
            trainjob = None
        if trainjob is not None:
            out.append(trainjob)
    return out


def build_reporter(cfg: JobConfig, env: DistEnv, environ: Mapping[str, str]) -> NullReporter:
    """Rank 0's reporter over ``sinks``; a null one elsewhere, when reporting is off, or with no sink."""
    if not (cfg.report.enabled and env.is_main):
        return NullReporter()
    chosen = sinks(cfg, env, environ)
    if not chosen:
        return NullReporter()
    log.info("progress reports to: %s", ", ".join(s.name for s in chosen))
    return StatusReporter(chosen)
