"""Run under real torchrun (2 processes, gloo) by tests/test_parallel.py; rank 0 writes JSON to argv[1].

Scenarios, in one launch so the ~10 s start-up is paid once:
  hooks   for each comm hook (bf16, fp16; PowerSGD deadlocks on gloo and is refused there): a few DDP steps via job.parallel.ddp.wrap_model on a fixed
          batch of the generated dataset; losses, and the max parameter difference across ranks.
  memory  bytes of AdamW optimizer state per rank for a ResNet-50, with and without ZeRO.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from job.config import load_config
from job.data.loaders import to_device
from job.data.source import build_loaders
from job.parallel import ddp as parallel
from job.parallel.distributed import Runtime
from job.tasks.image.model import build_model, image_probe
from job.train.optim import build_optimizer


def hook_run(hook: str, data: str, rt: Runtime, steps: int = 5) -> dict:
    args = [
        "--ddp.comm-hook",
        hook,
        "--ddp.bucket-cap-mb",
        "4",
        "--data.path",
        data,
        "--data.num-classes",
        "4",
        "--data.image-size",
        "16",
        "--data.num-workers",
        "0",
        "--data.augment",
        "false",
        "--optim.name",
        "sgd",
        "--optim.lr",
        "0.05",
    ]
    cfg = load_config(args, {})
    rank, ws = dist.get_rank(), dist.get_world_size()
    loaders = build_loaders(cfg.data, rank, ws, 8, 0, rt.device)
    images, labels = to_device(next(iter(loaders.train)), rt.device)
    torch.manual_seed(0)
    raw = build_model(cfg.model, 4)
    model = parallel.wrap_model(raw, cfg, rt, image_probe(cfg.data.image_size, rt.device))
    opt = build_optimizer(raw, cfg.optim, cfg.optim.lr, rt.device)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in raw.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(gathered, flat)
    return {
        "losses": losses,
        "max_param_diff_across_ranks": max((g - gathered[0]).abs().max().item() for g in gathered),
    }


def memory_run(rt: Runtime) -> dict:
    """AdamW state for a ResNet-50 (exp_avg + exp_avg_sq per parameter): one step with synthetic gradients
    creates it; no forward pass is needed to size it."""
    out = {}
    for zero in (False, True):
        cfg = load_config(["--optim.name", "adamw", "--optim.lr", "0.001", "--optim.zero", str(zero).lower()], {})
        torch.manual_seed(0)
        model = torchvision.models.resnet50(num_classes=1000)
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt = build_optimizer(model, cfg.optim, cfg.optim.lr, rt.device)
        opt.step()
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, parallel.optimizer_state_bytes(opt))
        out["zero" if zero else "plain"] = per_rank
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def main() -> None:
    out_path, data = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rt = Runtime(device=torch.device("cpu"), backend="gloo", control_group=None)
    faulthandler.dump_traceback_later(300, repeat=True)  # a hang shows where it is in the test's stderr
    t0 = time.perf_counter()
    results: dict = {"hooks": {}}
    for hook in ("bf16", "fp16"):
        results["hooks"][hook] = hook_run(hook, data, rt)
        print(
            f"rank {dist.get_rank()}: hook {hook} done at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True
        )
    results["memory"] = memory_run(rt)
    print(f"rank {dist.get_rank()}: memory done at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
