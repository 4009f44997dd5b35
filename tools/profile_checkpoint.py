"""Profile of one CheckpointManager save, async and sync (cProfile), and the cost of a fresh host snapshot
vs copying into reused buffers: where the checkpoint stall goes (docs/benchmarks.md section 4).

    python tools/profile_checkpoint.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision

from job.checkpoint.snapshot import to_host
from job.checkpoint.store import CheckpointManager


def timed(f: Callable[[], Any], n: int = 3) -> list[float]:
    """Seconds of each of ``n`` calls of ``f``, rounded to ms."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(round(time.perf_counter() - t0, 3))
    return ts


def profile_saves(d: Path, st: Callable[[], dict[str, Any]]) -> None:
    """One save of each kind under cProfile: its blocked time and the 8 costliest functions."""
    for kind in ("async", "sync"):
        mgr = CheckpointManager(d / kind, 1, kind == "async", True)
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        mgr.save(1, st, {"world_size": 1})
        pr.disable()
        print(f"== {kind} blocked {time.perf_counter() - t0:.2f} s")
        mgr.wait()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
        print(s.getvalue()[:2500])


def main() -> None:
    torch.manual_seed(0)
    m = torchvision.models.resnet50(num_classes=1000)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()

    def st() -> dict[str, Any]:
        return {"model": m.state_dict(), "optimizer": opt.state_dict()}

    with tempfile.TemporaryDirectory() as d:
        profile_saves(Path(d), st)
        # preallocated buffer copy vs fresh allocation
        flat = list(m.state_dict().values()) + [v["momentum_buffer"] for v in opt.state_dict()["state"].values()]
        bufs = [t.clone() for t in flat]
        print("fresh to_host", timed(lambda: to_host(st())))
        print("copy_ into reused buffers", timed(lambda: [b.copy_(t) for b, t in zip(bufs, flat)]))
        saves = iter(range(3))
        print("torch.save", timed(lambda: torch.save(st(), Path(d) / f"p{next(saves)}.pt")))


if __name__ == "__main__":
    main()
