"""Exact validation over all ranks, and the evaluation component with its own cadence (``train.eval_every``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from job.data.loaders import to_device
from job.observe.metrics import NullWriter
from job.train.parts import Parts


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Any,
    device: torch.device,
    num_classes: int,
    channels_last: bool,
    autocast: contextlib.AbstractContextManager[Any],
) -> dict[str, float]:
    """Exact over all ranks: each rank holds a disjoint shard; sums and counts are all-reduced, never means.

    Runs the unwrapped model: shards may differ in length, and DDP's forward would broadcast buffers, a
    collective every rank must join the same number of times.
    """
    was_training = model.training
    model.eval()
    k = min(5, num_classes)
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss_sum, top1, topk, count
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for batch in loader:
        images, labels = to_device(batch, device, channels_last)
        with autocast:
            logits = model(images)
        logits = logits.float()
        topk = logits.topk(k, dim=1).indices
        totals[0] += criterion(logits, labels).double()
        totals[1] += (topk[:, 0] == labels).sum()
        totals[2] += (topk == labels[:, None]).any(dim=1).sum()
        totals[3] += labels.numel()
    dist.all_reduce(totals)
    loss_sum, top1, topk_hits, count = totals.tolist()
    model.train(was_training)
    count = max(count, 1.0)
    return {"val/loss": loss_sum / count, "val/top1": top1 / count, "val/top5": topk_hits / count, "val/count": count}


class Evaluator:
    """Evaluates the model (and its EMA) every ``every`` steps during training, and once at the end."""

    def __init__(self, parts: Parts, num_classes: int, every: int, total_steps: int, writer: NullWriter) -> None:
        self.parts, self.num_classes, self.every, self.total_steps, self.writer = (
            parts,
            num_classes,
            every,
            total_steps,
            writer,
        )

    def results(self) -> dict[str, float]:
        """Validation metrics of the model, and of the EMA as ``ema/...`` when it is enabled (every rank)."""
        p = self.parts
        out = evaluate(p.raw_model, p.loaders.val, p.device, self.num_classes, p.channels_last, p.autocast)
        if p.ema is not None:
            ema = evaluate(p.ema.module, p.loaders.val, p.device, self.num_classes, p.channels_last, p.autocast)
            out.update({f"ema/{k}": v for k, v in ema.items()})
        return out

    def after_step(self, step: int) -> None:
        """The periodic evaluation; the last step is evaluated by the run's end, with the final report."""
        if self.every and step % self.every == 0 and step < self.total_steps:
            self.writer.scalars(step, self.results())
