"""Host-to-device prefetch: copy micro-batch i+1 to the GPU on a side CUDA stream while i computes.

Without it, ``to_device`` issues the copy on the compute stream right before the forward pass, so the
GPU waits for the PCIe/NVLink transfer every step (non_blocking only frees the CPU). With pinned host
batches (``data.pin_memory``), a copy on another stream overlaps the previous step's kernels; the compute
stream then waits on an event for just that batch. Only the uint8 images travel (4x fewer bytes than
float32); normalisation stays in ``to_device`` on the compute stream.

A no-op on CPU and for batches already on the device (``data.source=synthetic``). The wrapper sits
*under* the trainer's batch counter: the counter still advances when the trainer takes a batch, not when
it is prefetched, so checkpoints record exactly the consumed position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


class DevicePrefetcher:
    """Iterable over ``loader`` yielding (images, labels) already on ``device``, one batch in flight."""

    def __init__(self, loader: Any, device: torch.device, channels_last: bool) -> None:
        self.loader, self.device, self.channels_last = loader, device, channels_last
        self.stream = torch.cuda.Stream(device)

    def __len__(self) -> int:
        return len(self.loader)

    def _issue(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            images, labels = batch
            images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            done = torch.cuda.Event()
            done.record(self.stream)
        return (images, labels), done

    def __iter__(self) -> Iterator[Any]:
        pending = None
        for batch in self.loader:
            issued = self._issue(batch)  # copy of the next batch starts before the current one is handed out
            if pending is not None:
                yield self._ready(*pending)
            pending = issued
        if pending is not None:
            yield self._ready(*pending)

    def _ready(self, batch: Any, done: torch.cuda.Event) -> Any:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        for t in batch:
            # Allocated on the side stream, used on the compute stream: tell the caching allocator, or it
            # could hand the memory out again while kernels still read it.
            t.record_stream(compute)
        return batch


def wrap_loaders(loaders: Any, device: torch.device, enabled: bool, channels_last: bool) -> Any:
    """``loaders`` with the training loader prefetching to ``device`` (unchanged on CPU, when disabled, or
    when the source already lives on the device)."""
    if not enabled or device.type != "cuda" or loaders.resident:
        return loaders  # the synthetic source keeps its images on the device already
    if loaders.decodes_on_device:
        return loaders  # encoded bytes: the decoder reads them from pinned host memory itself
    return dataclasses.replace(loaders, train=DevicePrefetcher(loaders.train, device, channels_last))
