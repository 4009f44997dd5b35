"""`ddp-job make-data`: write a small, learnable dataset of coloured shapes (ImageFolder or WebDataset shards).

Every class is one (shape, colour) pair: class ``c`` draws shape ``c % 7`` in colour ``c % 8`` (7 and 8
are coprime, so classes 0..55 are all distinct pairs). Each image is a shape of random size and position
on a dark noisy background with per-image colour jitter, so a small CNN needs both colour and shape
cues but learns them within a minute on a CPU. Horizontal flips and moderate crops keep the label.

Layout (torchvision ``ImageFolder`` compatible)::

    OUT/train/class_00/000000.png ...   --per-class images per class
    OUT/val/class_00/000000.png ...     --val-per-class images per class
    OUT/make-data.json                  the arguments, written last (marks the set complete)

``--format webdataset`` writes the same PNG files (byte for byte) as WebDataset shards instead, in the same
order (class by class, so sample ``i`` of a split is the ImageFolder's ``i``-th file): ``OUT/train-000000.tar``
... with their index ``OUT/train.json``, and the same for val (layout: job.data.shard_format). Sample keys are
the ImageFolder paths without extension (``class_00/000000``).

Determinism: every image has its own numpy generator seeded from ``(seed, split, class, index)``, so
the same arguments give byte-identical files, whatever order they are written in. Atomicity: the set is
written into a temporary sibling directory and renamed to OUT in one step, so a crash never leaves a
half-written dataset under OUT. Re-running with the same arguments is a no-op; this module needs no
torch, so the command is quick.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

from job.config import location
from job.data import shard_format
from job.errors import BadInput

SHAPES = ("circle", "square", "triangle", "cross", "diamond", "ring", "x")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 230),
    "yellow": (230, 220, 50),
    "magenta": (210, 60, 210),
    "cyan": (60, 210, 220),
    "white": (235, 235, 235),
    "orange": (240, 140, 30),
}
MAX_CLASSES = len(SHAPES) * len(COLOURS)
MANIFEST = "make-data.json"
_SUPERSAMPLE = 4  # draw at 4x and downsample: smooth edges, still deterministic
_FORMAT_VERSION = 1  # bump when the pixels change, so an old set is not mistaken for a new one
FORMATS = ("png", "jpeg", "webdataset")


def class_name(c: int) -> str:
    return f"class_{c:02d}"


def class_spec(c: int) -> tuple[str, str]:
    """(shape, colour) of class ``c``."""
    return SHAPES[c % len(SHAPES)], list(COLOURS)[c % len(COLOURS)]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple[int, ...]) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
    elif shape == "cross":
        w = r * 0.3
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    elif shape == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline=fill, width=max(1, int(r * 0.35)))
    elif shape == "x":
        w = max(1, int(r * 0.45))
        draw.line((cx - r, cy - r, cx + r, cy + r), fill=fill, width=w)
        draw.line((cx - r, cy + r, cx + r, cy - r), fill=fill, width=w)
    else:  # pragma: no cover - SHAPES is closed
        raise AssertionError(shape)


def render_image(c: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One HxWx3 uint8 image of class ``c``, all randomness from ``rng``."""
    shape, colour = class_spec(c)
    big = size * _SUPERSAMPLE
    background = tuple(int(v) for v in rng.integers(0, 90, size=3))
    img = Image.new("RGB", (big, big), background)
    r = rng.uniform(0.22, 0.38) * big
    cx, cy = rng.uniform(r, big - r, size=2)
    jitter = rng.integers(-25, 26, size=3)
    fill = tuple(int(v) for v in np.clip(np.array(COLOURS[colour]) + jitter, 0, 255))
    _draw_shape(ImageDraw.Draw(img), shape, float(cx), float(cy), float(r), fill)
    img = img.resize((size, size), Image.Resampling.BOX)
    noise = rng.normal(0.0, 12.0, size=(size, size, 3))
    return np.clip(np.asarray(img, dtype=np.float64) + noise, 0, 255).round().astype(np.uint8)


def _check_args(classes: int, per_class: int, size: int, val_per_class: int, fmt: str, shard_size: int) -> None:
    if not 1 <= classes <= MAX_CLASSES:
        raise BadInput(
            f"make-data --classes {classes}: must be between 1 and {MAX_CLASSES} "
            f"({len(SHAPES)} shapes x {len(COLOURS)} colours).",
            "pass --classes 10.",
            setting="--classes",
            value=classes,
        )
    if per_class < 1:
        raise BadInput(
            f"make-data --per-class {per_class}: must be >= 1.",
            "pass --per-class 100.",
            setting="--per-class",
            value=per_class,
        )
    if val_per_class < 1:
        raise BadInput(
            f"make-data --val-per-class {val_per_class}: must be >= 1.",
            "pass --val-per-class 20.",
            setting="--val-per-class",
            value=val_per_class,
        )
    if not 8 <= size <= 1024:
        raise BadInput(
            f"make-data --size {size}: must be between 8 and 1024 pixels.",
            "pass --size 32.",
            setting="--size",
            value=size,
        )
    if fmt not in FORMATS:
        raise BadInput(
            f"make-data --format {fmt!r}: must be one of {', '.join(FORMATS)}.",
            "pass --format png.",
            setting="--format",
            value=fmt,
        )
    if shard_size < 1:
        raise BadInput(
            f"make-data --shard-size {shard_size}: must be >= 1.",
            "pass --shard-size 256.",
            setting="--shard-size",
            value=shard_size,
        )


def _encode(image: np.ndarray, fmt: str) -> bytes:
    """One image file's bytes: PNG (also inside WebDataset shards) or JPEG quality 95."""
    buf = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(image).save(buf, format="JPEG", quality=95)
    else:
        Image.fromarray(image).save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def _split_images(
    seed: int, split_id: int, classes: int, n: int, size: int, fmt: str
) -> Iterator[tuple[int, int, bytes]]:
    """(class, index, file bytes) of one split, class by class; each image from its own seeded generator."""
    for c in range(classes):
        for i in range(n):
            rng = np.random.default_rng([seed, split_id, c, i])
            yield c, i, _encode(render_image(c, size, rng), fmt)


def _write_split(tmp: Path, split: str, images: Iterator[tuple[int, int, bytes]], fmt: str, shard_size: int) -> None:
    if fmt == "webdataset":
        samples = [(f"{class_name(c)}/{i:06d}", ".png", data, c) for c, i, data in images]
        names = sorted({class_name(c) for _, _, _, c in samples})
        shard_format.write_split(tmp, split, samples, shard_size, names)
        return
    ext = "png" if fmt == "png" else "jpg"
    for c, i, data in images:
        d = tmp / split / class_name(c)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.{ext}").write_bytes(data)


def make_dataset(
    out: Path,
    classes: int,
    per_class: int,
    size: int,
    seed: int = 0,
    val_per_class: int | None = None,
    fmt: Literal["png", "jpeg", "webdataset"] = "png",
    shard_size: int = 256,
) -> None:
    """Write the dataset to ``out`` atomically (see the module docstring).

    ``val_per_class`` defaults to ``max(1, per_class // 4)``; ``shard_size`` (samples per shard) applies to
    ``fmt="webdataset"`` only. If ``out`` already holds a set made with
    the same arguments this returns without writing; any other existing ``out`` is a BadInput.
    """
    out = Path(out)
    if val_per_class is None:
        val_per_class = max(1, per_class // 4)
    _check_args(classes, per_class, size, val_per_class, fmt, shard_size)
    args = {
        "classes": classes,
        "per_class": per_class,
        "size": size,
        "seed": seed,
        "val_per_class": val_per_class,
        "format": fmt,
        "version": _FORMAT_VERSION,
    }
    if fmt == "webdataset":
        args["shard_size"] = shard_size
    if out.exists() or out.is_symlink():
        _check_existing(out, args)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for split_id, (split, n) in enumerate(zip(shard_format.SPLITS, (per_class, val_per_class))):
            _write_split(tmp, split, _split_images(seed, split_id, classes, n, size, fmt), fmt, shard_size)
        # The manifest is written last: its presence means every image above is there.
        (tmp / MANIFEST).write_text(json.dumps(args, indent=1, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the set is meant to be shared (e.g. containers)
        try:
            os.rename(tmp, out)
        except OSError:
            # Someone else (a concurrent make-data) renamed theirs first: fine if it is the same set.
            if not out.exists():
                raise
            _check_existing(out, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_existing(out: Path, args: dict) -> None:
    manifest = out / MANIFEST
    try:
        existing = json.loads(manifest.read_text())
    except (OSError, ValueError):
        raise BadInput(
            f"make-data --out {out}: the directory exists but is not a complete make-data set "
            f"(no readable {MANIFEST}).",
            "delete it or pass another --out.",
            setting="--out",
            value=out,
        ) from None
    if existing != args:
        diff = ", ".join(
            f"{k}: {existing.get(k)!r} there, {v!r} asked" for k, v in args.items() if existing.get(k) != v
        )
        raise BadInput(
            f"make-data --out {out}: already holds a set made with other arguments ({diff}).",
            "delete it or pass another --out.",
            setting="--out",
            value=out,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-job make-data",
        description="Write a learnable dataset of coloured shapes: an ImageFolder OUT/train/<class>/*, "
        "OUT/val/<class>/*, or (--format webdataset) the same PNGs as shards OUT/train-NNNNNN.tar + OUT/train.json, "
        "OUT/val-NNNNNN.tar + OUT/val.json.",
    )
    p.add_argument(
        "--out",
        type=location.path_argument,
        required=True,
        help="directory to create (must not exist, or hold the same set)",
    )
    p.add_argument("--classes", type=int, default=10, help=f"number of classes, 1..{MAX_CLASSES} (default 10)")
    p.add_argument("--per-class", type=int, default=100, help="training images per class (default 100)")
    p.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    p.add_argument("--val-per-class", type=int, default=None, help="validation images per class (default per-class/4)")
    p.add_argument("--seed", type=int, default=0, help="seed: same arguments give byte-identical files (default 0)")
    p.add_argument(
        "--format",
        choices=(*FORMATS, "text"),
        default="png",
        help="png or jpeg ImageFolder, webdataset (PNG shards), or text: a byte-level corpus of the Python standard "
        "library's sources for the causal_lm task (OUT/train.bin, OUT/val.bin; job.data.corpus) (default png)",
    )
    p.add_argument(
        "--max-bytes", type=int, default=1_000_000, help="training tokens (bytes) with --format text (default 1000000)"
    )
    p.add_argument(
        "--shard-size", type=int, default=256, help="samples per shard with --format webdataset (default 256)"
    )
    return p


def make_data_main(argv: list[str]) -> int:
    """Entry point of ``ddp-job make-data``; returns the exit code (0 ok, 2 bad input)."""
    a = build_parser().parse_args(argv)
    if a.format == "text":
        return _text_main(a.out, a.max_bytes)
    try:
        make_dataset(a.out, a.classes, a.per_class, a.size, a.seed, a.val_per_class, a.format, a.shard_size)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_val = a.val_per_class if a.val_per_class is not None else max(1, a.per_class // 4)
    print(
        f"make-data: {a.out}: {a.classes} classes, {a.classes * a.per_class} train and "
        f"{a.classes * n_val} val images of {a.size}x{a.size} ({a.format})"
    )
    return 0


def _text_main(out: Path, max_bytes: int) -> int:
    from job.data import corpus

    try:
        meta = corpus.make_corpus(out, max_bytes)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"make-data: {out}: {corpus.describe(meta)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(make_data_main(sys.argv[1:]))
