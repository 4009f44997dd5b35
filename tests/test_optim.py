"""Optimizers, LR scaling and schedules, EMA, and the dp strategy's refusal on CPU.

The schedule tests compare torch's schedulers, as job.train.optim builds them, with the closed-form formulas;
the optimizer tests train on the generated dataset in-process; the EMA test runs the real CLI twice
(checkpoint at step 2, resume in a fresh run directory) and needs bitwise-equal results.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.cli import base_env, run_cli
from support.runs import load_final_state, tiny_args
from torch import nn

from job.config import load_config
from job.config.plan import make_plan
from job.data.loaders import to_device
from job.data.source import build_loaders
from job.errors import BadInput
from job.train.optim import build_optimizer, build_scheduler

# --- LR: scaling rule + warmup + schedule against closed forms ---------------------------------------------------


def scheduled_lrs(args: list[str], world_size: int = 1) -> tuple[float, list[float]]:
    """(peak LR of the plan, LR used by each optimizer step) for a config given as CLI flags."""
    cfg = load_config(args, {})
    plan = make_plan(cfg, world_size)
    opt = build_optimizer(nn.Linear(2, 2), cfg.optim, plan.lr, torch.device("cpu"))
    sched = build_scheduler(opt, cfg.sched, plan.total_steps)
    lrs = []
    for _ in range(plan.total_steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return plan.lr, lrs


def warm(t: int, peak: float, w: int, s: float) -> float:
    return peak * (s + (1 - s) * t / w)


@pytest.mark.parametrize("rule,expected", [("none", 0.1), ("linear", 0.1 * 1024 / 256), ("sqrt", 0.1 * 2.0)])
def test_lr_scaling_rules(rule: str, expected: float) -> None:
    peak, _ = scheduled_lrs(
        [
            "--optim.lr",
            "0.1",
            "--optim.lr-scaling",
            rule,
            "--train.global-batch-size",
            "1024",
            "--train.steps",
            "3",
            "--sched.name",
            "constant",
        ],
        world_size=4,
    )
    assert peak == pytest.approx(expected, rel=1e-12)


def test_warmup_cosine_closed_form() -> None:
    T, W, s, floor = 40, 5, 0.1, 0.05
    peak, lrs = scheduled_lrs(
        [
            "--optim.lr",
            "0.2",
            "--optim.lr-scaling",
            "linear",
            "--train.global-batch-size",
            "512",
            "--train.steps",
            str(T),
            "--sched.warmup-steps",
            str(W),
            "--sched.min-lr-factor",
            str(floor),
        ]
    )
    assert peak == pytest.approx(0.4)
    eta = peak * floor
    want = [
        warm(t, peak, W, s) if t < W else eta + (peak - eta) * (1 + math.cos(math.pi * (t - W) / (T - W))) / 2
        for t in range(T)
    ]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_cosine_floor_is_each_groups_own() -> None:
    """Groups at lr_scale 1.0 and 0.1 with min_lr_factor 0.5: each ends at half of its own peak, the 0.1 group
    never rising above its start."""
    cfg = load_config(["--optim.lr", "1.0", "--train.steps", "10", "--sched.min-lr-factor", "0.5"], {})
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    groups = [{"params": first.parameters()}, {"params": second.parameters(), "lr_scale": 0.1}]
    opt = build_optimizer(first, cfg.optim, 1.0, torch.device("cpu"), groups)
    sched = build_scheduler(opt, cfg.sched, 10)
    seen = []
    for _ in range(10):
        seen.extend(g["lr"] for g in opt.param_groups)
        opt.step()
        sched.step()
    cos = [(1 + math.cos(math.pi * t / 10)) / 2 for t in range(10)]
    assert seen == pytest.approx([lr for c in cos for lr in (0.5 + 0.5 * c, 0.05 + 0.05 * c)], rel=1e-9)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.05], rel=1e-9)


def test_warmup_step_closed_form() -> None:
    T, W = 30, 4
    peak, lrs = scheduled_lrs(
        [
            "--optim.lr",
            "0.1",
            "--optim.lr-scaling",
            "sqrt",
            "--train.global-batch-size",
            "64",
            "--train.steps",
            str(T),
            "--sched.name",
            "step",
            "--sched.warmup-steps",
            str(W),
            "--sched.step-size",
            "7",
            "--sched.gamma",
            "0.5",
        ]
    )
    assert peak == pytest.approx(0.05)
    want = [warm(t, peak, W, 0.1) if t < W else peak * 0.5 ** ((t - W) // 7) for t in range(T)]
    assert lrs == pytest.approx(want, rel=1e-9)


def test_warmup_multistep_milestones_are_absolute_steps() -> None:
    T, W = 20, 3
    peak, lrs = scheduled_lrs(
        [
            "--optim.lr",
            "0.3",
            "--train.steps",
            str(T),
            "--sched.name",
            "multistep",
            "--sched.warmup-steps",
            str(W),
            "--sched.milestones",
            "[8,15]",
            "--sched.gamma",
            "0.1",
        ]
    )
    want = [warm(t, peak, W, 0.1) if t < W else peak * 0.1 ** sum(t >= m for m in (8, 15)) for t in range(T)]
    assert lrs == pytest.approx(want, rel=1e-9)


def test_onecycle_closed_form() -> None:
    T, pct, div, fdiv = 50, 0.3, 25.0, 1e4
    peak, lrs = scheduled_lrs(
        [
            "--optim.lr",
            "0.8",
            "--optim.lr-scaling",
            "linear",
            "--train.global-batch-size",
            "128",
            "--train.steps",
            str(T),
            "--sched.name",
            "onecycle",
            "--sched.pct-start",
            str(pct),
        ]
    )
    assert peak == pytest.approx(0.4)
    init, low, e1 = peak / div, peak / div / fdiv, pct * T - 1

    def cos_anneal(a: float, b: float, f: float) -> float:
        return b + (a - b) / 2 * (math.cos(math.pi * f) + 1)

    want = [
        cos_anneal(init, peak, t / e1) if t <= e1 else cos_anneal(peak, low, (t - e1) / (T - 1 - e1)) for t in range(T)
    ]
    assert lrs == pytest.approx(want, rel=1e-9)
    assert max(lrs) == pytest.approx(peak, rel=1e-3)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--sched.name", "onecycle", "--sched.warmup-steps", "3"], "one-cycle has its own warmup"),
        (["--sched.name", "multistep", "--sched.milestones", "[5,3]"], "sched.milestones=[5, 3]"),
        (
            ["--sched.name", "multistep", "--sched.warmup-steps", "4", "--sched.milestones", "[2]"],
            "after sched.warmup_steps=4",
        ),
    ],
)
def test_inconsistent_schedules_are_bad_input(args: list[str], fragment: str) -> None:
    with pytest.raises(BadInput, match=re.escape(fragment)):
        load_config(args, {})


# --- every optimizer and schedule reduces the loss on the generated dataset -------------------------------------

OPTIMIZERS = {
    "sgd": ["--optim.lr", "0.05"],
    "adamw": ["--optim.lr", "0.002"],
    "lars": ["--optim.lr", "2.0", "--optim.trust-coeff", "0.02"],
    "lamb": ["--optim.lr", "0.03"],
}
SCHEDULES = {
    "cosine": ["--sched.warmup-steps", "2"],
    "step": ["--sched.step-size", "4", "--sched.gamma", "0.5"],
    "multistep": ["--sched.milestones", "[4,6]", "--sched.gamma", "0.5"],
    "onecycle": ["--sched.pct-start", "0.25"],
    "constant": [],
}


def small_cnn(classes: int) -> nn.Module:
    """Conv + BatchNorm + linear: every kind of parameter group the optimizers treat differently, at a
    fraction of a ResNet's cost (the full ResNet path runs in the EMA test below)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def train_losses(tiny_data: Path, optimizer: str, schedule: str, steps: int = 12) -> list[float]:
    """Full-batch training on the first 16 generated training images; the loss on them before each step."""
    args = [
        "--optim.name",
        optimizer,
        *OPTIMIZERS[optimizer],
        "--sched.name",
        schedule,
        *SCHEDULES[schedule],
        "--train.steps",
        str(steps),
        *tiny_args(tiny_data),
        "--data.augment",
        "false",
        "--optim.weight-decay",
        "0.0001",
    ]
    cfg = load_config(args, {})
    cpu = torch.device("cpu")
    images, labels = to_device(next(iter(build_loaders(cfg.data, 0, 1, 16, 0, cpu).train)), cpu)
    torch.manual_seed(0)
    model = small_cnn(4)
    opt = build_optimizer(model, cfg.optim, cfg.optim.lr, cpu)
    sched = build_scheduler(opt, cfg.sched, steps)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "optimizer,schedule", [*((o, "cosine") for o in OPTIMIZERS), *(("sgd", s) for s in SCHEDULES if s != "cosine")]
)
def test_optimizer_and_schedule_decrease_the_loss(tiny_data: Path, optimizer: str, schedule: str) -> None:
    losses = train_losses(tiny_data, optimizer, schedule)
    assert all(math.isfinite(x) for x in losses), losses
    assert min(losses[-3:]) < 0.8 * losses[0], losses


def test_large_batch_optimizers_are_timms() -> None:
    import timm.optim

    for name, cls in (("lars", timm.optim.Lars), ("lamb", timm.optim.Lamb)):
        cfg = load_config(["--optim.name", name], {})
        assert type(build_optimizer(nn.Linear(2, 2), cfg.optim, 0.1, torch.device("cpu"))) is cls


def test_no_decay_groups_for_every_optimizer() -> None:
    for name in OPTIMIZERS:
        cfg = load_config(["--optim.name", name, "--optim.weight-decay", "0.01"], {})
        opt = build_optimizer(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), cfg.optim, 0.1, torch.device("cpu"))
        decays = sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups)
        assert decays == [(0.0, 3), (0.01, 1)], (name, decays)  # bias, LN weight+bias undecayed; the matrix decayed


# --- EMA: evaluated, checkpointed, restored exactly on resume ----------------------------------------------------


def test_ema_checkpointed_and_restored_on_resume(tmp_path: Path, tiny_data: Path) -> None:
    env = base_env(tmp_path)
    common = [
        "train",
        "--run.output-dir",
        str(tmp_path),
        "--data.path",
        str(tiny_data),
        "--data.num-classes",
        "4",
        "--data.image-size",
        "16",
        "--data.num-workers",
        "0",
        "--model.name",
        "resnet18",
        "--train.steps",
        "4",
        "--train.global-batch-size",
        "8",
        "--ckpt.every",
        "2",
        "--log.every",
        "1",
        "--optim.name",
        "lars",
        "--optim.lr",
        "1.0",
        "--sched.name",
        "onecycle",
        "--train.label-smoothing",
        "0.1",
        "--ema.enabled",
        "true",
        "--ema.decay",
        "0.5",
        "--log.tensorboard",
        "false",
    ]
    a = run_cli([*common, "--run.name", "a"], env=env)
    assert a.returncode == 0, a.stderr[-3000:]
    assert re.search(r"EMA val_top1=[\d.]+ val_loss=[\d.]+", a.stderr + a.stdout), a.stderr[-2000:]
    final_a = load_final_state(tmp_path / "a")
    ema, model = final_a["ema"], final_a["model"]
    assert int(ema["n_averaged"]) == 4
    differs = [k for k, v in model.items() if v.is_floating_point() and not torch.equal(v, ema["module." + k])]
    assert differs, "EMA weights equal the raw weights: the EMA is not averaging"

    # Resume run b from a's step-2 checkpoint: the continuation must reproduce a's EMA exactly, which it
    # cannot if the EMA were not restored (it would restart from the step-2 weights).
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-0000002", tmp_path / "b" / "step-0000002")
    b = run_cli([*common, "--run.name", "b"], env=env)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resumed from" in b.stderr + b.stdout
    final_b = load_final_state(tmp_path / "b")
    assert final_b["trainer"]["step"] == 4
    for k, v in final_a["ema"].items():
        assert torch.equal(v, final_b["ema"][k]), f"EMA tensor {k} differs after resume"
    for k, v in final_a["model"].items():
        assert torch.equal(v, final_b["model"][k]), f"model tensor {k} differs after resume"


# --- DataParallel baseline: refused on CPU ------------------------------------------------------------------------


def test_dp_strategy_refused_on_cpu(tmp_path: Path) -> None:
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this is the CPU case on every machine.
    r = run_cli(
        [
            "train",
            "--train.strategy",
            "dp",
            "--data.source",
            "synthetic",
            "--run.output-dir",
            str(tmp_path),
            "--train.steps",
            "1",
        ],
        env=base_env(tmp_path, CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "train.strategy='dp' needs CUDA GPUs" in r.stderr and "--train.strategy ddp" in r.stderr
    assert not (tmp_path / "default").exists(), "nothing may be written before the input is checked"


@pytest.mark.parametrize(
    "args,world_size,cuda,fragment",
    [
        (["--train.strategy", "dp"], 2, True, "world_size=2 processes"),
        (
            ["--train.strategy", "dp", "--ddp.comm-hook", "bf16"],
            1,
            True,
            "ddp.comm_hook='bf16' needs train.strategy='ddp'",
        ),
        (["--train.strategy", "dp", "--optim.zero", "true"], 1, True, "optim.zero=True needs train.strategy='ddp'"),
        (["--ddp.comm-hook", "powersgd"], 2, False, "ddp.comm_hook='powersgd' needs the nccl backend"),
    ],
)
def test_dp_strategy_refusals(args: list[str], world_size: int, cuda: bool, fragment: str) -> None:
    from job.parallel.ddp import validate

    cfg = load_config(args, {})
    with pytest.raises(BadInput, match=re.escape(fragment)):
        validate(cfg, world_size, cuda, world_size)
    validate(load_config(["--train.strategy", "dp"], {}), 1, True, 1)  # one process with GPUs: accepted
