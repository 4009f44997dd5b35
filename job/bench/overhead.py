"""Overhead: steps/s of ``ddp-job train`` vs a bare hand-written DDP loop and vs Lightning's Trainer.

Same work in all three (model, synthetic data, batch, precision, memory format, SGD momentum), launched by
the same torchrun on gloo (nccl on a GPU), 1 and 2 processes. Runs are interleaved A/B/C per repetition
(the order rotates), the first ``--warmup`` steps are discarded, and each repetition gives a ratio of
adjacent runs; the ratios' median and spread are the result. ddp-job's step time is what it logs
(TensorBoard ``perf/step_time_s``); its ``wall`` time also counts what happens between logged steps
(stop-flag all-reduce, observer, logging), from the TensorBoard event wall times. ``cpu`` is CPU seconds per
step of the busiest rank's process (all threads, every iteration of the loop): on a shared or loaded machine
wall times move with the neighbours' load, CPU seconds far less, so ``ratio_cpu_vs_bare`` is the comparison
that can tell 0.99 from 0.96 there.

    ddp-job bench overhead [--quick] [--nprocs 1,2] [--reps 5] [--lightning auto|on|off]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common

HERE = Path(__file__).resolve().parent


def job_times(run_dir: Path, warmup: int, log_every: int) -> tuple[list[float], list[float]]:
    """(logged step times, wall seconds per step) of the windows after ``warmup`` steps."""
    ev = common.scalars(run_dir, "perf/step_time_s")
    logged = [v for step, v, _ in ev if step - log_every >= warmup]
    wall = [(w1 - w0) / (s1 - s0) for (s0, _, w0), (s1, _, w1) in itertools.pairwise(ev) if s0 >= warmup]
    return logged, wall


def job_cpu(run_dir: Path, warmup: int, log_every: int) -> float:
    """Median over the windows after ``warmup`` of the busiest rank's CPU seconds per step (the observer's)."""
    ev = common.scalars(run_dir, "perf/cpu_s_per_step_max")
    return statistics.median(v for step, v, _ in ev if step - log_every >= warmup)


def window_medians(times: list[float], k: int) -> float:
    """The trainer's estimator for a per-step series: the mean of each window of ``k`` steps, their median."""
    return statistics.median(statistics.fmean(times[i : i + k]) for i in range(0, len(times) - k + 1, k))


def bare_cpu(per_rank: list[list[float]], warmup: int, k: int) -> float:
    """The job_cpu estimator for the bare loop: per window the busiest rank's mean, median over windows."""
    windows = []
    for i in range(warmup, len(per_rank[0]) - k + 1, k):
        windows.append(max(statistics.fmean(cpu[i : i + k]) for cpu in per_rank))
    return statistics.median(windows)


def run_variant(kind: str, nproc: int, a: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    env = common.child_env(tmp)
    timeout = a.timeout
    if kind == "job":
        run_dir = tmp / "runs" / tag
        args = common.workload_train_args(run_dir, a, a.steps, ["--log.every", str(a.log_every)])
        common.run(common.torchrun_cmd(nproc, ["-m", "job", "train", *args]), env, timeout)
        logged, wall = job_times(run_dir, a.warmup, a.log_every)
        return {
            "step_s": statistics.median(logged),
            "wall_step_s": statistics.median(wall),
            "cpu_s": job_cpu(run_dir, a.warmup, a.log_every),
            "n": len(logged),
        }
    out = tmp / f"{tag}.json"
    script = HERE / ("bare_ddp.py" if kind == "bare" else "lightning_ref.py")
    ref = [
        "--model",
        a.model,
        "--image-size",
        str(a.image_size),
        "--batch",
        str(a.batch),
        "--steps",
        str(a.steps),
        "--precision",
        a.precision,
        "--out",
        str(out),
    ] + (["--channels-last"] if a.channels_last else [])
    common.run(common.torchrun_cmd(nproc, [str(script), *ref]), env, timeout)
    result = json.loads(out.read_text())
    # The same estimator as ddp-job's logged step time: the mean of each window of log_every steps, then the
    # median over windows (a median of single steps would drop the slow tail that a window mean keeps).
    measured = {"step_s": window_medians(result["step_times"][a.warmup :], a.log_every)}
    if "cpu_times_per_rank" in result:
        measured["cpu_s"] = bare_cpu(result["cpu_times_per_rank"], a.warmup, a.log_every)
    return measured


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ddp-job bench overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_workload_args(p)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument(
        "--lightning",
        default="auto",
        choices=("auto", "on", "off"),
        help="auto: run it when installed (pip install 'ddp-job[bench]'); on: required",
    )
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    common.resolve_workload(a)
    q = a.quick
    a.steps = a.steps or (6 if q else 30)
    a.warmup = a.warmup if a.warmup is not None else (2 if q else 5)
    a.log_every = a.log_every or (1 if q else 5)
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    have_l = importlib.util.find_spec("lightning") is not None
    if a.lightning == "on" and not have_l:
        print(
            "bench overhead: --lightning on but lightning is not installed. Fix: pip install 'ddp-job[bench]' "
            "(or pass --lightning off).",
            flush=True,
        )
        return 2
    kinds = ["job", "bare"] + (["lightning"] if a.lightning != "off" and have_l else [])
    with tempfile.TemporaryDirectory(dir=a.workdir) as d:
        tmp = Path(d)
        per: dict[str, dict[str, list[dict[str, Any]]]] = {str(n): {k: [] for k in kinds} for n in a.nprocs}
        for rep in range(a.reps):
            for n in a.nprocs:
                order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]  # rotate who runs first
                for k in order:
                    per[str(n)][k].append(run_variant(k, n, a, tmp, f"{k}-n{n}-r{rep}"))
                    common.emit_point("overhead", {"variant": k, "nprocs": n, "rep": rep, **per[str(n)][k][-1]})
    result: dict[str, Any] = {
        "quick": a.quick,
        "config": {
            k: getattr(a, k)
            for k in (
                "model",
                "image_size",
                "batch",
                "precision",
                "channels_last",
                "steps",
                "warmup",
                "reps",
                "log_every",
            )
        },
        "lightning": "lightning" in kinds,
        "nprocs": {},
    }
    rows = []
    for n, runs in per.items():
        r: dict[str, Any] = {k: common.median_spread(x["step_s"] for x in v) for k, v in runs.items()}
        r["job_wall"] = common.median_spread(x["wall_step_s"] for x in runs["job"])
        # ratio of steps/s (>1 = ddp-job faster), one per repetition from adjacent runs
        r["ratio_vs_bare"] = common.median_spread(b["step_s"] / j["step_s"] for j, b in zip(runs["job"], runs["bare"]))
        r["ratio_wall_vs_bare"] = common.median_spread(
            b["step_s"] / j["wall_step_s"] for j, b in zip(runs["job"], runs["bare"])
        )
        # CPU seconds per step do not grow when other processes take the cores: the load-robust ratio
        r["job_cpu"] = common.median_spread(x["cpu_s"] for x in runs["job"])
        r["bare_cpu"] = common.median_spread(x["cpu_s"] for x in runs["bare"])
        r["ratio_cpu_vs_bare"] = common.median_spread(
            b["cpu_s"] / j["cpu_s"] for j, b in zip(runs["job"], runs["bare"])
        )
        if "lightning" in runs:
            r["ratio_vs_lightning"] = common.median_spread(
                lt["step_s"] / j["step_s"] for j, lt in zip(runs["job"], runs["lightning"])
            )
        result["nprocs"][n] = r
        for k in [*kinds, "job_wall", "job_cpu", "bare_cpu"]:
            rows.append([n, k, common.fmt_ms(r[k], 1000, " ms"), f"{1 / r[k]['median']:.2f}"])
        for k in ("ratio_vs_bare", "ratio_wall_vs_bare", "ratio_cpu_vs_bare", "ratio_vs_lightning"):
            if k in r:
                rows.append([n, k, f"{r[k]['median']:.3f} [{r[k]['min']:.3f}-{r[k]['max']:.3f}]", ""])
    common.table(
        f"overhead: {a.model} {a.image_size}px batch {a.batch} {a.precision} "
        f"(step time median [min-max] over {a.reps} interleaved reps)",
        ["procs", "variant", "step time", "steps/s"],
        rows,
    )
    common.emit("overhead", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
