"""Per-sample augmentation, one definition for both decode paths.

The worker path (``data.decode=cpu``) runs the v2 transforms below on each decoded image, with the CPU
generator seeded from the sample's ``(seed, epoch, index)``. The device path (``data.decode=gpu``/``device``,
job.data.device_decode) cannot: the image is decoded later, on the device. Its worker draws the same crop box and
flip with ``draw_crop`` (the transforms' own parameter code, fed the image's size read from the file header,
drawing the same numbers in the same order), and the device applies them to the whole batch at once with the
same antialiased bilinear filter (job.data.resample). tests/test_decode.py checks both paths give the same crops,
and pixels within one level.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

# Random resized crop's area range: >= 0.35 rather than ImageNet's 0.08, so small generated images keep their
# shape in view.
TRAIN_SCALE = (0.35, 1.0)
FLIP_P = 0.5


def train_transform(size: int, augment: bool) -> v2.Transform:
    if not augment:
        return eval_transform(size)
    return v2.Compose([v2.RandomResizedCrop(size, scale=TRAIN_SCALE, antialias=True), v2.RandomHorizontalFlip(FLIP_P)])


def eval_transform(size: int) -> v2.Transform:
    return v2.Compose([v2.Resize(size, antialias=True), v2.CenterCrop(size)])


@dataclass(frozen=True)
class Crop:
    """One training sample's random resized crop box (in the decoded image) and horizontal flip."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


# Only its parameter code is used (the output size does not enter the box).
_CROP_PARAMS = v2.RandomResizedCrop(1, scale=TRAIN_SCALE, antialias=True)


def draw_crop(height: int, width: int, seed: int) -> Crop:
    """The crop and flip that ``train_transform`` would draw for an image of this size under ``seed``.

    Draws from the CPU generator seeded with ``seed`` and restores its state afterwards (as the worker path
    does), in the transforms' order: RandomResizedCrop's box, then RandomHorizontalFlip's ``rand(1) < p``.
    """
    probe = torch.zeros((), dtype=torch.uint8).expand(3, height, width)  # a size without pixels
    gen = torch.default_generator
    state = gen.get_state()
    try:
        gen.manual_seed(seed)
        box = _CROP_PARAMS.make_params([probe])
        flip = bool(torch.rand(1) < FLIP_P)
    finally:
        gen.set_state(state)
    return Crop(int(box["top"]), int(box["left"]), int(box["height"]), int(box["width"]), flip)
