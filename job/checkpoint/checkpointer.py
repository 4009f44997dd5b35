"""The run's checkpointing component: its cadence (every ``ckpt.every`` steps, at a stop request, at the
end), and saving and restoring the run's ``States`` through a ``CheckpointManager``.

Every rank calls the same methods at the same steps (a save starts with collectives); only rank 0 writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from job.checkpoint.states import States
from job.checkpoint.store import CheckpointManager, Found, load_state

log = logging.getLogger("job")


class Checkpointer:
    def __init__(
        self,
        manager: CheckpointManager,
        states: States,
        every: int,
        total_steps: int,
        meta: Callable[[], dict[str, Any]],
    ) -> None:
        self.manager, self.states, self.every, self.total_steps, self.meta = manager, states, every, total_steps, meta
        self.saved_step = -1
        """The newest step saved or restored by this run (identical on every rank)."""

    def restore(self, found: Found) -> None:
        self.states.load_state_dict(load_state(found))
        self.saved_step = found.step
        epoch = found.manifest.get("trainer", {}).get("epoch", 0)
        log.info("resumed from %s (step %d, epoch %d)", found.path, found.step, epoch)

    def save(self, step: int) -> None:
        """Every rank: gather what needs collectives, then rank 0 snapshots and writes (maybe in the background)."""
        self.saved_step = step
        self.states.gather()
        self.manager.save(step, self.states.state_dict, self.meta())

    def after_step(self, step: int) -> None:
        """The periodic save; the last step is saved by ``finish`` after the final evaluation."""
        if self.due(step):
            self.save(step)

    def due(self, step: int) -> bool:
        """Whether ``after_step`` saves at ``step``."""
        return bool(self.every) and step % self.every == 0 and step < self.total_steps

    def finish(self, step: int) -> None:
        """The end of the run: save the final step unless it was just saved, and wait until it is on disk."""
        if self.saved_step != step:
            self.save(step)
        self.manager.wait()
