"""Exact skips for optimizers that take no ``found_inf`` flag (ZeRO's sharded update, LARS, LAMB), without the host
waiting for the flag.

The update runs unconditionally and is undone on the device where the flag is set: the parameters and the optimizer
state on the flag's device are copied before the update and selected back with ``torch.where`` after it. State the
device cannot select (CPU tensors of a CUDA run: torch's non-capturable step counts, timm LAMB's group step) is
cloned on the host and restored one step late, when the flag has come back through a pinned non-blocking copy and
its event: at the next update, or at ``settle`` before anything reads the optimizer state (a check, a save). By
then the device is past that flag, so the host waits for nothing while the device still has the next step queued.

Cost: one copy of the parameters and of this rank's optimizer state in device memory, and about three kernels per
``CHUNK_BYTES`` of it per step. Plain numbers in the parameter groups (``lr``, the scheduler's) are not rolled
back: the scheduler owns them, and none of the supported optimizers keeps a counter as a Python number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

CHUNK_BYTES = 64 << 20
"""The most bytes one select kernel handles: bounds the temporary buffer of ``_Chunk.select``."""


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer that holds this rank's state: ZeroRedundancyOptimizer's local ``optim``, else itself."""
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, Optimizer):
        return inner
    return optimizer


def state_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    """Every tensor an update changes besides the parameters: this rank's per-parameter state and the groups'
    ``step`` (timm's LAMB keeps its count there)."""
    inner = local_optimizer(optimizer)
    out = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    out += [g["step"] for g in inner.param_groups if isinstance(g.get("step"), torch.Tensor)]
    return out


def state_complete(optimizer: Optimizer) -> bool:
    """Whether every parameter with a gradient has its state: the first update creates it (from nothing, which no
    copy can restore), so until then the flag is read on the host."""
    inner = local_optimizer(optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            if p.grad is not None and not inner.state.get(p):
                return False
    return True


@dataclass
class _Chunk:
    """Tensors of one dtype whose copy is one flat buffer."""

    tensors: list[torch.Tensor]
    copy: torch.Tensor

    def save(self) -> None:
        views = [v.view(t.shape) for v, t in zip(self.copy.split([t.numel() for t in self.tensors]), self.tensors)]
        torch._foreach_copy_(views, self.tensors)

    def select(self, skip: torch.Tensor) -> None:
        """Each tensor back to its copy where ``skip`` (0-d bool on the device) is set."""
        sizes = [t.numel() for t in self.tensors]
        now = torch.cat([t.reshape(-1) for t in self.tensors])
        torch.where(skip, self.copy, now, out=now)  # a NaN update is replaced, not mixed in
        torch._foreach_copy_(self.tensors, [v.view(t.shape) for v, t in zip(now.split(sizes), self.tensors)])


def chunks(tensors: Iterable[torch.Tensor], limit: int = CHUNK_BYTES) -> list[_Chunk]:
    """``tensors`` grouped by dtype into chunks of at most ``limit`` bytes (a larger tensor is a chunk alone)."""
    by_dtype: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for t in tensors:
        runs = by_dtype.setdefault(t.dtype, [[]])
        size = sum(x.numel() for x in runs[-1]) * t.element_size()
        if runs[-1] and size + t.numel() * t.element_size() > limit:
            runs.append([])
        runs[-1].append(t)
    return [
        _Chunk(run, torch.empty(sum(t.numel() for t in run), dtype=run[0].dtype, device=run[0].device))
        for runs in by_dtype.values()
        for run in runs
    ]


class Rollback:
    """Runs ``optimizer.step()`` and undoes it where the flag says so (module docstring). ``on_host`` picks the
    tensors restored one step late (default: those off the flag's device)."""

    def __init__(
        self, optimizer: Optimizer, device: torch.device, on_host: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        self.optimizer, self.device = optimizer, device
        self._on_host = on_host or (lambda t: t.device != device)
        self._tracked: list[torch.Tensor] = []
        self._chunks: list[_Chunk] = []
        self._flag = torch.zeros((), pin_memory=device.type == "cuda")
        self._flag_view = self._flag.numpy()  # read as host memory: no tensor read, no device wait
        self._pending: tuple[torch.cuda.Event | None, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor) -> None:
        """The optimizer's update, undone on the device where ``found_inf`` (0-d, 1.0 = skip) is set."""
        self.settle()
        on_device, on_host = self._split()
        for chunk in self._chunks_for(on_device):
            chunk.save()
        saved = [(t, t.clone()) for t in on_host]
        self.optimizer.step()
        skip = found_inf.bool()
        for chunk in self._chunks:
            chunk.select(skip)
        if saved:
            self._flag.copy_(found_inf, non_blocking=True)
            self._pending = (_record(found_inf.device), saved)

    @torch.no_grad()
    def settle(self) -> None:
        """Restore the host-side state of a skipped update whose flag has not been read yet."""
        if self._pending is None:
            return
        event, saved = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        if self._flag_view.item():
            for t, before in saved:
                t.copy_(before)

    def copy_bytes(self) -> int:
        """The device memory the copy keeps between steps."""
        return sum(c.copy.nbytes for c in self._chunks)

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        on_device, on_host = [], []
        for t in params + state_tensors(self.optimizer):
            if self._on_host(t):
                on_host.append(t)
            else:
                on_device.append(t)
        return on_device, on_host

    def _chunks_for(self, tensors: list[torch.Tensor]) -> list[_Chunk]:
        """The copy buffers, rebuilt only when the tracked tensors change (a loaded state replaces them)."""
        same = len(tensors) == len(self._tracked) and all(a is b for a, b in zip(tensors, self._tracked))
        if not same:
            self._tracked, self._chunks = tensors, chunks(tensors)
        return self._chunks


def _record(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None  # a CPU copy is done when it returns
    event = torch.cuda.Event()
    event.record()
    return event
