"""Shared pieces: statistics, the table + JSON output, subprocess runs of the real CLI, TensorBoard reading."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from job.cluster.env import LAUNCHER_VAR_PREFIXES

ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the ``job`` package
BIN = Path(sys.executable).parent


def reference_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line of the reference programs (bare_ddp.py, lightning_ref.py): the same work for both."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that race ddp-job against a reference: process counts, repetitions, and
    the work (model, image size, global batch, precision, memory format). ``resolve_workload`` fills defaults."""
    p.add_argument("--quick", action="store_true", help="tiny run that only proves the benchmark works (CI)")
    p.add_argument("--nprocs", default=None, help="comma-separated process counts (default 1,2; quick 1)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="global batch")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)


def resolve_workload(a: argparse.Namespace) -> None:
    """Defaults of ``add_workload_args``: resnet18 at 32 px, batch 32, 1 and 2 processes, 5 repetitions;
    ``--quick``: 16 px, batch 8, 1 process, 1 repetition."""
    q = a.quick
    a.nprocs = [int(x) for x in (a.nprocs or ("1" if q else "1,2")).split(",")]
    a.reps = a.reps or (1 if q else 5)
    a.image_size = a.image_size or (16 if q else 32)
    a.batch = a.batch or (8 if q else 32)


def workload_train_args(run_dir: Path, a: argparse.Namespace, steps: int, extra: Sequence[str] = ()) -> list[str]:
    """``job_train_args`` for the work of ``add_workload_args`` (model, image size, batch, precision, format)."""
    return job_train_args(
        run_dir,
        model=a.model,
        image_size=a.image_size,
        batch=a.batch,
        steps=steps,
        precision=a.precision,
        channels_last=a.channels_last,
        extra=extra,
    )


def median_spread(values: Iterable[float]) -> dict[str, float]:
    """Median and spread (min, max, and the relative half-range) of ``values``."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "spread_pct": float("nan")}
    med = statistics.median(v)
    spread = 100 * (v[-1] - v[0]) / 2 / med if med else float("nan")
    return {"median": med, "min": v[0], "max": v[-1], "n": len(v), "spread_pct": spread}


def fmt_ms(s: dict[str, float], scale: float = 1.0, unit: str = "") -> str:
    return f"{s['median'] * scale:.3g}{unit} [{s['min'] * scale:.3g}-{s['max'] * scale:.3g}] n={s['n']}"


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n== {title}")
    for j, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def emit(name: str, result: dict[str, Any]) -> None:
    """The one JSON line (the last line of stdout), tagged with the benchmark name and the machine load."""
    out = {"benchmark": name, "load_avg": os.getloadavg(), "cpus": os.cpu_count(), **result}
    print(json.dumps(out, sort_keys=True, default=float), flush=True)


def emit_point(name: str, result: dict[str, Any]) -> None:
    """One measurement's JSON line (``"point": true``), printed as soon as it is known: a run stopped later (a
    timeout, a budget) keeps what it measured. The benchmark's summary is still the last line (``emit``)."""
    emit(name, {"point": True, **result})


def child_env(tmp: Path, **extra: str) -> dict[str, str]:
    """A clean environment for a job subprocess (no inherited launcher/JOB_* variables), TMPDIR under ``tmp``,
    this checkout first on PYTHONPATH and what was there after it (packages installed into a directory of
    their own, as tools/gpu_run.sh installs wheels on a GPU image)."""
    drop = ("JOB_", *LAUNCHER_VAR_PREFIXES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONUNBUFFERED="1", TMPDIR=str(tmp / "tmp"), PYTHONPATH=path)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, target: Sequence[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node N TARGET``; TARGET is ``-m job train ...`` or ``script.py ...``.
    Through ``python -m torch.distributed.run``: a torchrun script next to the interpreter is not there in every
    install (a system interpreter with packages in a user or container prefix)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]


def run(cmd: Sequence[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(cmd), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stdout + r.stderr)[-3000:]
        raise RuntimeError(f"benchmark run failed (exit {r.returncode}): {' '.join(cmd)}\n{tail}")
    return r


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float, float]]:
    """(step, value, wall_time) of a TensorBoard scalar written by the trainer (rank 0), in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        raise RuntimeError(f"{run_dir / 'tb'} holds no scalar {tag!r} (tags: {acc.Tags().get('scalars')})")
    return [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]


def job_train_args(
    run_dir: Path,
    *,
    model: str,
    image_size: int,
    batch: int,
    steps: int,
    precision: str = "fp32",
    channels_last: bool = False,
    source: str = "synthetic",
    data_path: Path | None = None,
    workers: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """``ddp-job train`` arguments for a benchmark run: log every step, no checkpoints or eval in the loop."""
    args = [
        "--run.output-dir",
        str(run_dir.parent),
        "--run.name",
        run_dir.name,
        "--data.source",
        source,
        "--data.image-size",
        str(image_size),
        "--data.num-classes",
        "10",
        "--data.num-workers",
        str(workers),
        "--data.synthetic-train-size",
        str(max(batch * 4, 64)),
        "--data.synthetic-val-size",
        str(batch),
        "--model.name",
        model,
        "--model.channels-last",
        str(channels_last).lower(),
        "--train.steps",
        str(steps),
        "--train.global-batch-size",
        str(batch),
        "--train.precision",
        precision,
        "--ckpt.every",
        "0",
        "--log.every",
        "1",
        "--log.progress",
        "off",
        "--sched.name",
        "constant",
    ]
    if data_path is not None:
        args += ["--data.path", str(data_path)]
    return args + list(extra)
