"""Crops of the device decode path: the batched crop (job.data.resample) against the per-image torchvision
kernels it replaced and against ``torchvision.ops.roi_align``, in pixels and in time, on the CPU or a GPU.

Real JPEGs of many sizes (fine detail in every channel: a fractal, noise, a gradient), decoded on the device
by the install's batched decoder (job.data.jpeg), cropped with RandomResizedCrop boxes and flips drawn as the
workers draw them (train) and resized and centre-cropped (eval). Pixels: the largest difference in uint8
levels and the fraction of pixels that differ, against each reference; on CUDA also nvJPEG's decode against
libjpeg-turbo's. Time: milliseconds per batch (median of the timed repetitions, the device synchronised),
batched vs per-image.

    ddp-job bench crops [--quick] [--batch 64] [--size 224] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import io
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from job.bench import common

# (height, width): upscaled and downscaled crops, tall, wide, tiny, and one far larger than the rest
RAGGED_SIZES = [(17, 29), (48, 48), (300, 200), (123, 457), (64, 31), (375, 500), (24, 24), (1000, 90)]
# ImageNet-like sizes for the timed batches
TIMED_SIZES = [(375, 500), (500, 375), (333, 500), (500, 333), (400, 300), (480, 640)]


def jpeg_bytes(height: int, width: int, seed: int, orientation: int = 1) -> bytes:
    """A JPEG with fine detail in every channel: where resampling filters differ most. Stored ``height`` x
    ``width``; an ``orientation`` other than 1 goes into its EXIF (how to turn it upright, as cameras write)."""
    from PIL import ExifTags, Image

    rng = random.Random(seed)
    fractal = Image.effect_mandelbrot((width, height), (-2 + rng.random(), -1.2, 1, 1.2), 60)
    noise = Image.effect_noise((width, height), 40 + 40 * rng.random())
    ramp = Image.linear_gradient("L").resize((width, height))
    extra = {}
    if orientation != 1:
        exif = Image.Exif()
        exif[ExifTags.Base.Orientation] = orientation
        extra["exif"] = exif.tobytes()
    buf = io.BytesIO()
    Image.merge("RGB", (fractal, noise, ramp)).save(buf, "JPEG", quality=85, **extra)
    return buf.getvalue()


def write_jpeg(path: Path, height: int, width: int, seed: int) -> None:
    path.write_bytes(jpeg_bytes(height, width, seed))


def per_image(images: Sequence[Any], crops: Sequence[Any] | None, size: int, as_float: bool) -> Any:
    """The per-image torchvision path (uint8 kernels, or float32 rounded: what it runs on a GPU)."""
    import torch
    from torchvision.transforms.v2 import functional

    out = []
    for i, im in enumerate(images):
        x = im.float() if as_float else im
        if crops is None:
            x = functional.center_crop(functional.resize(x, [size], antialias=True), [size, size])
        else:
            c = crops[i]
            x = functional.resized_crop(x, c.top, c.left, c.height, c.width, [size, size], antialias=True)
            if c.flip:
                x = functional.horizontal_flip(x)
        out.append(x.round().to(torch.uint8) if as_float else x)
    return torch.stack(out)


def roi_align_crops(images: Sequence[Any], crops: Sequence[Any] | None, size: int, sampling_ratio: int) -> Any:
    """``torchvision.ops.roi_align`` (aligned=True) over the same boxes, the images padded to the largest."""
    import torch
    from torchvision.ops import roi_align

    from job.data.resample import eval_windows, train_windows

    shapes = [(int(im.shape[1]), int(im.shape[2])) for im in images]
    h, w = max(s[0] for s in shapes), max(s[1] for s in shapes)
    padded = torch.zeros(len(images), 3, h, w, device=images[0].device)
    for i, im in enumerate(images):
        padded[i, :, : im.shape[1], : im.shape[2]] = im
    if crops is None:
        rows, cols = eval_windows(shapes, size)
    else:
        rows, cols = train_windows(shapes, crops, size)
    (x1, x2), (y1, y2) = _span(cols, size), _span(rows, size)
    boxes = torch.stack([torch.arange(len(images)).double(), x1, y1, x2, y2], 1).float().to(padded.device)
    out = roi_align(padded, boxes, size, 1.0, sampling_ratio, aligned=True)
    if crops is not None:
        flip = torch.tensor([c.flip for c in crops], device=out.device)
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out.round().clamp(0, 255).to(torch.uint8)


def _span(w: Any, size: int) -> tuple[Any, Any]:
    """The source interval (pixel edges) of a window's kept outputs ``[offset, offset + size)``."""
    scale = w.length.double() / w.resized.double()
    return w.start + w.offset * scale, w.start + (w.offset + size) * scale


def compare(a: Any, b: Any) -> dict[str, float]:
    """Largest difference in levels, fraction of pixels that differ, mean difference."""
    diff = (a.int() - b.int()).abs()
    return {"max": int(diff.max()), "fraction": float((diff > 0).double().mean()), "mean": float(diff.double().mean())}


def _draws(images: Sequence[Any], seed: int, train: bool) -> Any:
    from job.data.augment import draw_crop

    if not train:
        return None
    return [draw_crop(int(im.shape[1]), int(im.shape[2]), seed + i) for i, im in enumerate(images)]


def pixels(encoded: list[Any], size: int, device: Any) -> dict[str, Any]:
    """Every pixel comparison, train and eval, on ``device``."""
    import torch

    from job.data.device_decode import batch_decoder
    from job.data.resample import crop_resize

    decoder = batch_decoder()
    images = decoder.decode(encoded, device)
    out: dict[str, Any] = {}
    if device.type == "cuda":
        host = decoder.decode(encoded, torch.device("cpu"))
        out["nvjpeg_vs_libjpeg"] = compare(
            torch.cat([i.flatten() for i in images]).cpu(), torch.cat([i.flatten() for i in host])
        )
    for split in ("train", "eval"):
        crops = _draws(images, 11, split == "train")
        got = crop_resize(images, crops, size)
        r: dict[str, Any] = {"per_image_float": compare(got, per_image(images, crops, size, True))}
        if device.type == "cpu":
            r["per_image_uint8"] = compare(got, per_image(images, crops, size, False))
        for ratio in (0, 2):
            r[f"roi_align_s{ratio}"] = compare(got, roi_align_crops(images, crops, size, ratio))
        out[split] = r
    return out


def timed(fn: Callable[[], Any], reps: int, device: Any) -> dict[str, float]:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return common.median_spread(times)


def timings(batch: int, size: int, reps: int, device: Any) -> dict[str, Any]:
    """Milliseconds per training batch of ImageNet-sized JPEGs: batched vs per-image crops (decode excluded)."""
    from job.data.device_decode import batch_decoder
    from job.data.resample import crop_resize

    files = [_tensor(jpeg_bytes(h, w, seed=i)) for i, (h, w) in enumerate(TIMED_SIZES)]
    encoded = [files[i % len(files)] for i in range(batch)]  # each with a crop of its own
    images = batch_decoder().decode(encoded, device)
    crops = _draws(images, 3, True)
    out: dict[str, Any] = {
        "batched": timed(lambda: crop_resize(images, crops, size), reps, device),
        "per_image": timed(lambda: per_image(images, crops, size, device.type == "cuda"), reps, device),
    }
    out["per_image_over_batched"] = out["per_image"]["median"] / out["batched"]["median"]
    return out


def _tensor(raw: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench crops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch", type=int, default=None, help="timed batch size (default 64; quick 8)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = p.parse_args(argv)
    import torch

    from job.data.device_decode import batch_decoder

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench crops: --device cuda but no CUDA GPU is visible. Fix: run it on a GPU machine, or --device cpu.")
        return 2
    device = torch.device(a.device)
    batch = a.batch or (8 if a.quick else 64)
    reps = a.reps or (2 if a.quick else 5)
    encoded = [_tensor(jpeg_bytes(h, w, i)) for i, (h, w) in enumerate(RAGGED_SIZES)]
    result = {"quick": a.quick, "device": a.device, "size": a.size, "decoder": batch_decoder().name}
    result["pixels"] = pixels(encoded, a.size, device)
    result["ms_per_batch"] = {"batch": batch, **timings(batch, a.size, reps, device)}
    _report(result)
    common.emit("crops", result)
    return 0


def _report(result: dict[str, Any]) -> None:
    rows = []
    for split in ("train", "eval"):
        for ref, c in result["pixels"][split].items():
            rows.append([split, ref, c["max"], f"{100 * c['fraction']:.3f} %", f"{c['mean']:.4f}"])
    common.table(
        f"crops: batched vs each reference, {len(RAGGED_SIZES)} JPEGs of different sizes to {result['size']} px "
        f"on {result['device']}, decoded by {result['decoder']}",
        ["split", "reference", "max levels", "pixels differing", "mean levels"],
        rows,
    )
    t = result["ms_per_batch"]
    print(
        f"batch of {t['batch']}: batched {common.fmt_ms(t['batched'], 1000, ' ms')}, per-image "
        f"{common.fmt_ms(t['per_image'], 1000, ' ms')} ({t['per_image_over_batched']:.2f}x)"
    )


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
