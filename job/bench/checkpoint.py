"""Checkpoint stall: how long training is blocked per checkpoint by job.checkpoint.store.CheckpointManager,
synchronous and asynchronous, vs a plain ``torch.save`` of the same state (model + SGD momentum state).

Blocked time = the duration of ``manager.save(...)`` on the training thread: sync writes, fsyncs and
hashes the file there; async only copies the state to host memory and hands it to a writer thread. The
background write is waited for (untimed) before the next repetition. Variants are interleaved per
repetition. Goals: the whole-state manager's async save <= 0.10x plain torch.save; the path every training run
takes (``dcp``: each rank's shards through torch.distributed.checkpoint, job.checkpoint.sharded, here one process
on gloo, under both strategies) async <= 0.04x. The staging floors: a fresh host copy, the reused host buffers
the async saves use (job.checkpoint.snapshot.HostStaging), and torch's DefaultStager (reused buffers too).

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

    dcp_models = _dcp_models(model_name)

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
        "DefaultStager": [],
        **{f"dcp {strategy} {mode}": [] for strategy in DCP_STRATEGIES for mode in ("sync", "async")},
    }
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    on_gpu = torch.cuda.is_available()  # its pinned memory and non-blocking copies need an accelerator
    stager = DefaultStager(StagingOptions(on_gpu, False, use_async_staging=False, use_non_blocking_copy=on_gpu))
    stager.stage(state())  # its buffers, allocated once
    staging = HostStaging()
    staging.snapshot(state())  # allocated once, as the trainer's first async save does
    write_s: list[float] = []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        root = Path(d)
        managers = {
            k: CheckpointManager(root / k, keep_last=1, async_save=k == "async", is_main=True)
            for k in ("sync", "async")
        }
        managers |= _dcp_managers(dcp_models, root)
        # Untimed first saves: they allocate the reused buffers once per run, and pay DCP's lazy imports and
        # its background group (steady state is timed).
        for kind, manager in managers.items():
            manager.save(0, state if kind in ("sync", "async") else _trainer, {"world_size": 1})
            manager.wait()
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
                elif kind == "DefaultStager":
                    stager.stage(state())
                else:
                    managers[kind].save(step, state if kind in ("sync", "async") else _trainer, {"world_size": 1})
                times[kind].append(time.perf_counter() - t0)
                if kind.startswith("dcp"):
                    managers[kind].wait()  # untimed: the stall of the next save starts with the write finished
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
    worst = max(per_rep[f"dcp {strategy} async"]["median"] for strategy in DCP_STRATEGIES)
    dcp_goal = worst <= 0.04
    print(f"goal dcp async (both strategies) <= 0.04x torch.save: {'met' if dcp_goal else 'MISSED'} ({worst:.3f}x)")
    _close(dcp_models)
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
            "goal_dcp_async_le_0_04": dcp_goal,
        },
    )
    return 0


DCP_STRATEGIES = ("ddp", "fsdp")


def _trainer() -> dict[str, Any]:
    """What state.pt holds beside the shards of a DCP save (the model and optimizer are the shards)."""
    return {"trainer": {"step": 1}}


def _dcp_models(model_name: str) -> dict[str, Any]:
    """(model, SGD with momentum) per strategy, as training holds them, in a 1-process gloo group: ddp's whole
    tensors, fsdp's DTensors on a 1-rank mesh."""
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    for strategy in DCP_STRATEGIES:
        torch.manual_seed(0)
        model = torchvision.models.get_model(model_name, weights=None, num_classes=1000)
        if strategy == "fsdp":
            model = fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        opt.step()
        out[strategy] = (model, opt)
    return out


def _dcp_managers(models: dict[str, Any], root: Path) -> dict[str, Any]:
    from job.checkpoint.sharded import Sharded
    from job.checkpoint.store import CheckpointManager

    managers = {}
    for strategy, (model, opt) in models.items():
        for mode in ("sync", "async"):
            kind = f"dcp {strategy} {mode}"
            sharded = Sharded(model, opt, 0)
            managers[kind] = CheckpointManager(
                root / kind.replace(" ", "-"), keep_last=1, async_save=mode == "async", is_main=True, sharded=sharded
            )
    return managers


def _close(models: dict[str, Any]) -> None:
    import torch.distributed as dist

    models.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
