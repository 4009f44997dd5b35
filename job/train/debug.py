"""Testing and debugging aids (the ``debug`` config section): faults injected on purpose.

Each aid is installed only when its setting is on, by wrapping or hooking a part once at start-up, so the
training step has no test-only branch and pays nothing when they are off.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from job.config.schema import DebugConfig

log = logging.getLogger("job")


class NanLossAt:
    """The task's loss, made NaN at the given (1-based) optimizer steps: exercises the non-finite skip."""

    def __init__(self, loss_fn: Callable[[nn.Module, Any], Any], steps: tuple[int, ...], state: Any) -> None:
        self.loss_fn, self.steps, self.state = loss_fn, frozenset(steps), state

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        out = self.loss_fn(model, batch)
        if self.state.step + 1 not in self.steps:
            return out
        if isinstance(out, tuple):
            return (out[0] * float("nan"), *out[1:])
        return out * float("nan")


class Straggler:
    """Sleeps before the first forward of the chosen steps (or of the evaluations after them) on one rank: makes
    that rank a straggler."""

    def __init__(self, cfg: DebugConfig, state: Any) -> None:
        self.delay_s, self.steps, self.state = cfg.straggler_delay_s, frozenset(cfg.straggler_steps), state
        self.in_training = cfg.straggler_in == "train"
        self._delayed_step = -1

    def __call__(self, module: nn.Module, _args: Any) -> None:
        step = self.state.step + 1
        if module.training != self.in_training or step == self._delayed_step:
            return
        if not self.steps or step in self.steps:
            self._delayed_step = step
            where = f"step {step}'s first forward"
            if not self.in_training:
                where = f"the first forward of the evaluation after step {step - 1}"
            # said before the sleep: a test that signals a straggling rank waits for this line, not a guess
            log.info("debug.straggler: sleeping %g s before %s", self.delay_s, where)
            time.sleep(self.delay_s)


class SignalGroupAtStart:
    """A DataLoader ``worker_init_fn`` that first sends SIGTERM to the worker's process group (worker 0 only),
    then runs the loader's own: the signal lands after torch's worker set its handlers, before ours ran."""

    def __init__(self, init_fn: Callable[[int], None] | None) -> None:
        self.init_fn = init_fn

    def __call__(self, worker_id: int) -> None:
        if worker_id == 0:
            os.killpg(os.getpgrp(), signal.SIGTERM)
        if self.init_fn is not None:
            self.init_fn(worker_id)


def _signal_group_at_worker_start(loaders: Any, which: str) -> None:
    loader = getattr(getattr(loaders, which), "loader", None)
    if loader is None or not loader.num_workers:
        log.warning("debug.signal_group_at_worker_start=%s: that loader has no worker processes", which)
        return
    log.warning("debug.signal_group_at_worker_start=%s: its first worker sends SIGTERM to its group", which)
    loader.worker_init_fn = SignalGroupAtStart(loader.worker_init_fn)


class SlowSave:
    """A checkpoint manager's ``save`` that sleeps first: this rank's save stalls longer than the others'."""

    def __init__(self, save: Callable[..., None], delay_s: float) -> None:
        self.save, self.delay_s = save, delay_s

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.delay_s)
        self.save(*args, **kwargs)


def install_checkpoint(cfg: DebugConfig, rank: int, checkpointer: Any) -> None:
    """Install the checkpoint aids that ``cfg`` switches on into ``checkpointer`` (the run's ``Checkpointer``)."""
    delays = cfg.ckpt_save_delay_s_by_rank
    if rank < len(delays) and delays[rank] > 0:
        log.warning("debug.ckpt_save_delay_s_by_rank: this rank sleeps %s s in each save", delays[rank])
        checkpointer.manager.save = SlowSave(checkpointer.manager.save, delays[rank])


def install(cfg: DebugConfig, rank: int, parts: Any, state: Any) -> None:
    """Install the aids that ``cfg`` switches on into ``parts`` (the run's ``Parts``)."""
    if cfg.nan_at_steps:
        log.warning("debug.nan_at_steps=%s: the loss is made NaN at these steps", list(cfg.nan_at_steps))
        parts.task.loss_fn = NanLossAt(parts.task.loss_fn, cfg.nan_at_steps, state)
    if cfg.straggler_delay_s > 0 and cfg.straggler_rank == rank:
        log.warning("debug.straggler_delay_s=%s: this rank sleeps before its forward pass", cfg.straggler_delay_s)
        parts.raw_model.register_forward_pre_hook(Straggler(cfg, state))
    if cfg.signal_group_at_worker_start:
        _signal_group_at_worker_start(parts.loaders, cfg.signal_group_at_worker_start)
