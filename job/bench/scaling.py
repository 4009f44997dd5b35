"""Scaling (GPU only): ResNet-50, bf16 autocast, channels_last, torch.compile off and on, images/s and MFU
on one GPU at batch sizes 128..512 (synthetic data already on the device: this measures the model step).

MFU = achieved model FLOP/s / the GPU's dense bf16 peak. ResNet-50 at 224 px costs 4.09 GFLOPs (multiply-adds
x 2) forward per image; training = 3x forward (forward + backward for inputs and weights).
Published for comparison: NVIDIA DeepLearningExamples ResNet-50 v1.5, 2,470 img/s on A100-80GB (AMP,
DGX A100, 1 GPU); H100 runs of the same scripts about 2,800 img/s. Goal: >= 4,000 img/s on the H200.

    ddp-job bench scaling [--quick] [--batches 128,256,384,512] [--compile both|on|off] [--compile-batches 512]
                          [--budget-s SECONDS]

Each measurement prints its JSON line when it is done (``"point": true``); the summary is the last line.
Compiled: one static-shape graph per compiled batch size (``dynamic=False``: no dynamic-shape recompile).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from job.bench import common

RESNET50_FWD_FLOPS = 4.09e9 * 2  # 4.09 GMACs per 224x224 image
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}  # dense, no sparsity


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


# Seconds a measurement may take, at most, on a GPU (model built, warm-up, timed steps; a compiled one: one cold
# inductor compile of ResNet-50's forward and backward). A measurement that would end past --budget-s is skipped.
COST_S = {False: 15.0, True: 100.0}


def measure(batch: int, compile_: bool, steps: int, warmup: int, size: int) -> dict[str, Any]:
    import torch
    import torchvision

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torchvision.models.resnet50(weights=None).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)
    # dynamic=False: one static graph for this batch size, never a dynamic-shape recompile
    step_model = torch.compile(model, dynamic=False) if compile_ else model
    x = torch.randn(batch, 3, size, size, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(step_model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        step()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1000)
    s = common.median_spread(times)
    mem = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, step_model, x, y
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {
        "batch": batch,
        "compile": compile_,
        "step_s": s,
        "img_s": batch / s["median"],
        "warmup_s": warm_s,
        "peak_mem_gib": mem,
    }


def plan(a: argparse.Namespace) -> list[tuple[int, bool]]:
    """(batch, compiled) in the order measured: every eager batch first (seconds each), then the compiled ones
    (``--compile-batches``, by default only the largest batch: one cold compile)."""
    batches = [int(b) for b in ("128" if a.quick else a.batches).split(",")]
    compiled = batches[-1:]
    if a.compile_batches:
        compiled = [int(b) for b in a.compile_batches.split(",")]
    out = []
    if a.compile in ("both", "off"):
        out += [(b, False) for b in batches]
    if a.compile in ("both", "on"):
        out += [(b, True) for b in compiled]
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", default="128,256,384,512")
    p.add_argument("--compile", default="both", choices=("both", "on", "off"))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--size", type=int, default=224)
    p.add_argument(
        "--compile-batches",
        default=None,
        help="the batch sizes measured compiled (default: the largest of --batches): one cold compile each",
    )
    p.add_argument("--budget-s", type=float, default=None, help="start no measurement that could end later")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    import torch

    if not torch.cuda.is_available():
        print(
            "bench scaling: needs a CUDA GPU and none is visible (torch.cuda.is_available() is False). This benchmark "
            "measures ResNet-50 on a GPU only. Fix: run it on a GPU machine (tools/gpu_run.sh).",
            flush=True,
        )
        common.emit("scaling", {"quick": a.quick, "skipped": "no CUDA GPU visible", "results": []})
        return 2
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    steps = a.steps or (5 if a.quick else 30)
    results, skipped = [], []
    for b, c in plan(a):
        if a.budget_s is not None and time.monotonic() - t0 + COST_S[c] > a.budget_s:
            skipped.append({"batch": b, "compile": c})
            common.emit_point("scaling", {"skipped": f"would end past --budget-s {a.budget_s:g}", **skipped[-1]})
            continue
        r = measure(b, c, steps, 3 if not c else 5, a.size)
        r["mfu"] = r["img_s"] * 3 * RESNET50_FWD_FLOPS * (a.size / 224) ** 2 / peak if peak else None
        results.append(r)
        print(f"batch {b} compile {c}: {r['img_s']:.0f} img/s", flush=True)
        common.emit_point("scaling", {"gpu": name, **r})
    if not results:
        common.emit("scaling", {"quick": a.quick, "gpu": name, "results": [], "skipped": skipped})
        return 1
    rows = [
        [
            r["batch"],
            "on" if r["compile"] else "off",
            f"{r['img_s']:.0f}",
            f"{100 * r['mfu']:.1f}%" if r["mfu"] else "?",
            common.fmt_ms(r["step_s"], 1000, " ms"),
            f"{r['peak_mem_gib']:.1f}",
        ]
        for r in results
    ]
    common.table(
        f"scaling: ResNet-50 bf16 channels_last {a.size}px on {name} (peak bf16 {peak and peak / 1e12:.0f} TFLOP/s)",
        ["batch", "compile", "img/s", "MFU", "step time", "peak GiB"],
        rows,
    )
    best = max(r["img_s"] for r in results)
    print(
        f"goal >= 4000 img/s: {'met' if best >= 4000 else 'MISSED'} (best {best:.0f}); published: A100 2,470, H100 ~2,800 img/s"
    )
    common.emit(
        "scaling",
        {
            "quick": a.quick,
            "gpu": name,
            "peak_flops": peak,
            "results": results,
            "best_img_s": best,
            "goal_ge_4000": best >= 4000,
            "skipped": skipped,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
