"""The argument helpers of ``ddp-job submit`` (pure, unit-testable): sweeps, the run directory taken out of the
train arguments, each task's train argv and the trainer's stop signals."""

from __future__ import annotations

import argparse
import itertools
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from job.cluster.stop import STOP_SIGNALS
from job.config import location
from job.errors import BadInput

DEFAULT_OUTPUT_DIR = Path("runs")
# The train flags that choose the run directory (both spellings load_config accepts) and what they set.
RUN_DIR_FLAGS = {"--run.output-dir": "output_dir", "--run.output_dir": "output_dir", "--run.name": "name"}


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
        if key == "output_dir" and (problem := location.refusal(value)) is not None:
            raise BadInput(f"train argument {flag} {problem}.", setting=flag, value=value)
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
