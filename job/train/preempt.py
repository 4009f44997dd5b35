"""Preemption: signal early, act late.

Handlers only set a flag (saving inside a handler can deadlock: Lightning#21406). Two ways to ask a run
to stop, both read as each step starts:

* a signal in ``train.stop_signals`` delivered to the worker. Plain torchrun forwards only
  SIGTERM/SIGINT/SIGHUP/SIGQUIT; ``ddp-job launch`` (and ``ddp-job train`` launching itself) adds
  SIGUSR1/SIGUSR2 to torchrun's ``--signals-to-handle`` (job.launchers.torchrun.with_stop_signals), so a USR1/USR2
  sent to the agent only (Slurm ``--signal=B:...``) reaches every worker too;
* the stop file ``<run_dir>/STOP``, for launchers that can only run a shell command (slurm/train.sbatch
  traps USR1/USR2 and writes it; works with plain torchrun and across nodes on a shared filesystem). Its
  protocol (who creates and removes it, and when) is ``job.cluster.stop``.

The agent delivers signals with killpg to each rank's process group, which holds the rank's DataLoader
workers: they ignore the stop signals (``job.cluster.stop.ignore_stop_signals``), otherwise their death makes the
DataLoader raise in the trainer before it can save.

Then all ranks agree with an all-reduce (MAX) that runs during the step (``job.parallel.distributed.StepFlagVote``),
so every rank stops after the same step (the one that began after the request), rank 0 saves, and all exit
with EXIT_PREEMPTED. Time budget: the rest of the current step + one more step + one checkpoint write (sync: the
whole write; async: the host copy plus the wait for any write in flight) + process exit must fit before the
launcher's hard kill (torchrun: ``--shutdown-timeout``, default 30 s after it forwards the signal; Slurm:
the ``--signal`` lead time; Kubernetes: terminationGracePeriodSeconds). A second signal only bumps a count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import FrameType

from job.cluster import stop
from job.errors import EXIT_PREEMPTED

log = logging.getLogger("job")


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere: since this module was imported)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()

_STOP_SAVE = threading.Event()
"""Set while this process answers a stop (the stop save, the record): process-wide, like the signals."""


def stop_save_running() -> bool:
    """Whether this process is saving to answer a stop: a deadline around the trainer (the submit task's) waits
    for it instead of tearing the save."""
    return _STOP_SAVE.is_set()


def attempt_age_s(environ: Mapping[str, str]) -> float:
    """Seconds since this attempt started: from the launcher's ``job.cluster.stop.ATTEMPT_START_VAR`` where it is
    set (and not in the future), else since this process started."""
    try:
        started = float(environ.get(stop.ATTEMPT_START_VAR, ""))
    except ValueError:
        return process_age_s()
    age = time.time() - started
    if age < 0:
        return process_age_s()
    return max(age, process_age_s())


class StopRequest:
    """Set by signal handlers, the stop file or the time budget; read by the loop at step boundaries.

    ``max_time_s``: the budget of this attempt (``train.max_time``), ``age_s`` of it already spent (``attempt_age_s``;
    None: since process start). Each rank reads its own clock; the stop vote ORs the ranks' flags, so they stop
    at the same step whichever rank's budget ran out.
    """

    def __init__(self, run_dir: Path, max_time_s: float | None = None, age_s: float | None = None) -> None:
        self.run_dir = run_dir
        self.stop_file = stop.stop_file(run_dir)
        self.deadline: float | None = None
        if max_time_s is not None:
            if age_s is None:
                age_s = process_age_s()
            self.deadline = time.monotonic() + max_time_s - age_s
        self.signal_name: str | None = None
        self.signal_at: float | None = None
        """``time.monotonic()`` when the first signal landed (job.observe.watchdog: a stop left unanswered)."""
        self.answered = False
        """Set by the loop once the ranks agreed to stop (it is saving and will exit)."""
        self.signals_received = 0
        self.where = "start-up"
        """What the loop is doing now (set by the loop, cheap): recorded when a signal lands."""
        self.busy: Callable[[], bool] = lambda: False
        """Whether a checkpoint write is in flight (e.g. CheckpointManager.in_flight); read when a signal lands."""
        self.received_during = ""
        self._previous: dict[int, object] = {}

    def install(self, signal_names: Iterable[str]) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "not on the main thread: signal handlers not installed; only the stop file %s works", self.stop_file
            )
            return
        for name in signal_names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag (and note where it landed): no I/O, no locks, no collectives in a handler.
        # A second signal (e.g. during the save) changes nothing but the count.
        self.signals_received += 1
        if self.signal_name is None:
            self.signal_at = time.monotonic()
            self.signal_name = signal.Signals(signum).name
            self.received_during = self.where + ("; a checkpoint write was in flight" if self.busy() else "")

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def discard_honoured(self) -> None:
        """Rank 0 of a fresh start: a request the previous attempt honoured must not stop this one; a
        request not yet honoured stays (it arrived during start-up) and stops the run at the first boundary."""
        if stop.discard_honoured(self.run_dir):
            log.info("removed %s: a stop request the previous attempt honoured", self.stop_file)
        elif self.stop_file.exists():
            log.warning(
                "%s exists: a stop request made before training started; this run saves and exits "
                "%d after its first step (delete the file to train on)",
                self.stop_file,
                EXIT_PREEMPTED,
            )

    def budget_spent(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def local(self) -> bool:
        return self.signal_name is not None or self.stop_file.exists() or self.budget_spent()

    def arrivals(self) -> Callable[[], bool]:
        """A flag that is set once a request arrives after this call: a signal, the stop file appearing, the time
        budget running out. A request already made does not set it (the final evaluation: job.train.loop.finish)."""
        signals, filed, spent = self.signals_received, self.stop_file.exists(), self.budget_spent()

        def arrived() -> bool:
            if self.signals_received > signals:
                return True
            return (not filed and self.stop_file.exists()) or (not spent and self.budget_spent())

        return arrived

    def reasons(self) -> list[bool]:
        """This rank's reasons to stop, one flag per ``job.cluster.stop.REASONS`` (agreed over the ranks with
        ``job.parallel.distributed.any_flags`` before the record is written)."""
        by = stop.requested_by(self.run_dir)
        mine = {"signal": self.signal_name is not None, "time-budget": self.budget_spent()}
        if by is not None:
            mine[by] = True
        return [mine.get(r, False) for r in stop.REASONS]

    def reason(self) -> str:
        if self.signal_name:
            return f"signal {self.signal_name}, received during {self.received_during}"
        if self.stop_file.exists():
            return f"stop file {self.stop_file}"
        if self.budget_spent():
            return "time budget: train.max_time spent"
        return "another rank's request"

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around the stop save and the record (``stop_save_running``)."""
        self.answered = True
        _STOP_SAVE.set()
        try:
            yield
        finally:
            _STOP_SAVE.clear()

    def record(self, step: int, reasons: list[bool]) -> None:
        """Rank 0, once the stop checkpoint of ``step`` is on storage: the stop record every launcher acts on
        (``job.cluster.stop.write_record``), and the STOP file's request, if there is one, marked honoured."""
        reason = next((r for r, f in zip(stop.REASONS, reasons, strict=True) if f), "signal")
        if stop.requested_by(self.run_dir) is not None:  # only a request is honoured: no file appears otherwise
            stop.mark_honoured(self.run_dir, step)
        stop.write_record(self.run_dir, step, reason)
