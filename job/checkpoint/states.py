"""What a checkpoint holds: one registry of named stateful parts, used both to save and to restore.

Each entry is an object with ``state_dict()`` and ``load_state_dict(value)`` (torch's ``Stateful`` shape,
as torchtitan's ``CheckpointManager(states=...)``). Adding a stateful component to the run is one line,
``states.add("name", obj)``, in ``job.train.run``. Entries load in the order they were added, so an entry
may rely on an earlier one (the data position and the schedule depend on the saved layout and step).
An entry whose state needs a collective before rank 0 reads it (ZeRO's consolidation, every rank's RNG)
also has ``gather()``: ``States.gather`` runs it on every rank before each save.

The adapters below wrap what has no ``state_dict`` of the right shape: the saved layout (world size and
batch plan), the trainer's progress (with the data position mapped onto a new world size), the optimizer
under ZeRO, the LR schedule (replayed when the horizon changed), and every rank's RNG streams. The model, the
optimizer (without ZeRO) and the EMA are not entries: every rank writes its own part of them (job.checkpoint.sharded).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from job.checkpoint.resume import map_data_position, rng_state, row_changed, set_rng_state
from job.config.plan import Plan
from job.errors import CheckpointLoadError

log = logging.getLogger("job")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class States:
    """The named parts of a checkpoint; ``optional`` parts may be absent from an older checkpoint."""

    def __init__(self) -> None:
        self._entries: dict[str, Stateful] = {}
        self._optional: set[str] = set()

    def add(self, name: str, obj: Stateful, optional: bool = False) -> None:
        self._entries[name] = obj
        if optional:
            self._optional.add(name)

    def gather(self) -> None:
        """Every rank, before a save: the collectives some entries need."""
        for obj in self._entries.values():
            gather: Callable[[], None] | None = getattr(obj, "gather", None)
            if gather is not None:
                gather()

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self._entries.items()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        missing = [n for n in self._entries if n not in saved and n not in self._optional]
        if missing:
            raise CheckpointLoadError(
                f"the checkpoint has no {', '.join(missing)} (it holds {', '.join(sorted(saved))}): it was written "
                f"by another version of ddp-job.",
                "resume with the version that wrote it, or start a new run (a new run.name).",
            )
        for name, obj in self._entries.items():
            obj.load_state_dict(saved.get(name))


class Layout:
    """The world size and batch plan a checkpoint was written with; later entries read ``saved``."""

    def __init__(self, world_size: int, plan: Plan) -> None:
        self.current: dict[str, Any] = {"world_size": world_size, "plan": asdict(plan)}
        self.saved: dict[str, Any] = self.current

    def state_dict(self) -> dict[str, Any]:
        return self.current

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = state

    @property
    def world_size_changed(self) -> bool:
        return bool(self.saved["world_size"] != self.current["world_size"])

    @property
    def row_changed(self) -> bool:
        """Whether a micro-batch takes another number of samples (world size x micro batch) than when saved."""
        return row_changed(self.saved, int(self.current["world_size"]), int(self.current["plan"]["micro_batch_size"]))


class Progress:
    """The trainer's counters (a dataclass updated in place); the data position is mapped onto this layout
    when a micro-batch takes another number of samples, by another world size or micro batch (allowed by
    ``check_resumable``: the same samples, split differently)."""

    def __init__(self, state: Any, layout: Layout, micro_batch_size: int) -> None:
        self.state, self.layout, self.micro_batch_size = state, layout, micro_batch_size

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key, value in saved.items():
            setattr(self.state, key, value)
        if self.layout.row_changed:
            world_size = int(self.layout.current["world_size"])
            self.state.micro_batches_in_epoch = map_data_position(
                saved, self.layout.saved["plan"], world_size, self.micro_batch_size
            )


class OptimizerState:
    """The optimizer under ZeRO (the shards hold it otherwise: job.checkpoint.sharded): every rank's shard is
    consolidated on rank 0 before a save."""

    def __init__(self, optimizer: Optimizer, before_save: Callable[[Optimizer], None]) -> None:
        self.optimizer, self.before_save = optimizer, before_save

    def gather(self) -> None:
        self.before_save(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class Schedule:
    """The LR schedule; replayed step by step when the run's horizon (``train.steps``) changed."""

    def __init__(self, scheduler: LRScheduler, layout: Layout, progress: Any) -> None:
        self.scheduler, self.layout, self.progress = scheduler, layout, progress

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.layout.saved["plan"]["total_steps"] == self.layout.current["plan"]["total_steps"]:
            self.scheduler.load_state_dict(state)
            return
        for _ in range(self.progress.step):
            self.scheduler.step()


class RngStates:
    """Every rank's RNG streams (torch, numpy, python, CUDA), gathered to rank 0. Restored only at the same
    world size: streams of other ranks cannot be mapped, so they stay as seeded."""

    def __init__(self, device: torch.device, rank: int, world_size: int, group: Any, layout: Layout) -> None:
        self.device, self.rank, self.world_size, self.group, self.layout = device, rank, world_size, group, layout
        self._gathered: list[Any] = []

    def gather(self) -> None:
        self._gathered = [None] * self.world_size
        dist.all_gather_object(self._gathered, rng_state(self.device), group=self.group)

    def state_dict(self) -> list[Any]:
        return self._gathered

    def load_state_dict(self, state: list[Any]) -> None:
        if self.layout.world_size_changed:
            log.info("world size changed: RNG streams re-seeded, not restored")
            return
        set_rng_state(state[self.rank])
