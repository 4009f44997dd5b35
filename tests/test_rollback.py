"""Skipping a non-finite update without ``found_inf`` (job.train.rollback): the update runs and is undone on the
device, host-side state one step late. Checked bitwise against the update skipped by reading the flag, for each
optimizer without ``found_inf``, here on the CPU with the late path forced onto the 0-d step counts (the tensors a
CUDA run keeps on the host)."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ROOT
from support.ci import bin_path
from support.cli import base_env
from timm.optim import Lamb, Lars
from torch import nn

from job.train.rollback import Rollback, chunks, state_complete

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "lars": lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "lamb": lambda p: Lamb(p, lr=1e-2, max_grad_norm=None),
}
SKIPS = {2, 3, 5}
"""Steps whose gradients are NaN (two in a row: the late restore must not undo the second one's own copy)."""


def is_step_count(t: torch.Tensor) -> bool:
    return t.dim() == 0  # the optimizers' step counts: CPU tensors of a CUDA run


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def set_grads(net: nn.Module, step: int) -> torch.Tensor:
    """Seeded gradients for ``step``, NaN on a skipped step; the step's flag (1.0 = skip)."""
    gen = torch.Generator().manual_seed(step)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
        if step in SKIPS:
            p.grad.fill_(float("nan"))
    return torch.tensor(float(step in SKIPS))


def state_of(opt: torch.optim.Optimizer) -> dict[str, Any]:
    sd = copy.deepcopy(opt.state_dict())
    return {"state": sd["state"], "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}


def assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


@pytest.mark.parametrize("on_host", [None, is_step_count], ids=["device", "late-host"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_rolled_back_updates_equal_skipped_ones(name: str, on_host: Callable[[torch.Tensor], bool] | None) -> None:
    ref_net, net = model(), model()
    ref_opt, opt = OPTIMIZERS[name](ref_net.parameters()), OPTIMIZERS[name](net.parameters())
    rollback = Rollback(opt, torch.device("cpu"), on_host=on_host)
    for step in range(1, 8):
        flag = set_grads(ref_net, step)
        set_grads(net, step)
        if not flag.item():
            ref_opt.step()
        if state_complete(opt):
            rollback.step(flag)
        else:
            assert step == 1  # the state exists after the first update
            opt.step()
        if step == 3 and on_host is not None and name in ("adamw", "lamb"):  # their counts are 0-d tensors
            assert rollback._pending is not None  # two skips in a row: the second one's restore is still due
    rollback.settle()
    for (k, want), got in zip(ref_net.state_dict().items(), net.state_dict().values()):
        assert torch.equal(want, got), f"{name}: {k} differs"
    assert_same(state_of(ref_opt), state_of(opt), name)
    with torch.no_grad():
        moved = sum(float((p - q).abs().sum()) for p, q in zip(net.parameters(), model().parameters()))
    assert moved > 0  # the updates that were not skipped did run


def test_without_the_select_a_skipped_update_shows() -> None:
    """The comparison above can fail: an update left in place is not equal to a skipped one."""
    net = model()
    opt = OPTIMIZERS["adamw"](net.parameters())
    set_grads(net, 1)
    opt.step()
    before = copy.deepcopy(net.state_dict())
    rollback = Rollback(opt, torch.device("cpu"))
    set_grads(net, 2)
    rollback.step(torch.tensor(0.0))  # the flag says go on: the NaN update stays
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_late_host_state_is_restored_at_settle_only() -> None:
    net = model()
    opt = OPTIMIZERS["lamb"](net.parameters())
    set_grads(net, 1)
    opt.step()
    rollback = Rollback(opt, torch.device("cpu"), on_host=is_step_count)
    set_grads(net, 2)
    rollback.step(torch.tensor(1.0))
    assert int(opt.param_groups[0]["step"]) == 2  # counted by the update, restored one step late
    rollback.settle()
    assert int(opt.param_groups[0]["step"]) == 1
    rollback.settle()  # nothing pending: a no-op
    assert int(opt.param_groups[0]["step"]) == 1


def test_chunks_split_by_dtype_and_size() -> None:
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(4, dtype=torch.float64)]
    got = chunks(ts, limit=25 * 4)
    assert [[t.numel() for t in c.tensors] for c in got] == [[10, 10], [30], [4]]
    assert [c.copy.dtype for c in got] == [torch.float32, torch.float32, torch.float64]
    assert [c.copy.numel() for c in got] == [20, 30, 4]


def test_zero_restores_its_shard_before_the_broadcast(tmp_path: Path) -> None:
    """ZeRO over 2 real torchrun ranks: each rank copies and restores only its shard, before the shards are
    broadcast, and every rank holds the whole model after each step, and its optimizer shard, bitwise equal to the skipped
    updates never run (tests/support/rollback_worker.py)."""
    out = tmp_path / "result"
    cmd = [
        bin_path("torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "support" / "rollback_worker.py"),
    ]
    r = subprocess.run([*cmd, str(out)], env=base_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for res in results:
        assert res["model_same"] == [True] * 6 and res["state_same"] and res["moved"], res
        assert res["copy_bytes"] < (res["model_bytes"] + res["state_bytes"])  # the shard, not the whole model
    assert sum(res["copy_bytes"] for res in results) == results[0]["model_bytes"] + sum(
        r["state_bytes"] for r in results
    )
