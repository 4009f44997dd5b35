"""One torchrun worker of ``job/bench/memory.py``: ddp-job's real run under one strategy, a few optimizer steps,
then what this rank holds and the most memory it used.

    python -m job.bench.memory_worker OUT STEPS -- ARGS     (ARGS' train.steps: STEPS + 1 at least)

ARGS are ``ddp-job train`` arguments. The run is built as ``ddp-job train`` builds it (``job.train.run.preflight``,
``build_run``) and advanced by ``job.train.loop.iteration``. The estimate (job.parallel.memory) is taken from the
model preflight built, before it is sharded. Written to ``OUT.rankN`` as JSON: each step's wall seconds, the
state bytes this rank holds after the last step (local storage of parameters, gradients, optimizer state and EMA),
the peak RSS of the process and the RSS before the run was built, and on CUDA ``max_memory_allocated``.

Peaks by phase (job.bench.memory.PHASES): the high-water mark is reset as each phase starts and read as it ends,
so each is that phase's own peak, not the run's so far: ``build`` (preflight, the process group, the model built, wrapped or
sharded, the loaders: ``job.train.run.build_run``), ``first_step``, ``steps`` (the other timed steps and
the untimed one that measures the state) and ``save`` (one checkpoint, written and committed). The run's peak is the
largest of them (so it includes a save). RSS: Linux's ``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``
(Linux 4.0, proc(5)); CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from job.bench.memory import PHASES
from job.cluster.env import detect_env
from job.config import load_config
from job.observe import metrics
from job.parallel import distributed, memory
from job.train import loop
from job.train import run as job_run
from job.train.preempt import StopRequest


def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident set since it started or since the last ``reset_peak``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no VmHWM: the peak since the start


def reset_peak() -> bool:
    """Start a new high-water mark at the current resident set (and CUDA's peak); False where the kernel cannot."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return peak_rss_bytes() - rss_bytes() < 2**20  # a write that did nothing (a sandbox) leaves the old mark


@contextlib.contextmanager
def phase(name: str, peaks: dict[str, dict[str, int | bool]]) -> Iterator[None]:
    """Record into ``peaks[name]`` the resident set as the phase starts and its peak until it ends (CUDA: its
    ``max_memory_allocated``); ``reset``: whether the peak is the phase's own (else the process's so far)."""
    start = rss_bytes()
    reset = reset_peak()
    yield
    peaks[name] = {"start_rss_bytes": start, "peak_rss_bytes": peak_rss_bytes(), "reset": reset}
    if torch.cuda.is_available():
        peaks[name]["max_memory_allocated"] = torch.cuda.max_memory_allocated()


def steps_of(run: loop.Run, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if loop.iteration(run):
            raise SystemExit(f"stop requested ({run.stop.reason()}): benchmark aborted")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def held_before_update(run: loop.Run) -> dict[str, int]:
    """The state this rank holds at its fullest, as the optimizer step starts (the gradients reduced, not yet
    freed), measured in one more, untimed step."""
    parts = run.parts
    ema = None if parts.ema is None else parts.ema.module
    held: dict[str, int] = {}

    def measure(*_: object) -> None:
        held.update(memory.measured_state(parts.raw_model, parts.optimizer, ema))

    handle = parts.optimizer.register_step_pre_hook(measure)
    try:
        steps_of(run, 1)
    finally:
        handle.remove()
    return held


def main(argv: list[str]) -> int:
    split = argv.index("--")
    out, steps = argv[0], int(argv[1])
    rss_start = rss_bytes()
    started = peak_rss_bytes()  # the imports' peak, before the first reset
    phases: dict[str, dict[str, int | bool]] = {}
    cfg = load_config(argv[split + 1 :], os.environ)
    env = detect_env(os.environ)
    metrics.setup_console(env.rank, env.world_size)
    with contextlib.ExitStack() as cleanup:
        with phase("build", phases):
            pre = job_run.preflight(cfg, env)
            estimates = job_run.memory_estimates(cfg, env.world_size, pre.task, pre.checked, env.local_world_size)
            assert estimates is not None  # ddp or fsdp: the benchmark runs no other strategy
            rt = distributed.setup(env, cfg.dist)
            cleanup.callback(distributed.teardown)  # the last thing the stack undoes
            stop = StopRequest(cfg.run_dir)
            job_run.start_run_dir(cfg, env, pre.plan, stop, rt)
            run = job_run.build_run(cfg, env, pre, rt, stop, cleanup)
        with phase("first_step", phases):
            step_s = steps_of(run, 1)
        with phase("steps", phases):
            step_s += steps_of(run, steps - 1)
            held = held_before_update(run)  # one more, untimed step: its peak is a step's
        with phase("save", phases):
            run.checkpointer.save(run.state.step)
            run.checkpointer.manager.wait()
        assert tuple(phases) == PHASES, phases  # what job.bench.memory reads
        facts = {"rank": env.rank, "world_size": env.world_size, "strategy": cfg.train.strategy, "step_s": step_s}
        peak = max([started, *(int(p["peak_rss_bytes"]) for p in phases.values())])
        peaks = {"peak_rss_bytes": peak, "rss_start_bytes": rss_start, "held": held, "phases": phases}
        if torch.cuda.is_available():
            peaks["max_memory_allocated"] = max(int(p["max_memory_allocated"]) for p in phases.values())
        ddp, fsdp = estimates
        with open(f"{out}.rank{env.rank}", "w") as f:
            json.dump({**facts, **peaks, "estimate": {"ddp": asdict(ddp), "fsdp": asdict(fsdp)}}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
