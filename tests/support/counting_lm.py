"""The built-in causal_lm task with every trained sample counted: ``support.counting_lm:task`` takes causal_lm's
options; each training process appends, in the directory the environment variable ``VISITS`` names, the index of every item it trains on
(one line each, in order, to ``<pid>.txt``). Items are counted in ``loss``, so evaluation counts nothing and
read-ahead of the data pipeline neither. Two start-up callers of ``loss`` train on no item and are not counted:
preflight's check of the loss (job.tasks.preflight.check_task, or ``check_values`` on a model built on the meta
device, once sharded) and, under DDP, the throwaway passes that let DDP
rebuild its gradient buckets before the first step (job.parallel.ddp.settle_buckets, 2 passes on preflight's batch,
whose state they restore)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from job.tasks.lm.task import CausalLM


class Indexed(Dataset):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.inner[index], "index": torch.tensor(index)}


class CountingLM:
    def __init__(self, lm: CausalLM, visits: Path) -> None:
        self.lm, self.visits = lm, visits

    def build_model(self) -> nn.Module:
        return self.lm.build_model()

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return self.lm.shard_units(model)

    def dataset(self, split: str) -> Indexed:
        return Indexed(self.lm.dataset(split))

    def collate(self, items: list[Any]) -> Any:
        return default_collate(items)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        if not _called_by(START_UP):
            with (self.visits / f"{os.getpid()}.txt").open("a") as f:
                f.write("".join(f"{i}\n" for i in batch["index"].tolist()))
        return self.lm.loss(model, batch["tokens"])

    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
        return self.lm.metrics(model, batch["tokens"])


START_UP = frozenset({"check_task", "check_values", "settle_buckets"})
"""The functions whose calls of ``loss`` train on nothing (see the module docstring)."""


def _called_by(names: frozenset[str]) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def task(**options: Any) -> CountingLM:
    visits = Path(os.environ["VISITS"])  # not an option: a resumed run's config must equal the checkpoint's
    visits.mkdir(parents=True, exist_ok=True)
    return CountingLM(CausalLM.from_options(options), visits)
