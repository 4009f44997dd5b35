"""The training step as a plain function, in this process at world size 1 (gloo, an in-memory store).

``train_step`` is checked against a hand-written step on the same parts: plain SGD on the same micro-batches
(the reference concatenates them), the non-finite guard skips an update and counts it, and too many skips
raise ``NonFiniteError``.
"""

from __future__ import annotations

import copy
import math
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.fake_cuda import FakeEvents
from support.runs import assert_bitwise_equal, tiny_args
from torch import nn

import job.data
from job.cluster.env import detect_env
from job.config import load_config
from job.config.plan import make_plan
from job.errors import NonFiniteError
from job.observe.metrics import NullWriter, TrainLog
from job.observe.observer import Observer
from job.parallel import distributed
from job.train import debug, optim
from job.train.guard import NonFiniteGuard
from job.train.parts import Parts, build_parts
from job.train.rollback import Rollback, local_optimizer
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
    assert not out.finite and state.step == 2 and state.nonfinite_skips == 0  # counted on the device until checked
    parts.guard.check(state.step, state)
    assert state.nonfinite_skips == 1
    for k, v in parts.raw_model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a skipped update"
    train_step(parts, batches, plan, state, cfg.train)
    with pytest.raises(NonFiniteError, match="max_nonfinite_skips=1"):
        parts.guard.check(state.step, state)
    assert state.nonfinite_skips == 2


HOST_SIDE = Path(job.data.__file__).parent


class HostSyncs:
    """Counts the calls that read a tensor's value on the host: each is a device synchronisation on CUDA. The input
    pipeline (job/data) is left out: its tensors are host tensors on a GPU run too (the sampler's order), and so
    are the tensors ``host`` names."""

    NAMES = ("__bool__", "item", "tolist", "__float__", "__int__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch, host: Callable[[torch.Tensor], bool] = lambda t: False) -> None:
        self.calls: list[str] = []
        self.host = host
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(t: torch.Tensor, *args: Any) -> Any:
            caller = traceback.extract_stack(limit=2)[0]
            if HOST_SIDE not in Path(caller.filename).parents and not self.host(t):
                self.calls.append(f"{name} at {caller.filename}:{caller.lineno}")
            return original(t, *args)

        return counted


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_non_log_steps_never_read_a_tensor_on_the_host(
    runtime: distributed.Runtime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, optimizer: str
) -> None:
    extra = ["--optim.name", optimizer, "--optim.momentum", "0.9", "--log.every", "100", "--train.steps", "100"]
    # the fused kernels the job picks on CUDA, here on the CPU: the guard hands them its flag (job.train.guard)
    monkeypatch.setattr(optim, "_impl_kwargs", lambda device, zero: {"fused": True})
    parts, plan, cfg = build(runtime, *extra, "--run.output-dir", str(tmp_path))
    observer = Observer(
        cfg, detect_env({}), None, parts.raw_model, parts.device, plan.global_batch_size, NullWriter(), 0
    )
    state = TrainState()
    debug.install(cfg.debug.model_copy(update={"nan_at_steps": (1, 3)}), 0, parts, state)  # a skip among them
    batches = parts.loaders.batches(state)
    train_log = TrainLog(100, 100, plan.global_batch_size, parts.device, NullWriter(), observer)
    syncs = HostSyncs(monkeypatch)
    for _ in range(4):
        train_log.before_step()
        out = train_step(parts, batches, plan, state, cfg.train)
        train_log.after_step(state.step, out, parts.optimizer.param_groups[0]["lr"])
        assert not train_log.due(state.step)
    assert syncs.calls == []
    monkeypatch.undo()
    parts.guard.check(state.step, state)
    assert state.nonfinite_skips == 2
    assert all(torch.isfinite(p).all() for p in parts.raw_model.parameters())  # step 1's skip left no garbage


def step_counts(optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor is one of the optimizer's step counts: CPU tensors of a CUDA run too (torch's non-capturable
    optimizers, timm's LAMB), read by the optimizers themselves without a device wait."""

    def is_count(t: torch.Tensor) -> bool:
        inner = local_optimizer(optimizer)
        counts = [s.get("step") for s in inner.state.values()] + [g.get("step") for g in inner.param_groups]
        return any(t is c for c in counts)

    return is_count


@pytest.mark.parametrize(
    "optimizer", [["lars"], ["lamb"], ["adamw", "--optim.zero", "true"], ["sgd", "--optim.zero", "true"]]
)
def test_optimizers_without_found_inf_skip_without_a_host_read(
    runtime: distributed.Runtime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, optimizer: list[str]
) -> None:
    """LARS, LAMB and ZeRO's sharded update roll a skipped update back on the device (job.train.rollback), here with
    the late host restore on the step counts, as on a GPU."""
    extra = ["--optim.name", *optimizer, "--optim.momentum", "0.9", "--log.every", "100", "--train.steps", "100"]
    parts, plan, cfg = build(runtime, *extra, "--run.output-dir", str(tmp_path))
    rollback = Rollback(parts.optimizer, parts.device, on_host=step_counts(parts.optimizer))
    parts.guard = NonFiniteGuard(parts.optimizer, parts.device, 100, False, rollback=rollback)
    state = TrainState()
    debug.install(cfg.debug.model_copy(update={"nan_at_steps": (3, 4)}), 0, parts, state)
    batches = parts.loaders.batches(state)
    train_step(parts, batches, plan, state, cfg.train)  # the first update creates the state (the flag read once)
    before = copy.deepcopy(parts.raw_model.state_dict())
    syncs = HostSyncs(monkeypatch, host=step_counts(parts.optimizer))
    outs = [train_step(parts, batches, plan, state, cfg.train) for _ in range(3)]  # steps 2-4: 3 and 4 skipped
    assert syncs.calls == []
    monkeypatch.undo()
    assert [bool(o.finite) for o in outs] == [True, False, False]
    parts.guard.check(state.step, state)
    assert state.nonfinite_skips == 2
    assert all(torch.isfinite(p).all() for p in parts.raw_model.parameters())
    moved = [k for k, v in parts.raw_model.state_dict().items() if not torch.equal(v, before[k])]
    assert moved  # step 2's update ran


def run_with_a_nonfinite_step(
    runtime: distributed.Runtime, tmp_path: Path, optimizer: list[str], rollback: bool, nan_at: tuple[int, ...] = (3, 4)
) -> tuple[Parts, TrainState, dict[str, Any]]:
    """Five real steps, the gradients of steps ``nan_at`` non-finite, an EMA; ``rollback``: their updates run and are
    undone (job.train.rollback, with the late host restore of the step counts as on a GPU), else never run (the
    flag read on the host before the update). Returns the parts, the state and the initial weights."""
    extra = ["--optim.name", *optimizer, "--optim.momentum", "0.9", "--log.every", "100", "--train.steps", "100"]
    extra += ["--ema.enabled", "true", "--ema.decay", "0.5", "--run.output-dir", str(tmp_path)]
    parts, plan, cfg = build(runtime, *extra)
    initial = copy.deepcopy(parts.raw_model.state_dict())
    if rollback:
        undo = Rollback(parts.optimizer, parts.device, on_host=step_counts(parts.optimizer))
        parts.guard = NonFiniteGuard(parts.optimizer, parts.device, 100, False, rollback=undo)
    assert (parts.guard.rollback is not None) == rollback
    state = TrainState()
    debug.install(cfg.debug.model_copy(update={"nan_at_steps": nan_at}), 0, parts, state)
    batches = parts.loaders.batches(state)
    outs = [train_step(parts, batches, plan, state, cfg.train) for _ in range(5)]
    assert [bool(o.finite) for o in outs] == [step not in nan_at for step in range(1, 6)]
    parts.guard.check(state.step, state)
    assert state.nonfinite_skips == len(nan_at)
    return parts, state, initial


@pytest.mark.parametrize("nan_at", [(3, 4), (1,)], ids=["steps-3-4", "first-update"])
@pytest.mark.parametrize("optimizer", [["lamb"], ["adamw", "--optim.zero", "true"]], ids=["lamb", "zero-adamw"])
def test_a_rolled_back_step_equals_one_that_never_ran(
    runtime: distributed.Runtime, tmp_path: Path, optimizer: list[str], nan_at: tuple[int, ...]
) -> None:
    """The real step with the rollback ends bitwise where the same steps end when the skipped updates never ran:
    parameters and buffers, the optimizer's state (``exp_avg``, momentum, step counts), the EMA and the scaler.
    ``first-update``: the very first update is non-finite, before the optimizer has state to roll back to."""
    never, undone = tmp_path / "never", tmp_path / "undone"
    want, want_state, initial = run_with_a_nonfinite_step(runtime, never, optimizer, rollback=False, nan_at=nan_at)
    got, got_state, got_initial = run_with_a_nonfinite_step(runtime, undone, optimizer, rollback=True, nan_at=nan_at)
    assert_bitwise_equal(initial, got_initial, "initial weights")  # the two runs start alike
    assert_bitwise_equal(want.raw_model.state_dict(), got.raw_model.state_dict(), "model")
    want_opt, got_opt = local_optimizer(want.optimizer), local_optimizer(got.optimizer)
    assert_bitwise_equal(want_opt.state_dict(), got_opt.state_dict(), "optimizer")
    assert want.ema is not None and got.ema is not None
    assert_bitwise_equal(want.ema.state_dict(), got.ema.state_dict(), "ema")
    assert_bitwise_equal(want.scaler.state_dict(), got.scaler.state_dict(), "scaler")
    assert want_state == got_state
    moved = [k for k, v in got.raw_model.state_dict().items() if not torch.equal(v, initial[k])]
    assert moved  # steps 1, 2 and 5 updated the model: the comparison is not between untouched ones


class Recorder:
    """A writer that keeps the scalars it is given."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.rows.append((step, scalars))


def observed(
    runtime: distributed.Runtime, tmp_path: Path, steps: int, clock: Any, *extra: str
) -> tuple[Parts, Any, TrainLog, Recorder, Any]:
    """Parts and an observer publishing every ``steps`` steps, timing busy spans with ``clock`` (None: the device's)."""
    parts, plan, cfg = build(runtime, "--log.every", str(steps), "--run.output-dir", str(tmp_path), *extra)
    writer = Recorder()
    env = detect_env({})
    observer = Observer(cfg, env, None, parts.raw_model, parts.device, plan.global_batch_size, writer, 0, clock=clock)
    state = TrainState()
    debug.install(cfg.debug, 0, parts, state)
    batches = parts.loaders.batches(state)
    train_log = TrainLog(steps, cfg.train.steps, plan.global_batch_size, parts.device, NullWriter(), observer)

    def step(pause_s: float = 0.0) -> None:
        train_log.before_step()
        out = train_step(parts, batches, plan, state, cfg.train)
        time.sleep(pause_s)  # after the gradients are ready, before the step ends: an all-reduce wait
        train_log.after_step(state.step, out, parts.optimizer.param_groups[0]["lr"])

    return parts, plan, train_log, writer, step


def test_busy_time_on_the_cpu_runs_from_the_step_start_to_the_gradients(
    runtime: distributed.Runtime, tmp_path: Path
) -> None:
    """The host's clock: busy covers the forward pass (slowed by 0.05 s) and ends when the gradients are ready,
    not with the step (which waits 0.1 s more)."""
    slow = ["--debug.straggler-delay-s", "0.05", "--debug.straggler-rank", "0"]
    parts, _, _, writer, step = observed(runtime, tmp_path, 3, None, *slow)
    for _ in range(3):
        step(pause_s=0.1)
    ((at, s),) = writer.rows
    assert at == 3 and parts.device.type == "cpu"
    assert 0.05 <= s["straggler/busy_s_max"] < s["straggler/step_s_max"] - 0.09, s


def test_busy_time_on_cuda_events_is_read_only_when_the_observer_publishes(
    runtime: distributed.Runtime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The GPU's path, its events simulated on the CPU: each step records its start and, from backward's hook, its
    gradients ready (once per micro-batch, the last counts); the steps in between read nothing, the publish step
    waits for the window's events and reports the mean span."""
    monkeypatch.setattr(optim, "_impl_kwargs", lambda device, zero: {"fused": True})  # as on CUDA: no flag read
    events = FakeEvents()
    parts, plan, _, writer, step = observed(runtime, tmp_path, 4, events.stopwatch(), "--train.micro-batch-size", "4")
    assert plan.grad_accum_steps == 2
    syncs = HostSyncs(monkeypatch)
    for n in range(1, 4):
        step()
        assert events.log == ["record"] * (1 + 3 * n)  # the first start, then 2 gradients + the next start per step
    assert syncs.calls == [] and writer.rows == []
    monkeypatch.undo()
    step()
    assert events.count("elapsed_time") == 4 and events.count("synchronize") == 8, events.log
    # events in order: start of step 1, its 2 gradients-ready, start of step 2, ...: a step's span is its start
    # to its last gradients
    t = [e.t for e in events.created]
    spans = [t[3 * k + 2] - t[3 * k] for k in range(4)]
    ((at, s),) = writer.rows
    assert at == 4 and s["straggler/busy_s_max"] == pytest.approx(sum(spans) / 4)
    step()
    assert events.count("elapsed_time") == 4  # the next window is read at its own publish step


def test_logged_loss_is_the_mean_of_the_steps_that_were_not_skipped(
    runtime: distributed.Runtime, tmp_path: Path
) -> None:
    """Step 2 of a 4-step window is skipped (NaN loss): train/loss is the mean of steps 1, 3 and 4, not their sum
    over 4."""
    parts, plan, cfg = build(runtime, "--log.every", "4", "--run.output-dir", str(tmp_path))
    writer = Recorder()
    observer = Observer(cfg, detect_env({}), None, parts.raw_model, parts.device, plan.global_batch_size, writer, 0)
    state = TrainState()
    debug.install(cfg.debug.model_copy(update={"nan_at_steps": (2,)}), 0, parts, state)
    batches = parts.loaders.batches(state)
    train_log = TrainLog(4, 4, plan.global_batch_size, parts.device, writer, observer)
    losses = []
    for _ in range(4):
        train_log.before_step()
        out = train_step(parts, batches, plan, state, cfg.train)
        losses.append(out.loss.item())
        train_log.after_step(state.step, out, parts.optimizer.param_groups[0]["lr"])
    assert not math.isfinite(losses[1]) and all(math.isfinite(x) for x in losses[::2] + losses[3:])
    logged = [s["train/loss"] for step, s in writer.rows if "train/loss" in s]
    assert logged == [pytest.approx((losses[0] + losses[2] + losses[3]) / 3, rel=1e-6)]
