"""``data.source: synthetic``: random uint8 images and labels generated from the seed, kept on the training
device and batched there by the samplers' indices (no DataLoader, no files)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import TensorDataset

from job.config import DataConfig
from job.data.images import Batch, Datasets
from job.data.loaders import Loaders, ValInfo, require_one_batch
from job.data.sampler import ResumableSampler, ShardSampler


class TensorBatches:
    """Synthetic source: batches gathered from device-resident uint8 images by a sampler's indices."""

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, sampler: ResumableSampler | ShardSampler, batch_size: int
    ):
        self.images, self.labels, self.sampler, self.batch_size = images, labels, sampler, batch_size

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        idx = torch.tensor([i for _, i in self.sampler], dtype=torch.long, device=self.images.device)
        for chunk in idx.split(self.batch_size):
            yield self.images[chunk], self.labels[chunk]


def generate(cfg: DataConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train then val uint8 images and labels, generated on the CPU from the seed (identical on every rank and
    device type)."""
    g = torch.Generator().manual_seed(seed)
    shape = (3, cfg.image_size, cfg.image_size)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
        return images, torch.randint(0, cfg.num_classes, (n,), generator=g)

    return *make(cfg.synthetic_train_size), *make(cfg.synthetic_val_size)


def synthetic_datasets(cfg: DataConfig, seed: int) -> Datasets:
    """The same images as map-style datasets of (uint8 image, label) items, on the CPU."""
    train_x, train_y, val_x, val_y = generate(cfg, seed)
    classes = tuple(f"class_{c:02d}" for c in range(cfg.num_classes))
    return Datasets(TensorDataset(train_x, train_y), TensorDataset(val_x, val_y), classes)


def synthetic_loaders(
    cfg: DataConfig,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    grad_accum_steps: int,
) -> Loaders:
    """Batches gathered on ``device`` from the generated images, moved there once."""
    train_x, train_y, val_x, val_y = (t.to(device) for t in generate(cfg, seed))
    n = cfg.synthetic_train_size
    require_one_batch(n, "data.synthetic_train_size", str(n), world_size, micro_batch_size, grad_accum_steps)
    sampler = ResumableSampler(cfg.synthetic_train_size, rank, world_size, micro_batch_size, seed, grad_accum_steps)
    val_sampler = ShardSampler(cfg.synthetic_val_size, rank, world_size)
    r = val_sampler.indices
    classes = tuple(f"class_{c:02d}" for c in range(cfg.num_classes))
    return Loaders(
        TensorBatches(train_x, train_y, sampler, micro_batch_size),
        sampler,
        TensorBatches(val_x, val_y, val_sampler, micro_batch_size),
        ValInfo(cfg.synthetic_val_size, r.start, r.stop, classes),
        resident=True,
    )


class SyntheticSource:
    """``data.source: synthetic`` as a data source (job.data.source.Source): nothing to validate."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg

    def size(self) -> tuple[int, str, str]:
        n = self.cfg.synthetic_train_size
        return n, "data.synthetic_train_size", str(n)

    def files(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"data.source=synthetic: {self.cfg.synthetic_train_size} generated training images, no files to read"

    def datasets(self, cfg: DataConfig, seed: int, device: torch.device, rank: int, decode: Any) -> Datasets:
        return synthetic_datasets(cfg, seed)

    def loaders(
        self,
        cfg: DataConfig,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        seed: int,
        device: torch.device,
        grad_accum_steps: int,
    ) -> Loaders:
        return synthetic_loaders(cfg, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)
