"""The task contract: what a training problem gives the job, and the job's checked view of it (``Bound``).

A task is any object with these members (docs/tasks.md is the user's page):

=====================================  =================================================================
``build_model() -> nn.Module``         the model, built the same way on every rank (the job seeds it)
``dataset(split) -> map-style``        ``"train"`` / ``"val"``: ``__len__`` and ``__getitem__(index)``
``collate(items) -> batch``            optional; default ``torch.utils.data.default_collate``
``loss(model, batch)``                 the micro-batch's mean loss (a scalar tensor) or ``(sum, count)``, either
                                       optionally followed by ``{name: t}``; ``model`` is the user's module
``metrics(model, batch)``              ``{name: (sum, count)}`` of an eval batch, summed over ranks exactly
``param_groups(model)``                optional: torch parameter groups; ``lr_scale`` multiplies the job's LR,
                                       parameters in no group are frozen
``flops_per_item() -> float``          optional: training FLOPs per item (forward + backward), for MFU
``summarize(values) -> {name: v}``     optional: derived validation values, e.g. perplexity = exp(loss)
``before_step(step, epoch)``           optional: called before each optimizer step (what ``loss`` may read)
``state_dict()``, ``load_state_dict``  optional: the task's own state, in every checkpoint (``"task"``)
``frozen_modules(model) -> [module]``  optional: modules kept in eval mode while training (frozen BatchNorm)
``transfer(batch, device) -> batch``   optional: the batch on the device; default: every tensor copied there
``describe_data() -> str``             optional: one line on the data, for the doctor
``shard_units(model) -> [modules]``    optional: the units FSDP shards (and activation checkpointing recomputes)
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
OPTIONAL = (
    "collate",
    "param_groups",
    "flops_per_item",
    "summarize",
    "before_step",
    "state_dict",
    "load_state_dict",
    "frozen_modules",
    "transfer",
    "describe_data",
    "shard_units",
)
"""The members a user's task may have beyond the required ones: each is in docs/tasks.md's table."""
BUILTIN = ("prepare", "initial_weights", "load_pending_weights", "check_built", "example_batch", "loaders")
"""Members the job asks of its own tasks only (``Bound(..., builtin=True)``, which job.tasks.load alone passes):
the image task's data pipeline and weights.
A user's task with a method of one of these names is not asked for it."""
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

    def __init__(self, task: Any, name: str, builtin: bool = False) -> None:
        missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
        if missing:
            raise self._error_for(
                name,
                f"the task ({type(task).__name__}) has no method {', '.join(missing)}.",
                f"give it {', '.join(f'{m}(...)' for m in REQUIRED)} as {DOC} describes.",
            )
        self.task, self.name = task, name
        self.builtin = builtin
        """One of the job's own tasks: the only kind asked for the ``BUILTIN`` members."""
        self.collate: Callable[[list[Any]], Any] = getattr(task, "collate", None) or default_collate
        self.loss_fn: Callable[[nn.Module, Any], Any] = task.loss
        # Resolved once: the step calls it every micro-batch.
        self.transfer: Callable[[Any, torch.device], Any] = move
        if self.has("transfer"):
            self.transfer = task.transfer
        self.counted: bool | None = None
        """Whether ``loss`` returns ``(sum, count)`` (True) or a mean (False); None until its first call."""

    @staticmethod
    def _error_for(name: str, what: str, fix: str) -> UserCodeError:
        return UserCodeError(f"task.name={name!r}: {what}", fix, setting="task.name", value=name)

    def error(self, what: str, fix: str) -> UserCodeError:
        return self._error_for(self.name, what, fix)

    def has(self, member: str) -> bool:
        """Whether the task has ``member``: one of the contract's, or of ``BUILTIN`` on a built-in task."""
        if member in BUILTIN:
            return self.builtin and callable(getattr(self.task, member, None))
        if member not in REQUIRED + OPTIONAL:
            raise ValueError(f"{member!r} is no member of the task contract: add it to OPTIONAL and {DOC}")
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

    def loss(self, model: nn.Module, batch: Any) -> LossOutput:
        """(loss, count, extras): the task's value split into the loss (a mean, or a sum when ``count`` is not
        None), the count of what the sum adds up, and the named values to log."""
        out = self.loss_fn(model, batch)
        loss, count, extras = _split_loss(out)
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
            raise self.error(
                f"loss(model, batch) returned {describe(loss)}, not a scalar float tensor.",
                "return the micro-batch's mean loss (e.g. F.cross_entropy(...)), (loss_sum, count), or either "
                "followed by {name: tensor}.",
            )
        if count is not None and not _is_scalar(count):
            raise self.error(
                f"loss(model, batch) returned the count {describe(count)}, not a scalar.",
                "return (loss_sum, count) with count a scalar tensor or number, e.g. (nll_sum, mask.sum()).",
            )
        bad = [k for k, v in extras.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor) and v.ndim == 0)]
        if bad:
            raise self.error(
                f"loss(model, batch) returned extra values {bad} that are not named scalar tensors.",
                "return (loss, {name: scalar tensor}) with str names, e.g. (loss, {'accuracy': acc}).",
            )
        self._check_kind(count is not None)
        if count is not None:
            count = torch.as_tensor(count, dtype=torch.float32, device=loss.device)
        return loss, count, dict(extras)

    def _check_kind(self, counted: bool) -> None:
        """The first loss (preflight's) fixes the kind; every rank runs the same preflight, so all agree."""
        if self.counted is None:
            self.counted = counted
        elif self.counted != counted:
            kinds = {True: "(loss_sum, count)", False: "a mean loss"}
            raise self.error(
                f"loss(model, batch) returned {kinds[counted]} after {kinds[self.counted]} on an earlier batch.",
                "return one kind of loss for every batch: the job normalises a step's gradients by it.",
            )

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

    def before_step(self, step: int, epoch: int) -> None:
        """Tell the task which optimizer step (1-based) of which epoch its next ``loss`` calls belong to."""
        if self.has("before_step"):
            self.task.before_step(step, epoch)

    def frozen_modules(self, model: nn.Module) -> list[nn.Module]:
        """The task's modules kept in eval mode while training (``frozen_modules(model)``), checked to be
        submodules of ``model``."""
        if not self.has("frozen_modules"):
            return []
        modules = list(self.task.frozen_modules(model))
        own = {id(m) for m in model.modules()}
        bad = [describe(m) for m in modules if not (isinstance(m, nn.Module) and id(m) in own)]
        if bad:
            raise self.error(
                f"frozen_modules(model) returned {', '.join(bad)}, not submodules of the model.",
                "return modules of the model itself, e.g. [model.backbone].",
            )
        return modules

    def stateful(self) -> bool:
        """Whether the task keeps state of its own to checkpoint (``state_dict`` and ``load_state_dict``)."""
        return self.has("state_dict") and self.has("load_state_dict")

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


def _split_loss(out: Any) -> tuple[Any, Any, Mapping[str, Any]]:
    """(loss, count or None, extras) of ``loss``'s return: ``loss``, ``(loss, extras)``, ``(sum, count)`` or
    ``(sum, count, extras)``."""
    if not isinstance(out, tuple):
        return out, None, {}
    if len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], None, out[1]
    if len(out) == 2:
        return out[0], out[1], {}
    if len(out) == 3 and isinstance(out[2], Mapping):
        return out[0], out[1], out[2]
    return out, None, {}


def _is_pair(value: Any) -> bool:
    if not (isinstance(value, tuple) and len(value) == 2):
        return False
    return all(_is_scalar(v) for v in value)


def _is_scalar(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.ndim == 0
    return isinstance(v, (int, float)) and not isinstance(v, bool)


LossOutput = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]
"""(loss, count, extras): a mean loss with count None, or a sum with the float count of what it adds up."""


class TrainingStep(nn.Module):
    """The task's loss as a module, for the training wrapper (DDP, DataParallel, compile) to wrap.

    ``loss`` then gets the user's own module (``model.config``, helper methods: what preflight and evaluation
    pass too), while the forward still runs through the wrapper's ``forward``, where DDP prepares the
    gradient all-reduce and broadcasts buffers. After Lightning, which wraps its ``training_step`` the same
    way. ``model`` is the only submodule: parameters, buffers and ``train()``/``eval()`` are the model's.
    """

    def __init__(self, model: nn.Module, task: Bound) -> None:
        super().__init__()
        self.model = model
        self.task = task  # not a module: holds no parameters
        self.frozen = task.frozen_modules(model)

    def train(self, mode: bool = True) -> TrainingStep:
        """The model in ``mode``, except the task's frozen modules, which stay in eval mode (a frozen backbone's
        BatchNorm keeps its running statistics, its dropout stays off)."""
        super().train(mode)
        for module in self.frozen:
            module.eval()
        return self

    def forward(self, batch: Any) -> LossOutput:
        return self.task.loss(self.model, batch)


def describe(value: Any) -> str:
    """A value as an error message names it: its type, and a tensor's shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"
