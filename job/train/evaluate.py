"""Exact validation over all ranks, and the evaluation component with its own cadence (``train.eval_every``).

The task's ``metrics(model, batch)`` gives ``{name: (sum, count)}`` per batch. Each rank adds them up over its
disjoint shard of the validation set, then one all-reduce adds every rank's sums and counts: the reported
``sum / count`` is the value of the whole set, whatever the world size (means are never averaged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from job.observe.metrics import NullWriter
from job.observe.observer import no_mark
from job.parallel import distributed, fsdp
from job.train.parts import Parts

log = logging.getLogger("job")


@torch.no_grad()
def evaluate(model: nn.Module, parts: Parts, mark: Callable[[str], None] = no_mark) -> dict[str, float]:
    """``val/<name>`` = sum / count over every rank for each metric, ``val/count`` = the items evaluated, and
    the task's derived values (``summarize``). Every rank returns the same. ``mark``: records on this rank's
    progress file that its shard is done (job.observe.observer.Observer.mark), so that a stall report tells a rank
    still evaluating from one waiting for it.

    Runs the unwrapped model: shards may differ in length, and DDP's forward would broadcast buffers, a
    collective every rank must join the same number of times.
    """
    was_training = model.training
    model.eval()
    names = parts.metric_names
    totals = torch.zeros(2 * len(names) + 1, dtype=torch.float64, device=parts.device)
    info = parts.loaders.val_info
    totals[-1] = info.stop - info.start  # this rank's items: its shard of the sampler
    for batch, counted in _batches(model, parts):
        with parts.autocast:
            values = parts.task.metrics(model, batch)
        if counted:
            _add(totals, values, names, parts)
    mark("evaluated its shard, waiting in the evaluation's all-reduce")
    dist.all_reduce(totals)
    sums = totals.tolist()
    model.train(was_training)
    out = {f"val/{name}": sums[2 * i] / max(sums[2 * i + 1], 1e-12) for i, name in enumerate(names)}
    out["val/count"] = sums[-1]
    out.update(parts.task.summarize(out))
    return out


def _batches(model: nn.Module, parts: Parts) -> Iterator[tuple[Any, bool]]:
    """(batch on the device, whether its metrics count) for this rank's validation batches. Under fsdp every
    forward is a collective (each unit's all-gather), so while any rank still has a batch, a rank whose shard
    has ended runs the preflight batch uncounted: one flag all-reduce per batch."""
    loader = iter(parts.loaders.val)
    if not fsdp.is_fsdp(model):
        for batch in loader:
            yield parts.to_device(batch), True
        return
    while True:
        batch = next(loader, None)
        more = torch.tensor([int(batch is not None)], device=parts.device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        if batch is None:
            yield parts.to_device(parts.probe_batch), False
        else:
            yield parts.to_device(batch), True


def _add(totals: torch.Tensor, values: dict[str, tuple[Any, Any]], names: tuple[str, ...], parts: Parts) -> None:
    if tuple(values) != names:
        raise parts.task.error(
            f"metrics(model, batch) returned the metrics {list(values)} on a validation batch, but {list(names)} "
            "on the preflight batch.",
            "return the same metric names for every batch: every rank sums the same ones.",
        )
    for i, name in enumerate(names):
        total, count = values[name]
        totals[2 * i] += total
        totals[2 * i + 1] += count


class Evaluator:
    """Evaluates the model (and its EMA) every ``every`` steps during training, and once at the end."""

    def __init__(
        self,
        parts: Parts,
        every: int,
        total_steps: int,
        writer: NullWriter,
        mark: Callable[[str], None] = no_mark,
        console: bool = False,
    ) -> None:
        """``mark``: records each phase of an evaluation on this rank's progress file (``evaluate``); ``console``:
        this rank prints each periodic evaluation (rank 0)."""
        self.parts, self.every, self.total_steps, self.writer, self.mark = parts, every, total_steps, writer, mark
        self.console = console
        self.latest: dict[str, float] = {}
        """The newest evaluation's results (empty until the first): what a progress report carries."""
        self.latest_step = -1
        """The step ``latest`` evaluated (-1: none yet)."""

    def results(self, step: int = 0) -> dict[str, float]:
        """Validation metrics of the model, and of the EMA as ``ema/...`` when it is enabled (every rank), after
        optimizer step ``step``."""
        p = self.parts
        self.mark(f"evaluating after step {step}")  # before its first collective: a rank stalled here marked it
        distributed.broadcast_buffers(p.raw_model)  # the model rank 0 saves, on every rank
        out = evaluate(p.raw_model, p, self.mark)
        fsdp.reshard(p.raw_model)  # units left gathered (fsdp.reshard_after_forward: false) back to their shards
        if p.ema is not None:
            self.mark(f"evaluating the EMA after step {step}")
            distributed.broadcast_buffers(p.ema.module)
            out.update({f"ema/{k}": v for k, v in evaluate(p.ema.module, p, self.mark).items()})
            fsdp.reshard(p.ema.module)  # the EMA's update writes into its shards
        self.latest, self.latest_step = out, step
        return out

    def final(self, step: int) -> dict[str, float]:
        """The final evaluation of ``step``: the one just made where the step was evaluated already (a run that
        stopped early), else a new one."""
        if self.latest_step == step:
            return self.latest
        return self.results(step)

    def due(self, step: int) -> bool:
        """Whether ``after_step`` evaluates at ``step``."""
        return bool(self.every) and step % self.every == 0 and step < self.total_steps

    def after_step(self, step: int) -> None:
        """The periodic evaluation; the last step is evaluated by the run's end, with the final report."""
        if self.due(step):
            results = self.results(step)
            self.writer.scalars(step, results)
            if self.console:
                log.info("VAL step=%d %s val_count=%d", step, metric_values(results, "val/"), int(results["val/count"]))


def metric_values(results: dict[str, float], prefix: str, only: tuple[str, ...] = ()) -> str:
    """``val_<name>=<value>`` for each result under ``prefix`` (the task's metrics in its order, then derived
    ones; ``only`` these names where given), the count left to the caller."""
    names = [k for k in results if k.startswith(prefix) and k != prefix + "count"]
    if only:
        names = [prefix + n for n in only if prefix + n in results]
    return " ".join(f"{console_name(k, prefix)}={results[k]:.4f}" for k in names)


def console_name(key: str, prefix: str = "val/") -> str:
    """How the VAL and FINAL lines name the result ``key`` under ``prefix``: ``val/loss`` -> ``val_loss``."""
    return "val_" + key[len(prefix) :].replace("/", "_")
