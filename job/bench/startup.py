"""Startup: wall time from launching ``torchrun -m job train`` (2 processes) to the first completed
optimizer step, vs launching a bare torchrun script (job/bench/bare_ddp.py) to its first collective
(and, for reference, to its first optimizer step on the same model). Interleaved per repetition; the
trainer's time comes from the wall time of its step-1 TensorBoard event. Goal: <= 1.25x.

    ddp-job bench startup [--quick] [--reps 3] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from job.bench import common

HERE = Path(__file__).resolve().parent


def import_profile(env: dict[str, str]) -> dict[str, float]:
    """Seconds to import torch alone vs the trainer's modules (where a slow start usually goes)."""
    out = {}
    for name, code in (
        ("import torch", "import torch"),
        ("import torch+torchvision", "import torch, torchvision"),
        ("import job.train.run", "import job.train.run"),
    ):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, cwd=common.ROOT, check=True)
        out[name] = time.perf_counter() - t0
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    reps = a.reps or (1 if a.quick else 3)
    size, batch = 16, 4 * a.nproc
    res: dict[str, list[float]] = {"job_first_step": [], "bare_first_collective": [], "bare_first_step": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = common.child_env(tmp)
        for rep in range(reps):
            for kind in ["job", "bare"] if rep % 2 == 0 else ["bare", "job"]:
                t0 = time.time()
                if kind == "job":
                    run_dir = tmp / "runs" / f"start-{rep}"
                    args = common.job_train_args(run_dir, model=a.model, image_size=size, batch=batch, steps=1)
                    common.run(common.torchrun_cmd(a.nproc, ["-m", "job", "train", *args]), env, a.timeout)
                    res["job_first_step"].append(common.scalars(run_dir, "perf/step_time_s")[0][2] - t0)
                else:
                    out = tmp / f"bare-{rep}.json"
                    common.run(
                        common.torchrun_cmd(
                            a.nproc,
                            [
                                str(HERE / "bare_ddp.py"),
                                "--model",
                                a.model,
                                "--image-size",
                                str(size),
                                "--batch",
                                str(batch),
                                "--steps",
                                "1",
                                "--out",
                                str(out),
                            ],
                        ),
                        env,
                        a.timeout,
                    )
                    r = json.loads(out.read_text())
                    res["bare_first_collective"].append(r["t_first_collective"] - t0)
                    res["bare_first_step"].append(r["t_first_step"] - t0)
        prof = import_profile(env) if not a.quick else {}
    stats = {k: common.median_spread(v) for k, v in res.items()}
    ratio = common.median_spread(j / b for j, b in zip(res["job_first_step"], res["bare_first_collective"]))
    ratio_step = common.median_spread(j / b for j, b in zip(res["job_first_step"], res["bare_first_step"]))
    rows = [[k, common.fmt_ms(s, 1, " s")] for k, s in stats.items()]
    rows += [
        [
            "ratio job first step / bare first collective",
            f"{ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]",
        ],
        [
            "ratio job first step / bare first step",
            f"{ratio_step['median']:.3f} [{ratio_step['min']:.3f}-{ratio_step['max']:.3f}]",
        ],
    ]
    rows += [[f"profile: {k}", f"{v:.2f} s"] for k, v in prof.items()]
    common.table(
        f"startup: {a.nproc} processes, {a.model} {size}px, launch -> event (median [min-max], {reps} interleaved reps)",
        ["measure", "seconds"],
        rows,
    )
    goal = ratio["median"] <= 1.25
    print(f"goal <= 1.25x: {'met' if goal else 'MISSED'} ({ratio['median']:.3f}x)")
    common.emit(
        "startup",
        {
            "quick": a.quick,
            "nproc": a.nproc,
            "reps": reps,
            "seconds": stats,
            "ratio": ratio,
            "ratio_vs_bare_first_step": ratio_step,
            "import_profile_s": prof,
            "goal_le_1_25": goal,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
