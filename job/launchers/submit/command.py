"""The command line of ``ddp-job submit``: its options, the submitit executor they configure, and the
submission (and, with ``--wait``, the jobs' exit codes)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import submitit

from job.config import location
from job.errors import EXIT_FAILURE, EXIT_OK, BadInput, TrainingFailed
from job.launchers.submit.args import DEFAULT_OUTPUT_DIR, run_argv, run_dir_choice, split_run_dir_args, sweep_runs
from job.launchers.submit.task import TrainTask


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-job submit",
        allow_abbrev=False,
        description="Submit ddp-job training to Slurm with submitit. Unknown --section.field arguments "
        "(or everything after --) are ddp-job train overrides.",
    )
    _resources(p)
    _run_directory(p)
    _preemption(p)
    p.add_argument(
        "--cluster",
        default=None,
        choices=["slurm", "local", "debug"],
        help="submitit backend (default: slurm when available)",
    )
    p.add_argument("--wait", action="store_true", help="wait for the job(s); exit 0 only if all succeeded")
    return p


def _resources(p: argparse.ArgumentParser) -> None:
    """What the job asks Slurm for."""
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


def _run_directory(p: argparse.ArgumentParser) -> None:
    """Where submitit and the runs write, and the runs of a sweep."""
    a = p.add_argument
    a(
        "--log-folder",
        type=location.path_argument,
        default=Path("logs/submitit"),
        help="submitit folder: logs, pickles (default logs/submitit)",
    )
    a(
        "--output-dir",
        type=location.path_argument,
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


def _preemption(p: argparse.ArgumentParser) -> None:
    """Time limits and preemption: the signal, the grace period to save, the requeues."""
    a = p.add_argument
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
