"""Storage I/O per rank of a sharded checkpoint's save and resume, measured at every pair of world sizes.

For each save size W_save: W_save processes (torchrun, gloo) save a model of 4 square linear layers with AdamW
(model and two moments: 12 bytes per parameter) through job.checkpoint.store with ckpt.keep_last 1, once to pay
DCP's lazy imports, then twice measured (each prunes the one before). For each load size W_load, W_load processes
load the newest checkpoint as a resume does: preflight's choice (``find_latest`` by sizes), the ranks' agreement
and hash check of the files not verified as read (``settle``), state.pt, and the shards (``Sharded.load``).

Per rank and window: bytes read and written by its syscalls (``rchar``/``wchar`` of /proc/self/io: page-cache hits
count, since a resume on another node reads from storage what this machine may hold cached; gloo's messages go
through recv/send and are not counted), and its file-system calls counted by strace (files opened, and metadata
operations: open, stat, directory listing, mkdir, rename, unlink, fsync), between two markers the worker leaves.

The projection column is ``predicted``: what a resume reads in all by the model of docs/benchmarks.md, from the
checkpoint's own file sizes: every stored item once, plus per loading rank the manifest (preflight), plus on rank 0
alone DCP's ``.metadata``, the item digests and state.pt (sent to the others), plus state.pt once more for the
ranks' hash check.

    python tools/ckpt_io.py [--sizes 1 2 4 8] [--width 512] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

WORKER = "--worker"
BEGIN, END = "/ckpt-io-window-begin", "/ckpt-io-window-end"
OPENS = ("open", "openat")
METADATA_CALLS = (
    *OPENS,
    *("stat", "lstat", "newfstatat", "statx", "getdents64", "mkdir", "mkdirat"),
    *("rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "fsync", "fdatasync"),
)
TRACED = ",".join((*METADATA_CALLS, "access", "faccessat", "faccessat2"))


def io_counters() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["rchar"]), "written": int(fields["wchar"])}


class Window:
    """Bytes read and written by this process between ``with`` and its end; strace sees the markers."""

    def __enter__(self) -> Window:
        os.access(BEGIN, os.F_OK)
        self.before = io_counters()
        return self

    def __exit__(self, *exc: object) -> None:
        after = io_counters()
        os.access(END, os.F_OK)
        self.bytes = {k: after[k] - self.before[k] for k in after}


def build(width: int, seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def save(run_dir: Path, width: int, rank: int) -> list[dict[str, int]]:
    import torch.distributed as dist

    from job.checkpoint import store
    from job.checkpoint.sharded import Sharded

    model, optimizer = build(width, 0)
    manager = store.CheckpointManager(run_dir, 1, False, rank == 0, sharded=Sharded(model, optimizer, rank))
    meta = {"world_size": dist.get_world_size()}
    manager.save(1, lambda: {"trainer": {"step": 1}}, meta)  # DCP's lazy imports, read once per process
    windows = []
    for step in (2, 3):
        dist.barrier()
        with Window() as w:
            manager.save(step, lambda s=step: {"trainer": {"step": s}}, meta)
        windows.append(w.bytes)
    return windows


def load(run_dir: Path, width: int, rank: int) -> list[dict[str, int]]:
    import torch.distributed as dist

    from job.checkpoint import store
    from job.checkpoint.resume import settle
    from job.checkpoint.sharded import Sharded

    model, optimizer = build(width, 1)
    sharded = Sharded(model, optimizer, rank)
    warm = store.find_latest(run_dir, hashes=False)
    assert warm is not None
    sharded.load(warm.path, {}, warm.manifest["files"])  # lazy imports, as in the save
    dist.barrier()
    with Window() as w:
        found = store.find_latest(run_dir, hashes=False)
        found = settle(found, run_dir, rank, dist.get_world_size())
        saved = store.load_state_shared(found)
        sharded.load(found.path, saved, found.manifest["files"])
    return [w.bytes]


def worker(mode: str, run_dir: Path, width: int, out: Path) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    windows = save(run_dir, width, rank) if mode == "save" else load(run_dir, width, rank)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "windows": windows}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def calls_in_windows(trace: Path) -> list[Counter[str]]:
    """Each window's file-system calls in one rank's strace log (every thread of the process: ``-f``)."""
    windows: list[Counter[str]] = []
    inside = False
    for line in trace.read_text(errors="replace").splitlines():
        if BEGIN in line:
            inside = True
            windows.append(Counter())
        elif END in line:
            inside = False
        elif inside and (m := re.match(r"^\d+\s+(\w+)\(", line)) and m.group(1) in METADATA_CALLS:
            windows[-1][m.group(1)] += 1
    return windows


def launch(nproc: int, mode: str, run_dir: Path, width: int, out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    tool = Path(__file__).resolve()
    inner = (
        f'exec strace -f -qq -e trace={TRACED} -o "$0/strace-$RANK" "{sys.executable}" "{tool}" {WORKER} '
        f'{mode} "{run_dir}" {width} "$0"'
    )
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["--no-python", "bash", "-c", inner, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{mode} at {nproc} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    ranks = []
    for rank in range(nproc):
        report = json.loads((out / f"rank{rank}.json").read_text())
        calls = calls_in_windows(out / f"strace-{rank}")
        for window, counted in zip(report["windows"], calls, strict=True):
            window["opens"] = sum(counted[c] for c in OPENS)
            window["metadata_ops"] = sum(counted.values())
        ranks.append(report)
    return ranks


def checkpoint_bytes(run_dir: Path) -> int:
    steps = sorted(run_dir.glob("step-*"))
    files = json.loads((steps[-1] / "manifest.json").read_text())["files"]
    return sum(int(entry["size"]) for entry in files.values())


def parts(run_dir: Path) -> dict[str, int]:
    """The newest checkpoint's sizes that the model of its reads needs."""
    step = sorted(run_dir.glob("step-*"))[-1]
    files = json.loads((step / "manifest.json").read_text())["files"]
    digests = json.loads((step / "items.json").read_text())
    items = [item for per_file in digests.values() for item in per_file.values()]
    return {
        "items": sum(int(length) for length, _ in items),
        "item_count": len(items),
        "manifest": (step / "manifest.json").stat().st_size,
        "metadata": int(files["shards/.metadata"]["size"]),
        "digests": int(files["items.json"]["size"]),
        "state": int(files["state.pt"]["size"]),
    }


def predicted(sizes: dict[str, int], w_load: int) -> int:
    """Bytes a resume at ``w_load`` processes reads in all: each item once; per rank the manifest (preflight); rank 0
    alone ``.metadata``, the item digests and state.pt; state.pt once more (the ranks' hash check)."""
    rank0 = sizes["metadata"] + sizes["digests"] + 2 * sizes["state"]
    return sizes["items"] + w_load * sizes["manifest"] + rank0


def measure(sizes: list[int], width: int, work: Path) -> list[dict[str, Any]]:
    rows = []
    for w_save in sizes:
        run_dir = work / f"run-{w_save}"
        saved = launch(w_save, "save", run_dir, width, work / f"save-{w_save}")
        size, split = checkpoint_bytes(run_dir), parts(run_dir)
        rows.append({"phase": "save", "w_save": w_save, "w_load": None, "bytes": size, "ranks": saved, **split})
        for w_load in sizes:
            loaded = launch(w_load, "load", run_dir, width, work / f"load-{w_save}-{w_load}")
            row = {"phase": "resume", "w_save": w_save, "w_load": w_load, "bytes": size, "ranks": loaded, **split}
            rows.append(row | {"predicted": predicted(split, w_load)})
        shutil.rmtree(run_dir)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| phase | W save | W load | checkpoint MiB | read / checkpoint (all ranks) | read per rank KiB: max (rank 0) "
        "| written per rank KiB: max (rank 0) | files opened per rank: max (rank 0) | metadata ops per rank: max "
        "(rank 0) | predicted / checkpoint |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        per = len(row["ranks"][0]["windows"])  # saves: 2 windows, averaged
        total = sum(w["read"] for r in row["ranks"] for w in r["windows"]) / per / row["bytes"]
        load = row["w_load"] if row["w_load"] is not None else "-"
        cells = [_cell(row, "read", 1024), _cell(row, "written", 1024), _cell(row, "opens"), _cell(row, "metadata_ops")]
        projected = ""
        if "predicted" in row:
            projected = f"{row['predicted'] / row['bytes']:.3f}"
        lines.append(
            f"| {row['phase']} | {row['w_save']} | {load} | {row['bytes'] / 2**20:.1f} | {total:.3f} "
            f"| {' | '.join(cells)} | {projected} |"
        )
    return "\n".join(lines)


def _cell(row: dict[str, Any], key: str, scale: float = 1.0) -> str:
    """The largest value of any rank's window, and rank 0's mean over its windows."""
    top = max(w[key] for r in row["ranks"] for w in r["windows"]) / scale
    rank0 = row["ranks"][0]["windows"]
    first = sum(w[key] for w in rank0) / len(rank0) / scale
    return f"{top:.0f} ({first:.0f})"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        sys.exit(worker(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--width", type=int, default=512, help="the layers' width (4 layers)")
    parser.add_argument("--out", type=Path, help="keep the reports and traces here (default: a temporary directory)")
    args = parser.parse_args()
    if shutil.which("strace") is None:
        sys.exit("strace is needed to count file-system calls (apt-get install strace)")
    with tempfile.TemporaryDirectory() as tmp:
        work = (args.out or Path(tmp)).resolve()
        rows = measure(args.sizes, args.width, work)
        (work / "ckpt_io.json").write_text(json.dumps(rows, indent=1))
        print(table(rows))


if __name__ == "__main__":
    main()
