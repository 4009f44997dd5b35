"""Preemption: signal early, act late.

Handlers only set a flag (saving inside a handler can deadlock: Lightning#21406). Two ways to ask a run
to stop, both checked at every step boundary:

* a signal in ``train.stop_signals`` delivered to the worker (SIGTERM/SIGINT reach torchrun workers);
* the stop file ``<run_dir>/STOP``, for signals torchrun does not forward to its workers (USR1/USR2 from
  Slurm's ``--signal``): the launch script traps them and touches the file.

Then all ranks agree with an all-reduce (MAX), so every rank stops after the same step, rank 0 saves, and
all exit with EXIT_PREEMPTED. Time budget: one step + one checkpoint write must fit before the launcher's
hard kill (torchrun: 30 s after SIGTERM; Slurm: the ``--signal`` lead time; Kubernetes:
terminationGracePeriodSeconds).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from types import FrameType

log = logging.getLogger("job")

STOP_FILE = "STOP"


class StopRequest:
    """Set by signal handlers or the stop file; read by the loop at step boundaries."""

    def __init__(self, run_dir: Path) -> None:
        self.stop_file = run_dir / STOP_FILE
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self, signal_names: Iterable[str]) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not on the main thread: signal handlers not installed; only the stop file %s works", self.stop_file)
            return
        for name in signal_names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: no I/O, no locks, no collectives in a handler.
        self.signal_name = signal.Signals(signum).name

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def clear_stale_file(self) -> None:
        """A STOP file from a previous (preempted) attempt must not stop the resumed run at once."""
        self.stop_file.unlink(missing_ok=True)

    def local(self) -> bool:
        return self.signal_name is not None or self.stop_file.exists()

    def reason(self) -> str:
        if self.signal_name:
            return f"signal {self.signal_name}"
        return f"stop file {self.stop_file}"
