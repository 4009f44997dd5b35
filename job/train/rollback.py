"""Exact skips for optimizers that take no ``found_inf`` flag (ZeRO's sharded update, LARS, LAMB), without the host
waiting for the flag.

The update runs unconditionally and is undone on the device where the flag is set: what the update can change
(the parameters with a gradient in this rank's optimizer, and its state) is copied before the update and
selected back in place with ``torch.where`` after it. Under ZeRO that is this rank's shard, selected before the
shards are broadcast, so every rank receives the restored values. State the device cannot select (CPU tensors of
a CUDA run: torch's non-capturable step counts, timm LAMB's group step) is cloned on the host and restored one
step late, only when the flag is set: the flag comes back through a pinned non-blocking copy and its event, read
at the next update or at ``settle`` before anything reads the optimizer state (a check, a save). By then the
device is past that flag, so the host waits for nothing while the device still has the next step queued.

The device tensors cannot be restored that late: the next step's forward pass reads the parameters (and writes
BatchNorm statistics, and the EMA averages them) before a flag read without a wait could say the update was bad.

Cost per step, in passes over what is tracked (``ddp-job bench rollback`` counts them): the copy reads and
writes it once (2), the select reads the copy and the update's result and writes the result (3): 5. A select
over a flat gather of the tensors would launch fewer kernels but move 9 (the gather and the copy back add 4).
Memory: one copy of what is tracked (under ZeRO this rank's shard, not the whole model), in flat buffers of at
most ``CHUNK_BYTES``. Kernels: one foreach copy, and one select per tensor.
Plain numbers in the parameter groups (``lr``, the scheduler's) are not rolled back: the scheduler owns them, and
none of the supported optimizers keeps a counter as a Python number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

CHUNK_BYTES = 64 << 20
"""The most bytes one flat copy buffer holds (one foreach copy each)."""


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

    def views(self) -> list[torch.Tensor]:
        """The copy of each tensor: a view of the flat buffer in its shape."""
        sizes = [t.numel() for t in self.tensors]
        return [v.view(t.shape) for v, t in zip(self.copy.split(sizes), self.tensors)]


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
        self._copies: list[torch.Tensor] = []
        self._flag = torch.zeros((), pin_memory=device.type == "cuda")
        self._flag_view = self._flag.numpy()  # read as host memory: no tensor read, no device wait
        self._pending: tuple[torch.cuda.Event | None, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor) -> None:
        """The optimizer's update, undone on the device where ``found_inf`` (0-d, 1.0 = skip) is set."""
        self.settle()
        on_device, on_host = self._split()
        copies = self._copies_for(on_device)
        if on_device:
            torch._foreach_copy_(copies, on_device)
        saved = [(t, t.clone()) for t in on_host]
        zero = self.optimizer if isinstance(self.optimizer, ZeroRedundancyOptimizer) else None
        if zero is not None:
            zero._local_step()  # this rank's shard only: restored below before it is broadcast
        else:
            self.optimizer.step()
        skip = found_inf.bool()
        for t, before in zip(on_device, copies):
            torch.where(skip, before, t, out=t)  # in place: a NaN update is replaced, not mixed in
        if zero is not None:
            cast(Any, zero)._sync_params()  # what ZeroRedundancyOptimizer.step does after its local step
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
        """What the update can change: the parameters with a gradient that this rank's optimizer holds (under
        ZeRO its shard; a parameter without a gradient is left alone by every supported optimizer) and its
        state, split into those selected on the device and those restored one step late."""
        inner = local_optimizer(self.optimizer)
        params = [p for g in inner.param_groups for p in g["params"] if p.grad is not None]
        on_device, on_host = [], []
        for t in params + state_tensors(self.optimizer):
            if self._on_host(t):
                on_host.append(t)
            else:
                on_device.append(t)
        return on_device, on_host

    def _copies_for(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The copy buffers, rebuilt only when the tracked tensors change (a loaded state replaces them)."""
        same = len(tensors) == len(self._tracked) and all(a is b for a, b in zip(tensors, self._tracked))
        if not same:
            self._tracked, self._chunks = tensors, chunks(tensors)
            by_tensor = {id(t): v for c in self._chunks for t, v in zip(c.tensors, c.views())}
            self._copies = [by_tensor[id(t)] for t in tensors]
        return self._copies


def _record(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None  # a CPU copy is done when it returns
    event = torch.cuda.Event()
    event.record()
    return event
