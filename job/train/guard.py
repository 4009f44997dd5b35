"""The non-finite guard: an update whose loss or gradient norm is NaN/Inf is skipped, decided on the device.

Fused SGD/AdamW take the flag as ``found_inf`` (as GradScaler hands it to them) and skip inside the kernel, so the
host queues the next step while the device drains. Other optimizers (ZeRO, LARS, LAMB) have no such input: on a
GPU their update is undone on the device where the flag is set, and the host reads the flag one step late, only
for the state it keeps itself (job.train.rollback). On the CPU the flag is a host tensor, read before the update
(no device to wait for). The skips are counted on the device and checked against ``train.max_nonfinite_skips`` at
log and checkpoint steps only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.optim import Optimizer

from job.errors import NonFiniteError
from job.train.rollback import Rollback, state_complete

log = logging.getLogger("job")


def takes_found_inf(optimizer: Optimizer) -> bool:
    """Whether ``step`` honours ``optimizer.found_inf``: torch's fused implementations (GradScaler's test)."""
    fused = any(group.get("fused") for group in optimizer.param_groups)
    return fused and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class NonFiniteGuard:
    """Skips and counts non-finite updates; ``fp16``: GradScaler's overflow skips count too, and the limit is on
    skips in a row (the scaler skips deliberately now and then; a poisoned run skips every step)."""

    def __init__(
        self, optimizer: Optimizer, device: torch.device, limit: int, fp16: bool, rollback: Rollback | None = None
    ) -> None:
        self.optimizer, self.limit, self.fp16 = optimizer, limit, fp16
        self.fused = takes_found_inf(optimizer)
        if rollback is None and not self.fused and device.type == "cuda":
            rollback = Rollback(optimizer, device)
        self.rollback = rollback
        """Undoes skipped updates on the device for an optimizer without ``found_inf`` (None: read the flag)."""
        self.skips = torch.zeros((), dtype=torch.int64, device=device)
        """Skips since the last ``check``."""
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.max_streak = torch.zeros((), dtype=torch.int64, device=device)
        self.checked_step = 0
        self._host = torch.zeros((), pin_memory=device.type == "cuda")
        if self.fused:
            _prime_momentum(optimizer)

    def flag(self, grad_norm: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """1.0 where the step must be skipped, else 0.0 (float: the fused kernels' ``found_inf``)."""
        finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
        return (~finite).float()

    def update(self, found_inf: torch.Tensor) -> None:
        """The optimizer's update unless ``found_inf``, then the count."""
        if self.fused:
            opt: Any = self.optimizer
            opt.grad_scale, opt.found_inf = None, found_inf  # gradients are unscaled already (or never scaled)
            try:
                self.optimizer.step()
            finally:
                del opt.grad_scale, opt.found_inf
        elif self.rollback is not None and state_complete(self.optimizer):
            self.rollback.step(found_inf)
        elif not self._read(found_inf):  # the first update creates the state: nothing to roll back to before it
            self.optimizer.step()
        skipped = found_inf.to(torch.int64)
        self.skips += skipped
        self.streak.mul_(skipped).add_(skipped)  # +1 on a skip, back to 0 on an update
        torch.maximum(self.max_streak, self.streak, out=self.max_streak)

    def _read(self, found_inf: torch.Tensor) -> bool:
        """The flag on the host: one transfer into pinned memory (on a GPU only before the first update)."""
        self._host.copy_(found_inf, non_blocking=True)
        if found_inf.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
        return bool(self._host)

    def check(self, step: int, state: Any) -> None:
        """At a log or checkpoint step: fold the device count into ``state.nonfinite_skips`` (one transfer), warn,
        and stop past the limit.

        Raises:
            NonFiniteError: more than ``train.max_nonfinite_skips`` skips (in a row with fp16).
        """
        if self.rollback is not None:
            self.rollback.settle()  # before anything (a save) reads the optimizer state
        skips, max_streak = torch.stack([self.skips, self.max_streak]).tolist()
        since, self.checked_step = self.checked_step, step
        self.skips.zero_()
        self.max_streak.copy_(self.streak)
        if not skips:
            return
        state.nonfinite_skips += skips
        counted = state.nonfinite_skips
        if self.fp16:
            counted = max_streak
        log.warning(
            "step %d: non-finite loss or gradient norm; update skipped %d time(s) in steps %d-%d (%d/%d%s)",
            step, skips, since + 1, step, counted, self.limit, " in a row" if self.fp16 else "",
        )  # fmt: skip
        if counted > self.limit:
            raise NonFiniteError(
                f"step {step}: more than train.max_nonfinite_skips={self.limit} updates skipped for non-finite "
                f"loss/gradients. The newest checkpoint holds only finite values.",
                "lower optim.lr, enable train.grad_clip_norm, or check the data.",
                setting="train.max_nonfinite_skips",
                value=self.limit,
            )


def _prime_momentum(optimizer: Optimizer) -> None:
    """Zero momentum buffers before the first fused SGD step: a skipped first step would leave the buffers it
    allocates uninitialised (the kernel returns before writing them). Zero is what the first step assumes."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or group["dampening"] != 0:
            continue
        for p in group["params"]:
            optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p, memory_format=torch.preserve_format))
