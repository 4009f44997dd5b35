"""Tasks a user might write, named by import path in the tests (``support.user_tasks:NAME``): a small regression
task that keeps the contract, and one that breaks each part of it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset


class Points(Dataset):
    """``n`` items ``{"x": 4 floats, "y": 1 float}`` of a fixed linear map plus noise drawn at read time (from
    the RNG the job seeds per item)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        gen = torch.Generator().manual_seed(1234 + offset)
        self.x = torch.randn(n, 4, generator=gen)
        self.w = torch.tensor([1.0, -2.0, 0.5, 3.0])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = self.x[index]
        noise = 0.01 * torch.randn(())  # drawn from the generator the job seeded for (epoch, index)
        return {"x": x, "y": (x @ self.w + noise).reshape(1)}


class Regression:
    """The contract kept: a linear model, mean squared error, a frozen bias (``param_groups``), a half-LR
    weight group, and the sum of squared errors over items as its metric."""

    def __init__(self, n_train: int = 64, n_val: int = 20, freeze_bias: bool = True) -> None:
        self.n_train, self.n_val, self.freeze_bias = n_train, n_val, freeze_bias

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def dataset(self, split: str) -> Dataset:
        if split == "train":
            return Points(self.n_train)
        return Points(self.n_val, offset=1)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        err = model(batch["x"]) - batch["y"]
        return (err**2).mean(), {"mae": err.abs().mean()}

    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
        err = model(batch["x"]) - batch["y"]
        n = batch["y"].numel()
        return {"mse": ((err**2).sum().double(), n), "mae": (err.abs().sum().double(), n)}

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        first, last = model[0], model[2]
        groups: list[dict[str, Any]] = [{"params": [first.weight], "lr_scale": 0.5}, {"params": [last.weight]}]
        if not self.freeze_bias:
            groups.append({"params": [first.bias, last.bias], "weight_decay": 0.0})
        return groups


def regression(**options: Any) -> Regression:
    return Regression(**options)


class NoMetrics:
    def build_model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def dataset(self, split: str) -> Dataset:
        return Points(16)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return model(batch["x"]).mean()


class NanLoss(Regression):
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return torch.log(-model(batch["x"]).abs().sum() - 1.0), {}


class VectorLoss(Regression):
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        return (model(batch["x"]) - batch["y"]) ** 2  # per item: not the mean


class MeanMetrics(Regression):
    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"mse": ((model(batch["x"]) - batch["y"]) ** 2).mean()}  # a mean, not (sum, count)


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from Points(8)


class IterableData(Regression):
    def dataset(self, split: str) -> Any:
        return Stream()


class EmptyVal(Regression):
    def dataset(self, split: str) -> Dataset:
        if split == "val":
            return Points(0)
        return Points(16)


class Ragged(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(index + 1)  # a different length per item


class RaggedItems(Regression):
    def dataset(self, split: str) -> Dataset:
        return Ragged()


class ConfiguredNet(nn.Module):
    """A model with what real models carry beside ``forward``: a ``config`` and a helper method."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"scale": 2.0}
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def residual(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self(batch["x"]) - batch["y"]


class ReadsModel(Regression):
    """A loss and metrics that read ``model.config`` and call a helper method of the model."""

    def build_model(self) -> nn.Module:
        return ConfiguredNet()

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert isinstance(model, ConfiguredNet), type(model)  # the user's own module, never a wrapper
        err = model.residual(batch) * model.config["scale"]
        return (err**2).mean(), {}

    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
        assert isinstance(model, ConfiguredNet), type(model)
        err = model.residual(batch)
        return {"mse": ((err**2).sum().double(), err.numel())}

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        return [{"params": list(model.parameters())}]


class Sentences(Dataset):
    """``n`` token sequences of ragged lengths (2 to 12 tokens), fixed by the index."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        i = index + self.offset
        length = 2 + (i * 7) % 11
        return torch.tensor([(i * 3 + 5 * j) % 16 for j in range(length)])


def pad(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs padded with 0 and next-token targets padded with -100 (ignored)."""
    width = max(len(t) for t in items) - 1
    x = torch.zeros(len(items), width, dtype=torch.long)
    y = torch.full((len(items), width), -100, dtype=torch.long)
    for row, t in enumerate(items):
        x[row, : len(t) - 1], y[row, : len(t) - 1] = t[:-1], t[1:]
    return {"x": x, "y": y}


class TokenSum:
    """Next-token loss over ragged sequences, as ``(sum, count)`` of the real tokens (``counted``), or as each
    micro-batch's mean over its tokens (the accumulation that weighs a short micro-batch's tokens more)."""

    def __init__(self, counted: bool = True) -> None:
        self.counted = counted

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Embedding(16, 8), nn.Tanh(), nn.Linear(8, 16))

    def dataset(self, split: str) -> Dataset:
        if split == "train":
            return Sentences(32)
        return Sentences(8, offset=100)

    def collate(self, items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return pad(items)

    def _nll(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch["x"]).flatten(0, 1)
        targets = batch["y"].flatten()
        return nn.functional.cross_entropy(logits, targets, reduction="sum"), (targets != -100).sum()

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        nll, n = self._nll(model, batch)
        if self.counted:
            return nll, n
        return nll / n

    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
        nll, n = self._nll(model, batch)
        return {"loss": (nll.double(), n)}


class NoisyCollate(Regression):
    """A collate that draws: noise on the inputs of each batch (as masking or mixup would)."""

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = torch.utils.data.default_collate(items)
        batch["x"] = batch["x"] + 0.1 * torch.randn(batch["x"].shape)
        return batch


class Curriculum(Regression):
    """State of its own, checkpointed: a count of its loss calls, and the step and epoch the job announced,
    all of which weigh the loss."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls = torch.zeros(())
        self.step, self.epoch = 0, -1

    def before_step(self, step: int, epoch: int) -> None:
        self.step, self.epoch = step, epoch

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.calls += 1
        mse, extras = super().loss(model, batch)
        return mse * (1.0 + 0.01 * self.calls + 0.1 * self.step), extras

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls.clone(), "step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"].clone()
        self.step, self.epoch = state["step"], state["epoch"]


class FrozenBackbone(Regression):
    """A frozen backbone with BatchNorm (in no parameter group, kept in eval mode) under a trained head."""

    def build_model(self) -> nn.Module:
        backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        return nn.Sequential(backbone, nn.Linear(8, 1))

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        return [{"params": list(model[1].parameters())}]

    def frozen_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model[0]]


class NamesBuiltinMembers(Regression):
    """Methods named like the built-in tasks' own members, which the job does not ask of a user's task."""

    def prepare(self, *args: Any) -> None:
        raise AssertionError("prepare is the built-in tasks' own")

    def loaders(self, *args: Any) -> Any:
        raise AssertionError("loaders is the built-in tasks' own")

    def example_batch(self, n: int) -> Any:
        raise AssertionError("example_batch is the built-in tasks' own")


class Widening(Dataset):
    """Items whose width grows after the first 8: the first two (preflight's batch) still collate."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        width = 4 + int(index >= 8)
        return {"x": torch.zeros(width), "y": torch.zeros(1)}


class LaterItemsDoNotCollate(Regression):
    def dataset(self, split: str) -> Dataset:
        return Widening()


class Plateau(Regression):
    """A model that training never changes (every parameter's LR scaled by 0): its validation metrics are the
    same at every evaluation, the plateau on which early stopping ends a run. ``summarize`` derives ``val/rmse``.
    ``stop_before_step``: as that step begins, the task asks the run to stop (creates ``stop_file``), a request
    the ranks agree on at the next step's boundary (0: never)."""

    def __init__(self, stop_file: str = "", stop_before_step: int = 0, **options: Any) -> None:
        super().__init__(**options)
        self.stop_file, self.stop_before_step = stop_file, stop_before_step

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        return [{"params": list(model.parameters()), "lr_scale": 0.0}]

    def summarize(self, values: dict[str, float]) -> dict[str, float]:
        return {"val/rmse": values["val/mse"] ** 0.5}

    def before_step(self, step: int, epoch: int) -> None:
        if step == self.stop_before_step:
            with open(self.stop_file, "w"):
                pass
