"""The parts of a training run, built in one place: loaders, model (raw, wrapped, compiled), optimizer,
schedule, gradient scaler, EMA and the task. ``build_parts`` is the whole wiring; nothing here trains.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from job.cluster.env import DistEnv
from job.config import JobConfig
from job.config.plan import Plan
from job.data.items import task_loaders
from job.data.loaders import Loaders
from job.parallel import ddp, distributed, fsdp, meta_init
from job.tasks.contract import Bound, TrainingStep
from job.tasks.load import load_task
from job.tasks.preflight import Checked, check_task, check_values, transfer
from job.train.ema import Ema, build_ema
from job.train.guard import NonFiniteGuard
from job.train.optim import build_optimizer, build_scheduler

log = logging.getLogger("job")


@dataclass
class Parts:
    device: torch.device
    loaders: Loaders
    raw_model: nn.Module
    """The model itself: what is saved, evaluated and averaged."""
    model: nn.Module
    """The DDP (or DataParallel) wrapper of the task's ``TrainingStep`` around ``raw_model``: gradient
    all-reduce, ``no_sync()``."""
    train_model: nn.Module
    """What the step calls with a batch: ``model``, compiled whole when ``model.compile`` is set (under fsdp or
    with activation checkpointing the units are compiled instead); it returns the checked output of the task's
    ``loss(raw_model, batch)``."""
    optimizer: Optimizer
    scheduler: LRScheduler
    scaler: torch.amp.GradScaler
    ema: Ema | None
    task: Bound
    """The training problem: loss and metrics (job.tasks.contract)."""
    metric_names: tuple[str, ...]
    autocast: contextlib.AbstractContextManager[Any]
    guard: NonFiniteGuard
    """Skips non-finite updates on the device and counts them (job.train.guard)."""
    probe_batch: Any = None
    """Preflight's batch (on the CPU): the uncounted forward of a rank whose validation shard ended (fsdp)."""

    def to_device(self, batch: Any) -> Any:
        """A batch as the task's loss and metrics take it, on the training device."""
        return transfer(self.task, batch, self.device)


def build_parts(
    cfg: JobConfig,
    env: DistEnv,
    plan: Plan,
    rt: distributed.Runtime,
    task: Bound | None = None,
    checked: Checked | None = None,
    initial_weights: bool = True,
) -> Parts:
    """Every part, from the model preflight built (identical on every rank; DDP also broadcasts rank 0's
    weights). ``initial_weights``: load the weights preflight left to after the process group (a resumed run does
    not: its checkpoint holds the weights). Without ``task`` and ``checked`` (a test, a tool), the config's task
    is loaded and checked here."""
    if task is None or checked is None:
        task = load_task(cfg)
        checked = check_task(task, cfg, env, plan, rt.device.type == "cuda", load_weights=initial_weights)
    device = rt.device
    distributed.seed_all(cfg.run.seed)
    loaders = _loaders(cfg, env, plan, device, task, checked)
    raw_model = checked.model
    if initial_weights and task.has("load_pending_weights"):
        task.task.load_pending_weights(raw_model, env)
    groups = checked.param_groups
    if cfg.train.strategy == "fsdp":
        names = {id(p): n for n, p in raw_model.named_parameters()}
        raw_model, ema, units_compiled = _sharded(cfg, env, task, checked, device)
        groups = fsdp.remap_groups(groups, names, raw_model)
        # The step module only hands loss the user's module, as everywhere else.
        model: nn.Module = TrainingStep(raw_model, task)
    else:
        raw_model = raw_model.to(device)
        ema = build_ema(raw_model, cfg.ema)
        units_compiled = _prepare_units(raw_model, cfg, task)
        settle = _loss_probe(transfer(task, checked.batch, device))
        # The wrapper wraps the task's step, not the model: loss gets the user's own module, as everywhere else.
        model = ddp.wrap_model(TrainingStep(raw_model, task), cfg, rt, settle)  # DDP, or the dp baseline
    train_model = model
    if cfg.model.compile and not units_compiled:
        train_model = cast(
            nn.Module, torch.compile(model, backend=cfg.model.compile_backend, mode=cfg.model.compile_mode)
        )
    optimizer = build_optimizer(raw_model, cfg.optim, plan.lr, device, groups)
    if not cfg.optim.zero:  # a sharded load, under either strategy, needs the state's shape (job.parallel.fsdp)
        fsdp.init_optimizer_state(optimizer)
    return Parts(
        device=device,
        loaders=loaders,
        raw_model=raw_model,
        model=model,
        train_model=train_model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.sched, plan.total_steps),
        scaler=torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16"),
        ema=ema,
        task=task,
        metric_names=checked.metric_names,
        autocast=autocast(cfg.train.precision, device),
        guard=NonFiniteGuard(optimizer, device, cfg.train.max_nonfinite_skips, cfg.train.precision == "fp16"),
        probe_batch=checked.batch,
    )


def _sharded(
    cfg: JobConfig, env: DistEnv, task: Bound, checked: Checked, device: torch.device
) -> tuple[nn.Module, Ema | None, bool]:
    """Preflight's model sharded in place (its hooks gather and reduce-scatter; its parameters become DTensors of
    this rank's chunks), and the EMA sharded the same way (FSDP modules cannot be copied, so it is copied first);
    the model's units checkpointed and compiled between the two (``_prepare_units``, whose answer is returned).

    A meta model (``checked.replay``) is sharded on meta, then only this rank's chunks are allocated on
    ``device`` and filled with the CPU build's values, one tensor at a time: no rank holds the whole model. The
    EMA starts equal to it, and preflight's loss and metrics checks run on it now (``check_values``)."""
    raw_model = checked.model
    replay = checked.replay
    if replay is None:
        raw_model = raw_model.to(device)
    ema = build_ema(raw_model, cfg.ema)
    shape = fsdp.mesh_shape(cfg.fsdp, env.world_size, env.local_world_size)
    if env.is_main:
        log.info("fsdp mesh: %s (replicate x shard; docs/sharding.md)", fsdp.mesh_label(shape))
    if ema is not None:
        fsdp.shard(ema.module, cfg, task, device, shape)
    units_compiled = _prepare_units(raw_model, cfg, task)
    raw_model = fsdp.shard(raw_model, cfg, task, device, shape)
    if replay is not None:
        replay.materialise(raw_model, device)
        if ema is not None:
            meta_init.allocate(ema.module, device)
            ema.start_from(raw_model)
        check_values(task, checked, raw_model, device)
        fsdp.reshard(raw_model)  # its forward may have left units gathered: the optimizer takes the shards
        if env.is_main:
            params = list(raw_model.parameters())
            mine = sum(fsdp.local(p).numel() * p.element_size() for p in params)
            whole = sum(p.numel() * p.element_size() for p in params)
            log.info("fsdp: model built on the meta device; rank 0 holds %d of its %d parameter bytes", mine, whole)
    return raw_model, ema, units_compiled


def _prepare_units(model: nn.Module, cfg: JobConfig, task: Bound) -> bool:
    """Activation checkpointing, then compile, of each unit: after the EMA's copy (evaluated without gradients,
    it recomputes nothing), before sharding or wrapping (torchtitan's order). Under fsdp or with activation
    checkpointing ``model.compile`` compiles the units (job.parallel.fsdp.compile_units); True when it did, else
    the whole step is compiled."""
    if cfg.train.activation_checkpointing:
        count = fsdp.checkpoint_activations(model, cfg, task)
        log.info("train.activation_checkpointing: checkpointing the activations of %d units", count)
    if not cfg.model.compile or (cfg.train.strategy != "fsdp" and not cfg.train.activation_checkpointing):
        return False
    count = fsdp.compile_units(model, cfg, task)
    if count:
        log.info("model.compile: compiled %d units (the rest of the step runs eagerly)", count)
    return count > 0


def _loaders(cfg: JobConfig, env: DistEnv, plan: Plan, device: torch.device, task: Bound, checked: Checked) -> Loaders:
    """The task's own loaders (the image task: its sources' pipelines, prefetched to the GPU), else the job's
    over the datasets preflight opened."""
    micro, accum, seed = plan.micro_batch_size, plan.grad_accum_steps, cfg.run.seed
    if task.has("loaders"):
        loaders = task.task.loaders(env.rank, env.world_size, micro, seed, device, accum)
        return cast(Loaders, loaders)
    sets = checked.datasets
    return task_loaders(cfg.data, sets, task.collate, task.error, env.rank, env.world_size, micro, seed, device, accum)


def _loss_probe(batch: Any) -> Callable[[nn.Module], torch.Tensor]:
    """The task's loss on the preflight batch, through the wrapped ``TrainingStep``: DDP's start-up passes run
    the real training graph."""

    def probe(model: nn.Module) -> torch.Tensor:
        out: torch.Tensor = model(batch)[0]
        return out

    return probe


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16
    if precision == "fp16":
        dtype = torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
