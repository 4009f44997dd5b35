"""Optimizer with no-decay parameter groups, and the LR schedule from torch.optim.lr_scheduler.

The scheduler is stepped once per optimizer step (not per epoch), so ``total_steps`` is the horizon.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR, StepLR, ConstantLR

from job.config import OptimConfig, SchedConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices/kernels only: norm scales and biases are 1-d and decaying them hurts."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _impl_kwargs(device: torch.device) -> dict[str, bool]:
    # fused kernels exist for CUDA; foreach (multi-tensor) is the fast path elsewhere.
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float, device: torch.device) -> Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **_impl_kwargs(device))
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, **_impl_kwargs(device))
    raise ValueError(f"optim.name={cfg.name!r}")  # unreachable: the config's Literal forbids it


def build_scheduler(optimizer: Optimizer, cfg: SchedConfig, total_steps: int) -> LRScheduler:
    """Linear warmup (if any) followed by the main schedule over the remaining steps."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    main_steps = max(total_steps - warmup, 1)
    if cfg.name == "cosine":
        base_lr = optimizer.param_groups[0]["lr"]
        main: LRScheduler = CosineAnnealingLR(optimizer, T_max=main_steps, eta_min=base_lr * cfg.min_lr_factor)
    elif cfg.name == "step":
        main = StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    else:
        main = ConstantLR(optimizer, factor=1.0, total_iters=0)
    if warmup == 0:
        return main
    ramp = LinearLR(optimizer, start_factor=cfg.warmup_start_factor, end_factor=1.0, total_iters=warmup)
    return SequentialLR(optimizer, schedulers=[ramp, main], milestones=[warmup])
