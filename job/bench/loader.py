"""Images/s of the training loader alone: the measurement that ``bench data`` and ``bench shards`` share."""

from __future__ import annotations

import time
from pathlib import Path


def loader_rate(path: Path, workers: int, batch: int, size: int, batches: int, source: str = "imagefolder") -> float:
    """Images/s of this rank's training loader over ``batches`` batches, after two warm-up batches."""
    import torch

    from job.config import DataConfig
    from job.data.source import build_loaders

    cfg = DataConfig(source=source, path=path, num_classes=10, image_size=size, num_workers=workers)
    loaders = build_loaders(cfg, 0, 1, batch, 0, torch.device("cpu"))
    it = iter(loaders.train)
    for _ in range(2):
        next(it)
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        images, _labels = next(it)
        n += images.shape[0]
    dt = time.perf_counter() - t0
    del it, loaders
    return n / dt
