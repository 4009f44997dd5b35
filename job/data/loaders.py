"""The DataLoaders over a source's map-style datasets (job.data.images.Datasets), sharded over ranks,
resumable, and the copy of their batches to the device.

Sample order and the resumable position: see job/data/sampler.py (each optimizer step sees the same
samples whatever the world size / accumulation split; ``set_position(epoch, start_batch)``). Each loader has
its own ``torch.Generator``: DataLoader draws a worker base seed on every ``iter()``, which would otherwise
advance the main process's global RNG and break exact resume. Which source gives the datasets is decided in
one place, job.data.source.

Images leave the workers as uint8 CHW tensors (4x less to pin and copy); `to_device` copies them
non-blocking and normalises on the device. Validation is sharded into disjoint contiguous slices (no
padding, no duplicates, sizes differ by at most one); the trainer all-reduces sums and counts.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from job.config import DataConfig
from job.data.device_decode import EncodedBatch, decode_batch
from job.data.images import Batch, Datasets
from job.data.sampler import ResumableSampler, ShardSampler
from job.data.workers import WorkerFailure, WorkerTrackingLoader, init_worker, socket_tempdir_too_long
from job.errors import BadInput, DataStall, is_loader_timeout

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
log = logging.getLogger("job")


class CleanErrors:
    """Wraps a DataLoader: a worker's error reaches the caller as itself, a stalled loader as DataStall."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        for batch in self._batches():
            if isinstance(batch, WorkerFailure):
                raise batch.error
            yield batch

    def _batches(self) -> Iterator[Batch | WorkerFailure]:
        try:
            yield from self.loader
        except RuntimeError as e:
            if not is_loader_timeout(e):  # torch gives it no type of its own (job.errors)
                raise
            timeout = self.loader.timeout
            raise DataStall(
                f"{e}: the DataLoader workers delivered no batch within data.loader_timeout_s={timeout}.",
                "look for a worker traceback above, check the data path's storage, or raise the setting.",
                setting="data.loader_timeout_s",
                value=timeout,
            ) from None


@dataclass(frozen=True)
class ValInfo:
    total: int  # validation samples over all ranks
    start: int  # this rank's shard is [start, stop)
    stop: int
    classes: tuple[str, ...]


@dataclass(frozen=True)
class Loaders:
    train: Any  # iterable of (uint8 images, labels) micro-batches, len() = remaining batches
    train_sampler: ResumableSampler
    val: Any  # iterable of this rank's validation batches (last may be short; may be empty)
    val_info: ValInfo
    decodes_on_device: bool = False  # batches are EncodedBatch: to_device decodes them (job.data.device_decode)
    resident: bool = False  # the batches are on the training device already (data.source=synthetic)

    @property
    def batches_per_epoch(self) -> int:
        return self.train_sampler.batches_per_epoch

    def batches(self, position: Any) -> Generator[Batch, None, None]:
        """Endless training micro-batches from ``position`` on (anything with ``epoch`` and
        ``micro_batches_in_epoch``, e.g. the trainer's state), advancing it as each batch is handed out, so
        a checkpoint taken at any step boundary holds exactly where the data stands. ``close()`` it when done
        (the run's cleanup does): it closes the epoch's iterator and any thread behind it."""
        while True:
            self.train_sampler.set_position(position.epoch, position.micro_batches_in_epoch)
            epoch = iter(self.train)
            try:
                for batch in epoch:
                    position.micro_batches_in_epoch += 1
                    yield batch
            finally:  # closing these batches closes the epoch's too: a decode thread ends with them
                close = getattr(epoch, "close", None)
                if close is not None:
                    close()
            position.epoch += 1
            position.micro_batches_in_epoch = 0


def require_one_batch(
    n: int, setting: str, value: str, world_size: int, micro_batch_size: int, grad_accum_steps: int
) -> None:
    """At least one global batch in a training set of ``n`` samples.

    Raises:
        BadInput: naming ``setting`` (the data setting that gave the set), the sample count and the batch
            arithmetic.
    """
    sampler = ResumableSampler(n, 0, world_size, micro_batch_size, 0, grad_accum_steps)
    if sampler.batches_per_epoch == 0:
        raise BadInput(
            f"{setting}={value}: the training set has {n} samples, fewer than one global batch "
            f"({sampler.accum} accumulation steps x {sampler.world_size} ranks x micro batch "
            f"{sampler.micro_batch_size} = {sampler.accum * sampler.row}).",
            "lower --train.global-batch-size or use a larger training set.",
            setting=setting,
            value=value,
        )


def dataset_loaders(
    cfg: DataConfig,
    sets: Datasets,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    grad_accum_steps: int = 1,
) -> Loaders:
    """This rank's DataLoaders over a source's map-style ``sets`` (see the module docstring)."""
    sampler = ResumableSampler(len(sets.train), rank, world_size, micro_batch_size, seed, grad_accum_steps)
    kw: dict[str, Any] = dict(num_workers=cfg.num_workers, pin_memory=cfg.pin_memory and device.type == "cuda")
    if cfg.num_workers > 0:
        if socket_tempdir_too_long():
            log.info(
                "TMPDIR=%s is too long for the DataLoader workers' Unix sockets: they use a directory in /tmp",
                tempfile.gettempdir(),
            )
        # Workers ignore stop signals: torchrun signals each rank's whole process group, and a worker
        # killed by SIGTERM makes the DataLoader raise in the trainer before it can save (job.train.preempt).
        kw.update(
            persistent_workers=True,
            prefetch_factor=cfg.prefetch_factor,
            worker_init_fn=init_worker,
            timeout=cfg.loader_timeout_s,
        )
    kw["collate_fn"] = sets.collate_fn
    train = WorkerTrackingLoader(
        sets.train, batch_size=micro_batch_size, sampler=sampler, drop_last=True, generator=_generator(seed), **kw
    )
    val_sampler = ShardSampler(len(sets.val), rank, world_size)
    val = WorkerTrackingLoader(
        sets.val, batch_size=micro_batch_size, sampler=val_sampler, drop_last=False, generator=_generator(seed), **kw
    )
    r = val_sampler.indices
    info = ValInfo(len(sets.val), r.start, r.stop, sets.classes)
    return Loaders(CleanErrors(train), sampler, CleanErrors(val), info, decodes_on_device=sets.on_device)


def _generator(seed: int) -> torch.Generator:
    # One per loader: DataLoader draws a worker base seed from it on every iter(), which would otherwise
    # advance the main process's global RNG (or the other loader's) and break exact resume.
    return torch.Generator().manual_seed(seed)


@functools.lru_cache(maxsize=8)
def _norm_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255.0
    inv_std = 1.0 / (torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255.0)
    return mean.to(device), inv_std.to(device)


def to_device(batch: Batch | EncodedBatch, device: torch.device, channels_last: bool = False) -> Batch:
    """uint8 images -> normalised float32 on ``device`` (non-blocking copies; pinned on CUDA). Encoded
    batches (``data.decode=gpu``/``device``) are decoded and cropped on ``device`` first."""
    if isinstance(batch, EncodedBatch):
        images, labels = decode_batch(batch, device), batch.labels
    else:
        images, labels = batch
    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    if channels_last:  # on the uint8 tensor: a quarter of the bytes to reorder
        images = images.contiguous(memory_format=torch.channels_last)
    mean, inv_std = _norm_constants(device)
    return images.float().sub_(mean).mul_(inv_std), labels
