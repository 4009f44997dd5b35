"""Data pipeline: images/s of the ImageFolder loader alone (JPEGs from ``ddp-job make-data --format jpeg``,
decode + augmentation, workers 0..N) vs the images/s the trainer consumes with synthetic data (its logged
``perf/samples_per_s``), and the data-wait fraction the trainer logs when it reads the JPEGs with the default
worker count. Goals: loader >= 1.2x consumption at the default worker count; data-wait < 5 %.

The loader is measured alone (it has the whole machine); in training its workers share the cores with
the model, which is what the logged data-wait fraction shows. Also compared: the decode paths
(job/bench/decode.py) and WebDataset shards vs the ImageFolder on the same images (job/bench/shards.py).

    ddp-job bench data [--quick] [--workers 0,1,2,4] [--reps 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common, decode, shards
from job.bench.loader import loader_rate


def trainer_scalar(tmp: Path, tag: str, name: str, source: str, data: Path, a: Any, warmup: int) -> float:
    run_dir = tmp / "runs" / name
    args = common.job_train_args(
        run_dir,
        model=a.model,
        image_size=a.size,
        batch=a.batch,
        steps=a.steps,
        source=source,
        data_path=data,
        workers=a.default_workers,
        extra=["--log.every", str(a.log_every)],
    )
    common.run(common.torchrun_cmd(1, ["-m", "job", "train", *args]), common.child_env(tmp), a.timeout)
    values = [v for step, v, _ in common.scalars(run_dir, tag) if step - a.log_every >= warmup]
    return statistics.median(values)


def _cpu() -> Any:
    import torch

    return torch.device("cpu")  # the GPU comparison is tools/gpu_run.sh's


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workers", default=None, help="comma-separated worker counts (default 0,1,2,4; quick 0,2)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=None, help="image size (generated and trained)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--per-class", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--decode-size", type=int, default=None, help="JPEG size of the decode comparison (default 320)")
    p.add_argument("--decode-crop", type=int, default=None, help="its crop size (default 224)")
    a = p.parse_args(argv)
    from job.config import DataConfig

    q = a.quick
    a.default_workers = DataConfig().num_workers
    workers = [int(w) for w in (a.workers or ("0,2" if q else "0,1,2,4")).split(",")]
    if a.default_workers not in workers:
        workers.append(a.default_workers)
    a.reps, a.size, a.batch = a.reps or (1 if q else 2), a.size or (16 if q else 32), a.batch or (8 if q else 32)
    a.steps, a.log_every, warmup = a.steps or (5 if q else 20), 1 if q else 5, 2 if q else 5
    per_class, batches = a.per_class or (16 if q else 100), 3 if q else 20
    rates: dict[int, list[float]] = {w: [] for w in workers}
    consume: list[float] = []
    wait: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "jpeg"
        common.run(
            [
                str(common.BIN / "ddp-job"),
                "make-data",
                "--out",
                str(data),
                "--classes",
                "10",
                "--per-class",
                str(per_class),
                "--size",
                str(a.size),
                "--format",
                "jpeg",
            ],
            common.child_env(tmp),
            a.timeout,
        )
        for rep in range(a.reps):
            order = workers if rep % 2 == 0 else workers[::-1]
            for w in order:
                rates[w].append(loader_rate(data, w, a.batch, a.size, batches))
            consume.append(trainer_scalar(tmp, "perf/samples_per_s", f"synthetic-{rep}", "synthetic", data, a, warmup))
            wait.append(trainer_scalar(tmp, "perf/data_wait_frac", f"jpeg-{rep}", "imagefolder", data, a, warmup))
        decode_size, decode_crop = a.decode_size or (48 if q else 320), a.decode_crop or (32 if q else 224)
        paths = decode.compare(
            tmp, decode_size, decode_crop, a.batch, a.default_workers, max(a.reps, 1 if q else 5), batches, _cpu()
        )
        source_reps = max(a.reps, 1 if q else 5)
        sources = shards.compare(tmp, a.size, per_class, a.batch, sorted({0, a.default_workers}), source_reps, batches)
    stats = {w: common.median_spread(v) for w, v in rates.items()}
    cons = common.median_spread(consume)
    ratio = common.median_spread(r / c for r, c in zip(rates[a.default_workers], consume))
    waits = common.median_spread(wait)
    rows = [
        [f"loader, {w} workers" + (" (default)" if w == a.default_workers else ""), common.fmt_ms(s, 1, " img/s")]
        for w, s in stats.items()
    ]
    rows += [
        ["trainer consumption (synthetic data)", common.fmt_ms(cons, 1, " img/s")],
        ["loader / consumption at default workers", f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"],
        [
            "trainer data-wait fraction (JPEG, default workers)",
            f"{100 * waits['median']:.1f}% [{100 * waits['min']:.1f}-{100 * waits['max']:.1f}]",
        ],
    ]
    common.table(
        f"data: {a.size}px JPEG ImageFolder, batch {a.batch}, trainer {a.model} on 1 process ({a.reps} interleaved reps)",
        ["measure", "median [min-max]"],
        rows,
    )
    decode.report(paths, decode_size, decode_crop, a.batch, a.default_workers, _cpu())
    shards.report(sources, a.size, per_class, a.batch, source_reps)
    goals = {"loader_ge_1_2x": ratio["median"] >= 1.2, "data_wait_lt_5pct": waits["median"] < 0.05}
    print("goals: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in goals.items()))
    common.emit(
        "data",
        {
            "quick": q,
            "default_workers": a.default_workers,
            "loader_img_s": {str(w): s for w, s in stats.items()},
            "consumption_img_s": cons,
            "ratio_at_default": ratio,
            "data_wait_frac": waits,
            "decode_paths": paths,
            "sources": sources,
            "goals": goals,
            "config": {"size": a.size, "batch": a.batch, "model": a.model, "steps": a.steps, "reps": a.reps},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
