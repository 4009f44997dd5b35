"""The sharded part of a checkpoint under ``train.strategy: fsdp``: model and optimizer state written by every rank
as its own shards with torch.distributed.checkpoint (DCP), and loaded back at any world size (DCP reshards on load).

Layout inside a step directory (job.checkpoint.store commits it; nothing here renames or prunes):

    step-0000120/
        shards/         DCP: one ``__<rank>_0.distcp`` per rank and ``.metadata`` (written by rank 0 last)
        state.pt        rank 0: layout, progress, schedule, scaler, every rank's RNG, guard counters
    The shards hold the model, the optimizer and the EMA (sharded like the model) where enabled.
        manifest.json   written LAST by rank 0: size + sha256 of every file above, shards included

A save goes to the step's ``.tmp-shards`` directory; DCP returns on every rank only after rank 0 gathered every
rank's write results and wrote ``.metadata``, so when rank 0 then writes the manifest and renames the directory,
every rank's shards are on storage (fsynced by DCP's writer). A crash before the rename leaves a ``.tmp-``
directory that is never loaded and is removed at the next start.

A load prepares the state on every rank, then all ranks agree that every rank is ready before the first DCP
collective: a rank that fails alone ends every rank with an error naming the checkpoint and the rank instead of
leaving the others waiting in a collective.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from job.errors import CheckpointLoadError, NonFiniteStateError

log = logging.getLogger("job")


class ShardedEma(Protocol):
    """What a sharded checkpoint needs of the EMA (job.train.ema.Ema, a layer above this package): its module,
    sharded like the model, and its update count."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def averaged(self) -> Any: ...

    updates: int


SHARDS = "shards"
"""The DCP folder inside a step directory."""
TMP_SUFFIX = ".tmp-shards"
"""The name every rank writes a save's shards under before rank 0 commits it (a ``.tmp-`` name: never loaded)."""


class Sharded:
    """Model and optimizer, saved and loaded as this rank's shards (``rank``: for errors; ``group``: a gloo
    group for the agreement, the default group when None; ``fail_load``: a fault injected for tests)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        rank: int,
        group: Any = None,
        fail_load: bool = False,
        ema: ShardedEma | None = None,
    ) -> None:
        self.model, self.optimizer, self.rank, self.group, self.fail_load = model, optimizer, rank, group, fail_load
        self.ema = ema

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        out = {"model": model_sd, "optimizer": optim_sd}
        if self.ema is not None:  # sharded like the model; n_averaged is loaded in place into its own tensor
            out["ema"] = {"module": get_model_state_dict(self.ema.module), "n_averaged": self.ema.averaged.n_averaged}
        return out

    def save(self, run_dir: Path, step_name: str, is_main: bool) -> Path:
        """Every rank: write this rank's shards under the step's temporary directory, returned for the commit.

        Raises:
            NonFiniteStateError: on every rank, when any rank's shards hold NaN or Inf (nothing is written).
        """
        tmp = run_dir / f"{step_name}{TMP_SUFFIX}"
        if is_main:  # a torn earlier attempt at this step
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)  # nobody writes into a directory rank 0 is still replacing
        state = self.state_dict()
        bad = _nonfinite(state)
        flags = _agree(bool(bad), self.group)
        if any(flags):
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            ranks = [r for r, f in enumerate(flags) if f]
            raise NonFiniteStateError(
                f"not saving checkpoint {run_dir / step_name}: non-finite values in the shards of rank(s) {ranks}"
                + (f" ({', '.join(bad[:5])} here)" if bad else "")
                + ". Earlier checkpoints are intact.",
                "lower optim.lr, set train.grad_clip_norm, or check the data.",
            )
        dcp.save(state, checkpoint_id=tmp / SHARDS)
        return tmp

    def load(self, path: Path) -> None:
        """Every rank: read this rank's shards of the checkpoint at ``path`` (any world size).

        Raises:
            CheckpointLoadError: on every rank, naming the checkpoint and the rank(s) that failed.
        """
        state: dict[str, Any] = {}
        error = ""
        try:
            if self.fail_load:
                raise OSError("debug.fail_load_rank: load failure injected")
            state = self.state_dict()  # the shapes DCP loads into, in place
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self._raise_if_any(error, path, "preparing the load")
        try:
            dcp.load(state, checkpoint_id=path / SHARDS)
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
            if self.ema is not None:
                set_model_state_dict(self.ema.module, state["ema"]["module"])
                self.ema.updates = int(self.ema.averaged.n_averaged)
        except Exception as e:
            error = f"{type(e).__name__}: {str(e).strip()[:500]}"
        self._raise_if_any(error, path, "loading the shards")

    def _raise_if_any(self, error: str, path: Path, what: str) -> None:
        flags = _agree(bool(error), self.group)
        if not any(flags):
            return
        ranks = [r for r, f in enumerate(flags) if f]
        here = f" Rank {self.rank}: {error}" if error else ""
        raise CheckpointLoadError(
            f"checkpoint {path}: {what} failed on rank(s) {ranks}.{here}",
            f"see rank {ranks[0]}'s log; move {path} out of the run directory to resume from the one before.",
        )


def _agree(failed: bool, group: Any) -> list[bool]:
    """Every rank's flag, on every rank (one small all-gather)."""
    flags: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, failed, group=group)
    return [bool(f) for f in flags]


def _nonfinite(obj: Any, prefix: str = "") -> list[str]:
    """Dotted keys of this rank's floating-point shards holding NaN or Inf."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        bad = obj.is_floating_point() and obj.numel() > 0 and not bool(torch.isfinite(obj).all())
        return [prefix] if bad else []
    if isinstance(obj, dict):
        return [k for key, v in obj.items() for k in _nonfinite(v, f"{prefix}.{key}" if prefix else str(key))]
    if isinstance(obj, (list, tuple)):
        return [k for i, v in enumerate(obj) for k in _nonfinite(v, f"{prefix}[{i}]")]
    return []
