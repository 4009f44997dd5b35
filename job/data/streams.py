"""Where the input pipeline's device work runs, and how its results reach the training stream.

Work that prepares the next batch (a host-to-device copy, a decode) runs on a side stream so that it overlaps
the current step's kernels; the training (current) stream then waits on an event recorded after that work,
for that batch only, and each tensor handed over is ``record_stream``-ed on the training stream, or the caching
allocator could give its memory out again while the step still reads it. On the CPU there is no stream:
work runs in order where it is called and every method here is a no-op, so the same pipeline code (its thread,
its handover, its order) runs and is tested on a CPU; on CUDA only these objects differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Protocol

import torch


class SideStream(Protocol):
    def enter_thread(self) -> None:
        """Called first in a thread that will run work on this stream (CUDA's current device is per thread)."""

    def active(self) -> contextlib.AbstractContextManager[Any]:
        """The context in which work runs on the side stream (the calling thread's current stream)."""

    def handover(self) -> Any:
        """After the work of one batch, on the thread that ran it: a marker of that work's completion."""

    def receive(self, marker: Any, tensors: Iterable[torch.Tensor]) -> None:
        """On the training thread, before the batch is used: the training stream waits for ``marker`` and the
        allocator learns that ``tensors`` are used there."""


class HostSideStream:
    """The CPU's: work is complete when it returns."""

    def enter_thread(self) -> None:
        pass

    def active(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def handover(self) -> Any:
        return None

    def receive(self, marker: Any, tensors: Iterable[torch.Tensor]) -> None:
        pass


class CudaSideStream:
    """A CUDA stream of its own on ``device``, handed over with an event and ``record_stream``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def active(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)  # sets the current stream of the calling thread only

    def handover(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def receive(self, marker: Any, tensors: Iterable[torch.Tensor]) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(marker)
        for t in tensors:
            t.record_stream(compute)


def side_stream(device: torch.device) -> SideStream:
    """The side stream of ``device``: a CUDA stream of its own, else the no-op of the CPU."""
    if device.type == "cuda":
        return CudaSideStream(device)
    return HostSideStream()
