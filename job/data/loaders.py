"""Training and validation data: an ImageFolder, synthetic tensors, or a user dataset (job.data.usersource; the
``_datasets`` dispatch point), sharded over ranks, resumable.

Sample order and the resumable position: see job/data/sampler.py (each optimizer step sees the same
samples whatever the world size / accumulation split; ``set_position(epoch, start_batch)``).

Augmentation randomness. The sampler yields ``(epoch, index)`` pairs; for each sample's random crop/flip
the dataset seeds the CPU generator from ``(seed, epoch, index)`` and restores it afterwards. Results
therefore do not depend on ``num_workers``, persistent workers, worker seeds or prefetching, and the
DataLoader RNG need not be checkpointed. Each loader also has its own ``torch.Generator``: DataLoader
draws a worker base seed on every ``iter()``, which would otherwise advance the main process's global
RNG and break exact resume.

Images leave the workers as uint8 CHW tensors (4x less to pin and copy); `to_device` copies them
non-blocking and normalises on the device. Validation is sharded into disjoint contiguous slices (no
padding, no duplicates, sizes differ by at most one); the trainer all-reduces sums and counts.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision.transforms import v2

from job.config import DataConfig
from job.data import device_decode
from job.data.augment import eval_transform, train_transform
from job.data.datagen import make_data_main, make_dataset  # noqa: F401  (re-exported: the CLI's make-data)
from job.data.device_decode import EncodedBatch, EncodedFiles, collate_encoded, decode_batch
from job.data.sampler import ResumableSampler, ShardSampler, sample_seed, shard_range  # noqa: F401
from job.data.workers import (
    WorkerFailure,
    WorkerTrackingLoader,
    init_error,
    init_worker,
    socket_tempdir_too_long,
    unreadable_image,
)
from job.errors import BadInput, DataStall, JobError, is_loader_timeout
from job.usercode import is_import_path

if TYPE_CHECKING:
    from job.data.shards import ShardLayout

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Batch = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger("job")


# ----------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class DataLayout:
    """What `validate_data` found: class names and (path, label) lists, no image decoded."""

    classes: tuple[str, ...]
    train: tuple[tuple[str, int], ...]
    val: tuple[tuple[str, int], ...]


def _make_data_hint(cfg: DataConfig) -> str:
    return f"ddp-job make-data --out {cfg.path} --classes {cfg.num_classes} --per-class 100 --size {cfg.image_size}"


def _list_dir(d: Path, what: str) -> list[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        raise BadInput(
            f"data.path: cannot read {what} {d} ({e.strerror}).",
            "check the path and its permissions.",
            setting="data.path",
            value=d,
        ) from None


def _scan_split(cfg: DataConfig, split: str) -> tuple[list[str], list[tuple[str, int]]]:
    d = cfg.path / split
    if not d.is_dir():
        raise BadInput(
            f"data.path={cfg.path}: missing {d}/ (expected the ImageFolder layout "
            f"{cfg.path}/train/<class>/*.png and {cfg.path}/val/<class>/*.png).",
            f"point --data.path at such a root, or generate one with `{_make_data_hint(cfg)}`.",
            setting="data.path",
            value=cfg.path,
        )
    classes = [e.name for e in _list_dir(d, "split folder") if e.is_dir()]
    if len(classes) != cfg.num_classes:
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        at_least = ""
        if len(classes) < 2:
            at_least = " (at least 2)"
        raise BadInput(
            f"data.num_classes={cfg.num_classes} but {d} has {len(classes)} class folders ({shown}).",
            f"pass --data.num-classes {len(classes)}{at_least} or point --data.path at the right dataset.",
            setting="data.num_classes",
            value=cfg.num_classes,
        )
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        files = [
            e.path
            for e in _list_dir(d / name, "class folder")
            if e.name.lower().endswith(IMG_EXTENSIONS) and e.is_file()
        ]
        if not files:
            raise BadInput(
                f"data.path: class folder {d / name} holds no image files ({', '.join(IMG_EXTENSIONS)}).",
                f"add images to it or remove the folder from both {cfg.path}/train and {cfg.path}/val.",
                setting="data.path",
                value=cfg.path,
            )
        samples.extend((f, label) for f in files)
    return classes, samples


def validate_data(cfg: DataConfig) -> DataLayout | ShardLayout | None:
    """Cheap checks before any process group or device work: paths, class folders, counts.

    Lists directories but decodes nothing. Returns a ShardLayout for WebDataset shards
    (job.data.shards.validate_shards: it also decodes a few samples) and None for the other sources (synthetic:
    nothing to check; a user dataset is checked by job.data.usersource). Raises BadInput naming the setting or
    file, the bad value and the fix.
    """
    if cfg.source == "webdataset":
        from job.data.shards import validate_shards  # imported here: job.data.shards builds on this module

        return validate_shards(cfg)
    if cfg.source != "imagefolder":
        return None
    if not cfg.path.is_dir():
        what = "is not a directory" if cfg.path.exists() else "does not exist"
        raise BadInput(
            f"data.path={cfg.path} {what}.",
            f"generate the demo dataset with `{_make_data_hint(cfg)}`, pass --data.path pointing at an "
            "ImageFolder root holding train/ and val/, or use --data.source synthetic.",
            setting="data.path",
            value=cfg.path,
        )
    train_classes, train = _scan_split(cfg, "train")
    val_classes, val = _scan_split(cfg, "val")
    if train_classes != val_classes:
        only_t = sorted(set(train_classes) - set(val_classes))
        only_v = sorted(set(val_classes) - set(train_classes))
        raise BadInput(
            f"data.path={cfg.path}: train/ and val/ class folders differ (only in train: {only_t}, "
            f"only in val: {only_v}).",
            "give both splits the same class folder names.",
            setting="data.path",
            value=cfg.path,
        )
    return DataLayout(tuple(train_classes), tuple(train), tuple(val))


# ---------------------------------------------------------------------------------------- dataset
def pil_to_tensor(file: str | IO[bytes]) -> torch.Tensor:
    """Decode one image file (a path or an open file) to a uint8 RGB CHW tensor; PIL's error otherwise."""
    # PIL, not torchvision.io.decode_image: the latter segfaulted (killing the worker, losing the file
    # name) on a PNG with flipped bytes here, while PIL raises for truncated and corrupt PNG and JPEG.
    with Image.open(file) as im:
        array = np.asarray(im.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def decode(path: str) -> torch.Tensor:
    """Read and decode one image file to a uint8 RGB CHW tensor; BadInput naming the file otherwise."""
    try:
        return pil_to_tensor(path)
    except Exception as e:
        raise unreadable_image(path, e) from None


class ImageFiles(Dataset):
    """(path, label) list -> (uint8 CHW image, label); items are keyed by (epoch, index) pairs."""

    def __init__(self, samples: tuple[tuple[str, int], ...], transform: v2.Transform | None, seed: int, random: bool):
        self.samples, self.transform, self.seed, self.random = samples, transform, seed, random

    def __len__(self) -> int:
        return len(self.samples)

    def __getitems__(self, keys: list[tuple[int, int] | int]) -> list[tuple[torch.Tensor, int]] | WorkerFailure:
        """One batch's samples (DataLoader's fetcher calls this), or the error that stopped it, as data."""
        try:
            return [self[key] for key in keys]
        except JobError as err:
            return WorkerFailure(err)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index`` before any transform: a uint8 CHW image and its label (job.data.shards.ShardImages
        and job.data.usersource.UserImages override it)."""
        path, label = self.samples[index]
        return decode(path), label

    def __getitem__(self, key: tuple[int, int] | int) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        img, label = self.load(index)
        if self.transform is None:
            return img, label
        if not self.random:
            return self.transform(img), label
        # v2 transforms draw from the global CPU generator: seed it for this sample and restore it after,
        # so nothing leaks into the caller's RNG (num_workers=0 runs here). Not torch.manual_seed /
        # fork_rng: they also touch every accelerator's generators (0.6 ms a sample, measured).
        gen = torch.default_generator
        state = gen.get_state()
        try:
            gen.manual_seed(sample_seed(self.seed, epoch, index))
            return self.transform(img), label
        finally:
            gen.set_state(state)


# ---------------------------------------------------------------------------------------- loaders
def collate(batch: list[tuple[torch.Tensor, int]] | WorkerFailure) -> Batch | WorkerFailure:
    """DataLoader ``collate_fn``: default_collate, passing failures (a sample's, the worker start's) on."""
    failed_start = init_error()
    if failed_start is not None:
        return WorkerFailure(failed_start)
    if isinstance(batch, WorkerFailure):
        return batch
    images, labels = default_collate(batch)
    return images, labels


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

    @property
    def batches_per_epoch(self) -> int:
        return self.train_sampler.batches_per_epoch

    def batches(self, position: Any) -> Iterator[Batch]:
        """Endless training micro-batches from ``position`` on (anything with ``epoch`` and
        ``micro_batches_in_epoch``, e.g. the trainer's state), advancing it as each batch is handed out, so
        a checkpoint taken at any step boundary holds exactly where the data stands."""
        while True:
            self.train_sampler.set_position(position.epoch, position.micro_batches_in_epoch)
            for batch in self.train:
                position.micro_batches_in_epoch += 1
                yield batch
            position.epoch += 1
            position.micro_batches_in_epoch = 0


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


def build_loaders(
    cfg: DataConfig,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    grad_accum_steps: int = 1,
) -> Loaders:
    """Train and val loaders of this rank (see the module docstring for order and determinism)."""
    if cfg.source == "synthetic":
        return _synthetic(cfg, rank, world_size, micro_batch_size, seed, device, grad_accum_steps)
    sets = _datasets(cfg, seed, device, rank)
    check_train_size(cfg, sets.layout, world_size, micro_batch_size, grad_accum_steps, train_size=len(sets.train))
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


@dataclass(frozen=True)
class Datasets:
    """One source's map-style train and val datasets, keyed by the samplers' (epoch, index) pairs."""

    train: Any  # a Dataset with __len__
    val: Any
    classes: tuple[str, ...]
    collate_fn: Any = collate
    on_device: bool = False
    layout: DataLayout | ShardLayout | None = None  # what validate_data found (its size check names the setting)


def _datasets(cfg: DataConfig, seed: int, device: torch.device, rank: int) -> Datasets:
    """The dispatch point: each source that reads samples through the DataLoader, by data.source."""
    if is_import_path(cfg.source):
        from job.data import usersource  # here, not at the top: usersource builds on this module's ImageFiles

        return usersource.datasets(cfg, seed)
    if cfg.source == "webdataset":
        return _webdataset(cfg, seed)
    return _imagefolder(cfg, seed, device, rank)


def _webdataset(cfg: DataConfig, seed: int) -> Datasets:
    from job.data.shards import shard_datasets, validate_shards  # here: job.data.shards builds on this module

    layout = validate_shards(cfg)
    train, val = shard_datasets(cfg, layout, seed)
    return Datasets(train, val, layout.classes, layout=layout)


def _imagefolder(cfg: DataConfig, seed: int, device: torch.device, rank: int) -> Datasets:
    layout = validate_data(cfg)
    assert isinstance(layout, DataLayout)
    if _decodes_on_device(cfg, layout, device, rank):
        train_enc = EncodedFiles(layout.train, cfg.image_size, seed, random=cfg.augment)
        val_enc = EncodedFiles(layout.val, cfg.image_size, seed, random=False)
        return Datasets(train_enc, val_enc, layout.classes, collate_encoded, on_device=True, layout=layout)
    train = ImageFiles(layout.train, train_transform(cfg.image_size, cfg.augment), seed, random=cfg.augment)
    val = ImageFiles(layout.val, eval_transform(cfg.image_size), seed, random=False)
    return Datasets(train, val, layout.classes, layout=layout)


def _generator(seed: int) -> torch.Generator:
    # One per loader: DataLoader draws a worker base seed from it on every iter(), which would otherwise
    # advance the main process's global RNG (or the other loader's) and break exact resume.
    return torch.Generator().manual_seed(seed)


def decode_choice(cfg: DataConfig, layout: DataLayout | ShardLayout | None, cuda: bool) -> device_decode.DecodeChoice:
    """Where this run decodes (job.data.device_decode.choose_decode); BadInput where data.decode cannot be met."""
    files: list[str] = []
    if isinstance(layout, DataLayout):
        files = [path for path, _ in layout.train + layout.val]
    return device_decode.choose_decode(cfg, files, cuda, device_decode.has_torchcodec())


def _decodes_on_device(cfg: DataConfig, layout: DataLayout | ShardLayout, device: torch.device, rank: int) -> bool:
    choice = decode_choice(cfg, layout, device.type == "cuda")
    if rank == 0:
        where = "the workers (PIL)"
        if choice.on_device:
            where = f"{device.type} (torchcodec)"
        log.info("data: decoding on %s: %s", where, choice.reason)
    return choice.on_device


def _synthetic(
    cfg: DataConfig,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    grad_accum_steps: int,
) -> Loaders:
    # Generated on the CPU from the seed (identical on every rank and device type), then moved once.
    g = torch.Generator().manual_seed(seed)
    shape = (3, cfg.image_size, cfg.image_size)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, cfg.num_classes, (n,), generator=g)
        return images.to(device), labels.to(device)

    train_x, train_y = make(cfg.synthetic_train_size)
    val_x, val_y = make(cfg.synthetic_val_size)
    check_train_size(cfg, None, world_size, micro_batch_size, grad_accum_steps)
    sampler = ResumableSampler(cfg.synthetic_train_size, rank, world_size, micro_batch_size, seed, grad_accum_steps)
    val_sampler = ShardSampler(cfg.synthetic_val_size, rank, world_size)
    r = val_sampler.indices
    classes = tuple(f"class_{c:02d}" for c in range(cfg.num_classes))
    return Loaders(
        TensorBatches(train_x, train_y, sampler, micro_batch_size),
        sampler,
        TensorBatches(val_x, val_y, val_sampler, micro_batch_size),
        ValInfo(cfg.synthetic_val_size, r.start, r.stop, classes),
    )


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
