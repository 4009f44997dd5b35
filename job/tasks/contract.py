"""The task contract: what a training problem gives the job, and the job's checked view of it (``Bound``).

A task is any object with these members (docs/tasks.md is the user's page):

=====================================  =================================================================
``build_model() -> nn.Module``         the model, built the same way on every rank (the job seeds it)
``dataset(split) -> map-style``        ``"train"`` / ``"val"``: ``__len__`` and ``__getitem__(index)``
``collate(items) -> batch``            optional; default ``torch.utils.data.default_collate``
``loss(model, batch)``                 the micro-batch's mean loss, a scalar tensor, or ``(loss, {name: t})``
``metrics(model, batch)``              ``{name: (sum, count)}`` of an eval batch, summed over ranks exactly
``param_groups(model)``                optional: torch parameter groups; ``lr_scale`` multiplies the job's LR,
                                       parameters in no group are frozen
``flops_per_item() -> float``          optional: training FLOPs per item (forward + backward), for MFU
``summarize(values) -> {name: v}``     optional: derived validation values, e.g. perplexity = exp(loss)
``shard_units(model) -> [modules]``    optional: the units FSDP shards under train.strategy=fsdp
=====================================  =================================================================

The job owns everything else: the sampler (the only source of item order), the seeding of the item-reading
RNGs from ``(run.seed, epoch, index)``, the device copies, DDP, accumulation, precision, checkpoints and
exact evaluation. ``Bound`` turns each member's output into the one shape the loop uses and refuses what
breaks the contract with a ``UserCodeError`` (exit 2) naming ``task.name``, what is wrong and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import default_collate

from job.data.items import move
from job.errors import UserCodeError

REQUIRED = ("build_model", "dataset", "loss", "metrics")
OPTIONAL = ("collate", "param_groups", "flops_per_item", "summarize", "shard_units")
SPLITS = ("train", "val")
DOC = "docs/tasks.md"


@runtime_checkable
class Task(Protocol):
    """The members every task has (the optional ones are in the module docstring)."""

    def build_model(self) -> nn.Module: ...

    def dataset(self, split: str) -> Any: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor | tuple[torch.Tensor, Mapping[str, torch.Tensor]]: ...

    def metrics(self, model: nn.Module, batch: Any) -> Mapping[str, tuple[Any, Any]]: ...


class Bound:
    """A task as the loop uses it: one shape per member's output, optional members filled with defaults.

    ``name`` is the ``task.name`` value, for messages. Checks here are of types and structure only: nothing in
    them reads a tensor's value, so a training step stays free of host synchronisation.
    """

    def __init__(self, task: Any, name: str) -> None:
        missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
        if missing:
            raise self._error_for(
                name,
                f"the task ({type(task).__name__}) has no method {', '.join(missing)}.",
                f"give it {', '.join(f'{m}(...)' for m in REQUIRED)} as {DOC} describes.",
            )
        self.task, self.name = task, name
        self.collate: Callable[[list[Any]], Any] = getattr(task, "collate", None) or default_collate
        self.loss_fn: Callable[[nn.Module, Any], Any] = task.loss
        # Resolved once: the step calls it every micro-batch.
        self.transfer: Callable[[Any, torch.device], Any] = getattr(task, "transfer", None) or move

    @staticmethod
    def _error_for(name: str, what: str, fix: str) -> UserCodeError:
        return UserCodeError(f"task.name={name!r}: {what}", fix, setting="task.name", value=name)

    def error(self, what: str, fix: str) -> UserCodeError:
        return self._error_for(self.name, what, fix)

    def has(self, member: str) -> bool:
        return callable(getattr(self.task, member, None))

    def build_model(self) -> nn.Module:
        model = self.task.build_model()
        if not isinstance(model, nn.Module):
            raise self.error(
                f"build_model() returned a {type(model).__name__}, not a torch.nn.Module.",
                "return the model itself; the job moves it to the device and wraps it in DDP.",
            )
        return model

    def dataset(self, split: str) -> Any:
        return self.task.dataset(split)

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, extras): the task's value split into the mean loss and the named values to log."""
        out = self.loss_fn(model, batch)
        extras: Mapping[str, Any] = {}
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            out, extras = out
        if not (isinstance(out, torch.Tensor) and out.ndim == 0 and out.is_floating_point()):
            raise self.error(
                f"loss(model, batch) returned {describe(out)}, not a scalar float tensor.",
                "return the micro-batch's mean loss (e.g. F.cross_entropy(...)), or (loss, {name: tensor}).",
            )
        bad = [k for k, v in extras.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor) and v.ndim == 0)]
        if bad:
            raise self.error(
                f"loss(model, batch) returned extra values {bad} that are not named scalar tensors.",
                "return (loss, {name: scalar tensor}) with str names, e.g. (loss, {'accuracy': acc}).",
            )
        return out, dict(extras)

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, tuple[Any, Any]]:
        """The eval batch's ``{name: (sum, count)}``, checked to be that."""
        out = self.task.metrics(model, batch)
        if not isinstance(out, Mapping) or not out:
            raise self.error(
                f"metrics(model, batch) returned {describe(out)}, not a non-empty {{name: (sum, count)}} mapping.",
                "return e.g. {'loss': (loss_sum, n_items)}: the job sums both over every rank and reports sum/count.",
            )
        for key, value in out.items():
            if not (isinstance(key, str) and _is_pair(value)):
                raise self.error(
                    f"metrics(model, batch)[{key!r}] is {describe(value)}, not a (sum, count) pair.",
                    "give each metric as (sum, count) of scalar tensors or numbers, never a mean: means of "
                    "shards of different sizes do not add up to the mean of the whole set.",
                )
        return dict(out)

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]] | None:
        if not self.has("param_groups"):
            return None
        return list(self.task.param_groups(model))

    def flops_per_item(self) -> float:
        if not self.has("flops_per_item"):
            return 0.0
        return float(self.task.flops_per_item())

    def summarize(self, values: Mapping[str, float]) -> dict[str, float]:
        if not self.has("summarize"):
            return {}
        return {str(k): float(v) for k, v in self.task.summarize(dict(values)).items()}


def _is_pair(value: Any) -> bool:
    if not (isinstance(value, tuple) and len(value) == 2):
        return False
    return all(_is_scalar(v) for v in value)


def _is_scalar(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.ndim == 0
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def describe(value: Any) -> str:
    """A value as an error message names it: its type, and a tensor's shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"
