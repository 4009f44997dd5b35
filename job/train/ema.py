"""Exponential moving average of the weights (``ema.enabled``), kept in a torch.optim.swa_utils.AveragedModel
(its state dict is the checkpoint format) but updated here with one ``torch._foreach_lerp_``: AveragedModel's own
update reads ``n_averaged`` on the host at every update, a device synchronisation.

The EMA copy averages parameters AND buffers (BatchNorm running statistics), so it can be evaluated as is.
Every rank holds the same EMA parameters (the weights it averages are identical after each DDP step); its
buffers average each rank's own statistics, so they are made rank 0's before evaluation and before a save. It is
checkpointed with the model, as every rank's shards (job.checkpoint.sharded), and every rank restores it on resume.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

from job.config import EmaConfig

log = logging.getLogger("job")


class Ema:
    def __init__(self, model: nn.Module, cfg: EmaConfig) -> None:
        self.every, self.decay = cfg.every, cfg.decay
        self.averaged = AveragedModel(model, use_buffers=True)
        self.averaged.requires_grad_(False)
        self.updates = 0
        """``n_averaged`` known on the host (set from the checkpoint on resume), so no update reads the device."""

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step ``step`` (1-based): fold the current weights in every ``ema.every`` steps, buffers
        (BatchNorm statistics) too. The first update copies the weights (AveragedModel's n_averaged == 0 case)."""
        if step % self.every != 0:
            return
        ema_float, cur_float, ema_other, cur_other = [], [], [], []
        for e, c in zip(_tensors(self.averaged.module), _tensors(model), strict=True):
            if e.is_floating_point():
                ema_float.append(e)
                cur_float.append(c)
            else:  # counters (num_batches_tracked): the current value
                ema_other.append(e)
                cur_other.append(c)
        with torch.no_grad():
            if self.updates == 0:
                torch._foreach_copy_(ema_float, cur_float)
            elif ema_float:
                torch._foreach_lerp_(ema_float, cur_float, 1.0 - self.decay)
            if ema_other:
                torch._foreach_copy_(ema_other, cur_other)
            self.averaged.n_averaged.add_(1)
        self.updates += 1

    def start_from(self, model: nn.Module) -> None:
        """The averaged copy set equal to ``model`` (parameters and buffers; each rank its own shards): an EMA
        built from a model on the meta device, allocated with ``to_empty``, starts where the model does."""
        with torch.no_grad():
            torch._foreach_copy_(_tensors(self.averaged.module), _tensors(model))

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()  # module.* tensors + n_averaged

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if saved is None:
            # A run that enabled EMA on resume (allowed with ckpt.allow_config_change): start from the weights.
            log.warning("checkpoint has no EMA state: the EMA starts from the resumed weights")
            return
        self.averaged.load_state_dict(saved)
        self.updates = int(saved["n_averaged"])  # once, on resume


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers, detached, in AveragedModel's order. Under fsdp the EMA is sharded like the model
    (job.train.parts), so each rank averages its own shards: the local tensors, which the foreach ops take."""
    return [_local(t.detach()) for t in itertools.chain(model.parameters(), model.buffers())]


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.to_local()
    return t


def build_ema(model: nn.Module, cfg: EmaConfig) -> Ema | None:
    return Ema(model, cfg) if cfg.enabled else None
