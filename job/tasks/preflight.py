"""A task checked before any process group or write, computed once and handed on (``Checked``).

In order: the task's own preparation (the image task validates its data source), the model built once on the
CPU from ``run.seed`` (the one the run trains, so it is never built twice) with ``model.weights`` loaded (under
``train.strategy: fsdp`` with no weights to load: on the meta device, job.parallel.meta_init), both
datasets opened and checked to be map-style and non-empty, one collated batch of the first training items, ``loss`` on it (a finite
scalar) and ``metrics`` on it (``(sum, count)`` pairs, whose names every rank then agrees on). The model's
buffers (BatchNorm statistics) and every RNG are left as they were, so the checks change no result. A model on
the meta device has no values: its loss and metrics are checked once it is sharded and materialised
(``check_values``, from job.train.parts), on the model the run trains, never on a second whole copy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from job.checkpoint import weights
from job.cluster.env import DistEnv
from job.config import JobConfig
from job.config.plan import Plan
from job.data.items import Collate, SeededItems, check_dataset
from job.data.loaders import require_one_batch
from job.data.workers import WorkerFailure
from job.errors import JobError
from job.parallel import meta_init
from job.tasks.contract import SPLITS, Bound, describe

log = logging.getLogger("job")

PROBE_ITEMS = 2
"""Items in the preflight batch (BatchNorm in train mode needs more than one)."""
SPREAD_ITEMS = 8
"""At most this many items, spread from the first to the last of each split, collated as one batch in preflight:
items that do not collate fail there, before anything is written, not at a later batch of the run."""


@dataclass
class Checked:
    """What preflight found, for the run to use: nothing here is computed again."""

    model: nn.Module
    """Built on the CPU from run.seed, with ``model.weights`` loaded (by the task, where it owns them); on the
    meta device where ``replay`` is set."""
    metric_names: tuple[str, ...]
    """The names ``metrics`` returns, in order: every rank sums the same ones."""
    datasets: dict[str, Any]
    """A task's opened datasets by split (empty for a task with its own loaders)."""
    data: str
    """One line on the data, for the doctor."""
    batch: Any = None
    """The preflight batch (CPU): DDP's start-up passes run the task's loss on it (job.parallel.ddp)."""
    param_groups: list[dict[str, Any]] | None = None
    """The task's parameter groups of ``model`` (``lr_scale`` kept for the optimizer), None for the job's own."""
    replay: meta_init.Replay | None = None
    """``model`` is on the meta device and this gives each tensor's value as the CPU build makes it; its loss and
    metrics are not checked yet (``check_values``), ``metric_names`` is empty until then."""
    saved_bytes_per_item: float = 0.0
    """Bytes autograd saved for backward in the loss check's forward, per item of the preflight batch: the
    activations the memory estimate scales to a micro-batch (job.parallel.memory)."""


def check_task(task: Bound, cfg: JobConfig, env: DistEnv, plan: Plan, cuda: bool, load_weights: bool = True) -> Checked:
    """``load_weights``: load the task's initial weights (a resumed run restores its checkpoint instead).

    Raises:
        UserCodeError / BadInput (exit 2) naming the setting, the value and the fix.
    """
    own = task.task
    if task.has("prepare"):
        own.prepare(env, plan, cuda)
    model, replay = _build(task, cfg, env, load_weights)
    if load_weights and task.has("initial_weights"):  # the image task owns its weights (torchvision names, heads)
        own.initial_weights(model, env)
    elif load_weights and cfg.model.weights:
        weights.load_strict(cfg.model, model, task.name, env.is_main)
    datasets: dict[str, Any] = {}
    if not task.has("loaders"):
        datasets = {split: check_dataset(task.dataset(split), split, task.error) for split in SPLITS}
        n = len(datasets["train"])
        require_one_batch(n, "task.name", task.name, env.world_size, plan.micro_batch_size, plan.grad_accum_steps)
    batch, items = _probe_batch(task, cfg, datasets)
    if datasets:
        _check_spread(task, cfg, datasets, plan.micro_batch_size)
    names: tuple[str, ...] = ()
    if replay is not None:
        if task.has("check_built"):  # shapes only: a meta forward computes the output's shape, not its values
            with torch.device("meta"):
                own.check_built(model)
        saved = _saved_on_meta(task, model, batch)
    else:
        with _unchanged(model):
            if task.has("check_built"):
                own.check_built(model)
            saved = _check_loss(task, model, batch)
            names = _check_metrics(task, model, batch)
    groups = _param_groups(task, model)
    return Checked(model, names, datasets, _describe(task, datasets), batch, groups, replay, saved / max(items, 1))


def _build(task: Bound, cfg: JobConfig, env: DistEnv, load_weights: bool) -> tuple[nn.Module, meta_init.Replay | None]:
    """The model from run.seed, identical on every rank, every RNG left as it was. Under fsdp, unless weights
    are to be loaded into it, on the meta device with its replay (None where meta_init refuses: then on the CPU)."""
    with torch.random.fork_rng(devices=[]):
        if cfg.train.strategy == "fsdp" and not (load_weights and cfg.model.weights):
            return meta_init.build(task.build_model, cfg.run.seed, warn=env.is_main)
        if cfg.train.strategy == "fsdp" and env.is_main:
            log.info("fsdp: model.weights is set: building the whole model on the CPU to load them, then sharding")
        torch.manual_seed(cfg.run.seed)
        return task.build_model(), None


def check_values(task: Bound, checked: Checked, model: nn.Module, device: torch.device) -> None:
    """The loss and metrics checks of ``check_task`` on ``model``, the meta model now sharded and materialised
    on ``device`` (every rank runs them on the same batch: the sharded forward's collectives match). Sets
    ``checked.metric_names``; buffers and every RNG are left as they were.

    Raises:
        UserCodeError / BadInput (exit 2) naming the setting, the value and the fix.
    """
    batch = transfer(task, checked.batch, device)
    with _unchanged(model, device):
        _check_loss(task, model, batch)
        checked.metric_names = _check_metrics(task, model, batch)


def _saved_on_meta(task: Bound, model: nn.Module, batch: Any) -> int:
    """The bytes the loss's forward saves for backward, counted on the meta model from shapes alone; 0 where the
    task's loss reads a value (it cannot on meta): the memory estimate then leaves activations out."""
    saved = SavedBytes(model)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            task.loss(model, transfer(task, batch, torch.device("meta")))
    except Exception:  # the loss's values are checked on the materialised model (check_values)
        return 0
    return saved.total


def _probe_batch(task: Bound, cfg: JobConfig, datasets: dict[str, Any]) -> tuple[Any, int]:
    """One collated batch of the first training items (or the task's ``example_batch``), on the CPU, and its
    number of items."""
    cpu = torch.device("cpu")
    if task.has("example_batch"):
        batch, n = task.task.example_batch(PROBE_ITEMS), PROBE_ITEMS
    else:
        train = SeededItems(datasets["train"], "train", cfg.run.seed, task.error)
        items = [train[(0, i)] for i in range(min(PROBE_ITEMS, len(train)))]
        batch, n = Collate(task.collate, task.error)(items), len(items)
    return transfer(task, batch, cpu), n


def _check_spread(task: Bound, cfg: JobConfig, datasets: dict[str, Any], micro_batch_size: int) -> None:
    """Each split's first and last items, and some between, collated as one batch: items that differ (shapes of
    later items, a field only some have) fail here with exit 2. The collate runs seeded, so no RNG moves."""
    for split in SPLITS:
        items = SeededItems(datasets[split], split, cfg.run.seed, task.error)
        n = len(items)
        k = min(SPREAD_ITEMS, max(micro_batch_size, PROBE_ITEMS), n)
        indices = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
        batch = items.__getitems__([(0, i) for i in indices])
        if isinstance(batch, WorkerFailure):
            raise batch.error
        Collate(task.collate, task.error)(batch)


def transfer(task: Bound, batch: Any, device: torch.device) -> Any:
    """A batch copied to ``device`` as the task wants it (its own ``transfer``, else every tensor moved)."""
    return task.transfer(batch, device)


def _storage_key(t: torch.Tensor) -> int:
    """One number per storage, meta ones included (whose data pointers are all 0), while the tensor lives."""
    return int(t.untyped_storage()._cdata)


class SavedBytes:
    """Counts the bytes of the tensors autograd saves for backward (``saved_tensors_hooks``), each storage once and
    the model's own parameters (and views of them) not at all: the activations a backward would need."""

    def __init__(self, model: nn.Module) -> None:
        self.skip = {_storage_key(p) for p in model.parameters()}
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = _storage_key(t)
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.total += storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _check_loss(task: Bound, model: nn.Module, batch: Any) -> int:
    """The loss on the preflight batch is a finite scalar; returns the bytes its forward saved for backward (with
    gradients on, no backward run: the graph is dropped here)."""
    model.train()
    saved = SavedBytes(model)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        try:
            loss, _, _ = task.loss(model, batch)
        except Exception as e:
            if isinstance(e, JobError):  # already one of the job's errors, naming its setting
                raise
            raise task.error(
                f"loss(model, batch) on the preflight batch of {PROBE_ITEMS} training items raised "
                f"{type(e).__name__}: {str(e).strip()[:300]}",
                "make loss(model, batch) run on a collated batch (JOB_TRACEBACK=1 prints the traceback).",
            ) from e
    if not bool(torch.isfinite(loss)):
        raise task.error(
            f"loss(model, batch) is {float(loss)} on the preflight batch of {PROBE_ITEMS} training items, "
            "before any update.",
            "return a finite loss for the untrained model (check the targets' range and any log/division).",
        )
    return saved.total


def _check_metrics(task: Bound, model: nn.Module, batch: Any) -> tuple[str, ...]:
    model.eval()
    with torch.no_grad():
        try:
            values = task.metrics(model, batch)
        except Exception as e:
            if isinstance(e, JobError):
                raise
            raise task.error(
                f"metrics(model, batch) on the preflight batch raised {type(e).__name__}: {str(e).strip()[:300]}",
                "make metrics(model, batch) run on a collated batch (JOB_TRACEBACK=1 prints the traceback).",
            ) from e
    model.train()
    for name, (_, count) in values.items():
        if float(count) <= 0:
            raise task.error(
                f"metrics(model, batch)[{name!r}] has count {describe(count)} = {float(count)} on a batch of "
                f"{PROBE_ITEMS} items.",
                "count what the sum adds up (items, tokens, pixels): it must be positive for a non-empty batch.",
            )
    return tuple(values)


def _param_groups(task: Bound, model: nn.Module) -> list[dict[str, Any]] | None:
    """The task's groups, checked: each a dict with "params" of this model's parameters, none in two groups.
    Parameters in no group are frozen (requires_grad False: DDP and the optimizer leave them alone)."""
    groups = task.param_groups(model)
    if groups is None:
        return None
    fix = 'return [{"params": [...], "lr_scale": 0.1, "weight_decay": 0.0}, ...] of model.parameters().'
    owned = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    out = []
    for i, group in enumerate(groups):
        if not (isinstance(group, dict) and "params" in group):
            raise task.error(f"param_groups(model)[{i}] is {describe(group)}, not a dict with 'params'.", fix)
        params = list(group["params"])
        for p in params:
            if id(p) not in owned or id(p) in seen:
                what = "is not a parameter of the model"
                if id(p) in seen:
                    what = f"({owned[id(p)]}) is in two groups"
                raise task.error(f"param_groups(model)[{i}] holds a tensor that {what}.", fix)
            seen.add(id(p))
        out.append({**group, "params": params})
    for p in model.parameters():
        if id(p) not in seen:
            p.requires_grad_(False)
    return out


@contextlib.contextmanager
def _unchanged(model: nn.Module, device: torch.device | None = None) -> Iterator[None]:
    """The model's buffers, mode and every CPU RNG (and ``device``'s, a CUDA one) as they were before the
    checks' forward passes."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    was_training = model.training
    devices: list[int] = []
    if device is not None and device.type == "cuda":
        devices = [torch.cuda.current_device() if device.index is None else device.index]
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
            model.train(was_training)


def _describe(task: Bound, datasets: dict[str, Any]) -> str:
    if task.has("describe_data"):
        return str(task.task.describe_data())
    return f"task.name={task.name}: {len(datasets['train'])} train / {len(datasets['val'])} val items"
