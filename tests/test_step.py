"""The training step as a plain function, in this process at world size 1 (gloo, an in-memory store).

``train_step`` is checked against a hand-written step on the same parts: plain SGD on the same micro-batches
(the reference concatenates them), the non-finite guard skips an update and counts it, and too many skips
raise ``NonFiniteError``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from support.runs import tiny_args
from torch import nn

from job.cluster.env import detect_env
from job.config import load_config
from job.config.plan import make_plan
from job.errors import NonFiniteError
from job.parallel import distributed
from job.train import debug
from job.train.parts import Parts, build_parts
from job.train.step import TrainState, train_step

ARGS = [
    *tiny_args(),
    "--model.norm",
    "group",
    "--optim.name",
    "sgd",
    "--optim.momentum",
    "0",
    "--optim.weight-decay",
    "0",
    "--sched.name",
    "constant",
    "--sched.warmup-steps",
    "0",
    "--train.global-batch-size",
    "8",
    "--train.steps",
    "4",
    "--doctor.enabled",
    "false",
]


@pytest.fixture
def runtime() -> Iterator[distributed.Runtime]:
    env = detect_env({})
    rt = distributed.setup(env, load_config(ARGS, {}).dist)
    yield rt
    distributed.teardown()


def build(runtime: distributed.Runtime, *extra: str) -> tuple[Parts, object, object]:
    cfg = load_config([*ARGS, *extra], {})
    env = detect_env({})
    plan = make_plan(cfg, env.world_size)
    return build_parts(cfg, env, plan, runtime), plan, cfg


def reference_step(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> float:
    """One SGD step on the concatenated micro-batches, written out by hand."""
    images = torch.cat([x for x, _ in micro_batches]).float()
    labels = torch.cat([y for _, y in micro_batches])
    model.train()
    loss = nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None
    return float(loss.detach())


def test_step_equals_a_hand_written_sgd_step_with_accumulation(runtime: distributed.Runtime) -> None:
    parts, plan, cfg = build(runtime, "--train.micro-batch-size", "4")  # 2 micro-batches of 4
    assert plan.grad_accum_steps == 2 and dist.get_world_size() == 1
    ref = copy.deepcopy(parts.raw_model)
    initial = copy.deepcopy(parts.raw_model)
    state = TrainState()
    source = parts.loaders.batches(state)
    taken: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in source:
            taken.append(batch)
            yield batch

    out = train_step(parts, recording(), plan, state, cfg.train)
    assert state.step == 1 and state.samples_seen == 8 and state.micro_batches_in_epoch == 2 and len(taken) == 2
    from job.data.loaders import to_device

    ref_loss = reference_step(ref, [to_device(b, parts.device) for b in taken], plan.lr)
    assert out.finite and float(out.loss) == pytest.approx(ref_loss, rel=1e-5)
    for (name, got), want in zip(parts.raw_model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    moved = max((a - b).abs().max().item() for a, b in zip(parts.raw_model.parameters(), initial.parameters()))
    assert moved > 1e-4  # the comparison above is not between two untouched models


def test_nonfinite_loss_skips_the_update_then_raises(runtime: distributed.Runtime) -> None:
    parts, plan, cfg = build(runtime, "--train.max-nonfinite-skips", "1")
    state = TrainState()
    debug.install(cfg.debug.model_copy(update={"nan_at_steps": (2, 3)}), 0, parts, state)
    batches = parts.loaders.batches(state)
    assert train_step(parts, batches, plan, state, cfg.train).finite
    before = copy.deepcopy(parts.raw_model.state_dict())
    out = train_step(parts, batches, plan, state, cfg.train)
    assert not out.finite and state.step == 2 and state.nonfinite_skips == 1
    for k, v in parts.raw_model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a skipped update"
    with pytest.raises(NonFiniteError, match="max_nonfinite_skips=1"):
        train_step(parts, batches, plan, state, cfg.train)
