"""Values derived from the frozen config and the world size, computed once and logged at start.

The config says what the user asked for (global batch, micro batch, base LR); the plan says what that
means on this many ranks. Nothing here mutates the config.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from job.config import JobConfig
from job.errors import BadInput


@dataclass(frozen=True)
class Plan:
    world_size: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    total_steps: int
    lr: float
    """Peak LR after the scaling rule."""

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


def scaled_lr(base_lr: float, rule: str, global_batch_size: int, base_batch: int) -> float:
    if rule == "none":
        return base_lr
    if rule == "linear":
        return base_lr * global_batch_size / base_batch
    if rule == "sqrt":
        return base_lr * math.sqrt(global_batch_size / base_batch)
    raise ValueError(f"unknown lr scaling rule {rule!r}")


def make_plan(cfg: JobConfig, world_size: int) -> Plan:
    """Derive the per-rank batch layout: global_batch_size = micro_batch_size x grad_accum_steps x world_size.

    Raises:
        BadInput: the batch sizes do not divide; the message prints the numbers.
    """
    gbs = cfg.train.global_batch_size
    micro = cfg.train.micro_batch_size
    if micro == 0:
        if gbs % world_size:
            raise BadInput(
                f"train.global_batch_size={gbs} is not divisible by world_size={world_size}.",
                f"choose a global batch that is a multiple of {world_size}, or set train.micro_batch_size.",
                setting="train.global_batch_size",
                value=gbs,
            )
        micro = gbs // world_size
    if gbs % (micro * world_size):
        raise BadInput(
            f"train.global_batch_size={gbs} must equal train.micro_batch_size x grad_accum_steps x world_size, "
            f"but {gbs} is not a multiple of micro_batch_size x world_size = {micro} x {world_size} = {micro * world_size}.",
            f"use a global batch that is a multiple of {micro * world_size}, or change train.micro_batch_size.",
            setting="train.global_batch_size",
            value=gbs,
        )
    return Plan(
        world_size=world_size,
        global_batch_size=gbs,
        micro_batch_size=micro,
        grad_accum_steps=gbs // (micro * world_size),
        total_steps=cfg.train.steps,
        lr=scaled_lr(cfg.optim.lr, cfg.optim.lr_scaling, gbs, cfg.optim.lr_scaling_base),
    )
