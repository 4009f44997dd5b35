"""Checkpoint stall: how long training is blocked per checkpoint by job.checkpoint.store.CheckpointManager,
synchronous and asynchronous, vs a plain ``torch.save`` of the same state (model + SGD momentum state).

Blocked time = the duration of ``manager.save(...)`` on the training thread: sync writes, fsyncs and
hashes the file there; async only copies the state to host memory and hands it to a writer thread. The
background write is waited for (untimed) before the next repetition. Variants are interleaved per
repetition. Goal: async <= 0.10x plain torch.save.

    ddp-job bench checkpoint [--quick] [--model resnet50] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from job.bench import common


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", default=None, help="torchvision model (default resnet50; quick resnet18)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    a = p.parse_args(argv)
    model_name, reps = a.model or ("mobilenet_v3_small" if a.quick else "resnet50"), a.reps or (2 if a.quick else 5)

    import torch
    import torchvision

    from job.checkpoint.snapshot import HostStaging, to_host
    from job.checkpoint.store import CheckpointManager

    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, weights=None, num_classes=1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()  # fills the momentum buffers: the optimizer state is as large as the model

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": {"step": 1}}

    nbytes = sum(
        t.numel() * t.element_size()
        for t in [*model.state_dict().values()]
        + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    )
    # The floors of the async stall, nothing written: "fresh host copy" allocates (to_host, what sync saves
    # use), "reused host buffers" copies into buffers kept between saves (HostStaging, what async saves use).
    times: dict[str, list[float]] = {
        "torch.save": [],
        "sync": [],
        "async": [],
        "fresh host copy": [],
        "reused host buffers": [],
    }
    staging = HostStaging()
    staging.snapshot(state())  # allocated once, as the trainer's first async save does
    write_s: list[float] = []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        root = Path(d)
        managers = {
            k: CheckpointManager(root / k, keep_last=1, async_save=k == "async", is_main=True)
            for k in ("sync", "async")
        }
        # Untimed first async save: it allocates the reused buffers once per run (steady state is timed).
        managers["async"].save(0, state, {"world_size": 1})
        managers["async"].wait()
        step = 0
        for rep in range(reps):
            order = list(times)
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for kind in order:
                step += 1
                t0 = time.perf_counter()
                if kind == "torch.save":
                    torch.save(state(), root / f"plain-{step}.pt")
                elif kind == "fresh host copy":
                    to_host(state())
                elif kind == "reused host buffers":
                    staging.snapshot(state())
                else:
                    managers[kind].save(step, state, {"world_size": 1})
                times[kind].append(time.perf_counter() - t0)
                if kind == "async":
                    managers[kind].wait()  # untimed for the stall; the full write time is recorded apart
                    write_s.append(time.perf_counter() - t0)
                if kind == "torch.save":
                    os.remove(root / f"plain-{step}.pt")
    stats = {k: common.median_spread(v) for k, v in times.items()}
    base = stats["torch.save"]["median"]
    ratios = {k: stats[k]["median"] / base for k in ("sync", "async")}
    per_rep = {
        k: common.median_spread(x / b for x, b in zip(times[k], times["torch.save"]))
        for k in times
        if k != "torch.save"
    }
    rows = [
        [
            k,
            common.fmt_ms(s, 1000, " ms"),
            f"{s['median'] / base:.3f}",
            f"{per_rep[k]['min']:.3f}-{per_rep[k]['max']:.3f}" if k in per_rep else "",
        ]
        for k, s in stats.items()
    ]
    rows.append(["async (whole write, background)", common.fmt_ms(common.median_spread(write_s), 1000, " ms"), "", ""])
    common.table(
        f"checkpoint stall: {model_name} + SGD momentum, {nbytes / 2**20:.0f} MiB of tensors, {reps} interleaved reps",
        ["variant", "blocked time median [min-max]", "x torch.save", "per-rep ratio range"],
        rows,
    )
    goal = per_rep["async"]["median"] <= 0.10
    print(f"goal async <= 0.10x torch.save: {'met' if goal else 'MISSED'} ({per_rep['async']['median']:.3f}x)")
    common.emit(
        "checkpoint",
        {
            "quick": a.quick,
            "model": model_name,
            "state_bytes": nbytes,
            "reps": reps,
            "blocked_s": stats,
            "async_write_s": common.median_spread(write_s),
            "ratio_of_medians": ratios,
            "ratio_per_rep": per_rep,
            "goal_async_le_0_10": goal,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
