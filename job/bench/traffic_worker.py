"""One torchrun worker of ``job/bench/traffic.py``: a model of equal blocks trained under ddp, fsdp or hsdp with
ddp-job's own sharding (job.parallel.fsdp.shard on the mesh of job.parallel.fsdp.mesh_shape), the bytes this
rank sends per optimizer step counted by the kernel and split by link class.

    torchrun ... -m job.bench.traffic_worker --out DIR [--strategies ddp,fsdp,hsdp] [--width 1024] [--steps 4]

A socket whose two ends have the same address stays inside the node (loopback, or the node's own address); any
other crosses to another node. Bytes are TCP payload acked (``job.bench.sync_worker.tcp_bytes``' counter, per
socket), read after a warm-up step and after ``--steps`` more, each read behind a barrier. Every rank writes
``<strategy>/rank<R>.json`` into ``--out``: its sent bytes by class, its node, the model's parameter bytes and the state it
holds (job.parallel.memory.measured_state).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from job.bench.sync_worker import BYTES_ACKED_AT, TCP_INFO_LEN
from job.bench.traffic import padded_bytes
from job.config import JobConfig
from job.config.schema import FsdpConfig
from job.parallel import fsdp, memory

STRATEGIES = ("ddp", "fsdp", "hsdp")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def sent_by_link() -> dict[str, int]:
    """Payload bytes acked on this process's open TCP sockets: ``node`` (both ends one address) and ``cross``."""
    out = {"node": 0, "cross": 0}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # closed meanwhile, or not an inet socket
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            try:
                here, there = s.getsockname()[0], s.getpeername()[0]
            except OSError:  # a listening socket has no peer
                continue
            acked = struct.unpack_from(
                "Q", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN), BYTES_ACKED_AT
            )[0]
            key = "node"
            if here != there:
                key = "cross"
            out[key] += acked
    return out


def mesh(strategy: str, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(replicate, shard): ddp replicates over every rank; fsdp is one shard group of every rank; hsdp the job's
    default mesh (shard within a node, replicate across nodes)."""
    if strategy == "ddp":
        return world_size, 1
    if strategy == "fsdp":
        return 1, world_size
    return fsdp.mesh_shape(FsdpConfig(), world_size, local_world_size)


def wrap(model: nn.Module, shape: tuple[int, int]) -> nn.Module:
    if shape[1] == 1:
        return DDP(model)
    cfg = JobConfig(fsdp=FsdpConfig(units=("Block",)))
    return fsdp.shard(model, cfg, None, torch.device("cpu"), shape)


def measure(a: argparse.Namespace, strategy: str) -> dict[str, Any]:
    """One strategy: a fresh model, a warm-up step, then ``a.steps`` counted ones; this rank's record."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    raw = nn.Sequential(*(Block(a.width) for _ in range(a.blocks)))
    shape = mesh(strategy, world_size, local_world_size)
    param_bytes = padded_bytes([tuple(q.shape) for q in raw.parameters()], 4, shape[1])
    model = wrap(raw, shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, a.width, generator=torch.Generator().manual_seed(rank))
    marks = []
    for step in range(1 + a.steps):
        if step == 1:
            dist.barrier()
            marks.append(sent_by_link())
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    dist.barrier()  # every peer's segments acked before the count ends (a barrier adds a few bytes)
    marks.append(sent_by_link())
    return {
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "strategy": strategy,
        "shape": shape,
        "label": f"{strategy} {shape[0]}x{shape[1]}",
        "local_world_size": local_world_size,
        "steps": a.steps,
        "param_bytes": param_bytes,
        "sent": {k: marks[1][k] - marks[0][k] for k in marks[0]},
        "state": memory.measured_state(model, opt),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, measured in this order")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for strategy in a.strategies.split(","):
        record = measure(a, strategy)
        (a.out / strategy).mkdir(parents=True, exist_ok=True)
        (a.out / strategy / f"rank{record['rank']}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
