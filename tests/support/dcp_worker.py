"""Run under real torchrun (3 processes, gloo) by tests/test_dcp.py; rank 0 writes JSON to argv[1].

A small model whose rows do not split evenly over 3 ranks (7 and 2 rows: chunks of 3, 3, 1 and 1, 1, 0) is trained
2 AdamW steps under one strategy, saved as every rank's shards (job.checkpoint.sharded), and loaded into a fresh,
untrained model and optimizer under each strategy. Per case and rank: the largest difference between what was
saved and what was loaded, over the parameters, the optimizer state (as whole tensors) and its learning rate.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from job.checkpoint.sharded import Sharded
from job.config import load_config
from job.parallel import fsdp

CASES = (("ddp", "ddp"), ("ddp", "fsdp"), ("fsdp", "ddp"), ("fsdp", "fsdp"))
"""(strategy saved, strategy loaded)."""


def build(strategy: str) -> tuple[nn.Module, Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    if strategy == "fsdp":
        cfg = load_config(["--train.strategy", "fsdp", "--fsdp.units", "[Linear]"], {})
        fsdp.shard(model, cfg, None, torch.device("cpu"), (1, dist.get_world_size()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    fsdp.init_optimizer_state(optimizer)
    return model, optimizer


def trained(strategy: str) -> tuple[nn.Module, Optimizer]:
    """Two steps on the same batches on every rank (under either strategy the same update), then the learning rate
    a schedule would have set."""
    model, optimizer = build(strategy)
    for step in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.param_groups[0]["lr"] = 0.025
    return model, optimizer


def whole(model: nn.Module, optimizer: Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state by name, as whole tensors (gathered from the shards under fsdp), and the
    learning rate."""
    out: dict[str, torch.Tensor] = {"lr": torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float64)}
    for name, p in model.named_parameters():
        out[name] = fsdp.full_value(p.detach()).clone()
        for key, value in optimizer.state[p].items():
            out[f"{name}.{key}"] = fsdp.full_value(value).clone()
    return out


def case(out: Path, saved_as: str, loaded_as: str) -> dict[str, Any]:
    model, optimizer = trained(saved_as)
    want = whole(model, optimizer)
    rank = dist.get_rank()
    tmp, _, _ = Sharded(model, optimizer, rank).save(out, f"step-{saved_as}-{loaded_as}", rank == 0)
    fresh, fresh_optimizer = build(loaded_as)
    before = whole(fresh, fresh_optimizer)
    Sharded(fresh, fresh_optimizer, rank).load(tmp, {}, {})
    got = whole(fresh, fresh_optimizer)
    assert want.keys() == got.keys(), (sorted(want), sorted(got))
    return {
        "loaded_diff": max((want[k].double() - got[k].double()).abs().max().item() for k in want),
        "fresh_diff": min((want[k].double() - before[k].double()).abs().max().item() for k in want),
        "tensors": len(want),
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        results: dict[str, list[Any]] = {}
        for saved_as, loaded_as in CASES:
            mine = case(out, saved_as, loaded_as)
            results[f"{saved_as}->{loaded_as}"] = [None] * dist.get_world_size()
            dist.all_gather_object(results[f"{saved_as}->{loaded_as}"], mine)
        if dist.get_rank() == 0:
            (out / "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave as ddp-job does (job.cli.entrypoint): under load, the interpreter's teardown aborted a rank after
    # everything was written and the group destroyed ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
