"""GPU throughput table of the efficiency options (one GPU; prepared on a CPU machine, run on the device machine).

ResNet-50, synthetic ImageNet-size batches held in pinned HOST memory (so the host-to-device copy is part of
every step, as with a real DataLoader; the job's own `data.source=synthetic` keeps images on the GPU and
would hide it). Rows: fp32 (IEEE), fp32+tf32, bf16, bf16+channels_last, bf16+channels_last+compile, each
with and without job.data.prefetch's side-stream copy; then the wrapper overhead on one GPU: no wrapper vs DDP
vs nn.DataParallel (bf16+channels_last, prefetch on). Every model is built and wrapped by the job's own
modules (job.tasks.image.model, job.parallel.ddp.wrap_model, job.train.optim).

    python tools/gpu_efficiency.py --out $OUT/efficiency_gpu.json [--batch 256 --steps 30 --warmup 8 --budget-s 420]

Writes JSON (one record per row, plus the device and versions) and prints a markdown table. A row that would
start after --budget-s seconds is recorded as skipped, so the run always finishes inside its time box.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from job.config import load_config
from job.data.loaders import to_device
from job.data.prefetch import DevicePrefetcher
from job.parallel import ddp as parallel
from job.parallel.distributed import Runtime
from job.tasks.image.model import build_model, image_probe
from job.train.optim import build_optimizer


class HostBatches:
    """`n` batches of pinned uint8 images + labels, handed out round-robin like a DataLoader with pin_memory."""

    def __init__(self, batch: int, size: int, n: int, count: int, pin: bool = True) -> None:
        g = torch.Generator().manual_seed(0)
        self.pool = [
            (
                torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g),
                torch.randint(0, 1000, (batch,), generator=g),
            )
            for _ in range(n)
        ]
        if pin:
            self.pool = [(x.pin_memory(), y.pin_memory()) for x, y in self.pool]
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Any:
        for i in range(self.count):
            yield self.pool[i % len(self.pool)]


def run_row(row: dict[str, Any], args: argparse.Namespace, rt: Runtime) -> dict[str, Any]:
    flags = [
        "--model.name",
        "resnet50",
        "--model.channels-last",
        str(row["channels_last"]).lower(),
        "--train.strategy",
        "dp" if row["strategy"] == "dp" else "ddp",
        "--train.tf32",
        str(row.get("tf32", False)).lower(),
        "--optim.name",
        "sgd",
        "--optim.lr",
        "0.01",
    ]
    cfg = load_config(flags, {})
    torch.manual_seed(0)
    raw = build_model(cfg.model, 1000).to(rt.device)
    if row["strategy"] == "none":
        parallel.apply_tf32(cfg.train.tf32)
        model: nn.Module = raw
    else:
        model = parallel.wrap_model(raw, cfg, rt, image_probe(cfg.data.image_size, rt.device))
    train_model = torch.compile(model) if row["compile"] else model
    opt = build_optimizer(raw, cfg.optim, cfg.optim.lr, rt.device)
    cuda = rt.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(rt.device)) if cuda else (lambda: None)
    autocast = (
        torch.autocast(rt.device.type, dtype=torch.bfloat16) if row["precision"] == "bf16" else contextlib.nullcontext()
    )
    total = args.warmup + args.steps
    source: Any = HostBatches(args.batch, args.size, 4, total, pin=cuda)
    if row["prefetch"]:
        source = DevicePrefetcher(source, rt.device, cfg.model.channels_last)
    crit = nn.CrossEntropyLoss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)
    t_start = time.perf_counter()
    t0 = None
    for i, batch in enumerate(source):
        if i == args.warmup:
            sync()
            t0 = time.perf_counter()
        images, labels = to_device(batch, rt.device, cfg.model.channels_last)
        with autocast:
            loss = crit(train_model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    elapsed = time.perf_counter() - t0
    return dict(
        row,
        images_per_s=round(args.batch * args.steps / elapsed, 1),
        step_ms=round(1000 * elapsed / args.steps, 2),
        warmup_s=round(t0 - t_start, 1),
        peak_mem_gib=round(torch.cuda.max_memory_allocated(rt.device) / 2**30, 2) if cuda else None,
        final_loss=round(loss.item(), 4),
    )


def rows() -> list[dict[str, Any]]:
    """Cheap rows first, torch.compile (about a minute of compiling) last, so a tight budget loses the least."""

    def precision_rows(specs: list[tuple[str, bool, bool, bool]]) -> list[dict[str, Any]]:
        return [
            dict(
                table="precision",
                precision=p,
                tf32=tf32,
                channels_last=cl,
                compile=comp,
                prefetch=prefetch,
                strategy="ddp",
            )
            for p, cl, comp, tf32 in specs
            for prefetch in (False, True)
        ]

    out = precision_rows(
        [
            ("fp32", False, False, False),
            ("fp32", False, False, True),
            ("bf16", False, False, False),
            ("bf16", True, False, False),
        ]
    )
    out += [
        dict(
            table="wrapper",
            precision="bf16",
            tf32=False,
            channels_last=True,
            compile=False,
            prefetch=True,
            strategy=strategy,
        )
        for strategy in ("none", "dp")
    ]  # "ddp" is the bf16+channels_last row above
    return out + precision_rows([("bf16", True, True, False)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="check the script's logic on a CPU: tiny sizes, "
        "rows without prefetch/compile/dp (those need CUDA); numbers meaningless",
    )
    args = ap.parse_args()
    if args.cpu_smoke:
        device, backend = torch.device("cpu"), "gloo"
        args.batch, args.size, args.steps, args.warmup = 2, 32, 2, 1
        todo = [r for r in rows() if not (r["prefetch"] or r["compile"] or r["strategy"] == "dp")]
    else:
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --cpu-smoke)"
        device, backend, todo = torch.device("cuda", 0), "nccl", rows()
        torch.cuda.set_device(device)
    # World size 1 on an in-memory store: DDP needs a process group, and nothing here may touch os.environ.
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device if device.type == "cuda" else None
    )
    rt = Runtime(device=device, backend=backend, control_group=None)
    start = time.perf_counter()
    results = []
    for row in todo:
        if time.perf_counter() - start > args.budget_s:
            results.append(dict(row, skipped="time budget"))
            continue
        try:
            results.append(run_row(row, args, rt))
        except Exception as e:
            results.append(dict(row, error=f"{type(e).__name__}: {e}"[:500]))
        torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "batch": args.batch,
                    "size": args.size,
                    "steps": args.steps,
                    "rows": results,
                },
                indent=1,
            )
        )
    dist.destroy_process_group()
    print("\n| precision | tf32 | channels_last | compile | prefetch | wrapper | images/s | step ms | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['precision']} | {r['tf32']} | {r['channels_last']} | {r['compile']} | {r['prefetch']} | {r['strategy']} "
            f"| {r.get('images_per_s', r.get('skipped') or r.get('error', ''))} | {r.get('step_ms', '')} | {r.get('peak_mem_gib', '')} |"
        )


if __name__ == "__main__":
    main()
