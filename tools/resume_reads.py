"""Bytes read from storage by a resume, summed over every rank, as a multiple of the checkpoint's size on disk.

A 2-process run of the causal language model (AdamW and an EMA: model, two moments and the average, 16 bytes per
parameter) saves step 1 under each strategy; that checkpoint is then resumed at 1, 2 and 4 processes under the same
strategy. Each rank reports what its process read through read syscalls (``rchar`` of /proc/self/io: page-cache
hits count, since a resume on another node reads from storage what this machine may hold cached) in three windows:
preflight's choice of the checkpoint (``find_resume``), the ranks' shared hash check (``settle_resume``) and the load
(``Checkpointer.restore``). ``read_bytes`` (what reached the block device) is reported beside it; on a machine that
just wrote the checkpoint it is near 0, which is why ``rchar`` is the measure.

    python tools/resume_reads.py [--procs 1 2 4] [--strategies ddp fsdp] [--n-embd 256] [--out DIR]

A windows's function missing from the job being measured (an earlier version, through PYTHONPATH) is skipped.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER = "--worker"


def io_counters() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"])}


def measured(name: str, f: Callable[..., Any], totals: dict[str, dict[str, int]]) -> Callable[..., Any]:
    """``f`` adding what this process reads during each call to ``totals[name]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = io_counters()
        try:
            return f(*args, **kwargs)
        finally:
            after = io_counters()
            window = totals.setdefault(name, {"rchar": 0, "read_bytes": 0})
            for key in window:
                window[key] += after[key] - before[key]

    return wrapper


def warm_up(tmp: Path) -> None:
    """A tiny DCP save and load in this process: what the first use of DCP reads once per process (lazy imports,
    the installed packages' metadata scanned for plugins; about 6 MB here) is not counted as the checkpoint's."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"t": torch.zeros(2)}, checkpoint_id=tmp, no_dist=True)
    dcp.load({"t": torch.zeros(2)}, checkpoint_id=tmp, no_dist=True)
    torch.save({"t": torch.zeros(2)}, tmp / "t.pt")
    torch.load(tmp / "t.pt", weights_only=True)


def worker(out: Path, argv: list[str]) -> int:
    """One rank of the resumed run: ``ddp-job train ARGV`` with the three windows measured."""
    from job.checkpoint.checkpointer import Checkpointer
    from job.train import run

    rank = int(os.environ.get("RANK", "0"))
    warm_up(out / f"warm-up-{rank}")
    totals: dict[str, dict[str, int]] = {}
    for name in ("find_resume", "settle_resume"):
        if hasattr(run, name):
            setattr(run, name, measured(name, getattr(run, name), totals))
    Checkpointer.restore = measured("restore", Checkpointer.restore, totals)  # type: ignore[method-assign]
    atexit.register(lambda: (out / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), **totals})))
    return run.main(argv)


def train_args(corpus: Path, runs: Path, name: str, strategy: str, n_embd: int) -> list[str]:
    options = {"path": str(corpus), "seq_len": 64, "n_layer": 4, "n_head": 4, "n_embd": n_embd, "dropout": 0.0}
    return [
        *("--task.name", "causal_lm", "--task.options", json.dumps(options)),
        *("--run.output-dir", str(runs), "--run.name", name, "--data.num-workers", "0"),
        *("--optim.name", "adamw", "--ema.enabled", "true", "--train.strategy", strategy),
        *("--train.steps", "1", "--train.global-batch-size", "8", "--train.micro-batch-size", "2"),
        *("--ckpt.every", "1", "--ckpt.allow-world-size-change", "true", "--ckpt.async-save", "off"),
        *("--log.tensorboard", "false", "--doctor.enabled", "false"),
    ]


def torchrun(nproc: int, argv: list[str], env: dict[str, str]) -> None:
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *argv]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")


def measure(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    corpus = work / "corpus"
    make = [str(bin_dir / "ddp-job"), "make-data", "--format", "text", "--out", str(corpus)]
    subprocess.run([*make, "--max-bytes", "200000"], env=env, check=True, capture_output=True)
    rows = []
    for strategy in args.strategies:
        saved = train_args(corpus, work / "runs", f"saved-{strategy}", strategy, args.n_embd)
        torchrun(2, ["-m", "job", "train", *saved], env)
        step = work / "runs" / f"saved-{strategy}" / "step-0000001"
        size = sum(f["size"] for f in json.loads((step / "manifest.json").read_text())["files"].values())
        for nproc in args.procs:
            name = f"resume-{strategy}-{nproc}"
            shutil.copytree(step, work / "runs" / name / step.name)
            reports = work / "reports" / name
            reports.mkdir(parents=True)
            resumed = train_args(corpus, work / "runs", name, strategy, args.n_embd)
            torchrun(nproc, [str(Path(__file__).resolve()), WORKER, str(reports), *resumed], env)
            ranks = [json.loads(p.read_text()) for p in sorted(reports.glob("rank*.json"))]
            rows.append({"strategy": strategy, "procs": nproc, "checkpoint_bytes": size, "ranks": ranks})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    windows = ("find_resume", "settle_resume", "restore")
    lines = [
        "| strategy | processes | checkpoint MiB | preflight | hash check | load | total rchar / checkpoint "
        "| read_bytes / checkpoint |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        size = row["checkpoint_bytes"]
        per = {w: sum(r.get(w, {}).get("rchar", 0) for r in row["ranks"]) / size for w in windows}
        disk = sum(r.get(w, {}).get("read_bytes", 0) for r in row["ranks"] for w in windows) / size
        lines.append(
            f"| {row['strategy']} | {row['procs']} | {size / 2**20:.1f} | {per['find_resume']:.2f} "
            f"| {per['settle_resume']:.2f} | {per['restore']:.2f} | {sum(per.values()):.2f} | {disk:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == WORKER:
        sys.exit(worker(Path(sys.argv[2]), sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--n-embd", type=int, default=256, help="the model's width (4 layers)")
    parser.add_argument("--out", type=Path, help="keep the runs and reports here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = (args.out or Path(tmp)).resolve()
        rows = measure(args, work)
        (work / "resume_reads.json").write_text(json.dumps(rows, indent=1))
        print(table(rows))


if __name__ == "__main__":
    main()
