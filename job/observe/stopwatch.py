"""Spans of time on the clock of the device that does the work, chosen once per device type.

On the CPU the host's ``perf_counter`` is that clock. On a GPU it is not: the host only queues the kernels and
runs ahead, so a host timestamp says when work was queued, not when it ran. There the points are CUDA events
recorded on the device's current stream, and a span is read with ``elapsed_time``, which needs its end event
complete: ``seconds`` waits for it, so callers read spans only where the host may wait (the observer at the
steps it publishes, the doctor after its timed loop), never on every training step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Stopwatch(Protocol):
    """``point()`` marks now without waiting for the device; ``seconds(a, b)`` is the time from point a to b."""

    def point(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class HostStopwatch:
    """The CPU: a point is ``perf_counter``'s reading."""

    def point(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaStopwatch:
    """A GPU: a point is a timing event recorded on the device's current stream (no host synchronisation).

    ``event`` and ``current_stream`` are torch's unless a test hands in stand-ins that run on the CPU."""

    def __init__(
        self,
        device: torch.device,
        event: Callable[..., Any] = torch.cuda.Event,
        current_stream: Callable[[torch.device], Any] = torch.cuda.current_stream,
    ) -> None:
        self.device, self._event, self._current_stream = device, event, current_stream

    def point(self) -> Any:
        # The current stream of the calling thread: autograd's device thread sets the one its kernels run on.
        e = self._event(enable_timing=True)
        e.record(self._current_stream(self.device))
        return e

    def seconds(self, start: Any, end: Any) -> float:
        # elapsed_time fails on an event that has not completed; both, as the two may be on different streams
        start.synchronize()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def stopwatch(device: torch.device) -> Stopwatch:
    """The stopwatch for work on ``device``."""
    if device.type == "cuda":
        return CudaStopwatch(device)
    return HostStopwatch()
