"""Host-to-device prefetch: copy micro-batch i+1 to the GPU on a side CUDA stream while i computes.

Without it, ``to_device`` issues the copy on the compute stream right before the forward pass, so the
GPU waits for the PCIe/NVLink transfer every step (non_blocking only frees the CPU). With pinned host
batches (``data.pin_memory``), a copy on another stream overlaps the previous step's kernels; the compute
stream then waits on an event for just that batch (job.data.streams). Only the uint8 images travel (4x fewer
bytes than float32); normalisation stays in ``to_device`` on the compute stream.

A no-op on CPU and for batches already on the device (``data.source=synthetic``). Batches that are decoded
on the device (``data.decode=gpu``/``device``) are decoded one batch ahead in a background thread instead
(job.data.decode_ahead), on the CPU too. Both wrappers sit *under* the trainer's batch counter: the counter
still advances when the trainer takes a batch, not when it is prefetched, so checkpoints record exactly the
consumed position.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch

from job.data.decode_ahead import DecodeAhead
from job.data.device_decode import decoded
from job.data.streams import CudaSideStream, side_stream


class DevicePrefetcher:
    """Iterable over ``loader`` yielding (images, labels) already on ``device``, one batch in flight."""

    def __init__(self, loader: Any, device: torch.device, channels_last: bool) -> None:
        self.loader, self.device, self.channels_last = loader, device, channels_last
        self.side = CudaSideStream(device)

    def __len__(self) -> int:
        return len(self.loader)

    def _issue(self, batch: Any) -> tuple[Any, Any]:
        with self.side.active():
            images, labels = batch
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            return (images, labels), self.side.handover()

    def __iter__(self) -> Iterator[Any]:
        pending = None
        for batch in self.loader:
            issued = self._issue(batch)  # copy of the next batch starts before the current one is handed out
            if pending is not None:
                yield self._ready(*pending)
            pending = issued
        if pending is not None:
            yield self._ready(*pending)

    def _ready(self, batch: Any, done: Any) -> Any:
        self.side.receive(done, batch)
        return batch


def wrap_loaders(loaders: Any, device: torch.device, enabled: bool, channels_last: bool) -> Any:
    """``loaders`` with the training loader prefetching to ``device``, and both loaders of the device decode path
    decoding one batch ahead (unchanged when disabled, on CPU without device decode, or when the source already
    lives on the device)."""
    if not enabled or loaders.resident:
        return loaders  # the synthetic source keeps its images on the device already
    if loaders.decodes_on_device:
        decode = functools.partial(decoded, device=device, channels_last=channels_last)
        train = DecodeAhead(loaders.train, decode, side_stream(device))
        return dataclasses.replace(loaders, train=train, val=DecodeAhead(loaders.val, decode, side_stream(device)))
    if device.type != "cuda":
        return loaders
    return dataclasses.replace(loaders, train=DevicePrefetcher(loaders.train, device, channels_last))
