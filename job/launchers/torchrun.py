"""``ddp-job launch``: torchrun with the job as its only target, and the job's exit codes.

``ddp-job launch [torchrun options] [--] [train|doctor|evaluate] [args]`` is ``torchrun [options] -m job train [args]``
run in this process (torch's own option parser, so every torchrun option and every ``PET_*`` variable a
PyTorchJob pod carries work the same), except for the exit status. The first word after the torchrun
options may choose the worker command: ``train`` (the default) or ``doctor`` (the preflight checks under
the very same launcher, with its exit code kept: 0, 1 or 2). Plain torchrun exits 1 whatever its
workers returned; a launcher (Slurm requeue, Kubernetes ``restartPolicy: ExitCode``) needs to know
"preempted after saving: restart me" (143) from "bad input: do not retry" (2). See ``map_exit_codes``.

This process becomes torchrun's elastic agent; it is the launcher, so it may set agent-level variables
in its own environment (``os.environ``), which torch reads there and the workers inherit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from job.checkpoint import store as ckpt
from job.cluster import stop
from job.cluster.env import NOTICE_VAR, launcher_notice_s
from job.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, EXIT_TIMEOUT, BadInput

log = logging.getLogger("job.launchers.torchrun")

TARGET_MODULE = "job"
TARGET_COMMAND = "train"  # the default worker command
TARGET_COMMANDS = ("train", "doctor", "evaluate")  # what the first word after the torchrun options may choose

# Elastic restarts (--max-restarts > 0) with the c10d rendezvous break when the agents' rendezvous
# TCPStore is shared with the workers (torch's default since 2.5): the store outlives a restart, so the
# restarted workers read the previous round's process-group keys (gloo peer addresses, NCCL unique ids)
# and fail to connect or hang (pytorch#135712; its fix, a new store per round, pytorch#135957, is not in
# torch 2.14.1: DynamicRendezvousHandler.next_rendezvous still creates the shared store only once).
# Measured here on torch 2.14.1, two agents on loopback, one worker crashing once, --max-restarts 2: see
# tests/test_launch.py's docstring. With sharing disabled, rank 0 of each round starts a fresh store.
# The price: the agent then names the workers' MASTER_PORT by binding port 0 and closing it
# (torch.distributed.elastic.utils.distributed.get_free_port), and any process may take the port before
# rank 0's store binds it ("Address already in use"). A run whose workers cannot restart keeps torch's shared
# store, which the agent binds and holds, so it has no such window. Workers restart on --max-restarts > 0,
# and also, whatever --max-restarts says, when a node joins an elastic run (--nnodes MIN:MAX with MIN < MAX:
# torch's agent restarts the group on a membership change without counting it as a retry).
RESTART_ENV_DEFAULTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def agent_env_defaults(max_restarts: int, nnodes: str) -> dict[str, str]:
    """Environment defaults for torchrun's agent: an unshared rendezvous store only where workers can restart."""
    from torch.distributed.run import parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(nnodes)
    if max_restarts > 0 or min_nodes < max_nodes:
        return dict(RESTART_ENV_DEFAULTS)
    return {}


# Options that choose another program: the command is always ``python -m job train|doctor``.
_TARGET_OPTIONS = {"-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}


TORCHRUN_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


SHUTDOWN_DEFAULT_S = 30.0
"""torchrun's ``--shutdown-timeout`` when neither it nor TORCH_ELASTIC_SHUTDOWN_TIMEOUT is given."""


def worker_notice_s(shutdown_timeout: int | None, environ: Mapping[str, str]) -> float:
    """The stop notice the workers get: the agent SIGKILLs them its shutdown timeout after forwarding a stop
    signal, so the notice is that, or less where the launcher around the agent states less (DDP_JOB_NOTICE_S:
    the sbatch script's, the pod's)."""
    agent_s = SHUTDOWN_DEFAULT_S
    if shutdown_timeout is not None:
        agent_s = float(shutdown_timeout)
    elif environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip().isdigit():
        agent_s = float(environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    stated = launcher_notice_s(environ)
    if stated:
        return min(stated, agent_s)
    return agent_s


def with_stop_signals(signals_to_handle: str) -> str:
    """torchrun's ``--signals-to-handle`` with SIGUSR1/SIGUSR2 added, unless the user chose the list.

    torchrun's agent forwards only the listed signals to its workers; USR1/USR2 (Slurm ``--signal``,
    submitit) would otherwise kill the agent (their default action) and orphan the workers. Listed, the
    agent sends them to every worker, which saves at the next step boundary and exits 143, while the agent
    waits ``--shutdown-timeout`` seconds (default 30) before SIGKILL: one step plus one checkpoint write
    must fit in it (raise it with --shutdown-timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT). The run
    directory's STOP file remains the way for launchers that signal nothing but a shell (job.train.preempt).
    """
    if signals_to_handle.replace(" ", "") != TORCHRUN_DEFAULT_SIGNALS:
        return signals_to_handle
    return TORCHRUN_DEFAULT_SIGNALS + ",SIGUSR1,SIGUSR2"


def standalone_argv(nproc: int, train_argv: Sequence[str]) -> list[str]:
    """``ddp-job launch`` arguments for ``ddp-job train`` starting ``nproc`` workers on this machine."""
    return ["--standalone", "--nproc-per-node", str(nproc), "--", *train_argv]


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ddp-job launch"
    parser.usage = "ddp-job launch [torchrun options] [--] [train|doctor|evaluate] [args]"
    parser.description = (
        "torchrun [options] -m job train [args] (or -m job doctor [args] when the first word after the "
        "options is `doctor`), exiting with the job's codes: 143 if any worker was preempted after saving, "
        "else 2 if any had bad input, else 124 on a collective timeout, else the first failure's code. "
        "torchrun options also come from PET_* variables."
    )
    return parser


def split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(torchrun options, train args). Everything after ``--`` is for train; without ``--`` the train
    args start at the first word that is not a torchrun option or its value, as with torchrun itself."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    actions = parser._option_string_actions
    i = 0
    while i < len(argv):
        word = argv[i]
        name = word.split("=", 1)[0]
        action = actions.get(name) if word.startswith("-") else None
        if action is None:
            break
        # Flags (check_env, store_true, help) take no value; every other torchrun option takes exactly one.
        takes_value = action.nargs != 0 and "=" not in word
        i += 2 if takes_value else 1
    return argv[:i], argv[i:]


def split_command(job_args: Sequence[str]) -> tuple[str, list[str]]:
    """(worker command, its args): a leading ``train`` or ``doctor`` chooses the command, else ``train``.
    Unambiguous: train's own arguments are options (``--config``, ``--section.field``), never bare words."""
    job_args = list(job_args)
    if job_args and job_args[0] in TARGET_COMMANDS:
        return job_args[0], job_args[1:]
    return TARGET_COMMAND, job_args


def build_torchrun_args(argv: Sequence[str], module: str = TARGET_MODULE) -> argparse.Namespace:
    """Parse ``ddp-job launch`` arguments into torchrun's namespace with the worker command forced."""
    parser = _parser()
    options, job_args = split_argv(argv, parser)
    chosen = sorted({o.split("=", 1)[0] for o in options} & _TARGET_OPTIONS)
    if chosen:
        raise BadInput(
            f"ddp-job launch {' '.join(chosen)}: the worker command is always `python -m {module} {TARGET_COMMAND}` "
            f"(or `doctor`: `ddp-job launch [options] -- doctor [args]`).",
            "drop the option (use plain torchrun to run another program).",
            setting=chosen[0],
        )
    command, rest = split_command(job_args)
    args = parser.parse_args([*options, "--module", module, command, *rest])
    # PET_NO_PYTHON / PET_RUN_PATH in the environment would change the command behind our back.
    if args.no_python or args.run_path:
        raise BadInput(
            "PET_NO_PYTHON or PET_RUN_PATH is set: ddp-job launch always runs `python -m job train` (or doctor).",
            "unset PET_NO_PYTHON and PET_RUN_PATH.",
            setting="PET_NO_PYTHON/PET_RUN_PATH",
        )
    return args


def _code(exitcode: int) -> int:
    """A worker killed by signal N is reported as -N by Popen; shells and Kubernetes say 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def map_exit_codes(exitcodes: Iterable[int]) -> int:
    """The launch's exit code from the failed workers' codes, first failure first (Popen style: -N = signal N).

    Only a code a worker *returned* counts as preempted: 143 from a worker that saved. A worker *killed* by
    SIGTERM (-15, e.g. torchrun stopping the peers of a crashed rank) is a failure, not "resume me"."""
    codes = list(exitcodes)
    # "Resume me" only when every failed worker either saved-and-stopped or was a peer torchrun terminated
    # with SIGTERM afterwards; a rank that crashed (e.g. during the save) makes it a failure.
    if EXIT_PREEMPTED in codes and all(c in (0, EXIT_PREEMPTED, -15) for c in codes):
        return EXIT_PREEMPTED
    for wanted in (EXIT_BAD_INPUT, EXIT_TIMEOUT):
        if wanted in codes:
            return wanted
    failed = [c for c in codes if c != 0]
    return max(_code(failed[0]), EXIT_FAILURE) if failed else EXIT_FAILURE


def _describe(exitcode: int) -> str:
    """A worker's code as it ended: a returned 143 (it saved) is not a death by SIGTERM, whatever 128 + N says."""
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return str(exitcode)


def run_dir_of(job_args: Sequence[str], environ: Mapping[str, str]) -> Path | None:
    """The run directory of ``train`` with these arguments (None for ``doctor``, or if the config does not load:
    the workers report that themselves, with exit 2)."""
    command, rest = split_command(job_args)
    if command != "train":
        return None
    from job.config import load_config

    try:
        return load_config(rest, environ).run_dir
    except Exception:  # any config error is the workers' to report (exit 2)
        return None


def stop_saved(run_dir: Path | None) -> stop.Record | None:
    """The stop record of this attempt, if the checkpoint of its step is on storage (its manifest, written
    last, exists): only then does 143 tell the truth."""
    if run_dir is None:
        return None
    record = stop.read_record(run_dir)
    if record is None or not (run_dir / ckpt.step_dir_name(record.step) / ckpt.MANIFEST).is_file():
        return None
    return record


def confirm_preempted(result: int, run_dir: Path | None) -> tuple[int, str]:
    """(exit code, what to add to the message): 143 only with a stop save on storage, else 1 (a lost save)."""
    if result != EXIT_PREEMPTED:
        return result, ""
    record = stop_saved(run_dir)
    if record is not None:
        return EXIT_PREEMPTED, f"; stop save of step {record.step} ({record.reason})"
    if run_dir is None:
        return EXIT_FAILURE, "; no stop save for this attempt (no stop record in the run directory): the save was lost"
    written = stop.read_record(run_dir)
    if written is None:
        return EXIT_FAILURE, f"; no stop save for this attempt (no {stop.record_file(run_dir)}): the save was lost"
    return EXIT_FAILURE, (
        f"; no stop save for this attempt (the stop record names step {written.step}, whose checkpoint is not on "
        "storage): the save was lost"
    )


def signalled_result(exits: Sequence[int], run_dir: Path | None) -> tuple[int, str]:
    """(exit code, what to add to the message) after the launcher got a stop signal and its workers ended with
    ``exits``:

    * every worker returned 0: the signal came too late to stop them (the last step, the final evaluation or
      save) and the run is finished: 0;
    * a worker returned 143: it saved, and rank 0 wrote the stop record: 143 if the record's save is on storage;
    * the workers were killed by the signal before the attempt's first step was done (during start-up, before
      their handlers existed; no trained mark, ``job.cluster.stop.mark_trained``): nothing was lost since the
      newest checkpoint, which is the state they stopped at; the launcher writes the stop record of its step
      and says 143 (without a checkpoint, a fresh run lost nothing but it has no save: 1);
    * anything else lost the save: 1, never 128 + the signal.
    """
    if exits and all(c == EXIT_OK for c in exits):
        return EXIT_OK, "; the workers finished the run"
    if EXIT_PREEMPTED in exits:
        return confirm_preempted(EXIT_PREEMPTED, run_dir)
    resumed = _stopped_before_training(exits, run_dir)
    if resumed is not None:
        return EXIT_PREEMPTED, (
            f"; stopped during start-up, before the first step: nothing lost since the checkpoint of step {resumed}"
        )
    return EXIT_FAILURE, "; no worker returned 143 after saving: the save was lost"


def _stopped_before_training(exits: Sequence[int], run_dir: Path | None) -> int | None:
    """The step of the newest checkpoint if every worker was killed by a signal before this attempt's first step
    was done (the stop record of that step is then written here), else None."""
    if run_dir is None or not exits or any(c >= 0 for c in exits) or stop.trained(run_dir):
        return None
    latest = ckpt.find_latest(run_dir, hashes=False)
    if latest is None:
        return None
    stop.write_record(run_dir, latest.step, "signal")
    return latest.step


def _first_failure_order(failures: dict) -> list[int]:
    """Exit codes, first failure first. torchrun records failures in the order it saw them (the real
    failure, then the peers it terminated); timestamps have one-second resolution, so a stable sort by
    time keeps that order on ties."""
    return [f.exitcode for f in sorted(failures.values(), key=lambda f: f.timestamp)]


def launch_main(argv: Sequence[str], module: str = TARGET_MODULE) -> int:
    """Run torchrun's agent in this process; return the job's exit code. ``module`` exists for tests only."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        args = build_torchrun_args(argv, module)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    for name, value in agent_env_defaults(args.max_restarts, args.nnodes).items():
        os.environ.setdefault(name, value)
    os.environ.setdefault(stop.ATTEMPT_START_VAR, f"{time.time():.3f}")  # train.max_time counts from here
    args.signals_to_handle = with_stop_signals(args.signals_to_handle)
    # torch 2.11's agent has no --shutdown-timeout: it waits its fixed 30 s (SHUTDOWN_DEFAULT_S)
    shutdown_timeout = getattr(args, "shutdown_timeout", None)
    os.environ[NOTICE_VAR] = f"{worker_notice_s(shutdown_timeout, os.environ):g}"  # workers inherit it

    run_dir = run_dir_of(args.training_script_args, os.environ)
    if run_dir is not None:
        stop.clear_record(run_dir)  # this attempt's workers write their own
    exits: list[int] = []
    try:
        with _recording_worker_exits(exits):
            _run(args)
    except ChildFailedError as e:
        codes = _first_failure_order(e.failures)
        result, why = confirm_preempted(map_exit_codes(codes), run_dir)
        detail = ", ".join(f"rank {rank}: {_describe(f.exitcode)}" for rank, f in sorted(e.failures.items()))
        print(f"ddp-job launch: workers failed ({detail}){why}; exit code {result}", file=sys.stderr, flush=True)
        return result
    except SignalException as e:
        # torchrun forwarded the signal to the workers and waited for them (--shutdown-timeout).
        sig = int(e.sigval)
        result, why = signalled_result(exits, run_dir)
        print(
            f"ddp-job launch: got {signal.Signals(sig).name}; workers ended "
            f"[{', '.join(_describe(c) for c in exits)}]{why}; exit code {result}",
            file=sys.stderr,
            flush=True,
        )
        return result
    return EXIT_OK


def _run(args: argparse.Namespace) -> None:
    from torch.distributed.run import run

    run(args)


class _recording_worker_exits:  # noqa: N801 - used as a context manager, reads like one
    """Let torchrun's agent report its workers' exit codes after it shut them down.

    On SIGTERM the agent forwards the signal, waits, and raises SignalException without the codes, which
    decide between "saved, resume me" (143) and "killed" (128+N). The agent object is private to
    ``torch.distributed.launcher.api.launch_agent``, so for the duration of the run that module's
    ``LocalElasticAgent`` is a subclass whose ``_shutdown`` also records the codes into ``exits``
    (torch is pinned; tests/test_launch.py checks it against the real agent)."""

    def __init__(self, exits: list[int]) -> None:
        self.exits = exits

    def __enter__(self) -> None:
        import torch.distributed.launcher.api as launcher_api

        base = launcher_api.LocalElasticAgent
        exits = self.exits

        class RecordingAgent(base):  # type: ignore[misc, valid-type]
            def _shutdown(self, *a: Any, **kw: Any) -> Any:  # the base's signature
                try:
                    return super()._shutdown(*a, **kw)
                finally:
                    handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
                    codes = [h.proc.returncode for h in handlers.values() if h.proc.returncode is not None]
                    if codes:
                        exits[:] = codes

        self._module, self._base = launcher_api, base
        setattr(launcher_api, "LocalElasticAgent", RecordingAgent)  # noqa: B010 - replaces a class, not a value

    def __exit__(self, *exc: object) -> None:
        setattr(self._module, "LocalElasticAgent", self._base)  # noqa: B010
