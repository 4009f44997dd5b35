"""Crop, resize and flip a whole batch of decoded images in a fixed number of kernels, whatever its size.

The images of a batch each have their own size. Done image by image (torchvision's ``resized_crop``, or
``resize`` then ``center_crop``: antialiased bilinear), a batch of 256 launches about 1,300 small kernels, each
dispatched from Python under the GIL. Here the batch's images are concatenated into one flat buffer and the
same antialiased bilinear filter is applied to all of them at once, as two separable passes (rows, then
columns) that gather from that buffer: about four kernels per filter tap and pass (five or six taps for ImageNet-sized
crops to 224 px), independent of the batch size.

The filter is PyTorch's own (aten's antialiased ``upsample_bilinear2d``: for output ``i`` of an axis scaled by
``scale = in / out``, centre ``scale * (i + 0.5)``, support ``scale`` when shrinking else 1, triangle weights,
normalised, clipped at the window's edges), so the result is the per-image float path's up to float rounding.
Measured against the per-image path on real decoded JPEGs, tests/test_decode.py states the tolerance.

Why not ``torchvision.ops.roi_align`` over all boxes: it takes one ``(N, C, H, W)`` input, so images of different
sizes would first be padded to the largest of the batch (one 4000 x 3000 photo in a batch of 256: 37 GB of
float32), and it averages sample points inside each output bin (a box filter) where the antialiased resize
weighs a triangle twice as wide; tools/crop_tolerance.py measures how far apart the two are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from job.data.augment import Crop

CHANNELS = 3  # decoded with mode="RGB"


@dataclass(frozen=True)
class Windows:
    """One axis of every image of the batch (all ``(N,)`` int64): the source window ``[start, start + length)``
    is resized to ``resized`` samples, of which ``[offset, offset + size)`` are kept."""

    start: torch.Tensor
    length: torch.Tensor
    resized: torch.Tensor
    offset: torch.Tensor


@dataclass(frozen=True)
class Taps:
    """One axis of every image: the source index of tap 0 for each kept output ``(N, S)`` and the weights of
    taps ``0..K-1`` ``(N, S, K)`` (zero past the filter's support, so a tap may point anywhere in memory)."""

    first: torch.Tensor
    weights: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.weights.shape[-1])


def axis_taps(w: Windows, size: int) -> Taps:
    """The antialiased bilinear filter of one axis for every image (float64 on the host, weights as float32)."""
    out = w.offset[:, None] + torch.arange(size)
    scale = (w.length.double() / w.resized.double())[:, None]
    center = scale * (out + 0.5)
    shrink = scale >= 1.0
    support = torch.where(shrink, scale, 1.0)
    inv_scale = torch.where(shrink, 1.0 / scale, 1.0)
    lo = (center - support + 0.5).trunc().long().clamp(min=0)  # aten: max(int64_t(center - support + 0.5), 0)
    hi = torch.minimum((center + support + 0.5).trunc().long(), w.length[:, None])
    n = hi - lo
    j = torch.arange(int(n.max()))
    x = (j + lo[..., None] - center[..., None] + 0.5) * inv_scale[..., None]
    weights = (1.0 - x.abs()).clamp(min=0.0) * (j < n[..., None])
    weights = weights / weights.sum(-1, keepdim=True)
    return Taps(w.start[:, None] + lo, weights.float())


def flipped(t: Taps, flip: torch.Tensor) -> Taps:
    """``t`` with the outputs of the images where ``flip`` is set in reverse order (a horizontal flip)."""
    size = t.first.shape[1]
    order = torch.where(flip[:, None], torch.arange(size - 1, -1, -1), torch.arange(size))
    weights = t.weights.gather(1, order[..., None].expand(-1, -1, t.count))
    return Taps(t.first.gather(1, order), weights)


def train_windows(shapes: Sequence[tuple[int, int]], crops: Sequence[Crop], size: int) -> tuple[Windows, Windows]:
    """(rows, columns) of RandomResizedCrop's boxes, each resized to ``size``; a box is kept inside its image
    (it always is: the boxes are drawn on the upright size, job.data.images.upright_size, and the decoders
    return the image upright)."""
    heights, widths = _dims(shapes)
    top = torch.minimum(torch.tensor([c.top for c in crops]), heights - 1)
    left = torch.minimum(torch.tensor([c.left for c in crops]), widths - 1)
    h = torch.minimum(torch.tensor([c.height for c in crops]), heights - top)
    w = torch.minimum(torch.tensor([c.width for c in crops]), widths - left)
    out = torch.full_like(h, size)
    zero = torch.zeros_like(h)
    return Windows(top, h, out, zero), Windows(left, w, out, zero)


def eval_windows(shapes: Sequence[tuple[int, int]], size: int) -> tuple[Windows, Windows]:
    """(rows, columns) of ``Resize(size)`` then ``CenterCrop(size)``: the shorter side to ``size`` (the longer
    ``int(size * long / short)``, torchvision's rounding), then the centre ``size`` samples of each axis."""
    heights, widths = _dims(shapes)
    short = torch.minimum(heights, widths)
    new_h = torch.where(heights == short, size, (size * heights / short).long())
    new_w = torch.where(widths == short, size, (size * widths / short).long())
    zero = torch.zeros_like(heights)
    return (
        Windows(zero, heights, new_h, _centre(new_h, size)),
        Windows(zero, widths, new_w, _centre(new_w, size)),
    )


def _dims(shapes: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([s[0] for s in shapes]), torch.tensor([s[1] for s in shapes])


def _centre(resized: torch.Tensor, size: int) -> torch.Tensor:
    # torchvision's anchor: int(round((resized - size) / 2.0)), Python's round: half to even
    return torch.round((resized - size).double() / 2.0).long()


# ------------------------------------------------------------------------------------------- apply
def crop_resize(images: Sequence[torch.Tensor], crops: Sequence[Crop] | None, size: int) -> torch.Tensor:
    """The batch's training crops (``crops``: RandomResizedCrop's boxes and flips) or evaluation crops (None:
    shorter side to ``size``, centre square), uint8 ``N x 3 x size x size`` on the images' device."""
    shapes = [(int(im.shape[1]), int(im.shape[2])) for im in images]
    if crops is None:
        rows, cols = eval_windows(shapes, size)
        x = axis_taps(cols, size)
    else:
        rows, cols = train_windows(shapes, crops, size)
        x = flipped(axis_taps(cols, size), torch.tensor([c.flip for c in crops]))
    return _resample(images, axis_taps(rows, size), x)


@dataclass(frozen=True)
class _Flat:
    """The batch's pixels in one uint8 buffer: image ``n``'s ``(c, y, x)`` is at
    ``offset[n] + c * strides[n, 0] + y * strides[n, 1] + x * strides[n, 2]``."""

    views: list[torch.Tensor]
    offset: torch.Tensor  # (N,) int64
    strides: torch.Tensor  # (N, 3) int64


def _flatten(images: Sequence[torch.Tensor]) -> _Flat:
    views, strides = [], []
    for im in images:
        view, stride = _dense(im)
        views.append(view)
        strides.append(stride)
    sizes = torch.tensor([v.numel() for v in views])
    return _Flat(views, torch.cumsum(sizes, 0) - sizes, torch.tensor(strides))


def _dense(image: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A 1-D view of ``image``'s memory and its strides in it, without a copy for the layouts decoders return
    (CHW from nvJPEG, HWC seen as CHW from libjpeg-turbo)."""
    if image.is_contiguous():
        return image.view(-1), image.stride()
    hwc = image.permute(1, 2, 0)
    if hwc.is_contiguous():
        return hwc.view(-1), image.stride()
    image = image.contiguous()
    return image.view(-1), image.stride()


def _resample(images: Sequence[torch.Tensor], y: Taps, x: Taps) -> torch.Tensor:
    """Rows pass (every source row the output needs, filtered to the kept columns), then columns pass, float32."""
    device = images[0].device
    flat = _flatten(images)
    plan = _RowPlan.of(y, flat)
    n, size = x.first.shape
    sx = flat.strides[:, 2]
    col = x.first * sx[:, None]  # the column term of tap 0, (N, S)
    pixels = _strided(flat, int(plan.base.max()) + (x.count - 1) * int(sx.max()) + 1, int(col.max()) + 1, device)
    on = plan.to(device)
    col_rows = col.to(device, non_blocking=True)[on.image][None]  # (1, R, S)
    wx = x.weights.to(device, non_blocking=True)
    tmp = torch.zeros(CHANNELS, plan.count, size, device=device)
    for k in range(x.count):
        vals = pixels[torch.add(on.base, on.sx, alpha=k)[..., None], col_rows]  # (3, R, S) uint8
        tmp.addcmul_(vals, wx[:, :, k][on.image][None])
    wy = y.weights.to(device, non_blocking=True)
    out = torch.zeros(CHANNELS, n, size, size, device=device)
    for k in range(y.count):
        picked = tmp.index_select(1, (on.first_row + k).view(-1)).view(CHANNELS, n, size, size)
        out.addcmul_(picked, wy[None, :, :, k, None])
    return out.round_().clamp_(0, 255).to(torch.uint8).permute(1, 0, 2, 3).contiguous()


def _strided(flat: _Flat, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The flat buffer seen as ``rows x cols`` with strides (1, 1): ``[a, b]`` is element ``a + b``, so a
    gather takes a per-row term and a per-column term without materialising their sum (padded to fit)."""
    total = sum(v.numel() for v in flat.views)
    pad = max(rows + cols - 1 - total, 0)
    buffer = torch.cat([*flat.views, torch.zeros(pad, dtype=torch.uint8, device=device)])
    return buffer.as_strided((rows, cols), (1, 1))


@dataclass(frozen=True)
class _RowPlan:
    """The source rows the columns pass needs, all images one after the other (``R`` rows): their image, the
    flat index of each channel's row start ``(3, R)``, and where output row ``(n, o)``'s tap 0 is ``(N, S)``."""

    count: int
    image: torch.Tensor
    base: torch.Tensor
    sx: torch.Tensor
    first_row: torch.Tensor

    @staticmethod
    def of(y: Taps, flat: _Flat) -> _RowPlan:
        lo = y.first.min(1).values
        hi = torch.maximum(y.first.max(1).values, lo)
        count = hi - lo + 1 + (y.count - 1)  # the last output's taps past its support stay inside the plan
        start = torch.cumsum(count, 0) - count
        image = torch.repeat_interleave(torch.arange(len(count)), count)
        local = torch.arange(int(count.sum())) - start[image]
        s = flat.strides[image]
        base = flat.offset[image] + (lo[image] + local) * s[:, 1]
        base = base[None] + torch.arange(CHANNELS)[:, None] * s[:, 0][None]
        first_row = start[:, None] + y.first - lo[:, None]
        return _RowPlan(int(count.sum()), image, base, s[:, 2], first_row)

    def to(self, device: torch.device) -> _RowPlan:
        return _RowPlan(
            self.count, *(t.to(device, non_blocking=True) for t in (self.image, self.base, self.sx, self.first_row))
        )
