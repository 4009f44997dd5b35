"""One torchrun worker of ``job/bench/paired.py``: ddp-job's real loop and the bare DDP step, in alternating
blocks in the same process.

    [ABLATE=clip,...] python -m job.bench.paired_worker OUT PAIRS BLOCK [bare-bucket-view] [bare-first] -- ARGS

ARGS are ``ddp-job train`` arguments. ``bare-first`` builds the bare loop's model and optimizer before the trainer's
(allocation order decides where each side's tensors lie in memory).

The trainer's ``Run`` is built by ``job.train.run.build_run`` (as ``ddp-job train`` builds it) and advanced by
``job.train.loop.iteration`` (what its loop runs). The bare step (``job.bench.bare_ddp.BareLoop``) has its own
model, DDP wrapper and optimizer. Blocks are BLOCK steps long; the trainer logs and gathers its statistics at
its own ``log.every`` cadence, counted in its own steps, as in a real run. Pairs alternate their order
(job-bare, bare-job, ...) so neither kind always follows the other. Each block's wall seconds and this rank's CPU seconds (all its
threads) go to OUT as JSON, one file per rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

import torch

from job.bench import ablate_train
from job.bench.bare_ddp import BareLoop
from job.cluster.env import detect_env
from job.config import JobConfig, load_config
from job.config.plan import Plan
from job.observe import metrics
from job.parallel import distributed
from job.train import loop
from job.train import run as job_run
from job.train.preempt import StopRequest


def timed(fn: Any, steps: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``steps`` calls of ``fn(i)``."""
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        fn(i)
    if torch.cuda.is_available():  # neither loop syncs per step: the block ends when the device is done
        torch.cuda.synchronize()
    return time.perf_counter() - w0, time.process_time() - c0


def alternate(run: loop.Run, bare: BareLoop, pairs: int, block: int) -> list[dict[str, float]]:
    def job_step(_: int) -> None:
        if loop.iteration(run):
            raise SystemExit(f"stop requested ({run.stop.reason()}): benchmark aborted")

    blocks = []
    for p in range(pairs):
        order = ("job", "bare") if p % 2 == 0 else ("bare", "job")
        row: dict[str, float] = {"pair": p}
        for kind in order:
            wall, cpu = timed(job_step if kind == "job" else bare.step, block)
            row[f"{kind}_wall_s"], row[f"{kind}_cpu_s"] = wall / block, cpu / block
        blocks.append(row)
    return blocks


def bare_loop(cfg: JobConfig, plan: Plan, rt: distributed.Runtime, bucket_view: bool) -> BareLoop:
    """The bare step for the trainer's work: its model, image size, micro-batch, device, format, precision."""
    return BareLoop(
        cfg.model.name,
        cfg.data.image_size,
        plan.micro_batch_size,
        rt.device,
        channels_last=cfg.model.channels_last,
        bf16=cfg.train.precision == "bf16",
        gradient_as_bucket_view=bucket_view,
    )


def main(argv: list[str]) -> int:
    split = argv.index("--")
    own, train_args = argv[:split], argv[split + 1 :]
    out, pairs, block = own[0], int(own[1]), int(own[2])
    bare_view, bare_first = "bare-bucket-view" in own[3:], "bare-first" in own[3:]
    ablate_train.apply(os.environ.get("ABLATE", ""))  # job/bench/ablate_train.py: extras switched off
    cfg = load_config(train_args, os.environ)
    env = detect_env(os.environ)
    metrics.setup_console(env.rank, env.world_size)
    pre = job_run.preflight(cfg, env)
    rt = distributed.setup(env, cfg.dist)
    try:
        stop = StopRequest(cfg.run_dir)
        job_run.start_run_dir(cfg, env, pre.plan, stop, rt)
        with contextlib.ExitStack() as cleanup:
            if bare_first:
                bare = bare_loop(cfg, pre.plan, rt, bare_view)
                run = job_run.build_run(cfg, env, pre, rt, stop, cleanup)
            else:
                run = job_run.build_run(cfg, env, pre, rt, stop, cleanup)
                bare = bare_loop(cfg, pre.plan, rt, bare_view)
            blocks = alternate(run, bare, pairs, block)
        with open(f"{out}.rank{env.rank}", "w") as f:
            facts = {"rank": env.rank, "world_size": env.world_size, "job_steps": run.state.step}
            json.dump({**facts, "blocks": blocks, "torch": torch.__version__}, f)
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
