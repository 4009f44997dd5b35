"""Run under real torchrun (2 processes, gloo) by tests/test_parallel.py; rank 0 writes JSON to argv[1].

Scenarios, in one launch so the ~10 s start-up is paid once:
  hooks   for each comm hook (bf16, fp16; PowerSGD deadlocks on gloo and is refused there): a few DDP steps via job.parallel.ddp.wrap_model on a fixed
          batch of the generated dataset; losses, and the max parameter difference across ranks.
  memory  bytes of AdamW optimizer state per rank for a ResNet-50, with and without ZeRO.
  meta    the causal_lm GPT sharded with FSDP2 as train.strategy=fsdp builds it (job.parallel.meta_init: on meta,
          sharded, this rank's shards materialised), then as a CPU build would (whole, then sharded): the peak of
          live CPU tensor bytes of each, this rank's parameter bytes, and its shards against the CPU build's.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from job.config import load_config
from job.data.loaders import to_device
from job.data.source import build_loaders
from job.parallel import ddp as parallel
from job.parallel import fsdp, meta_init
from job.parallel.distributed import Runtime
from job.tasks.image.model import build_model, image_probe
from job.tasks.lm.gpt import GPT, GPTConfig
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


class LiveBytes(TorchDispatchMode):
    """The bytes of CPU tensor storages alive, and their peak: each storage counted when an operation first
    returns it, uncounted when it is freed (a storage's Python object lives as long as the storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, DTensor):
                t = t.to_local()
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.sizes:
                    self.sizes[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key)
        return out


def meta_run() -> dict:
    """Peak live CPU bytes while the GPT is built and sharded over the 2 ranks: from the meta device (the fsdp
    path), and whole on the CPU first (what it replaces). Rank 0 also checks its shards bitwise."""
    cfg = load_config(["--train.strategy", "fsdp"], {})
    gpt = GPTConfig(n_layer=8, n_head=2, n_embd=64, seq_len=16)
    out: dict[str, Any] = {}
    with LiveBytes() as meta:
        model, replay = meta_init.build(lambda: GPT(gpt), seed=5)
        assert replay is not None, "the GPT fell back to the CPU build"
        fsdp.shard(model, cfg, None, torch.device("cpu"), (1, dist.get_world_size()))
        replay.materialise(model, torch.device("cpu"))
    with LiveBytes() as cpu:
        torch.manual_seed(5)
        whole = GPT(gpt)
        fsdp.shard(whole, cfg, None, torch.device("cpu"), (1, dist.get_world_size()))
    params = list(model.parameters())
    out["meta_peak"], out["cpu_peak"] = meta.peak, cpu.peak
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["largest_bytes"] = max(p.numel() * p.element_size() for p in params)
    out["mine_bytes"] = sum(fsdp.local(p).numel() * p.element_size() for p in params)
    out["shards_equal_cpu_build"] = all(
        torch.equal(fsdp.local(a), fsdp.local(b))
        for a, b in zip(model.state_dict().values(), whole.state_dict().values(), strict=True)
    )
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
    results["meta"] = [None] * dist.get_world_size()
    dist.all_gather_object(results["meta"], meta_run())
    print(f"rank {dist.get_rank()}: memory done at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
