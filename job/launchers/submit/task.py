"""The submitted task: one rank of a training run under submitit, with submitit's preemption signal chained
to the stop protocol (see the package docstring)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import submitit
from submitit.core import utils as submitit_utils

from job.cluster import stop
from job.errors import EXIT_OK, EXIT_PREEMPTED, BadInput, run_command
from job.train.preempt import stop_save_running


def node_address(name: str) -> str:
    """``name`` if it resolves, else the node's NodeAddr from ``scontrol show node`` (test clusters and
    some sites have node names that do not resolve)."""
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"\bNodeAddr=(\S+)", out)
    if not match:
        raise BadInput(
            f"node name {name!r} does not resolve and `scontrol show node {name}` shows no NodeAddr.",
            "fix the node's DNS/hosts entry.",
            setting="MASTER_ADDR",
            value=name,
        )
    return match.group(1)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class TrainTask(submitit.helpers.Checkpointable):
    """One rank of a training run. Picklable state only: the argv and two numbers."""

    def __init__(self, argv: list[str], run_dir: str, preempt_grace_s: int = 60) -> None:
        self.argv = list(argv)
        self.run_dir = run_dir
        self.preempt_grace_s = preempt_grace_s

    def __call__(self) -> int:
        from job.train.run import main as train_main  # heavy (torch): import in the job, not at submission

        dist_env = submitit.helpers.TorchDistributedEnvironment()
        # This process is the launcher of its rank, so setting its own environment is its job.
        # overwrite=True: a MASTER_ADDR inherited from the submitting shell must not win.
        dist_env.export(set_cuda_visible_devices=False, overwrite=True)
        os.environ["MASTER_ADDR"] = node_address(dist_env.master_addr)
        job_env = submitit.JobEnvironment()
        usr_sig = job_env._usr_sig()  # submitit's preemption signal (USR2 or SUBMITIT_PREEMPT_SIGNAL)
        run_dir = Path(self.run_dir)
        if dist_env.rank == 0:
            stop.begin_attempt(run_dir)  # this task starts a new attempt: an old request must not stop it
        chain = _SignalChain(usr_sig, run_dir, dist_env.rank, self.preempt_grace_s)
        chain.install()
        try:
            # Errors printed and mapped to exit codes as by `ddp-job train` (one rank: no self-launch here).
            code = run_command("train", train_main, self.argv)
        finally:
            chain.cancel_deadline()
        if code == EXIT_OK:
            return code
        if code == EXIT_PREEMPTED:
            sys.stdout.flush()
            sys.stderr.flush()
            # The stop record, not this task's own signal, says whether a stop save exists: a saved stop is
            # requeued whatever asked for it (submitit's signal, a STOP file, train.max_time), except a stop
            # signal to the trainer itself: that is Slurm's SIGTERM, and Slurm requeues or ends the job.
            record = stop.read_record(run_dir)
            if record is not None and record.reason != "signal" and dist_env.rank == 0:
                chain.call_submitit(usr_sig)  # checkpoint() + scontrol requeue + exit (or raises)
            # No result file: the job is being requeued (by submitit above or by Slurm after SIGTERM)
            # or was cancelled; a result would make the next attempt look finished.
            os._exit(EXIT_PREEMPTED)
        _end_failed(code)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        # Called by submitit on global rank 0 only, inside its signal handler: no collectives, no save.
        # The new job resumes from the newest complete checkpoint in run_dir.
        return submitit.helpers.DelayedSubmission(TrainTask(self.argv, self.run_dir, self.preempt_grace_s))


def _end_failed(code: int) -> NoReturn:
    """Record ``code`` as this task's result and leave the process with it.

    A task that raises reaches ``job.results()`` only as text (submitit pickles ``traceback.format_exc()``),
    so the exit code is written as the task's result instead, into submitit's result file, where
    ``job.results()`` returns it as a number. Exiting with the code keeps the Slurm job FAILED (``afterok``
    dependencies, accounting) and shows the code in ``sacct``.
    """
    paths = submitit.JobEnvironment().paths
    with submitit_utils.temporary_save_path(paths.result_pickle) as tmp:
        submitit_utils.cloudpickle_dump(("success", code), tmp)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _SignalChain:
    """Turns submitit's signal into a stop request (job.cluster.stop) and calls submitit's handler after
    the save. The trainer runs in this process: the request it reads is the run directory's STOP file."""

    def __init__(self, signum: int, run_dir: Path, rank: int, grace_s: int) -> None:
        self.signum, self.run_dir, self.rank, self.grace_s = signum, run_dir, rank, grace_s
        self._submitit_handler: Any = None

    def install(self) -> None:
        self._submitit_handler = signal.getsignal(self.signum)
        signal.signal(self.signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # The one exception to "handlers only set a flag": the flag other ranks and nodes must see is a
        # file. One small write, no locks; the trainer acts on it at its next step boundary.
        try:
            stop.request(self.run_dir, stop.SCHEDULER)
        except OSError as err:
            print(f"submit task: cannot write {stop.stop_file(self.run_dir)}: {err}", file=sys.stderr, flush=True)
        print(
            f"submit task rank {self.rank}: got {signal_name(signum)}: asking training to save via "
            f"{stop.stop_file(self.run_dir)}",
            flush=True,
        )
        if self.rank == 0 and self.grace_s > 0:
            signal.signal(signal.SIGALRM, self._on_deadline)
            signal.alarm(self.grace_s)

    def _on_deadline(self, signum: int, frame: FrameType | None) -> None:
        if stop_save_running():  # a requeue now would bring Slurm's SIGTERM into the save: it ends with 143 first
            print(f"submit task: {self.grace_s} s passed during the stop save: requeueing after it", flush=True)
            return
        print(f"submit task: training did not stop within {self.grace_s} s: requeueing now", flush=True)
        self.call_submitit(self.signum)

    def cancel_deadline(self) -> None:
        signal.alarm(0)

    def call_submitit(self, signum: int) -> None:
        signal.alarm(0)
        handler = self._submitit_handler
        if not callable(handler):
            return
        try:
            handler(signum, None)
        except subprocess.CalledProcessError as err:
            if not requeue_ended_by_slurm(err):
                raise
            # The requeue was accepted: Slurm ends this attempt by sending SIGTERM to every process of the job,
            # the `scontrol requeue` that asked for it included, which can die before it returns. Leave as
            # submitit does after a requeue it saw succeed (no result file: the next attempt resumes).
            print("submit task: scontrol requeue was ended by Slurm's SIGTERM: the job is being requeued", flush=True)
            sys.exit(-1)


def requeue_ended_by_slurm(err: subprocess.CalledProcessError) -> bool:
    """Whether submitit's ``scontrol requeue`` died of the SIGTERM with which Slurm ends a job it requeues."""
    return err.returncode == -signal.SIGTERM and list(err.cmd)[:2] == ["scontrol", "requeue"]
