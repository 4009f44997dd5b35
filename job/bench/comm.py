"""Communication: gradient all-reduce calls and bytes per optimizer step with accumulation 1, 2, 4
(counted by the trainer's own comm hook, job.parallel.ddp.CommCounter, not timed), and the step time of DDP
vs the same model under ``no_sync`` (the communication cost that backward does not hide).

Theory checked here: with ``no_sync`` on all but the last micro-batch, every optimizer step sends each
gradient exactly once, so bytes per step = the parameters' gradient bytes and calls per step = the bucket
count, whatever the accumulation.

    ddp-job bench comm [--quick] [--nproc 2] [--model resnet18]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench comm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--micro", type=int, default=None)
    p.add_argument("--timed", type=int, default=None)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)
    size, micro, timed = (
        a.image_size or (16 if a.quick else 32),
        a.micro or (2 if a.quick else 16),
        a.timed or (2 if a.quick else 10),
    )
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "comm.json"
        cmd = common.torchrun_cmd(
            a.nproc,
            [
                str(HERE / "comm_worker.py"),
                "--model",
                a.model,
                "--image-size",
                str(size),
                "--micro",
                str(micro),
                "--steps",
                "3",
                "--timed",
                str(timed),
                "--bucket-mb",
                str(a.bucket_mb),
                "--out",
                str(out),
            ],
        )
        common.run(cmd, common.child_env(Path(d)), a.timeout)
        r: dict[str, Any] = json.loads(out.read_text())
    rows = []
    for accum, c in r["counts"].items():
        rows.append(
            [
                accum,
                c["calls_per_step"],
                c["bytes_per_step"],
                f"{c['bytes_per_step'][-1] / 2**20:.2f} MiB",
                c["buckets"],
                f"{c['bytes_per_step'][-1] / r['grad_bytes']:.3f}",
            ]
        )
    common.table(
        f"comm: {a.model}, {r['params']:,} parameters = {r['grad_bytes'] / 2**20:.2f} MiB of fp32 gradients, "
        f"{a.nproc} processes, bucket_cap_mb {a.bucket_mb}",
        ["accum", "all-reduce calls/step", "bytes/step", "per step", "distinct buckets", "bytes / grad bytes"],
        rows,
    )
    s, n = common.median_spread(r["times"]["sync"]), common.median_spread(r["times"]["no_sync"])
    exposed = s["median"] - n["median"]
    common.table(
        f"DDP vs no_sync: forward+backward, micro batch {micro} at {size}px (interleaved, median [min-max])",
        ["variant", "step time"],
        [
            ["DDP (all-reduce)", common.fmt_ms(s, 1000, " ms")],
            ["no_sync", common.fmt_ms(n, 1000, " ms")],
            ["exposed comm", f"{exposed * 1000:.3g} ms ({100 * exposed / s['median']:.1f}% of the DDP step)"],
        ],
    )
    common.emit(
        "comm",
        {
            "quick": a.quick,
            "model": a.model,
            "world_size": r["world_size"],
            "grad_bytes": r["grad_bytes"],
            "params": r["params"],
            "bucket_cap_mb": a.bucket_mb,
            "counts": r["counts"],
            "sync_s": s,
            "no_sync_s": n,
            "exposed_s": exposed,
            "exposed_frac": exposed / s["median"],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
