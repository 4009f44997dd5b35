"""The WebDataset shard layout: what `ddp-job make-data --format webdataset` writes and job.data.shards reads.

A shard is a POSIX (ustar) tar file of samples. A sample is consecutive members that share a key (the member
name up to its first dot after the last ``/``): ``<key>.png`` (or another image extension) holds the image file
and ``<key>.cls`` the label as decimal text, the WebDataset convention for classification. An index is a wids
dataset description (JSON) listing each shard and its sample count; shard URLs are relative to the index::

    {"wids_version": 1, "name": "...", "classes": ["class_00", ...],
     "shardlist": [{"url": "train-000000.tar", "nsamples": 256, "filesize": 1290240}, ...]}

``classes`` is this project's addition (wids ignores it): the class names, whose count must equal
``data.num_classes``. make-data writes ``OUT/<split>-NNNNNN.tar`` and ``OUT/<split>.json`` for both splits.

Determinism: member headers carry no time, owner or mode of the writing machine (mtime 0, uid/gid 0, mode
0644), so the same samples give byte-identical shards. This module needs no torch (make-data stays quick).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

LABEL_EXT = ".cls"
WIDS_VERSION = 1  # the dataset-description version wids reads
SPLITS = ("train", "val")


def index_name(split: str) -> str:
    """The index file of ``split`` in a make-data directory (the default of data.<split>_shards)."""
    return f"{split}.json"


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def write_shard(path: Path, samples: Iterable[tuple[str, str, bytes, int]]) -> int:
    """Write ``(key, image extension, image bytes, label)`` samples to the tar ``path``; returns the count."""
    n = 0
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, ext, image, label in samples:
            tar.addfile(*_member(f"{key}{ext}", image))
            tar.addfile(*_member(f"{key}{LABEL_EXT}", f"{label}\n".encode()))
            n += 1
    return n


def write_split(
    out: Path, split: str, samples: Sequence[tuple[str, str, bytes, int]], shard_size: int, classes: Sequence[str]
) -> None:
    """``samples`` as ``out/<split>-NNNNNN.tar`` shards of ``shard_size`` samples (the last may be short), in
    order, and their index ``out/<split>.json`` (written after the shards)."""
    shardlist = []
    for number, start in enumerate(range(0, len(samples), shard_size)):
        path = out / shard_name(split, number)
        count = write_shard(path, samples[start : start + shard_size])
        shardlist.append({"url": path.name, "nsamples": count, "filesize": path.stat().st_size})
    index = {"wids_version": WIDS_VERSION, "name": split, "classes": list(classes), "shardlist": shardlist}
    (out / index_name(split)).write_text(json.dumps(index, indent=1) + "\n")
