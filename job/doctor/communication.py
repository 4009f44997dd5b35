"""Phase 3 of the doctor: an all-reduce checked for correctness on the training backend and device, then
(``ddp-job doctor`` only) timed over ``doctor.comm_sizes_kb`` with algorithm and bus bandwidth as nccl-tests
define them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from job.doctor.checks import FAIL, PASS, Check
from job.parallel import distributed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def comm_checks(
    rt: distributed.Runtime, world: int, rank: int, full: bool, sizes_kb: Sequence[int], iters: int
) -> list[Check]:
    """Phase 3 on the training backend and device: correctness, then timed sizes (nccl-tests definitions)."""
    device = rt.device
    x = torch.arange(1024, dtype=torch.float32, device=device) * (rank + 1)
    dist.all_reduce(x)
    expected = torch.arange(1024, dtype=torch.float32, device=device) * (world * (world + 1) // 2)
    bad = int((x != expected).sum())
    flags = torch.tensor([bad], dtype=torch.int64)
    dist.all_reduce(flags, group=rt.control_group)
    if int(flags) or bad:
        return [
            Check(
                "communication.allreduce",
                FAIL,
                f"all-reduce ({rt.backend}) returned {int(flags)} wrong values (first: {x[:3].tolist()})",
                "check the interconnect (NCCL_DEBUG=INFO, NCCL_IB_DISABLE / NCCL_SOCKET_IFNAME)",
            )
        ]
    out = [Check("communication.allreduce", PASS, f"all-reduce on {rt.backend} across {world} rank(s) correct")]
    if not full:
        return out
    rows, mine = [], []
    for kb in sizes_kb:
        t = torch.ones(max(1, kb * 1024 // 4), dtype=torch.float32, device=device)
        dist.all_reduce(t)  # warm-up: connection set-up and allocation are not bandwidth
        _sync(device)
        distributed.barrier(rt)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        _sync(device)
        mine.append((time.perf_counter() - t0) / iters)
    times = torch.tensor(mine, dtype=torch.float64)
    gathered = [torch.zeros_like(times) for _ in range(world)]
    dist.all_gather(gathered, times, group=rt.control_group)
    per_rank = torch.stack(gathered)  # [rank, size]
    factor = 2 * (world - 1) / world
    for i, kb in enumerate(sizes_kb):
        sec = float(per_rank[:, i].max())  # the collective is as slow as its slowest rank
        algbw = kb * 1024 / sec / 1e9
        rows.append({"size_bytes": kb * 1024, "time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor})
    total = per_rank.sum(dim=1)
    slow = int(total.argmax())
    best = max(rows, key=lambda r: r["busbw_GBps"])
    detail = (
        f"peak busbw {best['busbw_GBps']:.3f} GB/s (algbw {best['algbw_GBps']:.3f}) at {best['size_bytes'] // 1024} KiB; "
        f"slowest rank {slow} ({float(total[slow]) * 1e3:.1f} ms vs median {statistics.median(total.tolist()) * 1e3:.1f} ms)"
    )
    out.append(
        Check(
            "communication.bandwidth",
            PASS,
            detail,
            data={"rows": rows, "slowest_rank": slow, "per_rank_total_s": total.tolist(), "backend": rt.backend},
        )
    )
    return out
