"""Run under real torchrun (gloo) by tests/test_ckpt_io.py: what a rank reads from storage while it saves and while it
loads a sharded checkpoint (``rchar`` of /proc/self/io: every byte its read syscalls returned, page-cache hits
included, since a resume on another node reads from storage what this machine holds cached).

    ckpt_io_worker.py save RUN_DIR OUT   4 saves of a small model with AdamW (keep_last 2: pruning deletes), sync then
                                         async, after a first save that pays DCP's lazy imports; rank 0 also writes
                                         the model and optimizer as whole tensors to OUT/expected.pt
    ckpt_io_worker.py load CKPT... OUT   each checkpoint loaded at this world size into a model built with another
                                         seed as a resume does (state.pt, then the shards); a corrupt one is
                                         refused with CorruptCheckpointError; the files of each that the rank
                                         opened are listed
Each rank writes OUT/<mode>-rank<N>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from job.checkpoint import store
from job.checkpoint.sharded import Sharded
from job.errors import CorruptCheckpointError


def rchar() -> int:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(384, 384) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 384)).square().mean().backward()  # the moments exist, as after a training step
    optimizer.step()
    return model, optimizer


def save(run_dir: Path, out: Path, rank: int) -> dict[str, Any]:
    model, optimizer = build(0)
    sharded = Sharded(model, optimizer, rank)
    sync = store.CheckpointManager(run_dir, 2, False, rank == 0, sharded=sharded)

    def state() -> dict[str, Any]:
        return {"trainer": {"step": 1}}

    sync.save(1, state, {"world_size": dist.get_world_size()})  # DCP's first use reads its lazy imports
    before = rchar()
    for step in (2, 3):
        sync.save(step, state, {"world_size": dist.get_world_size()})
    background = store.CheckpointManager(run_dir, 2, True, rank == 0, sharded=sharded)
    for step in (4, 5):
        background.save(step, state, {"world_size": dist.get_world_size()})
    background.wait()
    dist.barrier()
    read = rchar() - before
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, out / "expected.pt")
    return {"saves": 4, "rchar": read}


OPENED: list[str] = []
"""Every file this process opened through Python (the audit hook's ``open`` event: open(), Path.open, torch.load and
DCP's reader all go through it)."""


def _record_opens(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        OPENED.append(os.fspath(args[0]))


def opened_in(path: Path, since: int) -> list[str]:
    """The files of the checkpoint at ``path`` this process opened after the ``since``-th open, by name inside it."""
    inside = [Path(p) for p in OPENED[since:] if Path(p).is_relative_to(path)]
    return sorted(p.relative_to(path).as_posix() for p in inside)


def load(paths: list[Path], out: Path, rank: int) -> dict[str, Any]:
    expected = torch.load(out / "expected.pt", weights_only=True)
    report: dict[str, Any] = {}
    for path in paths:
        model, optimizer = build(1)
        manifest = json.loads((path / store.MANIFEST).read_text())  # what preflight reads on every rank
        before, opens = rchar(), len(OPENED)
        try:
            saved = store.load_state_shared(store.Found(0, path, manifest))
            Sharded(model, optimizer, rank).load(path, saved, manifest["files"])
        except CorruptCheckpointError as e:
            report[path.name] = {"corrupt": e.found, "rchar": rchar() - before}
            continue
        read = rchar() - before
        report[path.name] = {"opened": opened_in(path, opens), "step": saved["trainer"]["step"]}
        same = all(torch.equal(v, expected["model"][k]) for k, v in model.state_dict().items())
        moments = optimizer.state_dict()["state"]
        same_adam = all(
            torch.equal(s["exp_avg"], expected["optimizer"]["state"][i]["exp_avg"]) for i, s in moments.items()
        )
        report[path.name] |= {"rchar": read, "model_equal": same, "adam_equal": same_adam}
    return report


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[-1])
    sys.addaudithook(_record_opens)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "save":
        report = save(Path(sys.argv[2]), out, rank)
    else:
        report = load([Path(p) for p in sys.argv[2:-1]], out, rank)
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps({"rank": rank, **report}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
