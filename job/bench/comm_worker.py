"""Worker of the communication benchmark (run under torchrun, gloo/nccl).

Counts gradient all-reduce calls and bytes per optimizer step with gradient accumulation 1, 2, 4 through
job.parallel.ddp.CommCounter (the trainer's own counting comm hook, ``ddp.comm_stats``) wrapped around a
byte-counting all-reduce, and times DDP steps with and without ``no_sync`` (interleaved, rank 0 writes JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from job.parallel.ddp import CommCounter


class Bytes:
    """Inner hook: the plain fp32 all-reduce, counting the bytes of every bucket it sends."""

    def __init__(self) -> None:
        self.total = 0

    def hook(self):  # type: ignore[no-untyped-def]
        def byte_counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            self.total += buf.numel() * buf.element_size()
            return default_hooks.allreduce_hook(state, bucket)

        return byte_counting_allreduce


def build(model: str, device: torch.device, bucket_mb: float) -> tuple[torch.nn.Module, DDP]:
    torch.manual_seed(0)
    raw = torchvision.models.get_model(model, weights=None, num_classes=10).to(device)
    return raw, DDP(raw, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per accumulation setting")
    p.add_argument("--accum", default="1,2,4")
    p.add_argument("--timed", type=int, default=6, help="timed iterations each of sync / no_sync")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    x = torch.randn(a.micro, 3, a.image_size, a.image_size, device=device)
    y = torch.randint(0, 10, (a.micro,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    counts: dict[str, dict] = {}
    raw = None
    for accum in (int(s) for s in a.accum.split(",")):
        raw, model = build(a.model, device, a.bucket_mb)
        counter, nbytes = CommCounter(), Bytes()
        model.register_comm_hook(None, counter.hook(nbytes.hook(), None))
        opt = torch.optim.SGD(raw.parameters(), lr=0.01, momentum=0.9)
        calls, sent = [], []
        for _ in range(a.steps):
            c0, b0 = counter.calls, nbytes.total
            for micro in range(accum):
                sync = contextlib.nullcontext() if micro == accum - 1 else model.no_sync()
                with sync:
                    (loss_fn(model(x), y) / accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            calls.append(counter.calls - c0)
            sent.append(nbytes.total - b0)
        counts[str(accum)] = {"calls_per_step": calls, "bytes_per_step": sent, "buckets": len(counter.buckets)}
    assert raw is not None
    grad_bytes = sum(q.numel() * q.element_size() for q in raw.parameters() if q.requires_grad)

    # Exposed communication: the same forward+backward with the all-reduce (DDP) and without (no_sync).
    raw, model = build(a.model, device, a.bucket_mb)
    t: dict[str, list[float]] = {"sync": [], "no_sync": []}
    for i in range(2 + a.timed * 2):
        kind = "sync" if i % 2 == 0 else "no_sync"
        ctx = contextlib.nullcontext() if kind == "sync" else model.no_sync()
        dist.barrier()
        t0 = time.perf_counter()
        with ctx:
            loss_fn(model(x), y).backward()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        raw.zero_grad(set_to_none=True)
        if i >= 2:  # the first pair is warm-up (bucket rebuild, allocator)
            t[kind].append(dt)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "world_size": dist.get_world_size(),
                    "grad_bytes": grad_bytes,
                    "params": sum(q.numel() for q in raw.parameters()),
                    "counts": counts,
                    "times": t,
                    "median_sync_s": statistics.median(t["sync"]),
                    "median_no_sync_s": statistics.median(t["no_sync"]),
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
