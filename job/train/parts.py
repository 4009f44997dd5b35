"""The parts of a training run, built in one place: loaders, model (raw, wrapped, compiled), optimizer,
schedule, gradient scaler, EMA and loss. ``build_parts`` is the whole wiring; nothing here trains.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from job.cluster.env import DistEnv
from job.config import JobConfig
from job.config.plan import Plan
from job.data.loaders import Loaders
from job.data.prefetch import wrap_loaders
from job.data.source import build_loaders
from job.parallel import ddp, distributed
from job.train.ema import Ema, build_ema
from job.train.model import build_model
from job.train.optim import build_optimizer, build_scheduler
from job.train.weights import load_weights


@dataclass
class Parts:
    device: torch.device
    loaders: Loaders
    raw_model: nn.Module
    """The model itself: what is saved, evaluated and averaged."""
    model: nn.Module
    """The DDP (or DataParallel) wrapper: gradient all-reduce, ``no_sync()``."""
    train_model: nn.Module
    """What the step calls: ``model``, compiled when ``model.compile`` is set."""
    optimizer: Optimizer
    scheduler: LRScheduler
    scaler: torch.amp.GradScaler
    ema: Ema | None
    criterion: nn.Module
    autocast: contextlib.AbstractContextManager[Any]
    channels_last: bool


def build_parts(
    cfg: JobConfig, env: DistEnv, plan: Plan, rt: distributed.Runtime, initial_weights: bool = True
) -> Parts:
    """Every part, seeded the same way on every rank (DDP also broadcasts rank 0's weights). ``initial_weights``:
    load model.weights (a resumed run does not: its checkpoint holds the weights)."""
    device = rt.device
    distributed.seed_all(cfg.run.seed)
    loaders = build_loaders(
        cfg.data, env.rank, env.world_size, plan.micro_batch_size, cfg.run.seed, device, plan.grad_accum_steps
    )
    loaders = wrap_loaders(loaders, device, cfg.data.device_prefetch, cfg.model.channels_last)
    torch.manual_seed(cfg.run.seed)  # identical init everywhere
    raw_model = build_model(cfg.model, cfg.data.num_classes)
    if initial_weights:
        load_weights(cfg.model, raw_model, cfg.data.num_classes, env.is_main)
    raw_model = raw_model.to(device)
    model = ddp.wrap_model(raw_model, cfg, rt)  # DDP with its knobs/comm hook, or the dp baseline
    train_model = model
    if cfg.model.compile:
        train_model = cast(nn.Module, torch.compile(model, mode=cfg.model.compile_mode))
    optimizer = build_optimizer(raw_model, cfg.optim, plan.lr, device)
    return Parts(
        device=device,
        loaders=loaders,
        raw_model=raw_model,
        model=model,
        train_model=train_model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.sched, plan.total_steps),
        scaler=torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16"),
        ema=build_ema(raw_model, cfg.ema),
        criterion=nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing),
        autocast=autocast(cfg.train.precision, device),
        channels_last=cfg.model.channels_last,
    )


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16
    if precision == "fp16":
        dtype = torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
