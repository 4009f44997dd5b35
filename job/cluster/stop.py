"""The stop protocol that the trainer and every launcher share: which signals ask a run to stop, and the
run directory's STOP file for launchers that can only run a shell command (or a person with ``touch``).

A stop request, however it arrives, makes every rank stop after the same step, save, and exit 143
(``job.train.preempt`` turns signals into a flag; the loop reads both as each step starts and the ranks agree
at that step's boundary).

``<run_dir>/STOP`` has three states::

    absent ──request()──> requested ──(trainer saves after the next step it starts)──> honoured
       ^                      │                                                            │
       └── begin_attempt() ───┴──── (a launcher starting a new attempt) ───────────────────┘
       └── discard_honoured() ─────────────────────────── (a trainer starting afresh) ─────┘

* ``request`` creates the file, empty. Anyone may call it: ``slurm/train.sbatch``'s USR1/USR2 trap (as a
  shell ``: > STOP``), the submit task on submitit's signal, a person.
* The trainer stops when the file exists, and after the checkpoint is on disk rank 0 writes the honoured
  mark into it (``mark_honoured``). Nothing ever re-touches the file.
* A trainer starting afresh removes only an honoured file, a finished request from the previous attempt. It
  keeps a requested one: that request arrived while the job was starting (the signal won the race against
  the trainer's start-up), and it is honoured after the first step.
* A worker group that torchrun restarted (``--max-restarts``) and that finds the file in any state exits
  143 at once without training: its node is being drained.
* A launcher that starts a new attempt of a job (the sbatch script, the submit task) removes the file in
  any state first (``begin_attempt``), so a request left by an attempt that was killed before it could
  honour it does not stop the new one.

Whatever asked for the stop (a signal, the file, ``train.max_time``, a scheduler), rank 0 writes the stop
record ``<run_dir>/STOPPED`` once the stop save is on storage (``write_record``): launchers requeue on it and
exit 143 only with it (the stop contract, docs/design.md).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

STOP_FILE = "STOP"
HONOURED = "honoured"
"""The first word that ``mark_honoured`` writes into the file; ``slurm/train.sbatch`` never writes it."""

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
"""The default ``train.stop_signals``: what launchers send to ask for save-and-exit (Slurm's ``--signal``,
submitit: USR1/USR2; Kubernetes, ``scancel``, torchrun: TERM; a terminal: INT). DataLoader workers ignore
them (their trainer handles them)."""

SIGNAL_NAMES = (*STOP_SIGNALS, "SIGHUP", "SIGQUIT")
"""Every signal ``train.stop_signals`` may list: the defaults plus the rest of what torchrun forwards."""


def stop_file(run_dir: Path) -> Path:
    return run_dir / STOP_FILE


SCHEDULER = "scheduler"
"""What a scheduler's request writes into the STOP file (the sbatch trap, the submit task): the record's reason
is then ``scheduler``; an empty file (a person's ``touch``) is ``stop-file``."""


def request(run_dir: Path, by: str = "") -> None:
    """Ask the run in ``run_dir`` to stop after the next step it starts (creates the directory if needed);
    ``by`` is ``SCHEDULER`` for a scheduler's request, else empty."""
    run_dir.mkdir(parents=True, exist_ok=True)
    stop_file(run_dir).write_text(by)


def requested_by(run_dir: Path) -> str | None:
    """The reason of a request in the STOP file (``scheduler`` or ``stop-file``), None without a request."""
    try:
        text = stop_file(run_dir).read_text().strip()
    except OSError:
        return None
    if text.startswith(HONOURED):
        return None
    if text == SCHEDULER:
        return "scheduler"
    return "stop-file"


def is_honoured(run_dir: Path) -> bool:
    try:
        return stop_file(run_dir).read_text().startswith(HONOURED)
    except OSError:
        return False


def mark_honoured(run_dir: Path, step: int) -> None:
    """Rank 0, after the stop checkpoint of ``step`` is on disk: the request is done."""
    stop_file(run_dir).write_text(f"{HONOURED} step={step}\n")


def discard_honoured(run_dir: Path) -> bool:
    """A trainer starting afresh: remove the file if it is an honoured request; True if it did."""
    if is_honoured(run_dir):
        stop_file(run_dir).unlink(missing_ok=True)
        return True
    return False


def begin_attempt(run_dir: Path) -> None:
    """A launcher starting a new attempt of a job: no request or record of an earlier attempt may stop or
    speak for this one."""
    stop_file(run_dir).unlink(missing_ok=True)
    clear_record(run_dir)


RECORD_FILE = "STOPPED"
"""``<run_dir>/STOPPED``: why and where the run stopped, written by rank 0 once the stop save is on storage.
One line, ``step=<step> reason=<reason>``: ``slurm/train.sbatch`` reads it with ``sed`` (it cannot import
this module; tests/test_slurm_golden.py checks that it reads what ``write_record`` writes)."""

REASONS = ("signal", "stop-file", "time-budget", "scheduler")
"""Why a run stopped: a stop signal, the STOP file (a person or a shell launcher), ``train.max_time`` spent,
or a scheduler's request (submitit's signal, which the submit task turns into the STOP file)."""


@dataclass(frozen=True)
class Record:
    step: int
    reason: str


def record_file(run_dir: Path) -> Path:
    return run_dir / RECORD_FILE


def write_record(run_dir: Path, step: int, reason: str) -> None:
    """Rank 0, after the stop checkpoint of ``step`` is on storage (atomic: a reader sees all or nothing)."""
    if reason not in REASONS:
        raise ValueError(f"stop reason {reason!r} is not one of {REASONS}")
    tmp = record_file(run_dir).with_name(f".{RECORD_FILE}.tmp-{os.getpid()}")
    tmp.write_text(f"step={step} reason={reason}\n")
    os.replace(tmp, record_file(run_dir))


def read_record(run_dir: Path) -> Record | None:
    """The run's stop record, None if there is none (or it is not one that ``write_record`` wrote)."""
    try:
        fields = dict(kv.split("=", 1) for kv in record_file(run_dir).read_text().split())
        return Record(int(fields["step"]), fields["reason"])
    except (OSError, ValueError, KeyError):
        return None


def clear_record(run_dir: Path) -> None:
    """A trainer or launcher starting an attempt: a record is only ever about the attempt that wrote it (the
    stop record and the trained mark)."""
    record_file(run_dir).unlink(missing_ok=True)
    trained_file(run_dir).unlink(missing_ok=True)


TRAINED_FILE = "TRAINED"
"""``<run_dir>/TRAINED``: ``step=<step>``, written by rank 0 once the first step of an attempt is done. A launcher
whose workers were killed by its signal before any step (during start-up, before their handlers existed) finds
none, and knows that nothing was lost since the newest checkpoint (``job.launchers.torchrun``)."""


def trained_file(run_dir: Path) -> Path:
    return run_dir / TRAINED_FILE


def mark_trained(run_dir: Path, step: int) -> None:
    """Rank 0, at the boundary of the first step of an attempt: from now on a kill loses steps."""
    trained_file(run_dir).write_text(f"step={step}\n")


def trained(run_dir: Path) -> bool:
    """Whether this attempt took a step (``mark_trained``)."""
    return trained_file(run_dir).is_file()


ATTEMPT_START_VAR = "DDP_JOB_ATTEMPT_START"
"""When this attempt started (Unix time, seconds): set by ``ddp-job launch`` as it starts, unless a launcher around it
set it earlier, and inherited by every worker, a torchrun restart's too. ``train.max_time`` counts from it, so
start-up under a launcher, a container or a slow rendezvous is counted, and a restart gets no new budget."""


def _stop_signums() -> list[int]:
    return [getattr(signal, name) for name in STOP_SIGNALS]


def block_stop_signals() -> set[int]:
    """Hold the stop signals pending in the calling thread (a forked child inherits the mask); returns the
    mask before, for ``unblock_stop_signals``. Wrapped around the start of DataLoader workers: see
    ``ignore_stop_signals``."""
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, _stop_signums()))


def unblock_stop_signals(before: set[int] | None = None) -> None:
    """Deliver the stop signals held by ``block_stop_signals`` (all of them, or those not blocked ``before``)."""
    signums = [s for s in _stop_signums() if before is None or s not in before]
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: worker processes ignore the stop signals; their trainer handles them.

    torchrun's agent delivers a signal with ``killpg`` to each rank's process group, which includes the
    rank's DataLoader workers. A worker killed by it makes the DataLoader raise ("worker ... is killed by
    signal: Terminated") in the trainer before it reaches the step boundary and saves. Workers still
    exit with their trainer (DataLoader's parent watchdog) and on SIGKILL.

    torch installs its own SIGTERM handler in a worker before it calls ``worker_init_fn``
    (torch/utils/data/_utils/worker.py), and that handler kills the worker on a SIGTERM that its parent did
    not send: a group signal landing while the workers start. So the trainer starts its workers with the stop
    signals blocked (``block_stop_signals``, inherited through fork): a signal in that window stays pending
    in the worker, is discarded here when its disposition becomes "ignore", and only then are they unblocked.
    """
    for signum in _stop_signums():
        signal.signal(signum, signal.SIG_IGN)
    unblock_stop_signals()
