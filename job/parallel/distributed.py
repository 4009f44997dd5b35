"""Process groups: the only module that initialises or destroys them.

One code path for 1 and N processes: a single process still gets a (world size 1) process group on an
in-memory store, so collectives in the trainer never need an ``if distributed`` branch.

Order matters on CUDA: ``set_device(local_rank)`` before ``init_process_group`` so NCCL binds each rank
to its own GPU instead of creating contexts on GPU 0.
"""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from job.cluster.env import DistEnv
from job.config import DistConfig
from job.errors import BadInput


@dataclass(frozen=True)
class Runtime:
    """What setup() produced: the device, the backend, and a CPU (gloo) group for control messages."""

    device: torch.device
    backend: str
    control_group: dist.ProcessGroup | None
    """gloo group for tiny host-side agreements (stop flag, straggler stats) that must not sync the GPU stream."""


def pick_backend(cfg: DistConfig, cuda_available: bool) -> str:
    if cfg.backend == "auto":
        return "nccl" if cuda_available else "gloo"
    if cfg.backend == "nccl" and not cuda_available:
        raise BadInput(
            "dist.backend='nccl' but no CUDA device is visible.",
            "use --dist.backend gloo (or auto) on CPU.",
            setting="dist.backend",
            value="nccl",
        )
    return cfg.backend


def pick_device(env: DistEnv, backend: str) -> torch.device:
    if backend != "nccl" and not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if env.local_rank < count:
        return torch.device("cuda", env.local_rank)
    if count == 1:
        # The launcher gave each task exactly one GPU (CUDA_VISIBLE_DEVICES per task: submitit's default,
        # pyxis, Kubernetes device plugin with one GPU per container).
        return torch.device("cuda", 0)
    raise BadInput(
        f"LOCAL_RANK={env.local_rank} but only {count} CUDA devices are visible.",
        f"start at most {count} processes per node (--dist.nproc-per-node / --nproc-per-node).",
        setting="LOCAL_RANK",
        value=env.local_rank,
    )


FLIGHT_RECORDER_ENTRIES = "2000"
"""The NCCL flight recorder's entries per rank when the environment sets none."""


def flight_recorder_env(environ: Mapping[str, str], run_dir: Path) -> dict[str, str]:
    """The NCCL flight recorder's variables this job sets where the environment leaves them unset (an explicit
    ``TORCH_FR_BUFFER_SIZE=0`` keeps it off): on a collective timeout each rank dumps its last collectives to
    ``<run_dir>/nccl_trace_rank_<rank>`` (docs/doctor.md). The buffer size goes by its current name: torch
    warns on every process group created while the old one, ``TORCH_NCCL_TRACE_BUFFER_SIZE``, is set (still
    honoured when a user sets it)."""
    defaults = {
        "TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir / "nccl_trace_rank_"),
    }
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" in environ:
        defaults.pop("TORCH_FR_BUFFER_SIZE")
    return {k: v for k, v in defaults.items() if k not in environ}


def setup(env: DistEnv, cfg: DistConfig) -> Runtime:
    """Bind the device and initialise the default process group with the init timeout."""
    backend = pick_backend(cfg, torch.cuda.is_available())
    if "OMP_NUM_THREADS" not in os.environ:
        # N processes on one CPU node each defaulting to all cores oversubscribe it several times over.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    device = pick_device(env, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.init_timeout_s)
    # Bound to its device, NCCL creates the communicator eagerly and never guesses the device from the rank.
    device_id = None
    if device.type == "cuda":
        device_id = device
    if env.launcher in ("torchrun", "env"):
        # torchrun workers share the agent's store (TORCHELASTIC_USE_AGENT_STORE); env:// knows how.
        dist.init_process_group(backend, init_method="env://", timeout=timeout, device_id=device_id)
    elif env.world_size == 1:
        store: dist.Store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, device_id=device_id)
    else:
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0, timeout=timeout
        )
        rank, world = env.rank, env.world_size
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id)
    control = None
    if backend == "nccl":
        control = cast(dist.ProcessGroup, dist.new_group(backend="gloo", timeout=timeout))
    return Runtime(device=device, backend=backend, control_group=control)


def set_train_timeout(rt: Runtime, seconds: float) -> None:
    """Shorten the collective timeout once the first step is done (rendezvous/compile are over), so a rank
    that stops participating fails the others quickly instead of after the long init timeout."""
    timeout = datetime.timedelta(seconds=seconds)
    # torch 2.11 (still the torch of some GPU images) has the setter under its private name only
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timeout)
    if rt.control_group is not None:
        set_timeout(timeout, rt.control_group)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def all_reduce_max_flag(flag: bool, rt: Runtime) -> bool:
    """True on every rank if it was True on any rank. Runs on the CPU control group (no GPU sync)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.control_group)
    return bool(t.item())


def any_flags(flags: list[bool], rt: Runtime) -> list[bool]:
    """Element-wise: True on every rank where it was True on any rank (one all-reduce on the control group)."""
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.control_group)
    return [bool(v) for v in t.tolist()]


class StepFlagVote:
    """The stop vote of one step, all-reduced while the step computes: ``start(flag)`` before the step,
    ``agreed()`` at its boundary, True on every rank if any rank's flag was set at ``start``.

    The blocking form (``all_reduce_max_flag`` at the boundary) made the ranks wait for each other twice per
    step, at the gradient all-reduce and again at the flag. Started before the step, the flag's gloo
    all-reduce completes on gloo's thread during the step, so the boundary's wait is normally zero. The price:
    a flag raised during step N is agreed at the boundary after step N + 1 (one step later).
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._flag = torch.zeros(1, dtype=torch.int32)  # the tensor the all-reduce in flight writes into
        self._work: dist.Work | None = None

    def start(self, flag: bool) -> None:
        self._flag = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.rt.control_group, async_op=True)

    def agreed(self) -> bool:
        if self._work is None:
            return False
        self._work.wait()
        self._work = None
        return bool(self._flag.item())


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over every rank (on the device group: the values stay on the device, no host
    wait); ``values`` itself where there is no process group or one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    dist.all_reduce(values)
    return values / dist.get_world_size()


def broadcast_buffers(module: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm running statistics) on every rank, in place, on the device group.

    DDP broadcasts them only at the start of a training forward, so after a step each rank holds the
    statistics of its own micro-batches. Evaluation and saving call this first: every rank evaluates the model
    rank 0 saves. Training is unchanged: the next forward would broadcast rank 0's anyway. Under fsdp, which
    broadcasts nothing, rank 0's statistics evolve from rank 0's micro-batches alone, as under DDP: broadcast
    before evaluating and saving, they are the ones evaluated and saved under both strategies.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in module.buffers():
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    with torch.no_grad():
        for buffers in groups.values():  # one broadcast per dtype, as DDP coalesces its own
            flat = _flatten_dense_tensors(buffers)
            dist.broadcast(flat, src=0)
            for buffer, value in zip(buffers, _unflatten_dense_tensors(flat, buffers), strict=True):
                buffer.copy_(value)


def broadcast_from_main(values: list[float], rt: Runtime) -> list[float]:
    """Rank 0's ``values`` on every rank (float64 on the CPU control group: no GPU sync)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(t, src=0, group=rt.control_group)
    return [float(v) for v in t.tolist()]


def barrier(rt: Runtime) -> None:
    dist.barrier(group=rt.control_group)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
