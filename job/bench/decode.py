"""Decode paths side by side (part of ``ddp-job bench data``): images/s delivered to the trainer as normalised
float batches on the training device, decoding in the DataLoader workers (``data.decode=cpu``: PIL) vs on the
device (``data.decode=device``: workers read bytes and draw crops, torchcodec decodes the batch on the device).
Both through the trainer's own loaders and host-to-device step (``build_loaders``, ``wrap_loaders``, ``to_device``:
on the device path the next batch is decoded in a background thread), with the same
generated JPEGs (larger than the demo's, e.g. 320 px cropped to 224) and the same crops. On a CPU-only machine
the "device" is the CPU: the main process decodes, so the ratio says how much the worker processes buy there;
on a GPU node tools/gpu_run.sh runs the same comparison against the GPU's consumption.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from job.bench import common


def decode_rate(path: Path, decode: str, workers: int, batch: int, crop: int, batches: int, device: Any) -> float:
    """Images/s from ``build_loaders`` through ``to_device`` over ``batches`` batches, after two warm-up ones."""
    import torch

    from job.config import DataConfig
    from job.data.loaders import to_device
    from job.data.prefetch import wrap_loaders
    from job.data.source import build_loaders

    cfg = DataConfig(
        source="imagefolder", path=path, num_classes=10, image_size=crop, num_workers=workers, decode=decode
    )
    # as the trainer reads them: on the device path the next batch is decoded in a background thread
    loaders = wrap_loaders(build_loaders(cfg, 0, 1, batch, 0, device), device, True, False)
    it: Any = iter(loaders.train)
    for _ in range(2):
        to_device(next(it), device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        images, _labels = to_device(next(it), device)
        n += images.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    it.close()  # ends a decode thread now
    del it, loaders
    return n / dt


def make_jpegs(tmp: Path, size: int, per_class: int, timeout: float) -> Path:
    data = tmp / f"jpeg-{size}"
    cmd = [str(common.BIN / "ddp-job"), "make-data", "--out", str(data), "--classes", "10"]
    cmd += ["--per-class", str(per_class), "--size", str(size), "--format", "jpeg"]
    common.run(cmd, common.child_env(tmp), timeout)
    return data


def compare(tmp: Path, size: int, crop: int, batch: int, workers: int, reps: int, batches: int, device: Any) -> dict:
    """Interleaved repetitions of both paths on the same images; median [min-max] of each and of the ratio."""
    data = make_jpegs(tmp, size, max(8, -(-batch * (batches + 3) // 10)), 600)
    rates: dict[str, list[float]] = {"cpu": [], "device": []}
    for rep in range(reps):
        order = ["cpu", "device"]
        if rep % 2:
            order.reverse()
        for decode in order:
            rates[decode].append(decode_rate(data, decode, workers, batch, crop, batches, device))
    ratio = common.median_spread(d / c for d, c in zip(rates["device"], rates["cpu"], strict=True))
    return {"cpu": common.median_spread(rates["cpu"]), "device": common.median_spread(rates["device"]), "ratio": ratio}


def report(result: dict, size: int, crop: int, batch: int, workers: int, device: Any) -> None:
    rows = [
        [f"data.decode=cpu ({workers} workers decode with PIL)", common.fmt_ms(result["cpu"], 1, " img/s")],
        [f"data.decode=device (decode on {device.type})", common.fmt_ms(result["device"], 1, " img/s")],
        ["device / cpu", common.fmt_ms(result["ratio"], 1, "x")],
    ]
    title = f"decode paths: {size}px JPEG -> {crop}px crops, batch {batch}, to normalised batches on {device.type}"
    common.table(title, ["path", "median [min-max]"], rows)


GPU_RUNS = ("synthetic", "cpu", "gpu", "dp", "fsdp")  # run names data-<name> in tools/gpu_run.sh; dp, fsdp: strategy
GPU_GOAL = 0.95  # decoded-JPEG throughput / synthetic throughput with data.decode=gpu
GPU_RATIOS = {  # each img/s / the synthetic (DDP) run's
    "cpu": "cpu_over_synthetic",
    "gpu": "gpu_over_synthetic",
    "dp": "dp_over_ddp",
    "fsdp": "fsdp_over_ddp",
}


def run_rate(runs: Path, name: str, warmup_steps: int) -> float | None:
    """The trained img/s of run ``data-<name>``: the median of its logged ``perf/samples_per_s`` after warm-up;
    None where it logged none (it did not run, or died first)."""
    import statistics

    if not (runs / f"data-{name}").is_dir():
        return None
    try:
        logged = common.scalars(runs / f"data-{name}", "perf/samples_per_s")
    except RuntimeError:  # the run died before its first log step
        return None
    values = [v for step, v, _ in logged if step > warmup_steps]
    if not values:
        return None
    return statistics.median(values)


def run_peak_memory_mb(runs: Path, name: str) -> float | None:
    """The largest ``perf/peak_memory_mb`` run ``data-<name>`` logged (rank 0's allocator peak on CUDA); None
    where it logged none."""
    if not (runs / f"data-{name}").is_dir():
        return None
    try:
        logged = common.scalars(runs / f"data-{name}", "perf/peak_memory_mb")
    except RuntimeError:
        return None
    return max((v for _, v, _ in logged), default=None)


def summarise_gpu(runs: Path, warmup_steps: int) -> dict:
    """tools/gpu_run.sh's comparison of the trainer's runs: each one's img/s over the synthetic-data (DDP) run's,
    for those that ran, each one's peak memory, and FSDP's step time over DDP's."""
    rate = {name: run_rate(runs, name, warmup_steps) for name in GPU_RUNS}
    out: dict[str, Any] = {"img_s": rate, "peak_memory_mb": {name: run_peak_memory_mb(runs, name) for name in GPU_RUNS}}
    base = rate["synthetic"]
    for name, key in GPU_RATIOS.items():
        value = rate[name]
        if base and value is not None:
            out[key] = value / base
    if base and rate["fsdp"]:  # the same batch: step time is the inverse of img/s
        out["fsdp_step_time_over_ddp"] = base / rate["fsdp"]
    if "gpu_over_synthetic" in out:
        out["goal_gpu_ge_0_95"] = out["gpu_over_synthetic"] >= GPU_GOAL
    common.emit("decode_gpu", out)
    return out


def main(argv: list[str]) -> int:
    """``python -m job.bench.decode RUNS WARMUP [NAME]``: one run's img/s as soon as it has run (NAME), or the
    comparison of them all (a JSON line each)."""
    runs, warmup = Path(argv[0]), int(argv[1])
    if len(argv) > 2:
        point = {"run": argv[2], "img_s": run_rate(runs, argv[2], warmup)}
        common.emit_point("decode_gpu", {**point, "peak_memory_mb": run_peak_memory_mb(runs, argv[2])})
        return 0
    summarise_gpu(runs, warmup)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
