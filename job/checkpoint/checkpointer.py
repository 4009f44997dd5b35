"""The run's checkpointing component: its cadence (``ckpt.every`` N or auto: job.checkpoint.cadence, at a stop
request, at the end), and saving and restoring the run's ``States`` through a ``CheckpointManager``.

Every rank calls the same methods at the same steps (a save starts with collectives); only rank 0 writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from job.checkpoint.cadence import Auto, Fixed
from job.checkpoint.resume import SHARDS_HOLD
from job.checkpoint.states import States
from job.checkpoint.store import CheckpointManager, Found, load_state, load_state_shared
from job.observe.observer import no_mark

log = logging.getLogger("job")

RUN_TIME = "run_time_s"
"""The manifest's record of the run's time up to the save (all attempts): what MTBF refinement divides."""
STOP_SAVES = "stop_saves"
"""The manifest's count of the run's attempts, up to the save, that ended with a stop save: the restarts after
them lost no work, so ``ckpt.every: auto`` does not count them as failures (job.checkpoint.cadence.failures)."""


class Checkpointer:
    def __init__(
        self,
        manager: CheckpointManager,
        states: States,
        cadence: Fixed | Auto,
        total_steps: int,
        meta: Callable[[], dict[str, Any]],
    ) -> None:
        self.manager, self.states, self.cadence, self.total_steps, self.meta = (
            manager,
            states,
            cadence,
            total_steps,
            meta,
        )
        self.saved_step = -1
        """The newest step saved or restored by this run (identical on every rank)."""
        self.saved_at = time.monotonic()
        """When the newest save (or restore, or the start) happened: the checkpoint's age is measured from it."""
        self._run_time_s = 0.0
        self._stop_saves = 0
        self._restored: tuple[int, float] | None = None
        self.saves = 0
        self.stalled_s = 0.0
        """Seconds training stood still for this attempt's saves (the waste ``ckpt.every`` trades off)."""
        self._started = time.monotonic()
        self.mark: Callable[[str], None] = no_mark
        """Records each save on this rank's progress file (job.observe.observer.Observer.mark): a stall report
        then tells a rank still saving from one waiting for it."""

    def start(self, step: int) -> None:
        """The loop begins after ``step`` (0, or the step restored)."""
        self.cadence.start(step, self._run_time_s, self._stop_saves)
        self.saved_at = self._started = time.monotonic()
        if self.saved_step == step:  # restored: its work is this attempt's from now on
            self._restored = (step, self.saved_at)

    def committed(self) -> tuple[int, float] | None:
        """(step, ``time.monotonic()`` its state was taken) of the newest checkpoint on storage: the newest one this
        run wrote completely (an async save in flight does not count), else the one it resumed from, measured
        from the start (rank 0; None: none yet)."""
        return self.manager.committed or self._restored

    def restore(self, found: Found) -> None:
        if self.manager.sharded is not None:  # every rank: rank 0 reads state.pt, the others receive it
            saved = load_state_shared(found, self.manager.sharded.group)
        else:
            saved = load_state(found)
        if self.manager.sharded is not None:  # verified as it is read: CorruptCheckpointError on every rank
            # First: the optimizer's saved learning rates, then the schedule's (replayed for another train.steps).
            self.manager.sharded.load(found.path, saved, found.manifest.get("files", {}))
        self.states.load_state_dict(saved)
        self.manager.resumed_from(found)
        self.saved_step = found.step
        self._run_time_s = float(found.manifest.get(RUN_TIME, 0.0))
        self._stop_saves = int(found.manifest.get(STOP_SAVES, 0))
        log.info("resumed from %s (step %d): %s", found.path, found.step, data_position(found.manifest))

    def save(self, step: int, stop: bool = False) -> float:
        """Every rank: gather what needs collectives, then rank 0 snapshots and writes (maybe in the background).
        ``stop``: the attempt's stop save (it ends the attempt). Returns the seconds training stood still for it."""
        t0 = time.perf_counter()
        self.mark(f"saving the checkpoint of step {step}")
        self.saved_step = step
        self.states.gather()
        stop_saves = self._stop_saves + int(stop)
        meta = {**self.meta(), RUN_TIME: self.cadence.run_time_s(), STOP_SAVES: stop_saves}
        if self.manager.sharded is not None:  # what preflight may need to know before loading anything
            meta[SHARDS_HOLD] = self.manager.sharded.parts()
        self.manager.save(step, self.states.state_dict, meta)
        self.saved_at = time.monotonic()
        stall = time.perf_counter() - t0
        self.saves += 1
        self.stalled_s += stall
        return stall

    def after_step(self, step: int) -> None:
        """The periodic save; the last step is saved by ``finish`` after the final evaluation."""
        self.cadence.step_done(step)
        if self.due(step):
            stall = self.save(step)
            write = 0.0  # a sync save's stall holds its write
            if self.manager.async_save:
                write = self.manager.last_write_s  # the newest finished one: this save's is still in flight
            self.cadence.saved(step, stall, write)

    def due(self, step: int) -> bool:
        """Whether ``after_step`` saves at ``step``."""
        return step < self.total_steps and self.cadence.due(step)

    def finish(self, step: int) -> None:
        """The end of the run: save the final step unless it was just saved, and wait until it is on disk."""
        if self.saved_step != step:
            self.save(step)
        self.manager.wait()

    def overhead(self) -> str:
        """This attempt's save stalls as a share of its time since ``start`` (for the final log line)."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return (
            f"checkpoints: {self.saves} save(s) stopped training for {self.stalled_s:.2f} s, "
            f"{100 * self.stalled_s / elapsed:.2f}% of this attempt's {elapsed:.1f} s"
        )


def data_position(manifest: dict[str, Any]) -> str:
    """Where a resume continues in the data, from a checkpoint's manifest: the samples consumed, and the epoch and
    sample of that epoch training continues at (the same for any world size: job.checkpoint.resume)."""
    trainer, plan = manifest.get("trainer", {}), manifest.get("plan", {})
    epoch = int(trainer.get("epoch", 0))
    row = int(manifest.get("world_size", 0)) * int(plan.get("micro_batch_size", 0))
    return (
        f"{int(trainer.get('samples_seen', 0))} samples consumed; continuing in epoch {epoch} at its sample "
        f"{int(trainer.get('micro_batches_in_epoch', 0)) * row}"
    )
