"""``ddp-job`` / ``python -m job``: subcommands. Maps errors to the documented exit codes (job.errors)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence

from job.errors import EXIT_BAD_INPUT, TRACEBACK_ENV, run_command

USAGE = f"""usage: ddp-job COMMAND [ARGS]

commands:
  train        train (as a torchrun worker, a single process, or launching one process per GPU itself)
  evaluate     a checkpoint's exact validation metrics: ddp-job evaluate [train args] [--ckpt.path DIR]
               (the newest checkpoint of the run directory by default; any launcher, any world size)
  export       a checkpoint's model (or EMA) as one full safetensors file, for inference, fine-tuning or
               model.weights: ddp-job export --checkpoint RUN_OR_STEP_DIR --out model.safetensors [--ema]
  launch       torchrun drop-in: ddp-job launch [torchrun options] -- [train|doctor|evaluate] [args]; maps exit codes
  make-data    write a learnable ImageFolder dataset: ddp-job make-data --out DIR --classes 10 --per-class 100
               (--format webdataset: the same images as tar shards + index)
  config show  print the resolved config as YAML: ddp-job config show [--config PATH] [--section.field VALUE]
  submit       submit to Slurm with submitit: ddp-job submit --help
  doctor       preflight checks: ddp-job doctor [train args]
  bench        benchmarks: ddp-job bench NAME [--quick]

Every command takes --help. Add --traceback (or {TRACEBACK_ENV}=1) to see tracebacks of bad-input errors.
Exit codes: 0 ok, 1 failure, 2 bad input, 124 collective timeout, 143 preempted after saving (resume me).
"""


# Set by a launcher that already started one process per rank: never launch again underneath it.
_LAUNCHED_MARKERS = ("TORCHELASTIC_RUN_ID", "RANK", "SLURM_STEP_ID", "PET_NNODES")


def _self_launch_nproc(configured: int, environ: os._Environ[str] | dict[str, str]) -> int:
    """How many workers plain ``ddp-job train`` should start itself (1 = train in this process)."""
    if any(k in environ for k in _LAUNCHED_MARKERS):
        return 1
    if configured:
        return configured
    import torch

    return max(torch.cuda.device_count(), 1)


def _train(argv: list[str]) -> int:
    from job.train.run import main as train_main

    # entrypoint() leaves with os._exit: no slow teardown after a preemption save.
    return _worker("train", train_main, argv)


def _evaluate(argv: list[str]) -> int:
    from job.train.checkpoint_eval import main as evaluate_main

    return _worker("evaluate", evaluate_main, argv)


def _worker(command: str, worker_main: Callable[..., int], argv: list[str]) -> int:
    """A command every rank runs: in this process, or launching ``dist.nproc_per_node`` workers itself."""
    from job.config import load_config

    cfg = None
    if "--help" not in argv and "-h" not in argv:
        cfg = load_config(argv, command=command)
        nproc = _self_launch_nproc(cfg.dist.nproc_per_node, os.environ)
        if nproc > 1:
            from job.launchers import torchrun as launch

            return launch.launch_main(launch.standalone_argv(nproc, [command, *argv]))
    # The config parsed here is the worker's (parsed once).
    code: int = worker_main(argv, cfg=cfg)
    return code


def _doctor(argv: list[str]) -> int:
    from job.doctor.phases import main as doctor_main
    from job.train.run import preflight_probes

    return doctor_main(argv, preflight_probes())


def _config(argv: list[str]) -> int:
    if not argv or argv[0] != "show":
        print("usage: ddp-job config show [--config PATH] [--section.field VALUE ...]", file=sys.stderr)
        return EXIT_BAD_INPUT
    from job.config import dump_config, load_config

    print(dump_config(load_config(argv[1:])), end="")
    return 0


def _lazy(module: str, func: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        code: int = getattr(importlib.import_module(module), func)(argv)
        return code

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train,
    "evaluate": _evaluate,
    "export": _lazy("job.checkpoint.export", "main"),
    "config": _config,
    "launch": _lazy("job.launchers.torchrun", "launch_main"),
    "make-data": _lazy("job.data.datagen", "make_data_main"),
    "submit": _lazy("job.launchers.submit.command", "main"),
    "doctor": _doctor,
    "bench": _lazy("job.bench", "main"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_tb = "--traceback" in argv or os.environ.get(TRACEBACK_ENV) == "1"
    argv = [a for a in argv if a != "--traceback"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else EXIT_BAD_INPUT
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"ddp-job: unknown command {command!r}.\n\n{USAGE}", file=sys.stderr, end="")
        return EXIT_BAD_INPUT
    return run_command(command, COMMANDS[command], rest, show_tb)


def entrypoint() -> None:
    """Console-script / ``python -m job`` entry: run, flush, and leave without the interpreter's teardown.

    After a run, interpreter shutdown (joining DataLoader workers, finalising torch's modules) took 30-45 s
    per process on a loaded machine, a delay every launcher waits through on every attempt. Everything the
    job owns is closed and flushed explicitly by then; ``os._exit`` skips only the generic teardown.
    """
    code = main()
    workers = sys.modules.get("job.data.workers")
    if workers is not None:  # os._exit skips atexit: a worker blocked in I/O would outlive the job and hold its stdout
        workers.kill_workers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
