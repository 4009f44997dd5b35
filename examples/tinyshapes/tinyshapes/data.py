"""A dataset as ddp-job calls a user dataset: ``shapes(split="train"|"val", path=data.path, **data.options)``.

Each item is drawn from its own index (a filled circle, square, triangle or cross of random colour, size and place
on a random background), so it needs no files: ``path`` is unused here, where a real dataset would read from it.
Items are ``(PIL image, int label)``; the job resizes, augments and normalises them.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw
from torch.utils.data import Dataset

CLASSES = ("circle", "square", "triangle", "cross")


def _draw(kind: str, draw: ImageDraw.ImageDraw, cx: float, cy: float, r: float, colour: tuple[int, ...]) -> None:
    if kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif kind == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif kind == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    else:
        w = r / 3
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)


class Shapes(Dataset):
    """``per_class`` images of each class in CLASSES, ``size`` pixels square; val draws other images than train."""

    classes = CLASSES

    def __init__(self, split: str, per_class: int, size: int, seed: int) -> None:
        self.split, self.size = split, size
        self.n = per_class * len(CLASSES)
        self.seed = seed * 2 + (split == "val")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        rng = random.Random(self.seed * 1_000_003 + index)
        label = index % len(CLASSES)
        background = tuple(rng.randrange(0, 96) for _ in range(3))
        image = Image.new("RGB", (self.size, self.size), background)
        colour = tuple(rng.randrange(128, 256) for _ in range(3))
        r = rng.uniform(0.2, 0.35) * self.size
        cx, cy = (rng.uniform(r, self.size - r) for _ in range(2))
        _draw(CLASSES[label], ImageDraw.Draw(image), cx, cy, r, colour)
        return image, label


def shapes(split: str, path: Path, per_class: int = 64, size: int = 40, seed: int = 0) -> Shapes:
    """The ``split`` of the generated dataset (``path``: where a real dataset would read its files)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    return Shapes(split, per_class, size, seed)
