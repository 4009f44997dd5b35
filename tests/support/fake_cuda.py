"""CUDA events simulated on the CPU, for the code paths that time work with them (job.observe.stopwatch): no
GPU runs here. A ``FakeEvents`` hands out events that take the host's clock when recorded and keep a log of
what was done with them, and refuses what CUDA refuses: reading a span whose events have not been waited for.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from job.observe.stopwatch import CudaStopwatch


class FakeEvent:
    def __init__(self, owner: FakeEvents, enable_timing: bool = False) -> None:
        assert enable_timing, "elapsed_time needs events created with enable_timing=True"
        self.owner, self.t, self.synced = owner, None, False

    def record(self, stream: Any = None) -> None:
        assert stream is self.owner.stream, "recorded on a stream other than the device's current one"
        self.t, self.synced = time.perf_counter(), False
        self.owner.log.append("record")

    def synchronize(self) -> None:
        assert self.t is not None, "synchronize on an event never recorded"
        self.synced = True
        self.owner.log.append("synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.synced and end.synced, "elapsed_time on an event not known to be complete (CUDA raises)"
        assert self.t is not None and end.t is not None
        self.owner.log.append("elapsed_time")
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA reports


class FakeEvents:
    """The event class and current stream of one simulated device, and the log of the calls made on them."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.created: list[FakeEvent] = []
        self.stream = object()

    def event(self, enable_timing: bool = False) -> FakeEvent:
        e = FakeEvent(self, enable_timing)
        self.created.append(e)
        return e

    def current_stream(self, device: torch.device) -> object:
        assert device.type == "cuda", device
        return self.stream

    def stopwatch(self) -> CudaStopwatch:
        """A CudaStopwatch whose events are these."""
        return CudaStopwatch(torch.device("cuda", 0), self.event, self.current_stream)

    def count(self, call: str) -> int:
        return self.log.count(call)
