"""`data.source: webdataset`: WebDataset tar shards read by index, so the resumable sampler keeps the order.

Library: ``wids`` (WebDataset's indexed reader, the ``wids`` package on PyPI; ``webdataset`` 1.x no longer ships
it). From it this module takes the tar index (``IndexedTarSamples``: member offsets from the headers, the file
memory-mapped, samples grouped by key), the dataset description (``wids_specs``: the JSON index with shard
URLs relative to it) and the download of remote shards into a local cache (``wids_dl``: http(s), s3, gs,
``pipe:`` commands). It leaves out ``wids.ShardListDataset`` itself: that class also takes a lock file next
to every local shard (fails on a read-only mount), closes shards beyond an LRU of 10 (a random order over more
shards would re-index a shard on nearly every sample) and prints a line per process.

Where a split's shards are (``data.train_shards`` / ``data.val_shards``, see job.config.schema): a wids index
(local path or URL), or a local directory whose ``*.tar`` files, in name order, are the shards (counted by
reading their headers). Empty: ``<data.path>/<split>.json`` (what make-data writes), else the directory
``<data.path>/<split>/``. Remote shards are downloaded once per machine into ``$WIDS_CACHE`` (wids' default
``/tmp/_wids_cache``); local ones are read in place.

Order and augmentation: sample ``i`` of a split is the ``i``-th sample of its shards in index order; the trainer's
sampler picks indices exactly as for an ImageFolder, and ``ShardImages`` is an ``ImageFiles`` (the same seeded
per-sample augmentation and exact validation shards). make-data writes the same images in the same order as its
ImageFolder, so both sources give the same batches.

Checks before any process group (`validate_shards`): the index or directory, a non-empty shard list, every local
shard file present with a tar's size (a multiple of 512 bytes) and a valid first tar header, the class count, and the first shard of each
split opened and its first samples decoded (labels in range). Every shard is checked again when a loader opens
it (its sample count against the index) and every sample when it is read; failures are ``BadShard`` errors naming
the shard file.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
from torchvision.transforms import v2

from job.config import DataConfig
from job.data import shard_format
from job.data.augment import eval_transform, train_transform
from job.data.images import IMG_EXTENSIONS, Datasets, ImageFiles, pil_to_tensor
from job.errors import BadInput, BadShard

PROBE_SAMPLES = 8  # samples of each split's first shard decoded before the process group
_TAR_BLOCK = 512
_REMOTE_SCHEMES = ("http", "https", "ftp", "ftps", "gs", "s3")  # wids_dl's download commands


@dataclass(frozen=True)
class ShardList:
    """One split's shards in order: their paths or URLs and sample counts; ``len()`` is the sample count."""

    setting: str  # the setting to blame for a bad shard: data.<split>_shards, or data.path for the default
    source: str  # the index, directory or URL the list came from
    urls: tuple[str, ...]
    counts: tuple[int, ...]

    def __len__(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class ShardLayout:
    """What `validate_shards` found (the WebDataset counterpart of job.data.imagefolder.DataLayout)."""

    classes: tuple[str, ...]
    train: ShardList
    val: ShardList

    def describe(self) -> str:
        """The layout in one line (validation decoded the first samples of each split already)."""
        return (
            f"WebDataset: {len(self.classes)} classes, {len(self.train)} train samples in {len(self.train.urls)} "
            f"shard(s) ({self.train.source}), {len(self.val)} val in {len(self.val.urls)} ({self.val.source}); "
            "first samples readable"
        )

    def size(self) -> tuple[int, str, str]:
        return len(self.train), self.train.setting, self.train.source

    def files(self) -> list[str]:
        return []  # samples inside shards: the on-device decode reads files of an ImageFolder only

    def datasets(self, cfg: DataConfig, seed: int, device: torch.device, rank: int, decode: Any) -> Datasets:
        train, val = shard_datasets(cfg, self, seed)
        return Datasets(train, val, self.classes, layout=self)


def is_remote(url: str) -> bool:
    """Whether wids downloads ``url`` (a remote URL or a ``pipe:`` command) rather than reading a local file."""
    return url.startswith("pipe:") or urlparse(url).scheme in _REMOTE_SCHEMES


def _local_path(url: str) -> str:
    if urlparse(url).scheme == "file":
        return urlparse(url).path
    return url


# ----------------------------------------------------------------------------------------- sources
def split_source(cfg: DataConfig, split: str) -> tuple[str, str]:
    """(setting to blame, where the shards of ``split`` are): the setting, or the make-data layout under data.path."""
    given: str = getattr(cfg, f"{split}_shards")
    if given:
        return f"data.{split}_shards", given
    index = cfg.path / shard_format.index_name(split)
    if not index.exists() and (cfg.path / split).is_dir():
        return "data.path", str(cfg.path / split)
    return "data.path", str(index)


def _bad(setting: str, source: str, what: str, fix: str) -> BadInput:
    return BadInput(f"{setting}={source}: {what}", fix, setting=setting, value=source)


def _missing_fix(cfg: DataConfig) -> str:
    return (
        f"point --data.path at a directory holding train.json and val.json (or train/ and val/ folders of .tar "
        f"shards), set --data.train-shards / --data.val-shards, or generate the demo set with `ddp-job make-data "
        f"--format webdataset --out {cfg.path} --classes {cfg.num_classes} --size {cfg.image_size}`."
    )


def _read_index(setting: str, source: str) -> dict[str, Any]:
    """The raw JSON of a wids index, local or remote (wids downloads it to a temporary file)."""
    from wids.wids_specs import load_remote_dsdesc_raw

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            desc = load_remote_dsdesc_raw(_local_path(source))
    except (OSError, AssertionError, ValueError) as e:  # wids asserts that its download command succeeded
        raise _bad(
            setting,
            source,
            f"cannot read the shard index ({type(e).__name__}: {str(e)[:200]}).",
            "fix the URL or path.",
        ) from None
    if not isinstance(desc, dict) or desc.get("wids_version") != shard_format.WIDS_VERSION:
        raise _bad(
            setting,
            source,
            f"not a wids dataset description (a JSON object with wids_version {shard_format.WIDS_VERSION}).",
            "write the index as job.data.shard_format describes, e.g. with `widsindex create`.",
        )
    return desc


def _from_index(setting: str, source: str) -> tuple[ShardList, tuple[str, ...] | None]:
    from wids.wids_specs import resolve_dsdesc, urldir

    desc = _read_index(setting, source)
    if not desc.get("shardlist") and not desc.get("datasets"):
        raise _bad(setting, source, "the index lists no shards (empty shardlist).", "list the shards in it.")
    try:
        resolved = resolve_dsdesc(desc, base=urldir(source))  # shard URLs relative to the index
        urls = tuple(str(s["url"]) for s in resolved["shardlist"])
        counts = tuple(int(s["nsamples"]) for s in resolved["shardlist"])
    except (AssertionError, KeyError, TypeError, ValueError, OSError) as e:
        raise _bad(setting, source, f"bad shard list ({type(e).__name__}: {str(e)[:200]}).", "fix the index.") from None
    classes = desc.get("classes")
    if classes is not None:
        classes = tuple(str(c) for c in classes)
    return ShardList(setting, source, urls, counts), classes


def _from_directory(setting: str, source: str) -> ShardList:
    urls = tuple(str(p) for p in sorted(Path(source).glob("*.tar")))
    if not urls:
        raise _bad(
            setting,
            source,
            "the directory holds no .tar shards.",
            "put the shards there or point the setting elsewhere.",
        )
    shards = ShardList(setting, source, urls, (0,) * len(urls))
    counts = tuple(len(open_shard(shards, i, check_count=False)) for i in range(len(urls)))
    return ShardList(setting, source, urls, counts)


def resolve_split(cfg: DataConfig, split: str) -> tuple[ShardList, tuple[str, ...] | None]:
    """The shards of ``split`` and, where the index names them, the class names; BadInput if there are none."""
    setting, source = split_source(cfg, split)
    if not is_remote(source) and Path(_local_path(source)).is_dir():
        shards, classes = _from_directory(setting, _local_path(source)), None
    elif is_remote(source) or Path(_local_path(source)).is_file():
        shards, classes = _from_index(setting, source)
    else:
        raise _bad(setting, source, "no such shard index or directory.", _missing_fix(cfg))
    if len(shards) == 0:
        raise _bad(setting, source, "the shards hold no samples.", "point the setting at a non-empty shard list.")
    return shards, classes


# ------------------------------------------------------------------------------------------ reading
def _bad_shard(shards: ShardList, url: str, what: str, fix: str = "") -> BadShard:
    fix = fix or "replace or re-create this shard, or remove it from the shard list."
    return BadShard(
        f"data: shard {url} ({shards.setting}={shards.source}): {what}", fix, setting=shards.setting, value=url
    )


def check_shard_files(shards: ShardList) -> None:
    """Every local shard present, of a tar's size and starting with a valid tar header (a stat and a 512-byte read
    each, not a scan: the whole index of a shard is read when a loader opens it; remote shards are checked then)."""
    for url in shards.urls:
        if is_remote(url):
            continue
        try:
            with open(_local_path(url), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(_TAR_BLOCK)
        except OSError as e:
            raise _bad_shard(shards, url, f"cannot be read ({e.strerror}).") from None
        if size == 0 or size % _TAR_BLOCK:
            raise _bad_shard(shards, url, f"{size} bytes, not a multiple of {_TAR_BLOCK}: truncated or not a tar file.")
        try:
            tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise _bad_shard(shards, url, f"does not start with a tar header ({type(e).__name__}: {e}).") from None


def _open_stream(url: str) -> io.BufferedReader:
    if not is_remote(url):
        return open(_local_path(url), "rb")
    from wids.wids import DefaultLocalname
    from wids.wids_dl import download_and_open

    cache = DefaultLocalname(os.environ.get("WIDS_CACHE", "/tmp/_wids_cache"))
    stream: io.BufferedReader = download_and_open(url, cache(url))
    return stream


def open_shard(shards: ShardList, i: int, check_count: bool = True) -> Any:
    """Shard ``i`` indexed (wids ``IndexedTarSamples``); BadShard if it cannot be, or holds another sample count."""
    from wids.wids import IndexedTarSamples

    url = shards.urls[i]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # wids prints the header it failed to parse
            tar = IndexedTarSamples(path=url, stream=_open_stream(url))
    except Exception as e:  # a corrupt tar fails in wids' parser with any of several types
        raise _bad_shard(
            shards, url, f"cannot be indexed as a tar file ({type(e).__name__}: {str(e)[:200]})."
        ) from None
    if check_count and len(tar) != shards.counts[i]:
        tar.close()
        raise _bad_shard(shards, url, f"holds {len(tar)} samples, the index says {shards.counts[i]}.")
    return tar


def decode_sample(shards: ShardList, url: str, sample: dict[str, Any], num_classes: int) -> tuple[torch.Tensor, int]:
    """One wids sample (``{".png": file, ".cls": file, "__key__": key}``) -> (uint8 CHW image, label)."""
    key = sample.get("__key__")
    image_ext = next((ext for ext in sample if ext.lower() in IMG_EXTENSIONS), None)
    if image_ext is None or shard_format.LABEL_EXT not in sample:
        parts = sorted(k for k in sample if not k.startswith("__"))
        raise _bad_shard(shards, url, f"sample {key} has {parts}, not an image ({'/'.join(IMG_EXTENSIONS)}) and .cls.")
    try:
        label = int(sample[shard_format.LABEL_EXT].read().decode().strip())
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad_shard(shards, url, f"sample {key}: the label is not an integer ({e}).") from None
    if not 0 <= label < num_classes:
        raise _bad_shard(
            shards,
            url,
            f"sample {key} has label {label}, outside [0, data.num_classes={num_classes}).",
            "set --data.num-classes to the number of classes of this dataset, or fix the label.",
        )
    try:
        return pil_to_tensor(sample[image_ext]), label
    except Exception as e:  # PIL raises several types for corrupt files
        raise _bad_shard(shards, url, f"sample {key}: cannot decode {image_ext} ({type(e).__name__}: {e}).") from None


class ShardReader:
    """Samples of one split by index: each shard is opened (indexed, memory-mapped) on first use and kept open,
    so a random order over all shards costs one index build per shard and process, not one per sample."""

    def __init__(self, shards: ShardList) -> None:
        self.shards = shards
        self.starts = np.cumsum((0, *shards.counts))
        self._open: dict[int, Any] = {}

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, sample number in the shard) of sample ``index``."""
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return shard, index - int(self.starts[shard])

    def sample(self, index: int) -> tuple[str, dict[str, Any]]:
        shard, inner = self.locate(index)
        if shard not in self._open:
            self._open[shard] = open_shard(self.shards, shard)
        return self.shards.urls[shard], self._open[shard][inner]

    def __getstate__(self) -> dict[str, Any]:
        # Open memory maps do not pickle (a spawned worker); each process opens its own.
        return {**self.__dict__, "_open": {}}


class ShardImages(ImageFiles):
    """A split of shards as an ImageFiles: same (epoch, index) keys and seeded augmentation, read from tars."""

    def __init__(self, shards: ShardList, num_classes: int, transform: v2.Transform | None, seed: int, random: bool):
        super().__init__((), transform, seed, random)
        self.shards, self.num_classes, self.reader = shards, num_classes, ShardReader(shards)

    def __len__(self) -> int:
        return len(self.shards)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        url, sample = self.reader.sample(index)
        return decode_sample(self.shards, url, sample, self.num_classes)


# ------------------------------------------------------------------------------------------ checks
def _check_classes(cfg: DataConfig, train: tuple[str, ...] | None, val: tuple[str, ...] | None) -> tuple[str, ...]:
    names = train or val
    if train is not None and val is not None and train != val:
        raise BadInput(
            f"data: the train and val shard indices name different classes ({list(train)[:5]} vs {list(val)[:5]}).",
            "give both indices the same classes list.",
            setting="data.val_shards",
            value=val,
        )
    if names is not None and len(names) != cfg.num_classes:
        raise BadInput(
            f"data.num_classes={cfg.num_classes} but the shard index names {len(names)} classes ({', '.join(names[:5])}).",
            f"pass --data.num-classes {len(names)} or point the data settings at the right dataset.",
            setting="data.num_classes",
            value=cfg.num_classes,
        )
    return names or tuple(f"class_{c:02d}" for c in range(cfg.num_classes))


def _probe(shards: ShardList, num_classes: int) -> None:
    """The first shard opened (its count checked) and its first samples decoded, labels in range."""
    tar = open_shard(shards, 0)
    try:
        for i in range(min(PROBE_SAMPLES, shards.counts[0])):
            decode_sample(shards, shards.urls[0], tar[i], num_classes)
    finally:
        tar.close()


def validate_shards(cfg: DataConfig) -> ShardLayout:
    """Cheap checks of ``data.source=webdataset`` before any process group (see the module docstring)."""
    (train, train_classes), (val, val_classes) = (resolve_split(cfg, s) for s in shard_format.SPLITS)
    classes = _check_classes(cfg, train_classes, val_classes)
    for shards in (train, val):
        check_shard_files(shards)
        _probe(shards, cfg.num_classes)
    return ShardLayout(classes, train, val)


def shard_datasets(cfg: DataConfig, layout: ShardLayout, seed: int) -> tuple[ShardImages, ShardImages]:
    """Train (augmented as configured) and val datasets of a validated layout."""
    train = ShardImages(layout.train, cfg.num_classes, train_transform(cfg.image_size, cfg.augment), seed, cfg.augment)
    val = ShardImages(layout.val, cfg.num_classes, eval_transform(cfg.image_size), seed, random=False)
    return train, val
