"""Phase 3 of the doctor: an all-reduce checked for correctness on the training backend and device, then
(``ddp-job doctor`` only) timed over a sweep of message sizes with algorithm and bus bandwidth as nccl-tests
define them.

The sweep depends on the backend. On NCCL it runs up to 1 GiB with 5 untimed warm-up iterations: NVLink
reaches its bus bandwidth only with messages of hundreds of MiB, and the first collectives of a size pay for
connection set-up and buffer registration. On gloo (CPU) it stops at 8 MiB so that the doctor stays quick.
``doctor.comm_sizes_kb`` and ``doctor.comm_iters`` override the sizes and the timed iterations.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from job.doctor.checks import FAIL, PASS, Check
from job.observe.stopwatch import stopwatch
from job.parallel import distributed


@dataclass(frozen=True)
class Sweep:
    """The all-reduce sizes timed, the timed iterations per size and the untimed warm-up iterations before them."""

    sizes_kb: tuple[int, ...]
    iters: int
    warmup: int


SWEEPS = {
    "nccl": Sweep((4, 64, 1024, 8192, 65536, 262144, 1048576), iters=20, warmup=5),
    "gloo": Sweep((4, 64, 1024, 8192), iters=5, warmup=1),
}
"""Each backend's sweep: NCCL's is nccl-tests' default iteration counts up to 1 GiB messages."""


def sweep_for(backend: str, sizes_kb: Sequence[int], iters: int) -> Sweep:
    """The backend's sweep with the config's overrides: ``sizes_kb`` unless empty, ``iters`` unless 0."""
    base = SWEEPS.get(backend, SWEEPS["gloo"])
    sizes, timed = base.sizes_kb, base.iters
    if sizes_kb:
        sizes = tuple(sizes_kb)
    if iters:
        timed = iters
    return Sweep(sizes, timed, base.warmup)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def comm_checks(rt: distributed.Runtime, world: int, rank: int, full: bool, sweep: Sweep) -> list[Check]:
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
    mine = _time_sizes(rt, sweep)
    times = torch.tensor(mine, dtype=torch.float64)
    gathered = [torch.zeros_like(times) for _ in range(world)]
    dist.all_gather(gathered, times, group=rt.control_group)
    per_rank = [t.tolist() for t in gathered]
    out.append(bandwidth_check(sweep.sizes_kb, per_rank, rt.backend))
    return out


def _time_sizes(rt: distributed.Runtime, sweep: Sweep) -> list[float]:
    """This rank's seconds per all-reduce for each size: warm-up first, then the timed iterations on the
    device's own clock (CUDA events on a GPU, where the host only queues the collectives)."""
    device, clock = rt.device, stopwatch(rt.device)
    mine = []
    for kb in sweep.sizes_kb:
        t = torch.ones(max(1, kb * 1024 // 4), dtype=torch.float32, device=device)
        for _ in range(sweep.warmup):  # connection set-up, allocation and registration are not bandwidth
            dist.all_reduce(t)
        _sync(device)
        distributed.barrier(rt)  # every rank starts the timed loop together
        start = clock.point()
        for _ in range(sweep.iters):
            dist.all_reduce(t)
        mine.append(clock.seconds(start, clock.point()) / sweep.iters)
    return mine


def bandwidth_rows(sizes_kb: Sequence[int], per_rank: Sequence[Sequence[float]]) -> list[dict[str, Any]]:
    """nccl-tests' numbers per size from every rank's seconds per all-reduce (``per_rank[rank][size]``):
    time = the slowest rank's, algbw = bytes / time, busbw = algbw x 2(n-1)/n. One rank moves nothing between
    ranks, so its busbw is None (n/a), not 0."""
    world = len(per_rank)
    rows = []
    for i, kb in enumerate(sizes_kb):
        sec = max(r[i] for r in per_rank)  # the collective is as slow as its slowest rank
        algbw = kb * 1024 / sec / 1e9
        busbw = None
        if world > 1:
            busbw = algbw * 2 * (world - 1) / world
        rows.append({"size_bytes": kb * 1024, "time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw})
    return rows


def bandwidth_check(sizes_kb: Sequence[int], per_rank: Sequence[Sequence[float]], backend: str) -> Check:
    """The ``communication.bandwidth`` line: peak busbw and the slowest rank; on one rank, busbw n/a."""
    rows = bandwidth_rows(sizes_kb, per_rank)
    total = [sum(r) for r in per_rank]
    slow = max(range(len(total)), key=lambda r: total[r])
    data = {"rows": rows, "slowest_rank": slow, "per_rank_total_s": total, "backend": backend}
    if len(per_rank) == 1:
        best = max(rows, key=lambda r: r["algbw_GBps"])
        detail = (
            f"1 rank: busbw n/a (no communication); peak algbw {best['algbw_GBps']:.3f} GB/s "
            f"at {best['size_bytes'] // 1024} KiB (the all-reduce's local work)"
        )
        return Check("communication.bandwidth", PASS, detail, data=data)
    best = max(rows, key=lambda r: r["busbw_GBps"])
    detail = (
        f"peak busbw {best['busbw_GBps']:.3f} GB/s (algbw {best['algbw_GBps']:.3f}) at {best['size_bytes'] // 1024} KiB; "
        f"slowest rank {slow} ({total[slow] * 1e3:.1f} ms vs median {statistics.median(total) * 1e3:.1f} ms)"
    )
    return Check("communication.bandwidth", PASS, detail, data=data)
