"""Synchronisation modes: DDP's bucketed ring all-reduce vs a parameter server on ``torch.distributed.rpc``,
for N = 2, 3, 4 trainers on gloo, with the model and gradient size of ``bench comm`` (``sync_worker.py``).

Per mode and N: seconds per step (median and spread of the per-launch medians over interleaved repetitions),
the bytes the busiest process sent and received per step, counted by the kernel on its TCP sockets, and their
ratio to a ring's ideal ``2(N-1)/N x gradient bytes``. The parameter server runs N trainers plus the server.

    ddp-job bench sync-modes [--quick] [--sizes 2,3,4] [--reps 3] [--model resnet18] [--params-dir DIR]

``--params-dir DIR`` keeps every process's final parameters (DIR/<mode>-<N>-rep<R>/params<rank>.pt): both
modes are synchronous SGD from the same start on the same batches, so they must end with the same parameters
(up to the order in which the N gradients are summed; tests/test_benchmarks.py checks it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common

MODES = {"ddp": "DDP ring all-reduce", "ps": "parameter server (RPC)"}


def ring_ideal(n: int, grad_bytes: int) -> float:
    """Bytes each process of a ring all-reduce sends (and receives) per step: 2(N-1)/N x the gradients."""
    return 2 * (n - 1) / n * grad_bytes


def launch(a: argparse.Namespace, mode: str, n: int, rep: int, tmp: Path) -> list[dict[str, Any]]:
    """One torchrun launch of the worker; every process's record (``rank<R>.json``)."""
    if a.params_dir is None:
        out = Path(tempfile.mkdtemp(dir=tmp))
    else:
        out = a.params_dir / f"{mode}-{n}-rep{rep}"
        out.mkdir(parents=True)
    nproc = n + 1 if mode == "ps" else n
    worker = ["-m", "job.bench.sync_worker", "--mode", mode, "--model", a.model, "--out", str(out)]
    worker += ["--image-size", str(a.image_size), "--micro", str(a.micro), "--lr", str(a.lr)]
    worker += ["--warmup", str(a.warmup), "--steps", str(a.steps), "--bucket-mb", str(a.bucket_mb)]
    if a.params_dir is not None:
        worker += ["--save-params"]
    common.run(common.torchrun_cmd(nproc, worker), common.child_env(tmp), a.timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def summary(n: int, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Step time over launches (trainer 0's median each), and the busiest process's bytes per step."""
    step = common.median_spread(
        common.median_spread(next(r for r in rs if r["index"] == 0 and r["step_s"])["step_s"])["median"] for rs in runs
    )
    per_step = [
        {**r, "sent": r["sent"] / r["steps"], "received": r["received"] / r["steps"]} for rs in runs for r in rs
    ]
    busiest = max(per_step, key=lambda r: r["sent"] + r["received"])
    grad_bytes = busiest["grad_bytes"]
    ideal = ring_ideal(n, grad_bytes)
    return {
        "n": n,
        "step_s": step,
        "busiest": busiest["role"],
        "sent_per_step": busiest["sent"],
        "received_per_step": busiest["received"],
        "sent_vs_ring_ideal": busiest["sent"] / ideal,
        "received_vs_ring_ideal": busiest["received"] / ideal,
        "sent_vs_grad_bytes": busiest["sent"] / grad_bytes,
        "grad_bytes": grad_bytes,
        "ring_ideal": ideal,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ddp-job bench sync-modes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="N = 2, 3, one repetition, 2 timed steps (CI)")
    p.add_argument("--sizes", default=None, help="comma-separated trainer counts (default 2,3,4)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--micro", type=int, default=None, help="batch per trainer")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="timed steps per launch")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--params-dir", type=Path, default=None, help="keep every process's final parameters here")
    a = p.parse_args(argv)
    a.sizes = [int(s) for s in (a.sizes or ("2,3" if a.quick else "2,3,4")).split(",")]
    a.reps = a.reps or (1 if a.quick else 3)
    a.image_size = a.image_size or (16 if a.quick else 32)
    a.micro = a.micro or (2 if a.quick else 16)
    a.steps = a.steps or (2 if a.quick else 5)
    if a.params_dir is not None:
        a.params_dir = a.params_dir.resolve()  # the workers run from the repository root
        if a.params_dir.exists() and any(a.params_dir.iterdir()):
            p.error(f"--params-dir {a.params_dir} is not empty: name a new or empty directory")
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    runs: dict[tuple[str, int], list[list[dict[str, Any]]]] = {(m, n): [] for m in MODES for n in a.sizes}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.reps):
            for n in a.sizes:
                order = list(MODES)
                if rep % 2:  # the order alternates per repetition: drift of the machine falls on both modes
                    order.reverse()
                for mode in order:
                    runs[mode, n].append(launch(a, mode, n, rep, Path(d)))
    results = {f"{m}/{n}": summary(n, rs) for (m, n), rs in runs.items()}
    rows = []
    for key, s in results.items():
        mode, n = key.split("/")
        rows.append(
            [
                MODES[mode],
                n,
                common.fmt_ms(s["step_s"], 1000, " ms"),
                s["busiest"],
                f"{s['sent_per_step'] / 2**20:.2f} MiB",
                f"{s['received_per_step'] / 2**20:.2f} MiB",
                f"{s['sent_vs_grad_bytes']:.3f}",
                f"{s['sent_vs_ring_ideal']:.3f} / {s['received_vs_ring_ideal']:.3f}",
            ]
        )
    grad = next(iter(results.values()))["grad_bytes"]
    common.table(
        f"sync-modes: {a.model} {a.image_size}px, batch {a.micro} per trainer, gradients {grad / 2**20:.2f} MiB, gloo, "
        f"{a.reps} interleaved repetitions of {a.steps} timed steps (median [min-max])",
        [
            "mode",
            "N",
            "step time",
            "busiest",
            "sent/step",
            "received/step",
            "sent / grad",
            "vs ring ideal (sent / recv)",
        ],
        rows,
    )
    common.emit(
        "sync-modes", {"quick": a.quick, "model": a.model, "reps": a.reps, "steps": a.steps, "results": results}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
