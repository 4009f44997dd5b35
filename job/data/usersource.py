"""``data.source: package.module:callable``: a user's map-style dataset under the job's own sampler, sharding,
seeded per-sample augmentation and exact validation (job.data.images, job.data.loaders), so exact resume holds for it too.

The contract (docs/user-code.md): ``callable(split="train"|"val", path=data.path, **data.options)`` returns a
map-style dataset (``__len__`` and ``__getitem__``) whose items are ``(image, label)``: ``image`` a PIL image or a
uint8 ``3 x H x W`` tensor of any size, ``label`` an int in ``[0, data.num_classes)``. The job asks for items by
index only, in the order its sampler decides; its transforms bring every image to ``data.image_size``.

Preflight (``check_user_data``) calls the callable for both splits and checks their first items, before any
process group starts; each later item is checked as it is read (in the DataLoader workers), with the same error.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import IterableDataset
from torchvision.transforms import v2

from job import usercode
from job.config import DataConfig
from job.data.augment import eval_transform, train_transform
from job.data.images import Datasets, ImageFiles
from job.errors import UserCodeError

SPLITS = ("train", "val")
CHECK_ITEMS = 4
"""Items of each split that preflight reads and checks (the rest are checked as the workers read them)."""


def _error(cfg: DataConfig, what: str, fix: str) -> UserCodeError:
    return UserCodeError(f"data.source={cfg.source!r}: {what}", fix, setting="data.source", value=cfg.source)


def open_split(cfg: DataConfig, split: str) -> Any:
    """The user's dataset for ``split``, checked to be a non-empty map-style dataset."""
    fn = usercode.resolve("data.source", cfg.source)
    kwargs = {"split": split, "path": cfg.path, **cfg.options}
    dataset = usercode.call("data.source", cfg.source, fn, kwargs, "data.options")
    iterable = isinstance(dataset, IterableDataset)
    if iterable or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise _error(
            cfg,
            f"split={split!r} returned a {type(dataset).__name__}, not a map-style dataset.",
            "return an object with __len__ and __getitem__(index) (a torch.utils.data.Dataset): the job's sampler "
            "picks the indices, which is what makes resume exact (an iterable dataset cannot be resumed).",
        )
    if len(dataset) == 0:
        raise _error(cfg, f"the {split!r} split is empty.", f"check data.path={cfg.path} and data.options.")
    return dataset


def to_image(cfg: DataConfig, image: Any, where: str) -> torch.Tensor:
    """A PIL image or uint8 3 x H x W tensor as the job's uint8 CHW tensor (RGB)."""
    if isinstance(image, Image.Image):
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).contiguous()
    if isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.ndim == 3 and image.shape[0] == 3:
        return image
    got = type(image).__name__
    if isinstance(image, torch.Tensor):
        got = f"a {image.dtype} tensor of shape {list(image.shape)}"
    raise _error(
        cfg,
        f"{where}: the image is {got}, not a PIL image or a uint8 3 x H x W tensor.",
        "return PIL images, or uint8 tensors with the 3 colour channels first (e.g. torchvision.io.decode_image, "
        "or tensor.permute(2, 0, 1) of an H x W x 3 array); the job normalises and resizes them itself.",
    )


def to_label(cfg: DataConfig, label: Any, where: str) -> int:
    """An int label in [0, data.num_classes)."""
    if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
        label = label.item()
    ok = isinstance(label, numbers.Integral) and not isinstance(label, bool)
    if ok and 0 <= int(label) < cfg.num_classes:
        return int(label)
    what = f"the label {label!r} ({type(label).__name__}) is not an int"
    if ok:
        what = f"the label {label} is outside [0, data.num_classes={cfg.num_classes})"
    raise _error(
        cfg,
        f"{where}: {what}.",
        "return class indices 0..num_classes-1 as ints, and set data.num_classes to the number of classes.",
    )


def to_item(cfg: DataConfig, item: Any, where: str) -> tuple[torch.Tensor, int]:
    """One user item checked against the contract: ``(uint8 CHW image, int label)``."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        got = type(item).__name__
        if isinstance(item, (tuple, list)):
            got = f"a {got} of {len(item)} elements"
        raise _error(cfg, f"{where} is {got}, not an (image, label) pair.", "make __getitem__ return (image, label).")
    return to_image(cfg, item[0], where), to_label(cfg, item[1], where)


class UserImages(ImageFiles):
    """The user's dataset behind ImageFiles' (epoch, index) keys and seeded transforms: only reading differs."""

    def __init__(self, cfg: DataConfig, split: str, transform: v2.Transform, seed: int, random: bool) -> None:
        super().__init__((), transform, seed, random)
        self.cfg, self.split = cfg, split
        self.items = open_split(cfg, split)

    def __len__(self) -> int:
        return len(self.items)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        return to_item(self.cfg, self.items[index], f"{self.split}[{index}]")


def _classes(cfg: DataConfig, dataset: Any) -> tuple[str, ...]:
    """The dataset's own class names (torchvision's ``classes`` attribute) when it has one per class."""
    names = getattr(dataset, "classes", None)
    if isinstance(names, (list, tuple)) and len(names) == cfg.num_classes:
        return tuple(str(n) for n in names)
    return tuple(f"class_{c:02d}" for c in range(cfg.num_classes))


def datasets(cfg: DataConfig, seed: int) -> Datasets:
    """Both splits, with the transforms, collate and (epoch, index) keys of every file source."""
    train = UserImages(cfg, "train", train_transform(cfg.image_size, cfg.augment), seed, random=cfg.augment)
    val = UserImages(cfg, "val", eval_transform(cfg.image_size), seed, random=False)
    return Datasets(train, val, _classes(cfg, train.items))


def check_user_data(cfg: DataConfig) -> int | None:
    """Preflight for a user dataset: both splits open and their first items keep the contract. Returns the size of
    the training set (None when data.source is not an import path).

    Raises:
        UserCodeError: naming the split, the item and what is wrong with it.
    """
    if not usercode.is_import_path(cfg.source):
        return None
    sizes: dict[str, int] = {}
    for split in SPLITS:
        dataset = open_split(cfg, split)
        sizes[split] = len(dataset)
        for index in range(min(CHECK_ITEMS, len(dataset))):
            where = f"{split}[{index}]"
            try:
                item = dataset[index]
            except Exception as e:
                raise _error(
                    cfg,
                    f"reading {where} raised {type(e).__name__}: {str(e).strip()[:300]}",
                    "fix the dataset's __getitem__ (JOB_TRACEBACK=1 prints the traceback).",
                ) from e
            to_item(cfg, item, where)
    return sizes["train"]


class UserSource:
    """A user dataset as a data source (job.data.source.Source), after ``check_user_data``."""

    def __init__(self, cfg: DataConfig, train_size: int) -> None:
        self.cfg, self.train_size = cfg, train_size

    def size(self) -> tuple[int, str, str]:
        return self.train_size, "data.source", self.cfg.source

    def files(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"data.source={self.cfg.source}: {self.train_size} training items, the first ones checked"

    def datasets(self, cfg: DataConfig, seed: int, device: torch.device, rank: int, decode: Any) -> Datasets:
        return datasets(cfg, seed)
