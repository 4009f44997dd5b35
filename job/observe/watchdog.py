"""The in-job watchdog: a training step that makes no progress for a deadline shorter than the collective timeout
ends the job with the stall report and exit 124; a stop signal the loop leaves unanswered gets this rank's stacks.

Why not the collective timeout alone: on NCCL with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (torch's default 3,
torchrun's agent sets 1) NCCL's own watchdog aborts the process while the main thread is blocked in the collective,
so no Python exception ever reports which rank stalled. This thread reports first.

Why the stacks: a launcher that stops a job SIGKILLs it a grace period after its stop signal (torchrun's agent
30 s). A rank stuck outside a step (evaluation waiting for a loader that delivers nothing, a write that never
returns) never reaches the boundary where it would act on the signal, and would die without a trace of where.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed

from job.errors import EXIT_TIMEOUT
from job.observe.observer import stall_report

log = logging.getLogger("job")

DEADLINE_FRACTION = 0.8
"""The deadline as a fraction of ``dist.train_timeout_s``: early enough to report before NCCL aborts."""
UNANSWERED_STOP_S = 20.0
"""A stop signal after which the loop's position has not changed for this long gets the rank's Python stacks
written: within torchrun's 30 s between its SIGTERM and its SIGKILL."""


class Where(Protocol):
    where: str
    signal_at: float | None
    answered: bool


class Watchdog:
    """Armed around each training step (``armed``/``disarmed``): progress is a change of ``where.where`` (every
    micro-batch and boundary writes it). Evaluation and checkpoints run disarmed: they take as long as they take."""

    def __init__(self, where: Where, timeout_s: float, run_dir: Path, rank: int, world_size: int) -> None:
        self.where, self.run_dir, self.rank, self.world_size = where, run_dir, rank, world_size
        self.timeout_s = timeout_s
        self.deadline_s = timeout_s * DEADLINE_FRACTION
        self._armed = False
        self._seen = ""
        self._since = time.monotonic()
        self._unanswered: tuple[str, float] | None = None
        """(the loop's position, since when) once a stop signal has landed: how long the stop went unanswered."""
        self._stacks_written = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="job-watchdog", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self._seen, self._since = self.where.where, time.monotonic()
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.deadline_s / 10)):
            self._check_stop_answered(time.monotonic())
            if not self._armed:
                continue
            now, where = time.monotonic(), self.where.where
            if where != self._seen:
                self._seen, self._since = where, now
            elif now - self._since > self.deadline_s:
                self._expire(where, now - self._since)

    def _check_stop_answered(self, now: float) -> None:
        """Once a stop signal has landed and the loop has neither agreed to stop nor moved for
        ``UNANSWERED_STOP_S``: every thread's Python stack to stderr, once."""
        if self.where.signal_at is None or self.where.answered or self._stacks_written:
            return
        where = self.where.where
        if self._unanswered is None:  # the signal has just been seen: unanswered since it landed
            self._unanswered = (where, self.where.signal_at)
        if self._unanswered[0] != where:  # the loop moved on: it will reach the boundary that acts on it
            self._unanswered = (where, now)
            return
        if now - self._unanswered[1] < UNANSWERED_STOP_S:
            return
        self._stacks_written = True
        log.warning(
            "rank %d: a stop signal landed %.0f s ago and the loop has not moved on from %s since; if the "
            "launcher kills this rank now, this is where it was (every thread's Python stack):",
            self.rank, now - self.where.signal_at, where,
        )  # fmt: skip
        _flush_logs()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()

    def _expire(self, where: str, idle_s: float) -> None:
        log.error(
            "watchdog: rank %d made no progress for %.1f s in %s (deadline %.0f%% of dist.train_timeout_s=%g): "
            "a collective timed out. %s",
            self.rank, idle_s, where, 100 * DEADLINE_FRACTION, self.timeout_s,
            stall_report(self.run_dir, self.world_size),
        )  # fmt: skip
        _dump_flight_recorder(self.rank)
        _flush_logs()
        sys.stderr.flush()
        os._exit(EXIT_TIMEOUT)  # the main thread is blocked in the collective: only the process can end it


def _flush_logs() -> None:
    """Every log handler's buffer out before what follows; a handler whose stream is gone must not end the
    watchdog's thread before it has reported."""
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except (OSError, ValueError):
            continue


def _dump_flight_recorder(rank: int) -> None:
    """The NCCL flight recorder's buffer to its dump file: exiting first, the job would pre-empt NCCL's own dump."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if not prefix or not torch.distributed.is_initialized() or torch.distributed.get_backend() != "nccl":
        return
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined]  # not in the stubs

        Path(prefix + str(rank)).write_bytes(_dump_nccl_trace())
    except Exception as e:  # the stall report matters more than the dump: say why and go on to it
        log.warning("watchdog: no flight recorder dump (%s: %s)", type(e).__name__, e)
