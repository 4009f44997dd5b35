"""The one place that maps ``data.source`` to its data: validation before any process group
(``validate_data``), the size check, the datasets and their loaders (``build_loaders``), and what preflight
reports of it (``describe_data``). The sources: an ImageFolder (job.data.imagefolder), synthetic tensors
(job.data.synthetic), WebDataset shards (job.data.shards) and a user dataset by import path
(job.data.usersource); the loaders over their datasets are job.data.loaders."""

from __future__ import annotations

import torch

from job.config import DataConfig
from job.data import shards, usersource
from job.data.imagefolder import DataLayout, imagefolder_datasets, validate_imagefolder
from job.data.images import Datasets
from job.data.loaders import Loaders, dataset_loaders, require_one_batch
from job.data.shards import ShardLayout
from job.data.synthetic import synthetic_loaders
from job.errors import BadInput
from job.usercode import is_import_path


def validate_data(cfg: DataConfig) -> DataLayout | ShardLayout | None:
    """Cheap checks before any process group or device work: paths, class folders, counts.

    Lists directories but decodes nothing. Returns a ShardLayout for WebDataset shards
    (job.data.shards.validate_shards: it also decodes a few samples) and None for the other sources (synthetic:
    nothing to check; a user dataset is checked by job.data.usersource). Raises BadInput naming the setting or
    file, the bad value and the fix.
    """
    if cfg.source == "webdataset":
        return shards.validate_shards(cfg)
    if cfg.source != "imagefolder":
        return None
    return validate_imagefolder(cfg)


def check_train_size(
    cfg: DataConfig,
    layout: DataLayout | ShardLayout | None,
    world_size: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    train_size: int | None = None,
) -> None:
    """At least one global batch in the training set (``layout`` from validate_data; None: synthetic, unless
    ``train_size`` gives the size of another source's training set).

    Raises:
        BadInput: naming the data setting, the sample count and the batch arithmetic.
    """
    n, setting, value = cfg.synthetic_train_size, "data.synthetic_train_size", str(cfg.synthetic_train_size)
    if train_size is not None:
        n, setting, value = train_size, "data.source", cfg.source
    if isinstance(layout, DataLayout):
        n, setting, value = len(layout.train), "data.path", str(cfg.path)
    elif layout is not None:  # WebDataset shards: the setting that named them
        n, setting, value = len(layout.train), layout.train.setting, layout.train.source
    require_one_batch(n, setting, value, world_size, micro_batch_size, grad_accum_steps)


def build_loaders(
    cfg: DataConfig,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    grad_accum_steps: int = 1,
) -> Loaders:
    """Train and val loaders of this rank (see job.data.loaders for order and determinism)."""
    if cfg.source == "synthetic":
        return synthetic_loaders(cfg, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)
    sets = _datasets(cfg, seed, device, rank)
    check_train_size(cfg, sets.layout, world_size, micro_batch_size, grad_accum_steps, train_size=len(sets.train))
    return dataset_loaders(cfg, sets, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)


def _datasets(cfg: DataConfig, seed: int, device: torch.device, rank: int) -> Datasets:
    """Each source that reads samples through the DataLoader, by data.source."""
    if is_import_path(cfg.source):
        return usersource.datasets(cfg, seed)
    if cfg.source == "webdataset":
        layout = shards.validate_shards(cfg)
        train, val = shards.shard_datasets(cfg, layout, seed)
        return Datasets(train, val, layout.classes, layout=layout)
    return imagefolder_datasets(cfg, seed, device, rank)


def describe_data(cfg: DataConfig) -> str:
    """What preflight (``ddp-job doctor``'s storage.data) reports of the data: path, class folders and count
    (``validate_data``), and one file actually read. Raises BadInput naming what is wrong and the fix."""
    layout = validate_data(cfg)
    if layout is None:  # synthetic, or a source its own module checks (a user dataset: train's preflight)
        return f"data.source={cfg.source}: no ImageFolder tree to read"
    if not isinstance(layout, DataLayout):  # WebDataset shards: validate_data decoded the first samples already
        return f"{layout.describe()}; first samples readable"
    path = layout.train[0][0]
    try:
        with open(path, "rb") as f:
            f.read(64)
    except OSError as e:
        raise BadInput(
            f"{path}: not readable ({e.strerror})",
            "check the data mount and its permissions",
            setting="data.path",
            value=cfg.path,
        ) from None
    return (
        f"data.path={cfg.path}: {len(layout.classes)} classes = data.num_classes, "
        f"{len(layout.train)} train / {len(layout.val)} val files, first file readable"
    )
