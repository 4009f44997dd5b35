"""Memory per rank, ddp vs fsdp (and hsdp 2 x nproc/2 from 4 processes), at 1, 2 and 4 processes: ddp-job's real runs of the causal language model
(``job/bench/memory_worker.py``), a few AdamW steps each, on CPU+gloo (CUDA+NCCL where there is a GPU).

Per run and rank: the state bytes it holds as an optimizer step starts (local storage of parameters, gradients,
optimizer state), the peak RSS (CUDA: ``max_memory_allocated``), each phase's own peak (``PHASES``: build, first
step, steps, save) and the median step time after the first step. Beside each, the estimate of job.parallel.memory for the same run. The goal: fsdp's state per rank at
most 1.1 x ddp's / shards + one gathered unit (shards: the world size, hsdp's shard degree). Step time is a ratio fsdp / ddp of runs launched one after the
other at the same process count (their order alternates between repetitions), median and spread over ``--reps``.

    ddp-job bench memory [--quick] [--nprocs 1,2,4] [--reps 3] [--steps 6] [--n-layer 8] [--n-embd 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common

STRATEGIES = ("ddp", "fsdp", "hsdp")
"""hsdp: fsdp on a mesh of 2 copies x nproc / 2 ranks (fsdp.replicate_degree 2), at even process counts from 4."""


def strategies(nproc: int) -> tuple[str, ...]:
    """What runs at ``nproc`` processes: hsdp needs 2 copies of shard groups of 2 ranks at least."""
    if nproc >= 4 and nproc % 2 == 0:
        return STRATEGIES
    return STRATEGIES[:2]


def strategy_args(strategy: str) -> list[str]:
    if strategy == "hsdp":
        return ["--train.strategy", "fsdp", "--fsdp.replicate-degree", "2"]
    return ["--train.strategy", strategy]


MIB = 2**20
PHASES = ("build", "first_step", "steps", "save")
"""The phases whose peak each rank records (job/bench/memory_worker.py): the run built (preflight, the process group,
the model wrapped or sharded, the loaders), its first step, the other timed steps, one checkpoint written."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ddp-job bench memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="2 processes, a tiny model, 1 repetition (CI)")
    p.add_argument("--nprocs", default=None, help="comma-separated process counts (default 1,2,4; quick 2)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 6; quick 2)")
    p.add_argument("--n-layer", type=int, default=None, help="transformer blocks (default 8; quick 2)")
    p.add_argument("--n-embd", type=int, default=None, help="width (default 512; quick 64)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2, help="items per rank per step")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    q = a.quick
    a.nprocs = [int(x) for x in (a.nprocs or ("2" if q else "1,2,4")).split(",")]
    a.reps = a.reps or (1 if q else 3)
    a.steps = a.steps or (2 if q else 6)
    a.n_layer = a.n_layer or (2 if q else 8)
    a.n_embd = a.n_embd or (64 if q else 512)
    return a


def train_args(a: argparse.Namespace, corpus: Path, run_dir: Path, nproc: int, strategy: str) -> list[str]:
    options = {"path": str(corpus), "seq_len": a.seq_len, "n_layer": a.n_layer, "n_head": 8, "n_embd": a.n_embd}
    return [
        *("--task.name", "causal_lm", "--task.options", json.dumps(options), "--data.num-workers", "0"),
        *("--run.output-dir", str(run_dir.parent), "--run.name", run_dir.name),
        *strategy_args(strategy),
        *("--train.steps", str(a.steps + 2)),
        *("--train.global-batch-size", str(a.micro_batch * nproc), "--train.grad-clip-norm", "1.0"),
        *("--optim.name", "adamw", "--optim.lr", "0.001", "--sched.name", "constant"),
        *("--ckpt.every", "0", "--log.every", "1000", "--log.progress", "off", "--log.tensorboard", "false"),
    ]


def one_run(a: argparse.Namespace, tmp: Path, corpus: Path, nproc: int, strategy: str, tag: str) -> list[dict]:
    out = tmp / f"{tag}.json"
    args = train_args(a, corpus, tmp / "runs" / tag, nproc, strategy)
    cmd = common.torchrun_cmd(nproc, ["-m", "job.bench.memory_worker", str(out), str(a.steps), "--", *args])
    common.run(cmd, common.child_env(tmp), a.timeout)
    files = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{tag}.json.rank*"))]
    if len(files) != nproc:
        raise RuntimeError(f"{tag}: {len(files)} rank files for {nproc} processes")
    return sorted(files, key=lambda r: r["rank"])


def point(ranks: list[dict]) -> dict[str, Any]:
    """One run: the largest rank's numbers (every rank holds about the same), rank 0's step times."""
    est = ranks[0]["estimate"][ranks[0]["strategy"]]  # train.strategy: ddp or fsdp (hsdp's on its mesh)
    ddp_est = ranks[0]["estimate"]["ddp"]
    state = {"parameters", "gradients", "optimizer", "ema"}
    return {
        "state_bytes": [r["held"]["state"] for r in ranks],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "phases": {name: [r["phases"][name] for r in ranks] for name in PHASES},
        "rss_start_bytes": [r["rss_start_bytes"] for r in ranks],
        "max_memory_allocated": [r.get("max_memory_allocated") for r in ranks],
        "step_s": statistics.median(ranks[0]["step_s"][1:] or ranks[0]["step_s"]),
        "estimate": est,
        "estimate_state": sum(est[k] for k in state),
        "estimate_total": sum(v for k, v in est.items() if k not in ("strategy", "world_size", "shards")),
        "estimate_shards": est["shards"],
        "ddp_estimate_state": sum(ddp_est[k] for k in state),
    }


def measure(a: argparse.Namespace, tmp: Path) -> dict[tuple[int, str], list[dict[str, Any]]]:
    corpus = tmp / "corpus"
    common.run(
        [sys.executable, "-m", "job", "make-data", "--format", "text", "--out", str(corpus), "--max-bytes", "300000"],
        common.child_env(tmp),
        a.timeout,
    )
    points: dict[tuple[int, str], list[dict[str, Any]]] = {(n, s): [] for n in a.nprocs for s in strategies(n)}
    for rep in range(a.reps):
        for nproc in a.nprocs[rep % len(a.nprocs) :] + a.nprocs[: rep % len(a.nprocs)]:
            order = strategies(nproc) if rep % 2 == 0 else strategies(nproc)[::-1]
            for strategy in order:
                p = point(one_run(a, tmp, corpus, nproc, strategy, f"{strategy}-p{nproc}-r{rep}"))
                common.emit_point("memory", {"nproc": nproc, "strategy": strategy, "rep": rep, **p})
                points[(nproc, strategy)].append(p)
    return points


def summarize(a: argparse.Namespace, points: dict[tuple[int, str], list[dict[str, Any]]]) -> dict[str, Any]:
    """The tables and the JSON result: per (process count, strategy) the medians over repetitions."""
    rows, result = [], {}
    for (nproc, strategy), ps in points.items():
        held = statistics.median(max(p["state_bytes"]) for p in ps)
        peak = statistics.median(max(p["peak_rss_bytes"]) for p in ps)
        grew = statistics.median(max(x - y for x, y in zip(p["peak_rss_bytes"], p["rss_start_bytes"])) for p in ps)
        est = ps[0]
        bound = est["ddp_estimate_state"] / est["estimate_shards"] * 1.1 + est["estimate"]["gathered_unit"]
        goal = strategy == "ddp" or held <= bound
        step = common.median_spread(p["step_s"] for p in ps)
        result[f"{strategy}-{nproc}"] = {
            "state_bytes": held,
            "estimate_state_bytes": est["estimate_state"],
            "estimate_total_bytes": est["estimate_total"],
            "peak_rss_bytes": peak,
            "peak_rss_growth_bytes": grew,
            "goal_bound_bytes": bound,
            "goal_met": goal,
            "step_s": step,
        }
        rows.append(
            [
                nproc,
                strategy,
                f"{held / MIB:.1f}",
                f"{est['estimate_state'] / MIB:.1f}",
                f"{est['estimate_total'] / MIB:.1f}",
                f"{peak / MIB:.0f}",
                f"{grew / MIB:.0f}",
                "" if strategy == "ddp" else f"{bound / MIB:.1f} {'met' if goal else 'MISSED'}",
                common.fmt_ms(step, 1e3, " ms"),
            ]
        )
    header = ["procs", "strategy", "state/rank MiB", "estimate state", "estimate total", "peak RSS MiB"]
    header += ["RSS growth MiB", "goal <= 1.1 ddp/shards + unit", "step median [min-max]"]
    title = f"memory per rank: causal_lm {a.n_layer}x{a.n_embd}, AdamW, micro-batch {a.micro_batch}, {a.steps} steps"
    common.table(title, header, rows)
    phase_table(points, result)
    ratios = {}
    for nproc in a.nprocs:
        pairs = zip(points[(nproc, "fsdp")], points[(nproc, "ddp")])
        ratios[str(nproc)] = common.median_spread(f["step_s"] / d["step_s"] for f, d in pairs)
    common.table(
        "step time fsdp / ddp (per repetition)",
        ["procs", "ratio median [min-max]"],
        [[n, common.fmt_ms(r)] for n, r in ratios.items()],
    )
    return {"points": result, "step_ratio_fsdp_over_ddp": ratios}


def growth(record: dict[str, Any], key: str) -> int:
    """How far a phase's peak rose above where it started (RSS; CUDA: above the allocation at its start, which the
    phase does not record, so the peak itself)."""
    if key == "max_memory_allocated":
        return int(record[key])
    # The start is read just before the reset: memory freed in between (another thread's) can leave the peak below it.
    return max(0, int(record["peak_rss_bytes"]) - int(record["start_rss_bytes"]))


def phase_table(points: dict[tuple[int, str], list[dict[str, Any]]], result: dict[str, Any]) -> None:
    """Peak memory per rank by phase (job/bench/memory_worker.py's PHASES): per (process count, strategy) the median
    over repetitions of the largest rank's peak in each phase, into ``result`` and a table."""
    records = [r for ps in points.values() for p in ps for name in PHASES for r in p["phases"][name]]
    key = "peak_rss_bytes"
    if all("max_memory_allocated" in r for r in records):
        key = "max_memory_allocated"
    rows = []
    for (nproc, strategy), ps in points.items():
        peaks = {name: statistics.median(max(int(r[key]) for r in p["phases"][name]) for p in ps) for name in PHASES}
        grew = {name: statistics.median(max(growth(r, key) for r in p["phases"][name]) for p in ps) for name in PHASES}
        result.setdefault(f"{strategy}-{nproc}", {}).update(phase_peak_bytes=peaks, phase_growth_bytes=grew)
        rows.append([nproc, strategy, *(f"{peaks[n] / MIB:.0f} (+{grew[n] / MIB:.0f})" for n in PHASES)])
    what = "RSS (VmHWM)"
    if key == "max_memory_allocated":
        what = "CUDA max_memory_allocated"
    own = "each phase's own peak"
    if not all(r["reset"] for r in records):
        own = "NOT reset between phases: the peak so far"
    title = f"peak memory per rank by phase, MiB (+ above its start) ({what}; {own}; largest rank, median of reps)"
    common.table(title, ["procs", "strategy", *PHASES], rows)


def main(argv: list[str]) -> int:
    a = parse(argv)
    with tempfile.TemporaryDirectory(dir=a.workdir) as d:
        points = measure(a, Path(d))
    result = summarize(a, points)
    args = {k: str(v) for k, v in vars(a).items()}
    common.emit("memory", {"quick": a.quick, "args": args, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
