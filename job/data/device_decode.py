"""Decode and augment on the device (``data.decode=gpu``/``device``): workers only read JPEG bytes.

A CPU core decodes and crops a few hundred ImageNet JPEGs a second, a GPU trains on thousands: on a GPU node
the workers, not the model, would set the pace. On this path a worker reads each file's bytes, reads the
image size from the JPEG header and draws the sample's crop and flip (``job.data.augment.draw_crop``: the
same numbers the PIL path draws, from the same per-sample seed). The batch travels as one flat uint8 tensor
of encoded bytes; ``decode_batch`` decodes it on the device in one batched call (torchcodec's
``decode_jpeg``: nvJPEG on CUDA, libjpeg-turbo on the CPU) and applies all the batch's crops, resizes and
flips at once with the PIL path's antialiased bilinear filter (job.data.resample). In training this runs one
batch ahead in a background thread, on a side stream (job.data.decode_ahead). The sampler, the per-sample seeds
and therefore the order, the crops and exact resume are those of the worker path; only the decoder and the
filter's rounding differ (tests/test_decode.py states the tolerance).

Why torchcodec: torchvision's own ``decode_jpeg`` is deprecated in its favour, it is the PyTorch team's
maintained decoder, it decodes a list of JPEGs in one call on CUDA (batched nvJPEG) and on the CPU (so CI
runs this very path), and it adds 24 MB to the image (12 MB of package, 12 MB of bundled libraries), without
FFmpeg (JPEG decoding does not need it). Where torchcodec has no image decoder, torchvision's serves
(job.data.jpeg).
DALI would also decode on the GPU but brings its own pipeline, sampler hand-off and ~0.5 GB; its CPU-only
pipelines decode differently from the GPU ones, so the CPU test would not exercise the production path.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from job.config import DataConfig
from job.data.images import upright_size
from job.data.jpeg import JpegDecoder, jpeg_decoder
from job.data.resample import crop_resize
from job.data.sampler import sample_seed
from job.data.workers import WorkerFailure, init_error, unreadable_image
from job.errors import BadInput, JobError

if TYPE_CHECKING:
    from job.data.augment import Crop

JPEG_EXTENSIONS = (".jpg", ".jpeg")
log = logging.getLogger("job")


# ----------------------------------------------------------------------------------------- choice
@dataclass(frozen=True)
class DecodeChoice:
    on_device: bool
    reason: str


def choose_decode(cfg: DataConfig, files: Sequence[str], cuda: bool, codec: bool) -> DecodeChoice:
    """Where this run decodes, from the setting and what is present (a pure function: tests pass each case).

    Raises:
        BadInput: ``gpu``/``device`` asked for where that path cannot run (no CUDA for ``gpu``, no JPEG decoder,
            a source that has no image files, a file that is not a JPEG).
    """
    asked = cfg.decode
    if asked == "cpu":
        return DecodeChoice(False, "data.decode=cpu")
    if asked == "gpu" and not cuda:
        _refuse(
            asked, "CUDA is not available to this process", "use data.decode=cpu or auto, or run where a GPU is visible"
        )
    if cfg.source != "imagefolder":
        _refuse_or_skip(asked, f"data.source={cfg.source} has no image files to decode", "use data.decode=cpu or auto")
        return DecodeChoice(False, f"data.source={cfg.source} has no image files")
    if not codec:
        _refuse_or_skip(
            asked,
            "no batched JPEG decoder is installed (torchcodec 0.16+, or torchvision's)",
            "pip install the pinned torchcodec",
        )
        return DecodeChoice(False, "no batched JPEG decoder is installed")
    other = next((f for f in files if not f.lower().endswith(JPEG_EXTENSIONS)), None)
    if other is not None:
        _refuse_or_skip(asked, f"{other} is not a JPEG file", "convert the dataset to JPEG or use data.decode=cpu")
        return DecodeChoice(False, f"{other} is not a JPEG file")
    if asked == "auto" and not cuda:
        return DecodeChoice(False, "no CUDA device: decoding in the DataLoader workers")
    return DecodeChoice(True, f"data.decode={asked}: batched JPEG decode and augmentation on the training device")


def _refuse_or_skip(asked: str, why: str, fix: str) -> None:
    if asked != "auto":
        _refuse(asked, why, fix)


def _refuse(asked: str, why: str, fix: str) -> None:
    raise BadInput(f"data.decode={asked}: {why}.", f"{fix}.", setting="data.decode", value=asked)


# ------------------------------------------------------------------------------------------ batch
@dataclass
class EncodedBatch:
    """One micro-batch as it leaves a worker: every file's bytes in one flat tensor (one pin, one copy)."""

    data: torch.Tensor  # uint8, the files' bytes one after the other
    lengths: list[int]
    crops: list[Crop] | None  # None: validation (resize + centre crop)
    labels: torch.Tensor
    paths: list[str]  # to name a file the decoder refuses
    image_size: int

    def pin_memory(self) -> EncodedBatch:
        # DataLoader's pin_memory thread calls this for custom batch types.
        self.data = self.data.pin_memory()
        self.labels = self.labels.pin_memory()
        return self

    def encoded(self) -> list[torch.Tensor]:
        return list(self.data.split(self.lengths))


def _jpeg_size(raw: np.ndarray, path: str) -> tuple[int, int]:
    """(height, width) of the upright image from the JPEG header, without decoding the pixels: the decoders
    turn the image as its EXIF orientation says, and the crop is drawn on what they return."""
    try:
        with Image.open(io.BytesIO(raw.tobytes())) as im:
            return upright_size(im)
    except Exception as e:
        raise unreadable_image(path, e) from None


class EncodedFiles(Dataset):
    """(path, label) list -> encoded batches: the worker half of the device path."""

    def __init__(self, samples: tuple[tuple[str, int], ...], image_size: int, seed: int, random: bool):
        self.samples, self.image_size, self.seed, self.random = samples, image_size, seed, random

    def __len__(self) -> int:
        return len(self.samples)

    def __getitems__(self, keys: list[tuple[int, int] | int]) -> EncodedBatch | WorkerFailure:
        try:
            return self._batch(keys)
        except JobError as err:
            return WorkerFailure(err)

    def _batch(self, keys: list[tuple[int, int] | int]) -> EncodedBatch:
        from job.data.augment import draw_crop  # torchvision, imported by image runs only

        raws, crops, labels, paths = [], [], [], []
        for key in keys:
            epoch, index = key if isinstance(key, tuple) else (0, key)
            path, label = self.samples[index]
            raw = np.fromfile(path, dtype=np.uint8)
            if self.random:
                height, width = _jpeg_size(raw, path)
                crops.append(draw_crop(height, width, sample_seed(self.seed, epoch, index)))
            raws.append(raw)
            labels.append(label)
            paths.append(path)
        data = torch.from_numpy(np.concatenate(raws))
        lengths = [len(r) for r in raws]
        batch_crops = crops if self.random else None
        return EncodedBatch(data, lengths, batch_crops, torch.tensor(labels), paths, self.image_size)


def collate_encoded(batch: EncodedBatch | WorkerFailure) -> EncodedBatch | WorkerFailure:
    """DataLoader ``collate_fn`` of the device path: the dataset already built the batch."""
    failed_start = init_error()
    if failed_start is not None:
        return WorkerFailure(failed_start)
    return batch


# ----------------------------------------------------------------------------------------- decode
def decode_batch(batch: EncodedBatch, device: torch.device) -> torch.Tensor:
    """The batch's images, decoded and cropped on ``device``: uint8 ``B x 3 x S x S``."""
    return crop_resize(_decode(batch, device), batch.crops, batch.image_size)


def decoded(batch: EncodedBatch, device: torch.device, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images, labels) of ``batch`` on ``device``: what job.data.decode_ahead hands to the trainer."""
    images = decode_batch(batch, device)
    if channels_last:  # here, on the decode's stream: one kernel less on the training stream
        images = images.contiguous(memory_format=torch.channels_last)
    return images, batch.labels.to(device, non_blocking=True)


def _decode(batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
    encoded = batch.encoded()
    try:
        return batch_decoder().decode(encoded, device)
    except RuntimeError as err:
        _name_the_bad_file(encoded, batch.paths, device)
        raise err


def _name_the_bad_file(encoded: list[torch.Tensor], paths: list[str], device: torch.device) -> None:
    """One call for the whole batch does not say which file it refused: find it and raise naming it."""
    decoder = batch_decoder()
    for data, path in zip(encoded, paths, strict=True):
        try:
            decoder.decode([data], device)
        except RuntimeError as e:
            raise BadInput(
                f"data: cannot decode JPEG file {path} on {device} ({str(e).strip()[:200]}).",
                "delete or replace this file, or decode it in the workers with data.decode=cpu.",
                setting="data.path",
                value=path,
            ) from None


def batch_decoder() -> JpegDecoder:
    """This install's batched JPEG decoder (job.data.jpeg); BadInput where it has none."""
    decoder = jpeg_decoder()
    if decoder is None:  # choose_decode refused the path already; reached only by a caller that skipped it
        raise BadInput(
            "data.decode: no batched JPEG decoder is installed.",
            "pip install the pinned torchcodec.",
            setting="data.decode",
            value="device",
        )
    return decoder
