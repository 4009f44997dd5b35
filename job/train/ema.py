"""Exponential moving average of the weights (``ema.enabled``), from torch.optim.swa_utils.

The EMA copy averages parameters AND buffers (BatchNorm running statistics), so it can be evaluated as is.
Every rank holds the same EMA (the weights it averages are identical after each DDP step), so no
communication is needed; rank 0 checkpoints it next to the model and every rank restores it on resume.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from job.config import EmaConfig

log = logging.getLogger("job")


class Ema:
    def __init__(self, model: nn.Module, cfg: EmaConfig) -> None:
        self.every = cfg.every
        # multi_avg_fn: one foreach lerp over all tensors instead of a Python loop per tensor.
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.decay), use_buffers=True)
        self.averaged.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step ``step`` (1-based): fold the current weights in every ``ema.every`` steps.
        The first update copies the weights (AveragedModel's n_averaged == 0 case)."""
        if step % self.every == 0:
            self.averaged.update_parameters(model)

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()  # module.* tensors + n_averaged

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if saved is None:
            # A run that enabled EMA on resume (allowed with ckpt.allow_config_change): start from the weights.
            log.warning("checkpoint has no EMA state: the EMA starts from the resumed weights")
            return
        self.averaged.load_state_dict(saved)


def build_ema(model: nn.Module, cfg: EmaConfig) -> Ema | None:
    return Ema(model, cfg) if cfg.enabled else None
