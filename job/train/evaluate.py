"""Exact validation over all ranks, and the evaluation component with its own cadence (``train.eval_every``).

The task's ``metrics(model, batch)`` gives ``{name: (sum, count)}`` per batch. Each rank adds them up over its
disjoint shard of the validation set, then one all-reduce adds every rank's sums and counts: the reported
``sum / count`` is the value of the whole set, whatever the world size (means are never averaged).

During training an evaluation stops at a batch boundary when a stop is requested (``StopPoll``): before each
batch the ranks vote, one all-reduce (MAX) of two ints on the CPU control group (gloo even under NCCL: no device
synchronisation), so every rank stops before the same batch and the partial evaluation is discarded
(``EvaluationStopped``). A request that lands during a batch stops the evaluation when that batch is done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from job.errors import EvaluationStopped
from job.observe.metrics import NullWriter
from job.observe.observer import no_mark
from job.parallel import distributed, fsdp
from job.train.parts import Parts

log = logging.getLogger("job")


@dataclass(frozen=True)
class StopPoll:
    """How an evaluation during training asks, before each batch, whether a stop was requested."""

    requested: Callable[[], bool]
    """This rank's stop flag now (job.train.preempt.StopRequest)."""
    group: dist.ProcessGroup | None
    """The CPU group the vote runs on (job.parallel.distributed.Runtime.control_group; None: the default group,
    gloo when there is no separate control group)."""


@torch.no_grad()
def evaluate(
    model: nn.Module, parts: Parts, mark: Callable[[str], None] = no_mark, poll: StopPoll | None = None
) -> dict[str, float]:
    """``val/<name>`` = sum / count over every rank for each metric, ``val/count`` = the items evaluated, and
    the task's derived values (``summarize``). Every rank returns the same. ``mark``: records on this rank's
    progress file that its shard is done (job.observe.observer.Observer.mark), so that a stall report tells a rank
    still evaluating from one waiting for it. ``poll``: raise ``EvaluationStopped`` on every rank, before the same
    batch, once any rank's flag is set (None: evaluate to the end).

    Runs the unwrapped model: shards may differ in length, and DDP's forward would broadcast buffers, a
    collective every rank must join the same number of times.
    """
    was_training = model.training
    model.eval()
    try:
        names = parts.metric_names
        totals = torch.zeros(2 * len(names) + 1, dtype=torch.float64, device=parts.device)
        info = parts.loaders.val_info
        totals[-1] = info.stop - info.start  # this rank's items: its shard of the sampler
        for batch, counted in _batches(model, parts, poll, mark):
            with parts.autocast:
                values = parts.task.metrics(model, batch)
            if counted:
                _add(totals, values, names, parts)
        mark("evaluated its shard, waiting in the evaluation's all-reduce")
        dist.all_reduce(totals)
        sums = totals.tolist()
    finally:
        model.train(was_training)
    out = {f"val/{name}": sums[2 * i] / max(sums[2 * i + 1], 1e-12) for i, name in enumerate(names)}
    out["val/count"] = sums[-1]
    out.update(parts.task.summarize(out))
    return out


def _batches(
    model: nn.Module, parts: Parts, poll: StopPoll | None, mark: Callable[[str], None]
) -> Iterator[tuple[Any, bool]]:
    """(batch on the device, whether its metrics count) for this rank's validation batches. The ranks vote before
    each batch (``_vote``) when a stop may end the evaluation, and under fsdp, where every forward is a collective
    (each unit's all-gather): while any rank still has a batch, a rank whose shard has ended runs the preflight
    batch uncounted (fsdp) or only votes. The evaluation is complete once no rank has a batch left, a stop
    requested then included. Each vote is marked (``mark``): the ranks then wait for each other at every batch,
    and a stall report names the rank still computing one."""
    loader = iter(parts.loaders.val)
    sharded = fsdp.is_fsdp(model)
    if poll is None and not sharded:
        for batch in loader:
            yield parts.to_device(batch), True
        return
    done = 0
    while True:
        batch = next(loader, None)
        if batch is None:
            mark(f"evaluated its shard ({done} batches), voting while the other ranks finish theirs")
        else:
            mark(f"voting before its validation batch {done + 1}")
        more, stop = _vote(batch is not None, poll, parts.device)
        if not more:
            return
        if stop:
            raise EvaluationStopped(done)
        if batch is not None:
            yield parts.to_device(batch), True
            done += 1
        elif sharded:
            yield parts.to_device(parts.probe_batch), False


def _vote(has_batch: bool, poll: StopPoll | None, device: torch.device) -> tuple[bool, bool]:
    """(any rank has a batch, any rank asks to stop): one all-reduce (MAX) of two ints, on the poll's CPU group
    (no device synchronisation), or without a poll (fsdp, nothing to stop) on the device group."""
    if poll is None:
        flags = torch.tensor([int(has_batch), 0], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    else:
        flags = torch.tensor([int(has_batch), int(poll.requested())], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=poll.group)
    more, stop = flags.tolist()
    return bool(more), bool(stop)


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
        self.poll: StopPoll | None = None
        """Set by the training loop: a stop request ends an evaluation in progress (``EvaluationStopped``)."""

    def results(self, step: int = 0) -> dict[str, float]:
        """Validation metrics of the model, and of the EMA as ``ema/...`` when it is enabled (every rank), after
        optimizer step ``step``. Raises ``EvaluationStopped`` on every rank when the ranks agree to stop."""
        try:
            out = self._results(step)
        except EvaluationStopped as e:
            log.info(
                "stop requested during the evaluation after step %d: stopped after %d validation batch(es) of "
                "this rank's %d item(s); the partial evaluation is discarded",
                step,
                e.batches,
                self.parts.loaders.val_info.stop - self.parts.loaders.val_info.start,
            )
            raise
        self.latest, self.latest_step = out, step
        return out

    def _results(self, step: int) -> dict[str, float]:
        p = self.parts
        self.mark(f"evaluating after step {step}")  # before its first collective: a rank stalled here marked it
        distributed.broadcast_buffers(p.raw_model)  # the model rank 0 saves, on every rank
        try:
            out = evaluate(p.raw_model, p, self.mark, self.poll)
        finally:  # a stopped evaluation too: the stop save reads the shards
            fsdp.reshard(p.raw_model)  # units left gathered (fsdp.reshard_after_forward: false) back to their shards
        if p.ema is not None:
            self.mark(f"evaluating the EMA after step {step}")
            distributed.broadcast_buffers(p.ema.module)
            try:
                out.update({f"ema/{k}": v for k, v in evaluate(p.ema.module, p, self.mark, self.poll).items()})
            finally:
                fsdp.reshard(p.ema.module)  # the EMA's update writes into its shards
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
