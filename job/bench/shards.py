"""WebDataset shards beside the ImageFolder (part of ``ddp-job bench data``): images/s through the training loader
(the trainer's ``build_loaders``: decode with PIL, random resized crop + flip, the trainer's sampler) on the same images,
``make-data --format png`` files vs ``make-data --format webdataset`` shards of the same seed (the same PNG bytes),
at each worker count, in interleaved repetitions (the order alternates).
"""

from __future__ import annotations

from pathlib import Path

from job.bench import common
from job.bench.loader import loader_rate

SOURCES = ("imagefolder", "webdataset")
_FORMAT = {"imagefolder": "png", "webdataset": "webdataset"}


def make_sets(tmp: Path, size: int, per_class: int, timeout: float) -> dict[str, Path]:
    """Both layouts of one generated set (10 classes, same seed)."""
    paths = {}
    for source in SOURCES:
        paths[source] = tmp / f"same-{source}"
        cmd = [str(common.BIN / "ddp-job"), "make-data", "--out", str(paths[source]), "--classes", "10"]
        cmd += ["--per-class", str(per_class), "--size", str(size), "--format", _FORMAT[source]]
        common.run(cmd, common.child_env(tmp), timeout)
    return paths


def compare(tmp: Path, size: int, per_class: int, batch: int, workers: list[int], reps: int, batches: int) -> dict:
    """Median [min-max] img/s of each source and worker count, and of the WebDataset / ImageFolder ratio."""
    paths = make_sets(tmp, size, per_class, 600)
    rates: dict[str, dict[int, list[float]]] = {s: {w: [] for w in workers} for s in SOURCES}
    for rep in range(reps):
        order = [(s, w) for w in workers for s in SOURCES]
        if rep % 2:
            order.reverse()
        for source, w in order:
            rates[source][w].append(loader_rate(paths[source], w, batch, size, batches, source))
    out: dict = {s: {str(w): common.median_spread(v) for w, v in rates[s].items()} for s in SOURCES}
    out["ratio"] = {
        str(w): common.median_spread(a / b for a, b in zip(rates["webdataset"][w], rates["imagefolder"][w]))
        for w in workers
    }
    return out


def report(result: dict, size: int, per_class: int, batch: int, reps: int) -> None:
    rows = []
    for w in result["ratio"]:
        rows += [
            [f"ImageFolder (PNG files), {w} workers", common.fmt_ms(result["imagefolder"][w], 1, " img/s")],
            [f"WebDataset (same PNGs in shards), {w} workers", common.fmt_ms(result["webdataset"][w], 1, " img/s")],
            [f"WebDataset / ImageFolder, {w} workers", common.fmt_ms(result["ratio"][w], 1, "x")],
        ]
    title = f"loader sources: {size}px PNG, 10 classes x {per_class}, batch {batch} ({reps} interleaved reps)"
    common.table(title, ["source", "median [min-max]"], rows)
