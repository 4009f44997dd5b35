"""Host snapshots of training state for checkpoints: what training blocks on while a checkpoint is written.

``to_host`` allocates a fresh copy each time (synchronous saves: the copy is freed as soon as it is written).
``HostStaging`` keeps the copy's buffers between saves and copies into them, so an asynchronous save costs
one memory copy (pinned host memory and a device-to-host copy on CUDA) instead of an allocation, page faults
and pageable transfers. Measured in ``ddp-job bench checkpoint`` (docs/benchmarks.md section 4).
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def to_host(obj: Any) -> Any:
    """Deep copy with every tensor moved to (unshared) CPU memory, so training can mutate the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.stride(), t.dtype, t.device.type)


class HostStaging:
    """Reusable host buffers, one per tensor of the state in traversal order.

    The caller must not snapshot again while a previous snapshot is still being read (CheckpointManager
    allows one save in flight and waits for it first). Buffers are reallocated only where a tensor's shape,
    layout, dtype or device type changed (e.g. optimizer state appearing after the first step).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._keys: list[tuple[Any, ...]] = []
        self._next = 0  # buffer index of the next tensor met in the traversal
        self._device_copies = False  # whether this snapshot queued non-blocking device-to-host copies

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def snapshot(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by its (reused) host buffer, filled with the current values."""
        self._next = 0
        self._device_copies = False
        out = self._copy(obj)
        del self._buffers[self._next :], self._keys[self._next :]
        if self._device_copies:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land before anyone reads
        return out

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._stage(obj.detach())
        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v) for v in obj)
        return copy.deepcopy(obj)

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        i, key = self._next, _key(t)
        self._next += 1
        on_device = t.device.type != "cpu"
        if i >= len(self._buffers) or self._keys[i] != key:
            # Pinned memory makes the copy a real asynchronous DMA; empty_like keeps the strides.
            buf = torch.empty_like(t, device="cpu", pin_memory=on_device and torch.cuda.is_available())
            if i >= len(self._buffers):
                self._buffers.append(buf)
                self._keys.append(key)
            else:
                self._buffers[i], self._keys[i] = buf, key
        buf = self._buffers[i]
        buf.copy_(t, non_blocking=on_device)
        self._device_copies |= on_device
        return buf
