"""The trainer's SGD step with its two parameter groups (weight decay on weights, none on norms and biases,
``job.train.optim.param_groups``) vs one group decaying everything (the bare loop's), resnet18, one CPU thread:
fresh gradients before each step (as after ``zero_grad(set_to_none=True)`` and a backward), 80 steps
alternating between the two, median of the last 75.

    OMP_NUM_THREADS=1 python tools/profile_param_groups.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torchvision

from job.train.optim import param_groups


def build(groups: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    params = list(model.parameters())
    spec = param_groups(model, 1e-4) if groups == 2 else [{"params": params, "weight_decay": 1e-4}]
    return params, torch.optim.SGD(spec, lr=0.1, momentum=0.9, foreach=True)


def main() -> None:
    torch.set_num_threads(1)
    sides = {groups: build(groups) for groups in (1, 2)}
    times: dict[int, list[float]] = {1: [], 2: []}
    for i in range(80):
        order = (1, 2)
        if i % 2:
            order = (2, 1)
        for groups in order:
            params, opt = sides[groups]
            for p in params:
                p.grad = torch.randn_like(p)
            t0 = time.perf_counter()
            opt.step()
            times[groups].append(time.perf_counter() - t0)
    for groups, t in times.items():
        print(f"{groups} parameter group(s): {statistics.median(t[5:]) * 1000:.2f} ms per step")


if __name__ == "__main__":
    main()
