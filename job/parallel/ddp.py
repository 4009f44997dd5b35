"""How the model and optimizer are spread over devices: the DDP/DataParallel wrapper with its knobs and
gradient-communication hooks, ZeRO optimizer-state sharding, and the TF32 switch.

The trainer calls ``validate`` in preflight (job.train.run: bad input fails before any process group exists),
``wrap_model`` after building the model (job.train.parts), ``before_save`` on every rank before a checkpoint (the
optimizer's checkpoint state) and ``comm_summary`` at the end of the loop (job.train.loop).
See docs/efficiency.md for what each option costs and buys.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer

from job.config import DdpConfig, JobConfig
from job.errors import BadInput

log = logging.getLogger("job")


def validate(cfg: JobConfig, world_size: int, cuda_available: bool, local_world_size: int) -> None:
    """Refuse combinations that cannot work, before any process group or device work.

    Raises:
        BadInput: naming the setting, its value and the fix.
    """
    if cfg.ddp.comm_hook == "powersgd" and (cfg.dist.backend == "gloo" or not cuda_available):
        # torch's PowerSGD hook waits on a second all-reduce inside a future callback; on gloo that callback
        # runs on gloo's own worker thread and the step never finishes (hung in our 2-process CPU test).
        raise BadInput(
            "ddp.comm_hook='powersgd' needs the nccl backend (CUDA); on gloo its hook deadlocks.",
            "--ddp.comm-hook bf16 (or fp16/none) on CPU/gloo.",
            setting="ddp.comm_hook",
            value="powersgd",
        )
    if cfg.train.strategy == "fsdp":
        from job.parallel import fsdp

        fsdp.validate(cfg, world_size, local_world_size)
    if cfg.train.strategy != "dp":
        return
    if not cuda_available:
        raise BadInput(
            "train.strategy='dp' needs CUDA GPUs: nn.DataParallel splits each batch over the visible GPUs of one "
            "process, and no GPU is visible.",
            "use --train.strategy ddp (runs on CPU with gloo).",
            setting="train.strategy",
            value="dp",
        )
    if world_size > 1:
        raise BadInput(
            f"train.strategy='dp' runs in one process, but this job has world_size={world_size} processes.",
            "start a single process (ddp-job train without torchrun, or --dist.nproc-per-node 1), "
            "or use --train.strategy ddp.",
            setting="train.strategy",
            value="dp",
        )
    for name, value, default in (
        ("ddp.comm_hook", cfg.ddp.comm_hook, "none"),
        ("optim.zero", cfg.optim.zero, False),
        ("model.sync_bn", cfg.model.sync_bn, False),
    ):
        if value != default:
            raise BadInput(
                f"{name}={value!r} needs train.strategy='ddp' (DataParallel has one process: nothing to "
                "communicate or shard).",
                f"--{name.replace('_', '-')} {str(default).lower()}, or --train.strategy ddp.",
                setting=name,
                value=value,
            )


def apply_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and cuDNN convolutions (Ampere+). Off = IEEE fp32, which also turns off
    torch's default of TF32 convolutions, so 'fp32' means the same in every layer.

    Set through the legacy API on purpose: torch maps it onto the new ``fp32_precision`` flags, so both APIs'
    getters read it back; after a set through the new API the legacy getters (``allow_tf32``,
    ``get_float32_matmul_precision``, which inductor's autotuning reads) raise for a mix of the two APIs."""
    matmul = "highest"
    if enabled:
        matmul = "high"  # TF32 where the device has it
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = enabled


class DataParallelBaseline(nn.DataParallel):
    """nn.DataParallel with the one method the training loop needs from DDP, around the task's training step:
    each GPU's replica returns its scalars, which come back as one value per replica and leave as their mean
    (the chunks of a batch are of equal size)."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return _replica_mean(super().forward(*inputs, **kwargs), len(self.device_ids))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        # One process: gradients land on the first device via autograd; there is no all-reduce to skip.
        return contextlib.nullcontext()


def _replica_mean(out: Any, replicas: int) -> Any:
    """The gathered per-replica scalars of ``out`` (tensors in tuples and dicts) as their mean."""
    if replicas <= 1:  # one device: DataParallel calls the module itself, nothing gathered
        return out
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    if isinstance(out, dict):
        return {k: _replica_mean(v, replicas) for k, v in out.items()}
    if isinstance(out, tuple):
        return tuple(_replica_mean(v, replicas) for v in out)
    return out


@dataclass
class CommCounter:
    """Gradient all-reduce calls seen by the comm hook; ``per_step`` closes at each iteration's last bucket."""

    calls: int = 0
    per_step: list[int] = field(default_factory=list)
    buckets: set[int] = field(default_factory=set)
    current: int = 0

    def hook(self, inner: Any, inner_state: Any) -> Any:
        # Unannotated on purpose: DDP compares annotations with the real types, and this module's
        # `from __future__ import annotations` would turn them into strings.
        def counting_hook(_state, bucket):  # type: ignore[no-untyped-def]
            self.calls += 1
            self.current += 1
            self.buckets.add(bucket.index())
            if bucket.is_last():
                self.per_step.append(self.current)
                self.current = 0
            return inner(inner_state, bucket)

        return counting_hook


# The counter of each wrapped model that counts its all-reduce calls (ddp.comm_stats); weak: dies with the model.
_COMM_COUNTERS: weakref.WeakKeyDictionary[nn.Module, CommCounter] = weakref.WeakKeyDictionary()


class PowerSgdReset:
    """PowerSGD carries state across steps: the compression error (error feedback) and Q (warm start). A step
    whose gradients were non-finite leaves NaN/Inf in both for good; after a skipped update this puts them back
    on the device, without the host: the error to zero (nothing owed), Q to the last finite step's (random at
    first, as the hook starts)."""

    def __init__(self, state: powerSGD_hook.PowerSGDState) -> None:
        self.state = state
        self.good_q: dict[int, torch.Tensor] = {}

    def after_update(self, found_inf: torch.Tensor) -> None:
        """After the step's update; ``found_inf`` (0-d, 1 = the update was skipped) from the non-finite guard."""
        skipped = found_inf.bool()
        for error in self.state.error_dict.values():
            error.masked_fill_(skipped, 0.0)
        for bucket, q in self.state.q_memory_dict.items():
            good = self.good_q.get(bucket)
            if good is None:
                g = torch.Generator(q.device).manual_seed(bucket)
                good = self.good_q[bucket] = torch.randn(q.shape, generator=g, device=q.device, dtype=q.dtype)
            q.copy_(torch.where(skipped, good, q))
            good.copy_(q)


# The PowerSGD reset of each wrapped model that uses the hook (after_update); weak: dies with the model.
_POWERSGD_RESETS: weakref.WeakKeyDictionary[nn.Module, PowerSgdReset] = weakref.WeakKeyDictionary()


def after_update(model: nn.Module, found_inf: torch.Tensor) -> None:
    """After every optimizer step: the comm hook's state made good again after a skipped update."""
    reset = _POWERSGD_RESETS.get(model)
    if reset is not None:
        reset.after_update(found_inf)


def _hook(cfg: DdpConfig) -> tuple[Any, Any]:
    """(hook, state) for the configured communication; state None = the default process group."""
    if cfg.comm_hook == "bf16":
        return default_hooks.bf16_compress_hook, None
    if cfg.comm_hook == "fp16":
        return default_hooks.fp16_compress_hook, None
    if cfg.comm_hook == "powersgd":
        # Error feedback + warm start: the compression error is re-added next step, so training converges
        # like plain all-reduce at a fraction of the bytes. Their state lives in memory only (not checkpointed):
        # after a resume PowerSGD restarts with plain all-reduce for start_iter iterations.
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=cfg.powersgd_start_iter
        )
        return powerSGD_hook.powerSGD_hook, state
    return default_hooks.allreduce_hook, None


def wrap_model(raw_model: nn.Module, cfg: JobConfig, rt: Any, settle: Callable[[nn.Module], torch.Tensor]) -> nn.Module:
    """The training wrapper around ``raw_model`` (already on ``rt.device``): DDP with the configured knobs and
    comm hook, or the DataParallel baseline. Also applies the TF32 switch (a process-wide setting). ``settle``:
    a training pass for ``settle_buckets`` (the task's loss on the preflight batch; an image classifier's on
    zero images is job.tasks.image.model.image_probe)."""
    if rt.device.type == "cuda":
        apply_tf32(cfg.train.tf32)
    if cfg.train.strategy == "dp":
        n = torch.cuda.device_count()
        log.info("strategy dp: nn.DataParallel over %d visible GPU(s), one process", n)
        return DataParallelBaseline(raw_model)
    d = cfg.ddp
    model = DDP(
        raw_model,
        device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        bucket_cap_mb=d.bucket_cap_mb,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        static_graph=d.static_graph,
    )
    # Before the hook, so PowerSGD's iteration count and the counter see real steps only (DDP takes a hook
    # between iterations).
    settle_buckets(model, settle)
    hook, state = _hook(d)
    if d.comm_stats:
        counter = CommCounter()
        model.register_comm_hook(state, counter.hook(hook, state))
        _COMM_COUNTERS[model] = counter  # read by comm_summary()
    elif d.comm_hook != "none":  # no hook = DDP's built-in C++ all-reduce (the fastest plain path)
        model.register_comm_hook(state, hook)
    if isinstance(state, powerSGD_hook.PowerSGDState):
        _POWERSGD_RESETS[model] = PowerSgdReset(state)
    return model


def settle_buckets(model: DDP, probe: Callable[[nn.Module], torch.Tensor]) -> None:
    """Let DDP rebuild its gradient buckets now, on throwaway passes that change no state, so that every real
    step of a fresh and of a resumed run all-reduces with the same, final bucket layout.

    Why: DDP starts with one bucket in reverse parameter order and rebuilds its buckets once, in the order the
    gradients became ready, at the forward after its first synced backward (its second with static_graph).
    A ring all-reduce (gloo, NCCL) sums an element over the ranks in an order set by the element's offset in
    its bucket, and from 3 ranks on float addition is not associative: a resumed run's first step, on the
    initial layout, differed in the last bits from the same step of an uninterrupted run on the rebuilt one.
    ``probe(model)`` runs the training graph (the task's loss on the preflight batch; zero images for a plain
    classifier), so the gradient order, and the overlap of communication with the backward pass, are those DDP
    would record on a real step.
    Cost: 2 forward/backward passes (3 with static_graph) on 2 items at start-up, nothing per step; it
    also lets static_graph start under no_sync(), which fails on a fresh DDP. Rejected: find_unused_parameters
    (never rebuilds, but walks the graph and all-reduces a usage map every step); the reducer's
    _push_all_rebuilt_params (a rebuild in forward order: the first bucket is ready last, no overlap).
    """
    raw = model.module
    was_training = raw.training
    buffers = [b.detach().clone() for b in raw.buffers()]  # BatchNorm running statistics and counters
    device = next(raw.parameters()).device
    raw.train()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # e.g. dropout draws
        for _ in range(3):  # static_graph: 2 passes before the one whose forward rebuilds
            if model._has_rebuilt_buckets:  # DDP's own flag, set by the forward that rebuilt
                break
            probe(model).backward()
    with torch.no_grad():
        for b, saved in zip(raw.buffers(), buffers):
            b.copy_(saved)
    raw.zero_grad(set_to_none=True)
    raw.train(was_training)
    if not model._has_rebuilt_buckets:
        log.warning(
            "DDP did not rebuild its gradient buckets during start-up: a resumed run may differ from an "
            "uninterrupted one in the last bits of the gradients"
        )


def comm_summary(model: nn.Module, grad_accum_steps: int) -> str | None:
    """One log line with the counted all-reduce calls per optimizer step (``ddp.comm_stats``), else None."""
    counter = _COMM_COUNTERS.get(model)
    if counter is None:
        return None
    return (
        f"comm: all-reduce calls per optimizer step {counter.per_step} (total {counter.calls}), "
        f"distinct buckets {len(counter.buckets)}, grad_accum_steps {grad_accum_steps}"
    )


def zero_optimizer(groups: list[dict], cls: type[Optimizer], kwargs: dict[str, Any]) -> Optimizer:
    """Optimizer state sharded over the ranks of the default group: each rank keeps and updates the state of
    its parameters only, then broadcasts the updated parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)


def before_save(optimizer: Optimizer) -> None:
    """Run on EVERY rank before ``optimizer.state_dict()`` is taken on rank 0 (a collective under ZeRO).

    Decision: consolidate to rank 0, which writes it into ``state.pt`` beside the model's shards
    (job.checkpoint.sharded): a checkpoint that resumes with or without ZeRO and at any world size
    (ZeroRedundancyOptimizer.load_state_dict takes the full state and keeps this rank's part). Cost: rank 0
    briefly holds a host copy of the full optimizer state.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer-state tensors held by this rank (under ZeRO: its shard only)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
