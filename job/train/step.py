"""One optimizer step: ``grad_accum_steps`` micro-batches, gradients all-reduced once, the non-finite guard,
the update. A plain function of the run's parts: a test calls it in-process at world size 1.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from job.config import TrainConfig
from job.config.plan import Plan
from job.parallel import ddp, fsdp
from job.train.parts import Parts


@dataclass
class TrainState:
    """What the loop advances; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    micro_batches_in_epoch: int = 0
    """Micro-batches this rank consumed in ``epoch``: resume continues at exactly the next sample."""
    samples_seen: int = 0
    nonfinite_skips: int = 0


@dataclass
class StepOutput:
    loss: torch.Tensor
    """This rank's share of the step's loss (on device): for a mean loss, the mean over its micro-batches; for a
    ``(sum, count)`` loss, its sum x world_size / the global count. Either way the mean over the ranks is the
    loss of the global batch."""
    grad_norm: torch.Tensor
    """Global gradient norm after the all-reduce (before clipping)."""
    finite: torch.Tensor
    """Whether loss and gradient norm were finite (identical on every rank; a 0-d bool on the device)."""
    data_wait_s: float
    """Seconds this rank waited for its micro-batches."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """The task's extra values of the step (``loss`` returned ``(loss, {name: value})``), averaged like the loss."""


class Where(Protocol):
    """Where the step is, for a stop signal's report (``StopRequest`` is one); a cheap attribute write."""

    where: str


class _Nowhere:
    where = ""


def train_step(
    parts: Parts, batches: Iterator[Any], plan: Plan, state: TrainState, cfg: TrainConfig, where: Where | None = None
) -> StepOutput:
    """Run optimizer step ``state.step + 1`` and advance ``state``.

    A non-finite update is skipped on the device and counted there; ``parts.guard.check`` at a log or checkpoint
    step folds the count into ``state`` and enforces ``train.max_nonfinite_skips`` (job.train.guard).
    """
    where = where or _Nowhere()
    parts.task.before_step(state.step + 1, _epoch_of_next_step(parts, state))
    parts.model.train()
    step_loss = torch.zeros((), device=parts.device)
    count = torch.zeros((), device=parts.device)
    data_wait = 0.0
    last = plan.grad_accum_steps - 1
    extras: dict[str, torch.Tensor] = {}
    # What holds the gradient sync switch: the DDP wrapper, or under fsdp the model sharded in place.
    sync_owner = parts.raw_model if fsdp.is_fsdp(parts.raw_model) else parts.model
    for micro in range(plan.grad_accum_steps):
        where.where = f"step {state.step + 1} micro-batch {micro + 1}/{plan.grad_accum_steps}"
        t0 = time.perf_counter()
        batch = parts.to_device(next(batches))
        data_wait += time.perf_counter() - t0
        # Gradients are all-reduced only on the last micro-step: no_sync() on the others.
        with _sync_context(sync_owner, sync=micro == last):
            with parts.autocast:
                loss, n, values = parts.train_model(batch)  # the task's loss(raw_model, batch)
                if n is None:  # a mean: each micro-batch weighs alike
                    loss = loss / plan.grad_accum_steps
                else:  # a sum: normalised by the step's global count after accumulation (_per_item)
                    count += n.detach()
            parts.scaler.scale(loss).backward()
        step_loss += loss.detach()
        _accumulate(extras, values, plan.grad_accum_steps)
    factor = None
    if parts.task.counted:
        factor = _per_item(count)
        step_loss *= factor
    grad_norm = _unscale_and_norm(parts, cfg.grad_clip_norm, factor)
    # Every rank holds the same all-reduced gradients, so all decide alike, without the host.
    found_inf = parts.guard.flag(grad_norm, step_loss)
    _update(parts, found_inf)
    state.step += 1
    state.samples_seen += plan.global_batch_size
    where.where = f"the bookkeeping after step {state.step}"
    if parts.ema is not None:
        parts.ema.update(parts.raw_model, state.step)
    return StepOutput(step_loss, grad_norm, found_inf == 0, data_wait, extras)


def _epoch_of_next_step(parts: Parts, state: TrainState) -> int:
    """The epoch the next step's micro-batches come from: ``state.epoch`` advances only when the first batch
    of the next epoch is drawn, and a step never straddles two epochs (job.data.sampler)."""
    if state.micro_batches_in_epoch >= parts.loaders.batches_per_epoch:
        return state.epoch + 1
    return state.epoch


def _per_item(count: torch.Tensor) -> torch.Tensor:
    """world_size / the step's count over every micro-batch and rank: the factor that turns the accumulated,
    rank-averaged gradients of a summed loss into those of its mean over the global batch.

    Decision: scale the gradients after accumulation, before clipping and the update, rather than count every
    micro-batch first: the count may come out of the forward (tokens not masked, boxes matched), and no task
    member is needed to count a batch. Cost: one all-reduce of a scalar and one multiply over the gradients
    per step, both on the device (no host synchronisation)."""
    world_size = 1
    if dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
        dist.all_reduce(count)
    return world_size / count.clamp_min(1.0)  # an empty step (count 0) has zero gradients: no 0/0


def _accumulate(extras: dict[str, torch.Tensor], values: dict[str, torch.Tensor], grad_accum_steps: int) -> None:
    """The task's extra loss values, averaged over the step's micro-batches like the loss (on the device)."""
    for name, value in values.items():
        v = value.detach().float() / grad_accum_steps
        if name in extras:
            extras[name] += v
        else:
            extras[name] = v


def _sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    if sync:
        return contextlib.nullcontext()
    if fsdp.is_fsdp(model):
        return fsdp.no_sync(model)
    # DDP and the DataParallel baseline both have no_sync(); the type says Module.
    return cast(DistributedDataParallel, model).no_sync()


def _unscale_and_norm(parts: Parts, clip_norm: float, factor: torch.Tensor | None = None) -> torch.Tensor:
    parts.scaler.unscale_(parts.optimizer)
    params = list(parts.raw_model.parameters())
    if factor is not None:  # under fsdp each rank scales its own shards (the factor is the same everywhere)
        torch._foreach_mul_([fsdp.local(p.grad) for p in params if p.grad is not None], factor)
    # Under fsdp the norm of sharded gradients is a DTensor reduced over the ranks: the global norm.
    if clip_norm > 0:
        return fsdp.full_value(nn.utils.clip_grad_norm_(params, clip_norm, foreach=True))
    # The norm alone (logged, finite check): clip_grad_norm_ with inf would also rescale every gradient by 1.
    return fsdp.full_value(nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True))


def _update(parts: Parts, found_inf: torch.Tensor) -> None:
    parts.guard.update(found_inf)  # also skips GradScaler's fp16 overflows: their gradient norm is inf
    ddp.after_update(parts.model, found_inf)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
