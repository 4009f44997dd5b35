"""Run under real torchrun (2 processes, gloo) by tests/test_rollback.py; each rank writes JSON to argv[1].rank.

ZeRO (AdamW) over 2 ranks, 6 updates with the same seeded gradients on every rank, those of steps 3 and 4 NaN:
once with the skipped updates never run (the flag read before ``step``), once run and undone by
job.train.rollback (the late host restore on the 0-d step counts, as on a GPU). Each rank reports whether the
whole model (after every step: what the next forward pass reads) and its optimizer shard came out bitwise
equal, and the bytes of the rollback's copy against the
whole model's parameters and this rank's state.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from job.train.rollback import Rollback, local_optimizer, state_complete, state_tensors

SKIPS = {3, 4}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 4))


def run(undo: bool) -> tuple[nn.Module, ZeroRedundancyOptimizer, Rollback, list[dict[str, torch.Tensor]]]:
    net = model()
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, foreach=True)
    rollback = Rollback(opt, torch.device("cpu"), on_host=lambda t: t.dim() == 0)
    after: list[dict[str, torch.Tensor]] = []  # the whole model after each step: what the next forward reads
    for step in range(1, 7):
        gen = torch.Generator().manual_seed(step)
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
            if step in SKIPS:
                p.grad.fill_(float("nan"))
        flag = torch.tensor(float(step in SKIPS))
        if undo and state_complete(opt):
            rollback.step(flag)
        elif not flag.item():
            opt.step()
        after.append({k: v.clone() for k, v in net.state_dict().items()})
    rollback.settle()
    return net, opt, rollback, after


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _, want_opt, _, want_after = run(undo=False)
    got_net, got_opt, rollback, got_after = run(undo=True)
    model_same = [all(torch.equal(w[k], g[k]) for k in w) for w, g in zip(want_after, got_after)]
    want_state, got_state = local_optimizer(want_opt).state_dict(), local_optimizer(got_opt).state_dict()
    state_same = all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for i in want_state["state"]
        for a, b in zip(want_state["state"][i].values(), got_state["state"][i].values())
    )
    moved = not all(torch.equal(a, b) for a, b in zip(model().state_dict().values(), got_net.state_dict().values()))
    result = {
        "rank": rank,
        "model_same": model_same,
        "state_same": state_same and want_state["state"].keys() == got_state["state"].keys(),
        "moved": moved,
        "copy_bytes": rollback.copy_bytes(),
        "model_bytes": sum(p.nbytes for p in got_net.parameters()),
        "state_bytes": sum(t.nbytes for t in state_tensors(got_opt) if t.dim() > 0),
    }
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
