"""What every map-style image source shares (ImageFolder, WebDataset shards, a user dataset): decoding one
image, the ``ImageFiles`` dataset keyed by the samplers' ``(epoch, index)`` pairs with its seeded per-sample
augmentation, the collate function and the ``Datasets`` pair a source hands to the loaders.

Augmentation randomness. The sampler yields ``(epoch, index)`` pairs; for each sample's random crop/flip
the dataset seeds the CPU generator from ``(seed, epoch, index)`` and restores it afterwards. Results
therefore do not depend on ``num_workers``, persistent workers, worker seeds or prefetching, and the
DataLoader RNG need not be checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps
from torch.utils.data import Dataset, default_collate

from job.data.sampler import sample_seed
from job.data.workers import WorkerFailure, init_error, unreadable_image
from job.errors import JobError

if TYPE_CHECKING:  # the transforms come from the sources (job.data.augment): torchvision is theirs to import
    from torchvision.transforms import v2

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
Batch = tuple[torch.Tensor, torch.Tensor]


# EXIF orientation -> (transpose, the axes then flipped) that turn the stored image upright
_UPRIGHT: dict[int, tuple[bool, tuple[int, ...]]] = {
    2: (False, (-1,)),
    3: (False, (-2, -1)),
    4: (False, (-2,)),
    5: (True, ()),
    6: (True, (-1,)),
    7: (True, (-2, -1)),
    8: (True, (-2,)),
}
# the orientations whose upright image is the stored one with height and width exchanged
QUARTER_TURNS = frozenset(o for o, (transpose, _) in _UPRIGHT.items() if transpose)


def pil_to_tensor(file: str | IO[bytes]) -> torch.Tensor:
    """Decode one image file (a path or an open file) to a uint8 RGB CHW tensor, upright as its EXIF orientation
    says (as torchcodec, the device path's decoder, always turns it); PIL's error otherwise."""
    # PIL, not torchvision.io.decode_image: the latter segfaulted (killing the worker, losing the file
    # name) on a PNG with flipped bytes here, while PIL raises for truncated and corrupt PNG and JPEG.
    with Image.open(file) as im:
        array = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def exif_orientation(im: Image.Image) -> int:
    """The EXIF orientation of an opened image (1: stored upright, also where it has none), from its header."""
    return int(im.getexif().get(ExifTags.Base.Orientation, 1))


def upright_size(im: Image.Image) -> tuple[int, int]:
    """(height, width) of an opened image once turned upright (``pil_to_tensor``), from its header alone."""
    width, height = im.size
    if exif_orientation(im) in QUARTER_TURNS:
        return width, height
    return height, width


def upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A ``C x H x W`` image as stored, turned upright as its EXIF ``orientation`` says, as PIL's
    ``ImageOps.exif_transpose`` turns it: 2-4 mirror it or turn it by half a turn; 5-8 exchange its height and
    width (6 is shown turned a quarter clockwise, 8 a quarter anticlockwise, 5 and 7 mirrored as well)."""
    transpose, flips = _UPRIGHT.get(orientation, (False, ()))
    if transpose:
        image = image.transpose(-2, -1)
    if flips:
        image = image.flip(flips)
    return image.contiguous()


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


def collate(batch: list[tuple[torch.Tensor, int]] | WorkerFailure) -> Batch | WorkerFailure:
    """DataLoader ``collate_fn``: default_collate, passing failures (a sample's, the worker start's) on."""
    failed_start = init_error()
    if failed_start is not None:
        return WorkerFailure(failed_start)
    if isinstance(batch, WorkerFailure):
        return batch
    images, labels = default_collate(batch)
    return images, labels


@dataclass(frozen=True)
class Datasets:
    """One source's map-style train and val datasets, keyed by the samplers' (epoch, index) pairs."""

    train: Any  # a Dataset with __len__
    val: Any
    classes: tuple[str, ...]
    collate_fn: Any = collate
    on_device: bool = False
    layout: Any = None  # what the source's validation found (the ImageFolder or shard layout)
