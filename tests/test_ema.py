"""The EMA's update against torch.optim.swa_utils' own (the reference it replaces) and its checkpoint format."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from job.config import EmaConfig
from job.train.ema import Ema


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def _train_a_little(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.train()
    model(torch.randn(8, 4))  # BatchNorm statistics move too


def test_ema_update_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    ema = Ema(model, EmaConfig(enabled=True, decay=0.9, every=1))
    reads: list[str] = []
    for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(t: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
            reads.append(_name)
            return _original(t, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for step in range(1, 4):
        ema.update(model, step)
    assert reads == []


def test_ema_matches_swa_utils_and_resumes_from_its_state_dict() -> None:
    model = _model()
    ema = Ema(model, EmaConfig(enabled=True, decay=0.9, every=2))
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for step in range(1, 9):
        _train_a_little(model)
        ema.update(model, step)
        if step % 2 == 0:
            ref.update_parameters(model)
    assert int(ema.averaged.n_averaged) == int(ref.n_averaged) == 4
    got, want = ema.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, msg=k)
    moved = (got["module.0.weight"] - model[0].weight).abs().max()
    assert moved > 0.1  # an average, not a copy of the weights
    resumed = Ema(_model(), EmaConfig(enabled=True, decay=0.9, every=2))
    resumed.load_state_dict(copy.deepcopy(got))  # the checkpoint format: AveragedModel's state dict
    _train_a_little(model)
    ema.update(model, 10)
    resumed.update(model, 10)
    for k, v in ema.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, msg=k)
