"""The one place that maps ``data.source`` to its data, in two phases.

``prepare_data`` runs in preflight, before any process group or device work: it validates the source once
(paths, class folders, shard indexes, a user dataset's first items), checks that the training set holds a
global batch, and decides where images are decoded. Its ``Prepared`` is handed on to ``build_loaders``, which
builds this rank's datasets and loaders from it without validating again. The sources: an ImageFolder
(job.data.imagefolder), synthetic tensors (job.data.synthetic), WebDataset shards (job.data.shards) and a user
dataset by import path (job.data.usersource); the loaders over their datasets are job.data.loaders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from job.config import DataConfig
from job.data import shards, usersource
from job.data.device_decode import DecodeChoice
from job.data.imagefolder import DataLayout, decode_choice, imagefolder_datasets, validate_imagefolder
from job.data.images import Datasets
from job.data.loaders import Loaders, dataset_loaders, require_one_batch
from job.data.shards import ShardLayout
from job.data.synthetic import synthetic_datasets, synthetic_loaders
from job.errors import BadInput


@dataclass(frozen=True)
class Prepared:
    """What preflight found of the source, handed to ``build_loaders`` (nothing is validated twice)."""

    layout: DataLayout | ShardLayout | None
    """ImageFolder or shard layout; None for synthetic data and a user dataset."""
    train_size: int
    setting: str
    """The setting that gave the training set (named by the size check)."""
    value: str
    decode: DecodeChoice


def validate_data(cfg: DataConfig) -> DataLayout | ShardLayout | None:
    """The layout of an ImageFolder (class folders, files) or of WebDataset shards (indexes, a few samples
    decoded); None for synthetic data and a user dataset. Raises BadInput naming the setting, value and fix."""
    if cfg.source == "webdataset":
        return shards.validate_shards(cfg)
    if cfg.source == "imagefolder":
        return validate_imagefolder(cfg)
    return None


def prepare_data(
    cfg: DataConfig, world_size: int, micro_batch_size: int, grad_accum_steps: int, cuda: bool
) -> Prepared:
    """Validate the source once and check it holds one global batch; raises BadInput / UserCodeError naming the
    setting or file, the bad value and the fix. Lists directories and reads a few samples; decodes no epoch."""
    layout = validate_data(cfg)
    n, setting, value = cfg.synthetic_train_size, "data.synthetic_train_size", str(cfg.synthetic_train_size)
    user_size = usersource.check_user_data(cfg)  # a user dataset's first items; None for the built-in sources
    if user_size is not None:
        n, setting, value = user_size, "data.source", cfg.source
    elif isinstance(layout, ShardLayout):
        n, setting, value = len(layout.train), layout.train.setting, layout.train.source
    elif isinstance(layout, DataLayout):
        n, setting, value = len(layout.train), "data.path", str(cfg.path)
    require_one_batch(n, setting, value, world_size, micro_batch_size, grad_accum_steps)
    return Prepared(layout, n, setting, value, decode_choice(cfg, layout, cuda))


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
    if cfg.source == "synthetic":
        return synthetic_loaders(cfg, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)
    sets = datasets(cfg, prepared, seed, device, rank)
    return dataset_loaders(cfg, sets, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)


def datasets(cfg: DataConfig, prepared: Prepared, seed: int, device: torch.device, rank: int) -> Datasets:
    """The map-style datasets of the prepared source (synthetic: its tensors, as the loaders generate them)."""
    if cfg.source == "synthetic":
        return synthetic_datasets(cfg, seed)
    layout: Any = prepared.layout
    if isinstance(layout, ShardLayout):
        train, val = shards.shard_datasets(cfg, layout, seed)
        return Datasets(train, val, layout.classes, layout=layout)
    if isinstance(layout, DataLayout):
        return imagefolder_datasets(cfg, seed, device, rank, layout, prepared.decode)
    return usersource.datasets(cfg, seed)


def describe_data(cfg: DataConfig, prepared: Prepared | None = None) -> str:
    """What preflight (``ddp-job doctor``'s storage.data) reports of the data (``prepared`` here when not given):
    path, class folders and count, and one file actually read. Raises BadInput naming what is wrong and the fix."""
    if prepared is None:
        prepared = prepare_data(cfg, 1, 1, 1, torch.cuda.is_available())
    layout: Any = prepared.layout
    if layout is None:
        return f"data.source={cfg.source}: {prepared.train_size} training samples ({prepared.setting})"
    if isinstance(layout, ShardLayout):  # the preparation decoded the first samples already
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
