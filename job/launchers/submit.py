"""``ddp-job submit`` / ``python -m job.launchers.submit``: submit training to Slurm with submitit.

    ddp-job submit --nodes 2 --gpus-per-node 8 --partition gpu --time 240 -- --config configs/x.yaml
    ddp-job submit --gpus-per-node 0 --tasks-per-node 2 --sweep optim.lr=0.1,0.2 --wait -- --train.steps 50

One submitit task per GPU (CPU: ``--tasks-per-node``); each task is one rank and runs
``ddp-job train`` in-process (``job.cli.main``) with the env contract (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*) exported by
``submitit.helpers.TorchDistributedEnvironment`` (without its one-GPU-per-task CUDA_VISIBLE_DEVICES:
the trainer picks ``cuda:LOCAL_RANK`` itself and NCCL wants to see the peers' GPUs).

Preemption and time limits (why it is built like this):
* submitit asks Slurm for ``--signal=USR2@<signal-delay>`` (or ``SUBMITIT_PREEMPT_SIGNAL``) and installs
  a handler for it that, on global rank 0, calls ``checkpoint()``, runs ``scontrol requeue`` and exits
  at once. Left alone, that would throw away the steps since the last periodic checkpoint.
* So the task does not silently replace it but *chains* it: it takes that signal out of the trainer's
  ``--train.stop-signals`` (the trainer would overwrite the handler), and installs a handler that touches
  ``run_dir/STOP`` (every rank checks it at the next step boundary, all stop after the same step, rank 0
  saves). When training returns 143 ("saved, resume me"), rank 0 calls submitit's original handler,
  which calls ``checkpoint()`` (resubmit the same task: it resumes from the newest checkpoint on disk,
  so nothing is saved there and no collective runs) and requeues. If training has not returned within
  ``--preempt-grace`` seconds, an alarm calls submitit's handler anyway (the periodic checkpoints remain).
* SIGTERM (``scontrol requeue``/``scancel``/preemption by Slurm) stays a trainer stop signal: the ranks
  save and exit 143; Slurm requeues the job itself (or it was cancelled). A task that exits 143 writes
  no submitit result, so a requeued job is not mistaken for a finished one.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import submitit
from submitit.core import utils as submitit_utils

from job.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, BadInput, TrainingFailed
from job.launchers import stop
from job.launchers.stop import STOP_SIGNALS

DEFAULT_OUTPUT_DIR = Path("runs")
# The train flags that choose the run directory (both spellings load_config accepts) and what they set.
RUN_DIR_FLAGS = {"--run.output-dir": "output_dir", "--run.output_dir": "output_dir", "--run.name": "name"}


# ---------------------------------------------------------------- pure helpers (unit-testable)
def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """``"optim.lr=0.1,0.2"`` -> ``("optim.lr", ["0.1", "0.2"])``."""
    key, sep, values = spec.partition("=")
    items = [v for v in values.split(",") if v != ""]
    if not sep or not re.fullmatch(r"[a-z_]+\.[a-z0-9_-]+", key) or not items:
        raise BadInput(
            f"--sweep {spec!r} is not section.field=v1,v2,...",
            "write it as e.g. --sweep optim.lr=0.1,0.2.",
            setting="--sweep",
            value=spec,
        )
    return key, items


def sweep_runs(base_name: str, sweeps: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Cartesian product of the sweeps: one (run name, extra overrides) per job-array task."""
    parsed = [parse_sweep(s) for s in sweeps]
    if not parsed:
        return [(base_name, [])]
    runs = []
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in parsed]):
        suffix = "_".join(f"{k.split('.')[-1]}={v}" for k, v in combo)
        name = re.sub(r"[^A-Za-z0-9_.=-]", "-", f"{base_name}-{suffix}")
        runs.append((name, [a for k, v in combo for a in (f"--{k.replace('_', '-')}", v)]))
    return runs


def trainer_stop_signals(train_args: Sequence[str], submitit_signal: str) -> list[str]:
    """The override that leaves submitit's signal to submitit (the task chains it, see the module doc)."""
    for i, arg in enumerate(train_args):
        if arg.startswith("--train.stop-signals") or arg.startswith("--train.stop_signals"):
            value = arg.split("=", 1)[1] if "=" in arg else (train_args[i + 1] if i + 1 < len(train_args) else "")
            if submitit_signal in value:
                raise BadInput(
                    f"--train.stop-signals {value!r} includes {submitit_signal}, which submitit needs for "
                    "checkpoint-and-requeue.",
                    f"remove it (the submit task turns {submitit_signal} into the STOP file).",
                    setting="--train.stop-signals",
                    value=value,
                )
            return []  # the user's list stands
    return ["--train.stop-signals", ",".join(s for s in STOP_SIGNALS if s != submitit_signal)]


def split_run_dir_args(train_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Take the user's ``--run.output-dir`` / ``--run.name`` (``--x v`` or ``--x=v``, either spelling) out of
    the train arguments: ``{"output_dir": ..., "name": ...}`` for what was given, and the rest. Submit passes
    the run directory itself, once, so the directory it prints, watches and resumes is the one training uses.
    """
    rest: list[str] = []
    given: dict[str, str] = {}
    args = iter(train_args)
    for arg in args:
        flag, eq, value = arg.partition("=")
        key = RUN_DIR_FLAGS.get(flag)
        if key is None:
            rest.append(arg)
            continue
        if not eq:
            value = next(args, "")
        if not value or value.startswith("--"):
            raise BadInput(
                f"train argument {flag} has no value.",
                f"pass {flag} DIR (or {flag}=DIR), or leave it out.",
                setting=flag,
                value=value,
            )
        given[key] = value
    return rest, given


def _pick(option: str, own: Any, flag: str, given: str | None) -> Any:
    """The train argument wins over the default; both given and different is refused (which one was meant?)."""
    if given is None:
        return own
    if own is not None and Path(str(own)) != Path(given):  # Path: "runs/" and "runs" are one directory
        raise BadInput(
            f"ddp-job submit {option} {own} and the train argument {flag} {given} disagree.",
            f"give the run directory once: {option} or {flag}.",
            setting=flag,
            value=given,
        )
    return given


def run_dir_choice(args: argparse.Namespace, given: dict[str, str]) -> tuple[Path, str]:
    """``(output_dir, base run name)`` from submit's ``--output-dir``/``--name`` and the train arguments'
    ``--run.output-dir``/``--run.name`` (as slurm/train.sbatch: the train arguments win over the defaults)."""
    output_dir = _pick("--output-dir", args.output_dir, "--run.output-dir", given.get("output_dir"))
    name = _pick("--name", args.name, "--run.name", given.get("name"))
    if output_dir is None:
        output_dir = DEFAULT_OUTPUT_DIR
    if name is None:
        name = f"{args.job_name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    return Path(output_dir).resolve(), name


def run_argv(
    train_args: Sequence[str], output_dir: Path, name: str, extra: Sequence[str], submitit_signal: str
) -> list[str]:
    """The argv of ``job.train.run.main`` for one task (the run directory is fixed here, so a resubmitted
    task resumes the same run)."""
    return [
        *train_args,
        *extra,
        "--run.output-dir",
        str(output_dir),
        "--run.name",
        name,
        *trainer_stop_signals(train_args, submitit_signal),
    ]


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


# ---------------------------------------------------------------- the submitted callable
class TrainTask(submitit.helpers.Checkpointable):
    """One rank of a training run. Picklable state only: the argv and two numbers."""

    def __init__(self, argv: list[str], run_dir: str, preempt_grace_s: int = 60) -> None:
        self.argv = list(argv)
        self.run_dir = run_dir
        self.preempt_grace_s = preempt_grace_s

    def __call__(self) -> int:
        from job import cli  # heavy (torch, later): import in the job, not at submission

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
            code = cli.main(["train", *self.argv])  # errors printed and mapped to exit codes as by `ddp-job train`
        finally:
            chain.cancel_deadline()
        if code == EXIT_OK:
            return code
        if code == EXIT_PREEMPTED:
            sys.stdout.flush()
            sys.stderr.flush()
            if chain.requested and dist_env.rank == 0:
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
    """Turns submitit's signal into a stop request (job.launchers.stop) and calls submitit's handler after
    the save. The trainer runs in this process: the request it reads is the run directory's STOP file."""

    def __init__(self, signum: int, run_dir: Path, rank: int, grace_s: int) -> None:
        self.signum, self.run_dir, self.rank, self.grace_s = signum, run_dir, rank, grace_s
        self.requested = False
        self._submitit_handler: Any = None

    def install(self) -> None:
        self._submitit_handler = signal.getsignal(self.signum)
        signal.signal(self.signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # The one exception to "handlers only set a flag": the flag other ranks and nodes must see is a
        # file. One small write, no locks; the trainer acts on it at its next step boundary.
        self.requested = True
        try:
            stop.request(self.run_dir)
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
        print(f"submit task: training did not stop within {self.grace_s} s: requeueing now", flush=True)
        self.call_submitit(self.signum)

    def cancel_deadline(self) -> None:
        signal.alarm(0)

    def call_submitit(self, signum: int) -> None:
        signal.alarm(0)
        handler = self._submitit_handler
        if callable(handler):
            handler(signum, None)


# ---------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-job submit",
        allow_abbrev=False,
        description="Submit ddp-job training to Slurm with submitit. Unknown --section.field arguments "
        "(or everything after --) are ddp-job train overrides.",
    )
    a = p.add_argument
    a("--nodes", type=int, default=1, help="nodes (default 1)")
    a("--gpus-per-node", type=int, default=8, help="GPUs per node; one task (rank) per GPU; 0 = CPU (default 8)")
    a("--tasks-per-node", type=int, default=None, help="ranks per node when --gpus-per-node 0 (default 1)")
    a("--cpus-per-task", type=int, default=None, help="CPUs per rank (default: Slurm's)")
    a("--mem-gb", type=int, default=None, help="memory per node in GB (default: Slurm's)")
    a("--partition", default=None)
    a("--time", type=int, default=60, help="time limit in minutes (default 60)")
    a("--account", default=None)
    a("--qos", default=None)
    a("--job-name", default="ddp-job")
    a(
        "--log-folder",
        type=Path,
        default=Path("logs/submitit"),
        help="submitit folder: logs, pickles (default logs/submitit)",
    )
    a(
        "--output-dir",
        type=Path,
        default=None,
        help=f"run.output_dir (default: the train argument --run.output-dir, else {DEFAULT_OUTPUT_DIR})",
    )
    a(
        "--name",
        default=None,
        help="run.name (default: the train argument --run.name, else <job-name>-<UTC time>); "
        "a sweep appends the values",
    )
    a(
        "--sweep",
        action="append",
        default=[],
        metavar="SECTION.FIELD=V1,V2",
        help="one array task per value (repeat for a grid)",
    )
    a("--max-requeues", type=int, default=3, help="how often a timed-out job is resubmitted (default 3)")
    a(
        "--signal-delay",
        type=int,
        default=120,
        help="seconds before the time limit that Slurm sends the signal (default 120)",
    )
    a(
        "--preempt-grace",
        type=int,
        default=None,
        help="seconds training has to save after the signal before submitit requeues anyway (default signal-delay - 30)",
    )
    a(
        "--cluster",
        default=None,
        choices=["slurm", "local", "debug"],
        help="submitit backend (default: slurm when available)",
    )
    a("--wait", action="store_true", help="wait for the job(s); exit 0 only if all succeeded")
    return p


def _executor(args: argparse.Namespace) -> submitit.AutoExecutor:
    if args.gpus_per_node < 0 or args.nodes < 1:
        raise BadInput(
            f"--nodes {args.nodes} / --gpus-per-node {args.gpus_per_node}: need nodes >= 1 and gpus >= 0.",
            "pass --nodes 1 or more and --gpus-per-node 0 or more.",
            setting="--nodes/--gpus-per-node",
        )
    if args.gpus_per_node > 0 and args.tasks_per_node not in (None, args.gpus_per_node):
        raise BadInput(
            f"--tasks-per-node {args.tasks_per_node} with --gpus-per-node {args.gpus_per_node}: one task per GPU.",
            "drop --tasks-per-node.",
            setting="--tasks-per-node",
            value=args.tasks_per_node,
        )
    tasks = args.gpus_per_node or args.tasks_per_node or 1
    ex = submitit.AutoExecutor(folder=args.log_folder, cluster=args.cluster, slurm_max_num_timeout=args.max_requeues)
    params: dict[str, Any] = dict(name=args.job_name, nodes=args.nodes, tasks_per_node=tasks, timeout_min=args.time)
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    if args.cpus_per_task:
        params["cpus_per_task"] = args.cpus_per_task
    if args.mem_gb:
        params["mem_gb"] = args.mem_gb
    slurm = dict(
        slurm_partition=args.partition,
        slurm_account=args.account,
        slurm_qos=args.qos,
        slurm_signal_delay_s=args.signal_delay,
    )
    params.update({k: v for k, v in slurm.items() if v is not None})
    ex.update_parameters(**params)
    return ex


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, train_args = argv[:i], argv[i + 1 :]
        args = build_parser().parse_args(own)
    else:
        args, train_args = build_parser().parse_known_args(argv)
    usr_sig = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    usr_sig = usr_sig if usr_sig.startswith("SIG") else f"SIG{usr_sig}"
    train_args, given = split_run_dir_args(train_args)
    output_dir, base = run_dir_choice(args, given)
    runs = sweep_runs(base, args.sweep)
    grace = args.preempt_grace if args.preempt_grace is not None else max(args.signal_delay - 30, 10)
    tasks = [
        TrainTask(run_argv(train_args, output_dir, name, extra, usr_sig), str(output_dir / name), grace)
        for name, extra in runs
    ]
    ex = _executor(args)
    if len(tasks) == 1:
        jobs = [ex.submit(tasks[0])]
    else:
        with ex.batch():
            jobs = [ex.submit(t) for t in tasks]
    for job, (name, _) in zip(jobs, runs):
        print(f"submitted job {job.job_id} run_dir={output_dir / name} log={job.paths.stdout}", flush=True)
    if not args.wait:
        return EXIT_OK
    failed: dict[str, int] = {}
    for job in jobs:
        status = job_exit_code(job)
        print(f"job {job.job_id} done: exit={status}", flush=True)
        if status != EXIT_OK:
            failed[job.job_id] = status
    if failed:
        raise TrainingFailed(failed, {job.job_id: str(job.paths.stderr) for job in jobs})
    return EXIT_OK


def job_exit_code(job: submitit.Job) -> int:
    """The worst exit code of a finished job's tasks: each task's result is its training exit code (a failed
    one records it, see ``_end_failed``). A task without a result died before it could: 1."""
    try:
        return int(max(job.results()))
    except Exception as err:
        text = str(err).strip()
        last = text.splitlines()[-1] if text else repr(err)
        print(f"job {job.job_id} failed without an exit code: {last}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    # Import by module name so submitit pickles TrainTask by reference to job.launchers.submit, not __main__.
    from job.cli import main as _cli

    sys.exit(_cli(["submit", *sys.argv[1:]]))
