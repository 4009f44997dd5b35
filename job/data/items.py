"""A task's map-style datasets under the job's sampler: items of any structure, read with seeded randomness.

The sampler yields ``(epoch, index)`` pairs. Before item ``index`` of ``epoch`` is read, the RNGs a dataset
may draw from (torch's CPU generator, Python's ``random``, NumPy's global generator) are seeded from
``(run.seed, epoch, index)`` and restored afterwards, exactly as the image sources seed their augmentation
(job.data.images). A random crop, mask or noise in a task's ``__getitem__`` is therefore the same draw
whatever ``num_workers``, prefetching or a resume in between: exact resume holds for any task. The task's
``collate`` runs seeded the same way, from ``(run.seed, epoch, index of the batch's first item)``
(job.data.sampler.collate_seed): masking, mixup or per-batch crops there resume exactly too.

Errors of the user's code reach the trainer as data (``WorkerFailure``), like the image sources' errors, so a
DataLoader worker never dies with the item's name lost. ``move`` copies any batch structure to the device.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from job.config import DataConfig
from job.data.images import Datasets
from job.data.loaders import Loaders, dataset_loaders
from job.data.sampler import collate_seed, sample_seed
from job.data.workers import WorkerFailure, init_error
from job.errors import JobError, UserCodeError

ErrorFor = Callable[[str, str], UserCodeError]
"""How the task names a failure: ``(what, fix) -> UserCodeError`` naming task.name."""


def check_dataset(dataset: Any, split: str, error: ErrorFor) -> Any:
    """``dataset`` if it is a non-empty map-style dataset; UserCodeError otherwise."""
    iterable = isinstance(dataset, IterableDataset)
    if iterable or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise error(
            f"dataset({split!r}) returned a {type(dataset).__name__}, not a map-style dataset.",
            "return an object with __len__ and __getitem__(index) (a torch.utils.data.Dataset): the job's sampler "
            "picks the indices, which is what makes resume exact (an iterable dataset cannot be resumed).",
        )
    if len(dataset) == 0:
        raise error(f"dataset({split!r}) is empty.", "check the task's data path and options.")
    return dataset


class SeededItems(Dataset):
    """A task's dataset keyed by ``(epoch, index)``: each read seeded from ``(seed, epoch, index)``."""

    def __init__(self, items: Any, split: str, seed: int, error: ErrorFor) -> None:
        self.items, self.split, self.seed, self.error = items, split, seed, error

    def __len__(self) -> int:
        return len(self.items)

    def __getitems__(self, keys: list[tuple[int, int] | int]) -> list[Any] | WorkerFailure:
        """One batch's items (DataLoader's fetcher calls this) with the seed of its collate, or the error that
        stopped it, as data."""
        try:
            items = SeededBatch(self[key] for key in keys)
        except JobError as err:
            return WorkerFailure(err)
        if keys:
            epoch, index = _epoch_index(keys[0])
            items.seed = collate_seed(self.seed, epoch, index)
        return items

    def __getitem__(self, key: tuple[int, int] | int) -> Any:
        epoch, index = _epoch_index(key)
        with _Seeded(sample_seed(self.seed, epoch, index)):
            try:
                return self.items[index]
            except Exception as e:
                raise self.error(
                    f"reading dataset({self.split!r})[{index}] raised {type(e).__name__}: {str(e).strip()[:300]}",
                    "fix the dataset's __getitem__ (JOB_TRACEBACK=1 prints the traceback).",
                ) from e


def _epoch_index(key: tuple[int, int] | int) -> tuple[int, int]:
    if isinstance(key, tuple):
        return key
    return 0, key


class SeededBatch(list[Any]):
    """A batch's items, with the seed its ``collate`` runs under (None: not seeded, e.g. preflight's batch)."""

    seed: int | None = None


class _Seeded:
    """Seed torch's CPU generator, ``random`` and NumPy's global generator; restore all three on exit.

    Not torch.manual_seed / fork_rng: they also touch every accelerator's generators (0.6 ms an item)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        self.saved = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
        torch.default_generator.manual_seed(self.seed)
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)

    def __exit__(self, *exc: object) -> None:
        torch_state, py_state, np_state = self.saved
        torch.default_generator.set_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


class Collate:
    """The task's collate as the DataLoader's ``collate_fn``: failures pass on as data, and items that do not
    collate are a UserCodeError naming the task (a plain class, so DataLoader workers can pickle it)."""

    def __init__(self, collate: Callable[[list[Any]], Any], error: ErrorFor) -> None:
        self.collate, self.error = collate, error

    def __call__(self, items: list[Any] | WorkerFailure) -> Any:
        failed_start = init_error()
        if failed_start is not None:
            return WorkerFailure(failed_start)
        if isinstance(items, WorkerFailure):
            return items
        try:
            seed = getattr(items, "seed", None)
            if seed is None:
                return self.collate(items)
            with _Seeded(seed):  # a random collate (masking, mixup) draws the same whatever the workers
                return self.collate(items)
        except Exception as e:
            raise self.error(
                f"the items of a batch do not collate: {type(e).__name__}: {str(e).strip()[:300]}",
                "return items of one structure and shape (tensors, numbers, or tuples/dicts of them), or give the "
                "task a collate(items) method that builds the batch.",
            ) from e


def move(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` (tensors, mappings, tuples, lists, dataclasses of them) copied to ``device``,
    non-blocking; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: move(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(move(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(move(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch, **{f.name: move(getattr(batch, f.name), device) for f in dataclasses.fields(batch)}
        )
    return batch


def task_loaders(
    cfg: DataConfig,
    datasets: Mapping[str, Any],
    collate: Callable[[list[Any]], Any],
    error: ErrorFor,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    grad_accum_steps: int,
) -> Loaders:
    """This rank's loaders over a task's opened ``datasets`` ("train", "val"): the job's sampler, sharding and
    DataLoader settings (data.num_workers, ...), seeded item reads and the task's collate."""
    sets = Datasets(
        SeededItems(datasets["train"], "train", seed, error),
        SeededItems(datasets["val"], "val", seed, error),
        classes=(),
        collate_fn=Collate(collate, error),
    )
    return dataset_loaders(cfg, sets, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)
