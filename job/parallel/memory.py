"""Per-device memory of a run, by strategy: the arithmetic of docs/sharding.md, in one place.

``estimate`` is pure: it reads the parameters' shapes and dtypes (a meta model will do) and the units, never a
process group or a device. Per device it counts:

- parameters: every parameter (4 B each in fp32) under ddp; under fsdp this rank's dim-0 chunk of each, padded as
  FSDP2 pads it (``ceil(dim0 / shard_degree)`` rows: the largest chunk any rank holds; shard_degree is the world size
  unless HSDP replicates the shard groups). Buffers are replicated.
- gradients: the same size as the trainable parameters' chunks (DDP's gradients are views into its buckets, so no
  second copy); under fsdp with gradient accumulation each rank keeps the unsharded gradients between
  micro-batches (one reduce-scatter per optimizer step), the whole model's.
- optimizer state: the optimizer's per-parameter tensors (AdamW and LAMB 2, SGD and LARS with momentum 1) of the
  trainable chunks, in the parameters' dtype; ``optim.zero`` divides it (only it) by ``world_size``.
- EMA: one more copy of parameters and buffers, sharded like the parameters under fsdp.
- gathered units (fsdp only): full parameters in the compute dtype (bf16 under ``train.precision: bf16``:
  ``job.parallel.fsdp.mixed_precision``). The root (what no other unit owns: a language model's embeddings and
  norm) stays gathered from its forward to its backward, and beside it the unit being computed and the next one,
  prefetched: the root plus the two largest units. With ``fsdp.reshard_after_forward: false`` every unit stays
  gathered from its forward to its backward: the whole model.
- activations: what the caller measured for one micro-batch (``job.tasks.preflight``, saved tensors of the
  preflight batch per item x ``micro_batch_size``).

``verdict`` compares the two strategies' totals with a capacity given to it; ``capacity_bytes`` (not pure) reads
the device's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from job.config import JobConfig
from job.errors import DoesNotFit

STATES_PER_PARAM = {"adamw": 2, "lamb": 2, "sgd": 1, "lars": 1}
"""Optimizer state tensors per parameter, each of its size (exp_avg + exp_avg_sq; momentum buffer)."""
ROWS = ("parameters", "gradients", "optimizer", "ema", "gathered_unit", "activations")

FITS, USE_FSDP, NONE_FITS = "fits", "use fsdp", "none fits"


@dataclass(frozen=True)
class Setup:
    """What the arithmetic depends on besides the model: a run's settings."""

    strategy: str
    world_size: int
    optimizer: str = "adamw"
    momentum: float = 0.9
    zero: bool = False
    precision: str = "fp32"
    ema: bool = False
    grad_accum_steps: int = 1
    shard_degree: int = 0
    """Ranks fsdp shards over (job.parallel.fsdp.mesh_shape); 0: all ``world_size``."""
    reshard_after_forward: bool = True

    @property
    def shards(self) -> int:
        """Over how many ranks the state is split: 1 under ddp."""
        if self.strategy != "fsdp":
            return 1
        return self.shard_degree or self.world_size


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, by what holds them."""

    strategy: str
    world_size: int
    parameters: int
    gradients: int
    optimizer: int
    ema: int
    gathered_unit: int
    activations: int
    shards: int = 1

    @property
    def label(self) -> str:
        """``ddp x4``, or the fsdp mesh: ``fsdp 1x4``, ``hsdp 2x2`` (job.parallel.fsdp.mesh_label)."""
        if self.strategy != "fsdp":
            return f"{self.strategy} x{self.world_size}"
        from job.parallel.fsdp import mesh_label

        return mesh_label((self.world_size // self.shards, self.shards))

    @property
    def state(self) -> int:
        """What stays between steps: parameters, gradients, optimizer state and EMA."""
        return self.parameters + self.gradients + self.optimizer + self.ema

    @property
    def total(self) -> int:
        return self.state + self.gathered_unit + self.activations

    def table(self, other: MemoryEstimate | None = None) -> str:
        """Rows of MiB, this estimate's column first and ``other``'s beside it."""
        columns = [self] + ([other] if other is not None else [])
        head = "".join(f"{e.label:>14}" for e in columns)
        lines = [f"{'per device [MiB]':<16}{head}"]
        for row in (*ROWS, "total"):
            lines.append(f"{row:<16}" + "".join(f"{getattr(e, row) / 2**20:>14.1f}" for e in columns))
        return "\n".join(lines)


def _chunk_numel(p: torch.Tensor, world_size: int) -> int:
    """Elements of the largest dim-0 chunk FSDP2 gives a rank (padded: every rank's chunk has this size)."""
    if p.dim() == 0:
        return 1
    return math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:])


def _bytes(params: Iterable[torch.Tensor], world_size: int) -> int:
    return sum(_chunk_numel(p, world_size) * p.element_size() for p in params)


UNITS_GATHERED = 2
"""Units gathered at once besides the root: the one computed and the next, prefetched (FSDP2's default)."""


def gathered_unit_bytes(
    model: nn.Module, units: list[nn.Module], precision: str, reshard_after_forward: bool = True
) -> int:
    """Full parameters gathered at once, in the compute dtype: the root (what no unit owns), which stays gathered
    through forward and backward, plus the ``UNITS_GATHERED`` largest units; the whole model where units stay
    gathered after their forward."""
    owned: set[int] = set()
    sizes = []
    for unit in units:
        params = [p for p in unit.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        sizes.append(sum(p.numel() for p in params))
    root = sum(p.numel() for p in model.parameters() if id(p) not in owned)
    dtype_bytes = {"bf16": 2, "fp16": 2}.get(precision, 4)
    if not reshard_after_forward:
        return (root + sum(sizes)) * dtype_bytes
    return (root + sum(sorted(sizes)[-UNITS_GATHERED:])) * dtype_bytes


def estimate(model: nn.Module, units: list[nn.Module], setup: Setup, activation_bytes: int = 0) -> MemoryEstimate:
    """Per-device bytes of ``model`` trained under ``setup``; ``activation_bytes``: one micro-batch's."""
    shards = setup.shards
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    param_bytes = _bytes(params, shards) + buffers
    grad_bytes = _bytes(trainable, shards)
    if setup.strategy == "fsdp" and setup.grad_accum_steps > 1:
        grad_bytes = _bytes(trainable, 1)
    states = STATES_PER_PARAM[setup.optimizer]
    if setup.optimizer in ("sgd", "lars") and setup.momentum == 0:
        states = 0
    optim_bytes = states * _bytes(trainable, shards)
    if setup.zero and setup.strategy != "fsdp":
        optim_bytes = math.ceil(optim_bytes / setup.world_size)
    gathered = 0
    if setup.strategy == "fsdp":
        gathered = gathered_unit_bytes(model, units, setup.precision, setup.reshard_after_forward)
    return MemoryEstimate(
        strategy=setup.strategy,
        world_size=setup.world_size,
        parameters=param_bytes,
        gradients=grad_bytes,
        optimizer=optim_bytes,
        ema=param_bytes if setup.ema else 0,
        gathered_unit=gathered,
        activations=activation_bytes,
        shards=shards,
    )


def setup_of(cfg: JobConfig, world_size: int, grad_accum_steps: int, shard_degree: int = 0) -> Setup:
    """The ``Setup`` of a run's config; ``shard_degree``: of its fsdp mesh (job.parallel.fsdp.mesh_shape)."""
    return Setup(
        strategy=cfg.train.strategy,
        world_size=world_size,
        optimizer=cfg.optim.name,
        momentum=cfg.optim.momentum,
        zero=cfg.optim.zero,
        precision=cfg.train.precision,
        ema=cfg.ema.enabled,
        grad_accum_steps=grad_accum_steps,
        shard_degree=shard_degree,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
    )


def both(
    model: nn.Module, units: list[nn.Module], setup: Setup, activation_bytes: int = 0
) -> tuple[MemoryEstimate, MemoryEstimate]:
    """(ddp, fsdp) estimates of the same run: ``optim.zero`` applies to ddp only (fsdp refuses it)."""
    ddp = estimate(model, units, replace(setup, strategy="ddp"), activation_bytes)
    fsdp = estimate(model, units, replace(setup, strategy="fsdp", zero=False), activation_bytes)
    return ddp, fsdp


def verdict(strategy: str, ddp: MemoryEstimate, fsdp: MemoryEstimate, capacity: int) -> str:
    """FITS: the chosen strategy's total fits ``capacity``; USE_FSDP: ddp was chosen and does not fit, fsdp
    would; NONE_FITS: neither does."""
    chosen = fsdp if strategy == "fsdp" else ddp
    if chosen.total <= capacity:
        return FITS
    if strategy != "fsdp" and fsdp.total <= capacity:
        return USE_FSDP
    return NONE_FITS


def require_fits(strategy: str, ddp: MemoryEstimate, fsdp: MemoryEstimate, capacity: int) -> None:
    """Refuse a ddp run that cannot fit the device where fsdp would.

    Raises:
        DoesNotFit: naming train.strategy, its value and ``--train.strategy fsdp``.
    """
    if verdict(strategy, ddp, fsdp, capacity) != USE_FSDP:
        return
    mib = 2**20
    raise DoesNotFit(
        f"train.strategy={strategy!r} needs about {ddp.total / mib:.0f} MiB per device (parameters, gradients, "
        f"optimizer state and activations of one micro-batch), more than the {capacity / mib:.0f} MiB this "
        f"device has for each process; sharded over {fsdp.shards} processes ({fsdp.label}) it needs "
        f"{fsdp.total / mib:.0f} MiB.\n{ddp.table(fsdp)}",
        "--train.strategy fsdp (docs/sharding.md); an estimate you know to be wrong: --doctor.enabled false.",
        setting="train.strategy",
        value=strategy,
        need_bytes=ddp.total,
        capacity_bytes=capacity,
    )


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_limit_files(proc_cgroup: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The memory-limit files of this process's cgroup and of each cgroup above it, cgroup v2 and v1, from the text
    of /proc/self/cgroup: a Slurm step or a Kubernetes pod sets its limit on a cgroup below the mount's root, and a
    limit anywhere above the process bounds it. Under a cgroup namespace the process's path is ``/``."""
    files: list[Path] = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part]
        files += [base.joinpath(*parts[:depth], name) for depth in range(len(parts), -1, -1)]
    return files


def host_memory_bytes(meminfo: str, cgroup_limits: list[str]) -> int:
    """What a CPU run's processes may share: MemTotal of ``meminfo`` (/proc/meminfo's text), bounded by the smallest
    of ``cgroup_limits`` (the limit files' texts: a byte count, or ``max`` for none).

    The total, not MemAvailable: available memory is a moment's reading on a shared host (page cache, another
    job's peak), and a run that fits the host must not be refused because something else held memory just then.
    """
    total = 0
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
    for text in cgroup_limits:
        if text.strip().isdigit() and (total == 0 or int(text) < total):  # v1 writes "no limit" as a huge number
            total = int(text)
    return total


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _host_memory() -> int:
    files = cgroup_limit_files(_read(Path("/proc/self/cgroup")) or "")
    limits = [text for text in map(_read, files) if text is not None]
    found = host_memory_bytes(_read(Path("/proc/meminfo")) or "", limits)
    if found == 0:
        found = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return found


def capacity_bytes(device: torch.device, local_world_size: int) -> int:
    """What one process may use: its GPU's free memory, or the node's memory (job.parallel.memory.host_memory_bytes)
    shared by its processes."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return _host_memory() // max(local_world_size, 1)


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's own storage of each tensor (a DTensor's local chunk), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def measured_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: nn.Module | None = None) -> dict[str, int]:
    """What this rank holds of the state the estimate counts, after an optimizer step: parameters and buffers,
    gradients, optimizer state tensors (0-d step counts included) and the EMA copy, in bytes of local storage."""
    params = list(model.parameters())
    optim = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {
        "parameters": _local_bytes([*params, *model.buffers()]),
        "gradients": _local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _local_bytes(optim),
        "ema": 0,
    }
    if ema is not None:
        out["ema"] = _local_bytes([*ema.parameters(), *ema.buffers()])
    out["state"] = sum(out.values())
    return out
