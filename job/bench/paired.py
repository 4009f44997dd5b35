"""Overhead, paired: ddp-job's loop vs the bare DDP step, alternating block by block inside one process.

``bench overhead`` compares whole runs, launched one after the other; on a virtual CPU whose speed changes
from minute to minute its spread (+-20-40 %) is far wider than the 1 % it should resolve. Here each torchrun
worker (``job/bench/paired_worker.py``) builds the trainer's real ``Run`` and a bare DDP step (own model, DDP
wrapper, optimizer) and alternates blocks of ``--block`` steps (job, bare, bare, job, ...): adjacent blocks run
within a second or two, on the same cores, at the same machine speed. The trainer keeps its own cadences
(``--log-every``: console line, TensorBoard scalars, observer gather). A repetition's ratio is the bare steps'
total time / the job steps' total time over the pairs after ``--warmup`` (> 1: ddp-job faster; totals, not a
median of pairs, so the trainer's periodic logging steps count in full); the spread is over ``--reps``
repetitions (separate launches, interleaved over process counts). ``cpu`` is process CPU seconds (all
threads) of the busiest rank, which other processes on the cores inflate less.

    ddp-job bench paired [--quick] [--nprocs 1,2] [--reps 5] [--pairs 150] [--block 1] [--log-every 5]
                         [--bare-bucket-view] [--ablate clip,stopflag,observer]
                         [--job-arg=--ddp.gradient-as-bucket-view --job-arg=false ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common


def rep_result(rank_files: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One repetition: bare/job of the summed step times after ``warmup`` pairs (rank 0's wall time; the busiest
    rank's CPU time per pair), the quartiles of the per-pair wall ratios, and the mean step times. Pure."""
    ranks = sorted(rank_files, key=lambda r: r["rank"])
    pairs = [[r["blocks"][p] for r in ranks] for p in range(warmup, len(ranks[0]["blocks"]))]
    job_wall = [rows[0]["job_wall_s"] for rows in pairs]
    bare_wall = [rows[0]["bare_wall_s"] for rows in pairs]
    job_cpu = [max(r["job_cpu_s"] for r in rows) for rows in pairs]
    bare_cpu = [max(r["bare_cpu_s"] for r in rows) for rows in pairs]
    per_pair = [b / j for b, j in zip(bare_wall, job_wall)]
    return {
        "wall": sum(bare_wall) / sum(job_wall),
        "cpu": sum(bare_cpu) / sum(job_cpu),
        "pair_quartiles": quartiles(per_pair),
        "job_step_s": statistics.fmean(job_wall),
        "bare_step_s": statistics.fmean(bare_wall),
        "pairs": len(pairs),
        "job_steps": [r["job_steps"] for r in ranks],
    }


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def one_rep(nproc: int, a: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    run_dir = tmp / "runs" / tag
    steps = a.pairs * a.block + 1  # never the last step: no final evaluation or save falls inside a block
    args = common.workload_train_args(run_dir, a, steps, ["--log.every", str(a.log_every), *a.job_arg])
    out = tmp / f"{tag}.json"
    flags = [name for name, on in (("bare-bucket-view", a.bare_bucket_view), ("bare-first", a.bare_first)) if on]
    own = [str(out), str(a.pairs), str(a.block), *flags]
    cmd = common.torchrun_cmd(nproc, ["-m", "job.bench.paired_worker", *own, "--", *args])
    common.run(cmd, common.child_env(tmp, ABLATE=a.ablate), a.timeout)
    files = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{tag}.json.rank*"))]
    if len(files) != nproc:
        raise RuntimeError(f"{tag}: {len(files)} rank files for {nproc} processes")
    return rep_result(files, a.warmup)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ddp-job bench paired", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_workload_args(p)
    p.add_argument("--pairs", type=int, default=None, help="job/bare block pairs per repetition")
    p.add_argument("--warmup", type=int, default=None, help="pairs discarded at the start")
    p.add_argument("--block", type=int, default=1, help="steps per block")
    p.add_argument("--log-every", type=int, default=5, help="the trainer's log.every (and observer cadence)")
    p.add_argument("--bare-bucket-view", action="store_true", help="the bare DDP with gradient_as_bucket_view")
    p.add_argument("--bare-first", action="store_true", help="build the bare loop before the trainer's parts")
    p.add_argument("--job-arg", action="append", default=[], help="extra ddp-job train argument (repeatable)")
    p.add_argument("--ablate", default="", help="trainer extras to switch off: job/bench/ablate_train.py CHOICES")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    common.resolve_workload(a)
    a.pairs = a.pairs or (6 if a.quick else 150)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 10)
    if a.warmup >= a.pairs:
        p.error(f"--warmup {a.warmup} leaves no pair of --pairs {a.pairs}; use --warmup < --pairs")
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    reps: dict[int, list[dict[str, Any]]] = {n: [] for n in a.nprocs}
    with tempfile.TemporaryDirectory(dir=a.workdir) as d:
        tmp = Path(d)
        for rep in range(a.reps):
            for nproc in a.nprocs[rep % len(a.nprocs) :] + a.nprocs[: rep % len(a.nprocs)]:
                reps[nproc].append(one_rep(nproc, a, tmp, f"p{nproc}-r{rep}"))
    rows, result = [], {}
    for nproc, rs in reps.items():
        wall = common.median_spread(r["wall"] for r in rs)
        cpu = common.median_spread(r["cpu"] for r in rs)
        job = common.median_spread(r["job_step_s"] for r in rs)
        bare = common.median_spread(r["bare_step_s"] for r in rs)
        result[str(nproc)] = {"ratio_wall": wall, "ratio_cpu": cpu, "job_step_s": job, "bare_step_s": bare, "reps": rs}
        iqr = "; ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in (r["pair_quartiles"] for r in rs))
        rows.append([nproc, len(rs), common.fmt_ms(wall), common.fmt_ms(cpu), iqr, common.fmt_ms(job, 1e3, " ms")])
    title = (
        f"ddp-job loop / bare DDP step (steps/s), {a.model} {a.image_size}px batch {a.batch}, {a.pairs} pairs of "
        f"{a.block}-step blocks, log every {a.log_every}"
    )
    header = ["procs", "reps", "ratio (wall)", "ratio (CPU)", "per-pair wall ratio quartiles, per rep", "job step"]
    common.table(title, header, rows)
    args = {k: str(v) for k, v in vars(a).items()}
    common.emit("paired", {"quick": a.quick, "pairs": a.pairs, "block": a.block, "args": args, "result": result})
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
