"""``data.source: imagefolder``: a ``root/{train,val}/<class>/*.png`` tree, checked without decoding
(``validate_imagefolder``), read by PIL in the DataLoader workers or, with ``data.decode``, as encoded files
decoded on the training device (job.data.device_decode)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from job.config import DataConfig
from job.data import device_decode
from job.data.augment import eval_transform, train_transform
from job.data.device_decode import EncodedFiles, collate_encoded
from job.data.images import IMG_EXTENSIONS, Datasets, ImageFiles
from job.data.jpeg import jpeg_decoder
from job.errors import BadInput

log = logging.getLogger("job")


@dataclass(frozen=True)
class DataLayout:
    """What `validate_imagefolder` found: class names and (path, label) lists, no image decoded. A data source
    (job.data.source.Source): it hands its datasets to the loaders without validating again."""

    classes: tuple[str, ...]
    train: tuple[tuple[str, int], ...]
    val: tuple[tuple[str, int], ...]
    root: str = ""

    def size(self) -> tuple[int, str, str]:
        return len(self.train), "data.path", self.root

    def files(self) -> list[str]:
        return [path for path, _ in self.train + self.val]

    def describe(self) -> str:
        """The layout in one line, after one file actually read (BadInput naming it when it cannot be)."""
        path = self.train[0][0]
        try:
            with open(path, "rb") as f:
                f.read(64)
        except OSError as e:
            raise BadInput(
                f"{path}: not readable ({e.strerror})",
                "check the data mount and its permissions",
                setting="data.path",
                value=self.root,
            ) from None
        return (
            f"data.path={self.root}: {len(self.classes)} classes = data.num_classes, "
            f"{len(self.train)} train / {len(self.val)} val files, first file readable"
        )

    def datasets(
        self, cfg: DataConfig, seed: int, device: torch.device, rank: int, decode: device_decode.DecodeChoice
    ) -> Datasets:
        return imagefolder_datasets(cfg, seed, device, rank, self, decode)


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


def validate_imagefolder(cfg: DataConfig) -> DataLayout:
    """Cheap checks before any process group or device work: paths, class folders, counts. Lists directories
    but decodes nothing. Raises BadInput naming the setting or file, the bad value and the fix."""
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
    return DataLayout(tuple(train_classes), tuple(train), tuple(val), str(cfg.path))


def imagefolder_datasets(
    cfg: DataConfig, seed: int, device: torch.device, rank: int, layout: DataLayout, choice: device_decode.DecodeChoice
) -> Datasets:
    """The datasets of a validated ``layout`` (``validate_imagefolder``), decoded where ``choice`` says."""
    if rank == 0:
        where = "the workers (PIL)"
        if choice.on_device:
            where = f"{device.type} ({device_decode.batch_decoder().name})"
        log.info("data: decoding on %s: %s", where, choice.reason)
    if choice.on_device:
        train_enc = EncodedFiles(layout.train, cfg.image_size, seed, random=cfg.augment)
        val_enc = EncodedFiles(layout.val, cfg.image_size, seed, random=False)
        return Datasets(train_enc, val_enc, layout.classes, collate_encoded, on_device=True, layout=layout)
    train = ImageFiles(layout.train, train_transform(cfg.image_size, cfg.augment), seed, random=cfg.augment)
    val = ImageFiles(layout.val, eval_transform(cfg.image_size), seed, random=False)
    return Datasets(train, val, layout.classes, layout=layout)


def decode_choice(cfg: DataConfig, files: list[str], cuda: bool) -> device_decode.DecodeChoice:
    """Where this run decodes the image ``files`` (job.data.device_decode.choose_decode; none: a source that is
    not a file tree); BadInput where data.decode cannot be met."""
    return device_decode.choose_decode(cfg, files, cuda, jpeg_decoder() is not None)
