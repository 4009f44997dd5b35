"""Optimizer with no-decay parameter groups, and the LR schedule from torch.optim.lr_scheduler.

Optimizers: torch SGD / AdamW (fused kernels on CUDA, foreach elsewhere and under ZeRO) and the large-batch optimizers
LARS / LAMB from timm (``timm.optim.Lars``, ``timm.optim.Lamb``: maintained implementations, not ours).
``optim.zero`` shards any of them over ranks with ZeroRedundancyOptimizer (job.parallel.ddp).

The scheduler is stepped once per optimizer step (not per epoch), so ``total_steps`` is the horizon.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    ConstantLR,
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    MultiStepLR,
    OneCycleLR,
    SequentialLR,
    StepLR,
)

from job.config import OptimConfig, SchedConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices/kernels only: norm scales and biases are 1-d and decaying them hurts."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _impl_kwargs(device: torch.device, zero: bool) -> dict[str, bool]:
    # Fused kernels on CUDA: they take the non-finite guard's flag and skip on the device (job.train.guard).
    # Elsewhere foreach: torch's fused CPU AdamW under DDP drifted from foreach by 3e-2 in 4 steps
    # (tests/test_parallel.py::test_zero_matches_plain_optimizer), and on the CPU a flag read is no device sync.
    # Under ZeRO foreach on CUDA too: ZeroRedundancyOptimizer.load_state_dict moves 0-d "step" tensors to the
    # CPU, which the fused kernels refuse.
    if device.type == "cuda" and not zero:
        return {"fused": True}
    return {"foreach": True}


def optimizer_spec(cfg: OptimConfig, lr: float, device: torch.device) -> tuple[type[Optimizer], dict[str, Any]]:
    """(class, keyword arguments) of the configured optimizer; weight decay comes per parameter group."""
    if cfg.name == "sgd":
        return torch.optim.SGD, dict(
            lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **_impl_kwargs(device, cfg.zero)
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW, dict(lr=lr, betas=cfg.betas, **_impl_kwargs(device, cfg.zero))
    from timm.optim import Lamb, Lars  # imported on demand: timm's import costs ~1 s

    if cfg.name == "lars":
        # Layer-wise trust ratio; timm skips it for the no-decay group (norms, biases) as in You et al. 2017.
        return Lars, dict(lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, trust_coeff=cfg.trust_coeff)
    if cfg.name == "lamb":
        # max_grad_norm=None: timm's LAMB would otherwise clip by the norm of the gradients *it* holds, which
        # under ZeRO is one rank's shard. Clipping is train.grad_clip_norm's job (global, over all ranks).
        return Lamb, dict(lr=lr, betas=cfg.betas, max_grad_norm=None)
    raise ValueError(f"optim.name={cfg.name!r}")  # unreachable: the config's Literal forbids it


def scaled_groups(groups: list[dict[str, Any]], lr: float, weight_decay: float) -> list[dict[str, Any]]:
    """A task's parameter groups for the optimizer: ``lr`` x each group's ``lr_scale`` (so LR scaling and the
    schedule apply to every group alike), ``weight_decay`` where the group sets none."""
    out = []
    for group in groups:
        g = {k: v for k, v in group.items() if k != "lr_scale"}
        g["lr"] = lr * float(group.get("lr_scale", 1.0))
        g.setdefault("weight_decay", weight_decay)
        out.append(g)
    return out


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, lr: float, device: torch.device, groups: list[dict[str, Any]] | None = None
) -> Optimizer:
    """The configured optimizer over ``groups`` (a task's, job.tasks.preflight), else the job's decay/no-decay
    groups of ``model``."""
    if groups is None:
        groups = param_groups(model, cfg.weight_decay)
    else:
        groups = scaled_groups(groups, lr, cfg.weight_decay)
    cls, kwargs = optimizer_spec(cfg, lr, device)
    if cfg.zero:
        from job.parallel.ddp import zero_optimizer

        return zero_optimizer(groups, cls, kwargs)
    return cls(groups, **kwargs)


class GroupCosine(CosineAnnealingLR):
    """Cosine annealing to a floor of ``min_lr_factor`` x each group's own base LR: a task's ``lr_scale`` holds
    at the floor too (torch's ``eta_min`` is one value for every group). Closed form, as torch's for one group."""

    def __init__(self, optimizer: Optimizer, steps: int, min_lr_factor: float) -> None:
        self.eta_mins = [float(g.get("initial_lr", g["lr"])) * min_lr_factor for g in optimizer.param_groups]
        super().__init__(optimizer, T_max=steps, eta_min=self.eta_mins[0])

    def get_lr(self) -> list[float | torch.Tensor]:
        return self._get_closed_form_lr()

    def _get_closed_form_lr(self) -> list[float | torch.Tensor]:
        cos = (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
        return [eta + (base - eta) * cos for base, eta in zip(self.base_lrs, self.eta_mins, strict=True)]


def build_scheduler(optimizer: Optimizer, cfg: SchedConfig, total_steps: int) -> LRScheduler:
    """Linear warmup (if any) followed by the main schedule over the remaining steps.

    Step counts are optimizer steps from the start of training: ``milestones`` are absolute steps; step's
    ``step_size`` counts from the end of the warmup. One-cycle brings its own warmup (``pct_start``).
    """
    if cfg.name == "onecycle":
        peak = [g["lr"] for g in optimizer.param_groups]  # per group: a task's lr_scale holds through the cycle
        # cycle_momentum=False: keep momentum/betas fixed so every optimizer (timm's too) behaves the same.
        return OneCycleLR(
            optimizer,
            max_lr=peak,
            total_steps=max(total_steps, 2),
            pct_start=cfg.pct_start,
            anneal_strategy="cos",
            cycle_momentum=False,
            div_factor=cfg.div_factor,
            final_div_factor=cfg.final_div_factor,
        )
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    main_steps = max(total_steps - warmup, 1)
    if cfg.name == "cosine":
        main: LRScheduler = GroupCosine(optimizer, steps=main_steps, min_lr_factor=cfg.min_lr_factor)
    elif cfg.name == "step":
        main = StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    elif cfg.name == "multistep":
        # SequentialLR restarts the main schedule's count at the warmup's end: shift to absolute steps.
        main = MultiStepLR(optimizer, milestones=[m - warmup for m in cfg.milestones], gamma=cfg.gamma)
    else:
        main = ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup == 0:
        return main
    ramp = LinearLR(optimizer, start_factor=cfg.warmup_start_factor, end_factor=1.0, total_iters=warmup)
    return SequentialLR(optimizer, schedulers=[ramp, main], milestones=[warmup])
