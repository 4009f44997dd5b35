"""Every exception type of ddp-job, the exit code each one ends a command with, and the one rule that
recognises a collective timeout raised by torch.

| code | name             | meaning                                                   | launcher action   |
|------|------------------|-----------------------------------------------------------|-------------------|
| 0    | EXIT_OK          | training finished                                         | done              |
| 1    | EXIT_FAILURE     | unexpected error (traceback printed)                      | restart may help  |
| 2    | EXIT_BAD_INPUT   | bad config / environment / data: nothing started/written  | do not retry      |
| 124  | EXIT_TIMEOUT     | a collective timed out: a peer stopped participating      | restart           |
| 143  | EXIT_PREEMPTED   | stopped on request after saving a checkpoint: resume me   | requeue / restart |

143 = 128 + SIGTERM: Kubernetes' ``restartPolicy: ExitCode`` retries codes >= 128 and fails the job for
1-127, so bad input (2) is permanent while a preempted job is restarted.

2 only before training starts: bad input found once the first step began (an image truncated mid-run) ends as
``FailedAfterStart`` (1), since checkpoints may be on storage; a transient I/O error of network storage (EIO,
ESTALE: ``TRANSIENT_ERRNOS``) is never bad input, before or after (``TransientIOError``, 1: retried).

Errors are data: each ``JobError`` carries ``what`` (what is wrong), ``fix`` (the remedy), ``exit_code`` and,
where one setting is to blame, ``setting`` and ``value``. ``str(err)`` renders "what. Fix: fix", the text
users see; code that needs a part reads the attribute, never the text. ``job.cli`` returns
``exit_code_of(err)`` for whatever a command raised.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_TIMEOUT = 124
EXIT_PREEMPTED = 143

TRACEBACK_ENV = "JOB_TRACEBACK"
"""Set to 1 to print tracebacks of errors that are shown without one (bad input); read by job.cli."""


class JobError(Exception):
    """Base of every ddp-job error.

    Args:
        what: what is wrong, naming the setting or variable and the bad value.
        fix: what the user should do about it ("" when nothing can be said).
        setting: the setting, variable or option to blame, if one is.
        value: its bad value.
    """

    exit_code: int = EXIT_FAILURE
    show_traceback: bool = True
    """Whether the CLI prints the traceback: for failures a developer may need to locate."""

    def __init__(self, what: str, fix: str = "", *, setting: str | None = None, value: Any = None) -> None:
        # One positional argument: torch's DataLoader and multiprocessing rebuild exceptions as cls(text).
        super().__init__(what)
        self.what = what
        self.fix = fix
        self.setting = setting
        self.value = value

    def __str__(self) -> str:
        if not self.fix:
            return self.what
        return f"{self.what} Fix: {self.fix}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the attributes without calling __init__ (subclasses take other arguments), so an error
        # crosses a process boundary (DataLoader workers, pickles) whole.
        return _rebuild, (type(self), self.__dict__)


def _rebuild(cls: type[JobError], state: dict[str, Any]) -> JobError:
    err = cls.__new__(cls)
    err.__dict__.update(state)
    err.args = (state.get("what", ""),)
    return err


class BadInput(JobError):
    """Bad config, environment or data, found before anything was started or written. The CLI prints the
    message without a traceback (``--traceback`` or JOB_TRACEBACK=1 add it) and exits 2."""

    exit_code = EXIT_BAD_INPUT
    show_traceback = False


class BadShard(BadInput):
    """A WebDataset shard (its path or URL in ``value``) that cannot be used: missing, truncated, not a tar, holding
    another sample count than its index says, or a sample without an image or label, with an undecodable image
    or a label outside ``[0, data.num_classes)``. Exits 2 like any bad input."""


class DoesNotFit(BadInput):
    """The estimated memory per device (job.parallel.memory) exceeds what the device has, where another
    ``train.strategy`` would fit: ``need_bytes`` and ``capacity_bytes`` say by how much. Exits 2."""

    def __init__(self, what: str, fix: str = "", *, need_bytes: int, capacity_bytes: int, **kwargs: Any) -> None:
        super().__init__(what, fix, **kwargs)
        self.need_bytes = need_bytes
        self.capacity_bytes = capacity_bytes


class UserCodeError(BadInput):
    """User code named in the config (``model.name`` or ``data.source`` as ``package.module:callable``) cannot be
    imported or called, or what it returned breaks the contract of docs/user-code.md. Found in preflight, on the
    first items, before any process group starts; a traceback of the user's own exception is chained
    (JOB_TRACEBACK=1 prints it)."""


class WeightsError(BadInput):
    """``model.weights`` cannot be loaded into the model: missing, corrupt, not a state dict, or of another
    architecture (the message names the first tensor that does not fit)."""


TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET})
"""Errors of network storage that a later try may not meet: never "bad input, do not retry"."""


def is_transient_io(err: BaseException) -> bool:
    """Whether ``err`` is an ``OSError`` whose errno says the storage, not the data, failed (``TRANSIENT_ERRNOS``)."""
    return isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS


class TransientIOError(JobError, RuntimeError):
    """Reading input failed with a transient storage error (``TRANSIENT_ERRNOS``): a failure (1) a launcher retries,
    not bad input."""


class FailedAfterStart(JobError, RuntimeError):
    """What would be bad input (2), met after training started: checkpoints may be on storage, so it ends as a
    failure (1), never as "nothing written, do not retry". ``what``, ``fix``, ``setting`` and ``value`` are the
    original error's."""

    show_traceback = False  # the original says all there is to say

    @classmethod
    def of(cls, err: BadInput, step: int) -> FailedAfterStart:
        return cls(
            f"{err.what} (met after training started, at step {step}: exit {EXIT_FAILURE}, not {EXIT_BAD_INPUT})",
            err.fix,
            setting=err.setting,
            value=err.value,
        )


class CollectiveTimeout(JobError, RuntimeError):
    """A collective timed out; the message says which rank(s) stalled (job.observe.observer)."""

    exit_code = EXIT_TIMEOUT


class DoctorFailed(JobError, RuntimeError):
    """A rendezvous/communication FAIL in train's doctor phase: a restart may help."""


class DataStall(JobError, RuntimeError):
    """The DataLoader workers delivered nothing within data.loader_timeout_s: this rank's input pipeline,
    not the network, so a failure (1), not a collective timeout."""


class CheckpointWriteError(JobError, RuntimeError):
    """A save failed (e.g. ENOSPC). Earlier checkpoints are untouched."""


class NonFiniteStateError(CheckpointWriteError):
    """The state to save holds NaN/Inf: refused, so no checkpoint ever holds non-finite values."""


class CheckpointLoadError(JobError, RuntimeError):
    """A checkpoint verified but cannot be loaded safely (weights_only=True refused it)."""


class CorruptCheckpointError(CheckpointLoadError):
    """Files of a checkpoint do not match the sha256 its manifest holds for them, as every rank agreed: a resume falls
    back to the checkpoint before it.

    Args:
        path: the checkpoint.
        found: what each rank found, e.g. ``"rank 1: shards/__1_0.distcp (item ...) does not match its sha256"``.
    """

    def __init__(self, path: Path, found: list[str]) -> None:
        super().__init__(
            f"checkpoint {path} is corrupt: {'; '.join(found)}.",
            f"move {path} out of the run directory to use the one before (nothing was deleted).",
        )
        self.path, self.found = path, list(found)


class EvaluationStopped(Exception):
    """The ranks agreed to stop between two validation batches (``job.train.evaluate``): the evaluation so far is
    discarded, and the training loop goes on to the stop save. Control flow, never an exit code."""

    def __init__(self, batches: int) -> None:
        super().__init__(f"evaluation stopped after {batches} batch(es)")
        self.batches = batches
        """The batches this rank had evaluated when the ranks agreed to stop."""


class CorruptShards(Exception):
    """Items (or ``.metadata``) of a sharded checkpoint that do not match their sha256, as every rank agreed
    while reading (``job.checkpoint.verified``); the loader turns it into ``CorruptCheckpointError``."""

    def __init__(self, found: list[str]) -> None:
        super().__init__("; ".join(found))
        self.found = found

    def __reduce__(self) -> tuple[Any, ...]:  # DCP pickles a rank's exception to every rank
        return (CorruptShards, (self.found,))


class NonFiniteError(JobError, RuntimeError):
    """More than train.max_nonfinite_skips optimizer updates were skipped for non-finite loss/gradients."""


class TrainingFailed(JobError, RuntimeError):
    """Submitted training jobs ended with non-zero exit codes; ``ddp-job submit --wait`` exits with the worst.

    Args:
        codes: exit code per failed job id.
        logs: where each job's log is, for the fix.
    """

    show_traceback = False  # the jobs' own logs hold the tracebacks

    def __init__(self, codes: dict[str, int], logs: dict[str, str]) -> None:
        listed = ", ".join(f"{job} (exit {code})" for job, code in codes.items())
        super().__init__(
            f"training failed in job(s) {listed}.", f"read the job log(s): {', '.join(logs[job] for job in codes)}."
        )
        self.codes = dict(codes)
        self.exit_code = max(codes.values())


class ReportFailed(Exception):
    """A progress-report sink (job.observe.status) could not deliver a status (unreachable, refused, no
    token...): logged, never fatal. ``permanent``: no later try can succeed (the sink is not tried again in
    this run)."""

    def __init__(self, sink: str, reason: str, permanent: bool = False) -> None:
        super().__init__(f"{sink}: {reason}")
        self.sink, self.reason, self.permanent = sink, reason, permanent


# A gloo collective that times out raises a plain RuntimeError (no torch type), with one of these texts:
# the operation that hit the timeout, and every later operation on the pair the timeout closed. Both
# measured with torch 2.14.1 (two gloo processes, one sleeping past dist.set_timeout).
_GLOO_TIMEOUT_TEXTS = ("Timed out waiting", "Application timeout caused pair closure")


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` is torch reporting that a collective (or the store behind it) timed out: a peer stopped
    participating.

    By type where torch gives one: ``DistBackendError`` (NCCL: the watchdog timed out the collective or
    aborted the communicator after a peer's failure; the type does not tell the two apart) and
    ``DistStoreError`` (a store wait or store-based barrier timed out). Gloo raises a plain ``RuntimeError``:
    for that type only, its two timeout texts decide (the fallback). Our own errors carry their exit code.
    """
    if isinstance(err, JobError):
        return isinstance(err, CollectiveTimeout)
    dist = sys.modules.get("torch.distributed")  # not imported: torch raised no distributed error
    if dist is not None and isinstance(err, (dist.DistBackendError, dist.DistStoreError)):
        return True
    return type(err) is RuntimeError and any(text in str(err) for text in _GLOO_TIMEOUT_TEXTS)


_LOADER_TIMEOUT_TEXT = "DataLoader timed out"  # torch/utils/data/dataloader.py, _try_get_data


def is_loader_timeout(err: BaseException) -> bool:
    """Whether ``err`` is torch's DataLoader reporting that its workers delivered no batch within the loader's
    timeout (``data.loader_timeout_s``). torch raises a plain ``RuntimeError`` for it: as for gloo's collective
    timeouts, for that type only its text decides."""
    return type(err) is RuntimeError and _LOADER_TIMEOUT_TEXT in str(err)


def exit_code_of(err: BaseException) -> int:
    """The exit code a command that raised ``err`` ends with: its ``exit_code`` for our errors, 124 for a
    collective timeout raised by torch, else 1."""
    if isinstance(err, JobError):
        return err.exit_code
    if is_collective_timeout(err):
        return EXIT_TIMEOUT
    return EXIT_FAILURE


def run_command(command: str, func: Callable[[list[str]], int], argv: list[str], show_tb: bool | None = None) -> int:
    """Run the command ``func(argv)`` and return its exit code: an error it raises is printed (ours that say
    all there is to say as one message, anything else with its traceback) and mapped by ``exit_code_of``.
    ``show_tb`` None: from a ``--traceback`` argument (taken out of ``argv``) or TRACEBACK_ENV=1."""
    if show_tb is None:
        show_tb = "--traceback" in argv or os.environ.get(TRACEBACK_ENV) == "1"
        argv = [a for a in argv if a != "--traceback"]
    try:
        return func(argv)
    except SystemExit as e:  # argparse/CliApp --help and usage errors
        return _exit_status(e.code)
    except Exception as e:
        _report(command, e, show_tb)
        return exit_code_of(e)


def _exit_status(code: object) -> int:
    """A ``SystemExit`` code as an exit status: None is success, a message (usage error) is bad input."""
    if isinstance(code, int):
        return code
    if code is None:
        return EXIT_OK
    return EXIT_BAD_INPUT


def _report(command: str, err: Exception, show_tb: bool) -> None:
    """Our errors that say all there is to say (bad input) as one message; anything else with its traceback."""
    if isinstance(err, JobError) and not err.show_traceback:
        if show_tb:
            traceback.print_exc()
        print(f"ddp-job {command}: error: {err}", file=sys.stderr, flush=True)
        return
    logging.getLogger("job").error("failed: %s", err)
    traceback.print_exc()
