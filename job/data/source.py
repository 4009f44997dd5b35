"""The one place that maps ``data.source`` to its data, in two phases, through one protocol (``Source``).

``prepare_data`` runs in preflight, before any process group or device work: it opens the source once
(``open_source``: paths, class folders, shard indexes, a user dataset's first items), checks that the training set
holds a global batch, and decides where images are decoded. Its ``Prepared`` is handed on to ``build_loaders``,
which builds this rank's datasets and loaders from it without validating again. The sources: an ImageFolder
(job.data.imagefolder.DataLayout), synthetic tensors (job.data.synthetic.SyntheticSource), WebDataset shards
(job.data.shards.ShardLayout) and a user dataset by import path (job.data.usersource.UserSource); the loaders
over their datasets are job.data.loaders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from job.config import DataConfig
from job.data import shards, usersource
from job.data.device_decode import DecodeChoice
from job.data.imagefolder import DataLayout, decode_choice, validate_imagefolder
from job.data.images import Datasets
from job.data.loaders import Loaders, dataset_loaders, require_one_batch
from job.data.shards import ShardLayout
from job.data.synthetic import SyntheticSource


class Source(Protocol):
    """A data source as validation found it. A source may also offer ``loaders(cfg, rank, world_size,
    micro_batch_size, seed, device, grad_accum_steps)`` when it does not read through a DataLoader."""

    def size(self) -> tuple[int, str, str]:
        """(training samples, the setting that gave them, its value): what the size check names."""
        ...

    def files(self) -> list[str]:
        """The image files, for where they are decoded (empty: not a file tree)."""
        ...

    def describe(self) -> str:
        """One line for the doctor's storage.data; raises BadInput naming what cannot be read."""
        ...

    def datasets(self, cfg: DataConfig, seed: int, device: torch.device, rank: int, decode: Any) -> Datasets:
        """The map-style train and val datasets."""
        ...


def validate_data(cfg: DataConfig) -> DataLayout | ShardLayout | None:
    """The layout of an ImageFolder (class folders, files) or of WebDataset shards (indexes, a few samples
    decoded); None for synthetic data and a user dataset. Raises BadInput naming the setting, value and fix."""
    if cfg.source == "webdataset":
        return shards.validate_shards(cfg)
    if cfg.source == "imagefolder":
        return validate_imagefolder(cfg)
    return None


_OPENERS: dict[str, Callable[[DataConfig], Source]] = {
    "imagefolder": validate_imagefolder,
    "webdataset": shards.validate_shards,
    "synthetic": SyntheticSource,
}


def open_source(cfg: DataConfig) -> Source:
    """``data.source`` validated: a built-in source by name, else a user dataset (its first items checked)."""
    opener = _OPENERS.get(cfg.source)
    if opener is not None:
        return opener(cfg)
    return usersource.UserSource(cfg, usersource.check_user_data(cfg) or 0)


@dataclass(frozen=True)
class Prepared:
    """What preflight found of the source, handed to ``build_loaders`` (nothing is validated twice)."""

    source: Source
    decode: DecodeChoice


def prepare_data(
    cfg: DataConfig, world_size: int, micro_batch_size: int, grad_accum_steps: int, cuda: bool
) -> Prepared:
    """Open the source once and check it holds one global batch; raises BadInput / UserCodeError naming the
    setting or file, the bad value and the fix. Lists directories and reads a few samples; decodes no epoch."""
    source = open_source(cfg)
    n, setting, value = source.size()
    require_one_batch(n, setting, value, world_size, micro_batch_size, grad_accum_steps)
    return Prepared(source, decode_choice(cfg, source.files(), cuda))


def build_loaders(
    cfg: DataConfig,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    grad_accum_steps: int = 1,
    prepared: Prepared | None = None,
) -> Loaders:
    """Train and val loaders of this rank over the ``prepared`` source, prepared here when not given (see
    job.data.loaders for order and determinism)."""
    if prepared is None:
        prepared = prepare_data(cfg, world_size, micro_batch_size, grad_accum_steps, device.type == "cuda")
    own = getattr(prepared.source, "loaders", None)
    if own is not None:
        return own(cfg, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)  # type: ignore[no-any-return]
    sets = datasets(cfg, prepared, seed, device, rank)
    return dataset_loaders(cfg, sets, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)


def datasets(cfg: DataConfig, prepared: Prepared, seed: int, device: torch.device, rank: int) -> Datasets:
    """The map-style datasets of the prepared source."""
    return prepared.source.datasets(cfg, seed, device, rank, prepared.decode)


def describe_data(cfg: DataConfig, prepared: Prepared | None = None) -> str:
    """What preflight (``ddp-job doctor``'s storage.data) reports of the data (``prepared`` here when not given):
    path, class folders and count, and one file actually read. Raises BadInput naming what is wrong and the fix."""
    if prepared is None:
        prepared = prepare_data(cfg, 1, 1, 1, torch.cuda.is_available())
    return prepared.source.describe()
