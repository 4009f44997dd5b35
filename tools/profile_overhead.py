"""Where ddp-job's per-step overhead over the bare DDP loop goes: the overhead benchmark's runs, plus ddp-job
runs with one per-step extra switched off each (job/bench/ablate_train.py), interleaved, same estimator.

    python tools/profile_overhead.py [--nprocs 2] [--reps 3] [--steps 30]

Prints, per variant, the median step time (window means of --log-every steps after --warmup) with its spread
and its steps/s ratio to the bare loop of the same repetition; one JSON line last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common
from job.bench.overhead import HERE, job_cpu, job_times, parse, run_variant

VARIANTS = ["job", "job -stopflag", "job -clip", "job -observer", "job -stopflag-clip-observer", "bare"]


def run_ablated(ablate: str, nproc: int, a: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    run_dir = tmp / "runs" / tag
    args = common.workload_train_args(run_dir, a, a.steps, ["--log.every", str(a.log_every)])
    env = common.child_env(tmp, ABLATE=ablate)
    common.run(common.torchrun_cmd(nproc, [str(HERE / "ablate_train.py"), *args]), env, a.timeout)
    logged, wall = job_times(run_dir, a.warmup, a.log_every)
    return {
        "step_s": statistics.median(logged),
        "wall_step_s": statistics.median(wall),
        "cpu_s": job_cpu(run_dir, a.warmup, a.log_every),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2)
    known, rest = p.parse_known_args(argv)
    a = parse(["--lightning", "off", *rest])
    n = known.nprocs
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(dir=a.workdir) as d:
        tmp = Path(d)
        for rep in range(a.reps):
            for v in VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]:
                tag = f"{v.replace(' ', '').replace('-', '_')}-r{rep}"
                if v in ("job", "bare"):
                    runs[v].append(run_variant(v, n, a, tmp, tag))
                else:
                    runs[v].append(run_ablated(v.split(" -")[1].replace("-", ","), n, a, tmp, tag))
                print(f"rep {rep} {v}: {runs[v][-1]['step_s'] * 1000:.0f} ms", file=sys.stderr, flush=True)
    rows, result = [], {}
    for v in VARIANTS:
        s = common.median_spread(x["step_s"] for x in runs[v])
        ratio = common.median_spread(b["step_s"] / x["step_s"] for x, b in zip(runs[v], runs["bare"]))
        cpu = common.median_spread(x["cpu_s"] for x in runs[v])
        cpu_ratio = common.median_spread(b["cpu_s"] / x["cpu_s"] for x, b in zip(runs[v], runs["bare"]))
        result[v] = {"step_s": s, "ratio_vs_bare": ratio, "cpu_s": cpu, "cpu_ratio_vs_bare": cpu_ratio}
        rows.append(
            [
                v,
                common.fmt_ms(s, 1000, " ms"),
                f"{ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]",
                common.fmt_ms(cpu, 1000, " ms"),
                f"{cpu_ratio['median']:.3f} [{cpu_ratio['min']:.3f}-{cpu_ratio['max']:.3f}]",
            ]
        )
    common.table(
        f"overhead profile: {n} procs, {a.model} {a.image_size}px batch {a.batch}, {a.reps} interleaved reps",
        ["variant", "logged step median [min-max]", "steps/s vs bare", "CPU s/step", "CPU ratio vs bare"],
        rows,
    )
    common.emit("profile_overhead", {"nprocs": n, "reps": a.reps, "steps": a.steps, "variants": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
