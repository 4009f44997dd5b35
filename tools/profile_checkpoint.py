"""Profile of one CheckpointManager save, async and sync (cProfile), and the cost of a fresh host snapshot
vs copying into reused buffers: where the checkpoint stall goes (docs/benchmarks.md section 4).

    python tools/profile_checkpoint.py
"""

import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch
import torchvision

from job.checkpoint.store import CheckpointManager, to_host

torch.manual_seed(0)
m = torchvision.models.resnet50(num_classes=1000)
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
m(torch.randn(2, 3, 32, 32)).sum().backward()
opt.step()
st = lambda: {"model": m.state_dict(), "optimizer": opt.state_dict()}
with tempfile.TemporaryDirectory() as d:
    for kind in ("async", "sync"):
        mgr = CheckpointManager(Path(d) / kind, 1, kind == "async", True)
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
    # preallocated buffer copy vs fresh allocation
    sd = st()
    flat = [t for t in m.state_dict().values()] + [v["momentum_buffer"] for v in opt.state_dict()["state"].values()]
    bufs = [t.clone() for t in flat]
    for name, f in (
        ("fresh to_host", lambda: to_host(st())),
        ("copy_ into reused buffers", lambda: [b.copy_(t) for b, t in zip(bufs, flat)]),
    ):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        print(name, [round(x, 3) for x in ts])
    ts = []
    for i in range(3):
        t0 = time.perf_counter()
        torch.save(st(), Path(d) / f"p{i}.pt")
        ts.append(time.perf_counter() - t0)
    print("torch.save", [round(x, 3) for x in ts])
