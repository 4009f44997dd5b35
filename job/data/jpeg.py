"""The batched JPEG decoder of this install: torchcodec's, else torchvision's.

torchcodec's ``decode_jpeg`` (0.16 and later) is the one the project pins. torchvision's ``decode_jpeg`` is
deprecated since torchvision 0.29 in its favour; torchcodec's was ported from it and makes the same calls
(one batched nvJPEG call on CUDA, libjpeg-turbo on the CPU). It serves a stack whose torchcodec has no image
decoder or that has no torchcodec at all, as GPU images built on an older torch do, so that the device path
runs there too; the log names the decoder in use.
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from job.data.images import exif_orientation, upright

log = logging.getLogger("job")

Decode = Callable[[Sequence[torch.Tensor], torch.device], list[torch.Tensor]]


@dataclass(frozen=True)
class JpegDecoder:
    name: str
    """``torchcodec`` or ``torchvision``: what the log states."""
    decode: Decode
    """Decodes a batch of encoded JPEGs (1-D uint8 tensors on the CPU) to RGB ``3 x H x W`` uint8 tensors on
    the device; raises RuntimeError naming no file when one of them is not a decodable JPEG."""


@functools.cache
def jpeg_decoder() -> JpegDecoder | None:
    """torchcodec's decoder where it has one, else torchvision's where it still has one, else None."""
    codec = _torchcodec()
    if codec is not None:
        return codec
    return _torchvision()


def _torchcodec() -> JpegDecoder | None:
    try:
        from torchcodec.decoders import decode_jpeg
    except ImportError:  # not installed, or a release before image decoding (0.16)
        return None
    except RuntimeError as e:  # installed, but its native libraries do not load with this torch
        log.warning("data: torchcodec does not load here (%s); trying torchvision's JPEG decoder", str(e)[:200])
        return None

    def decode(data: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        return list(decode_jpeg(list(data), mode="RGB", device=device))

    return JpegDecoder("torchcodec", decode)


def _torchvision() -> JpegDecoder | None:
    import torchvision.io

    decode_jpeg = getattr(torchvision.io, "decode_jpeg", None)
    if decode_jpeg is None:  # removed, as torchvision announces
        return None
    rgb = torchvision.io.ImageReadMode.RGB

    def decode(data: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if device.type == "cuda":
            # torchvision allocates the outputs on this stream but has nvJPEG write them from its own stream,
            # which it does not order after this one: the memory of the previous batch's images, freed to this
            # stream while its crops may still be queued, could be written too soon. Blocks this thread only
            # (the decode-ahead thread).
            torch.cuda.current_stream(device).synchronize()
        images = decode_jpeg(list(data), mode=rgb, device=device)
        # upright, as torchcodec returns them: torchvision applies EXIF orientation on the CPU only, so it is
        # applied here on every device, one code path
        return [upright(image, _orientation(raw)) for image, raw in zip(images, data, strict=True)]

    return JpegDecoder("torchvision", decode)


def _orientation(raw: torch.Tensor) -> int:
    try:
        with Image.open(io.BytesIO(raw.numpy().tobytes())) as im:
            return exif_orientation(im)
    except Exception:  # not a readable header: the decoder raises for this file, naming what is wrong
        return 1
