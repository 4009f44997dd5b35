"""Benchmarks of ddp-job against references run in the same minutes (docs/benchmarks.md).

``ddp-job bench NAME [--quick] [options]`` or ``python -m job.bench.NAME``. Each prints a table and, as its
last line, one JSON object. Everything that is timed is a ratio of interleaved A/B runs (medians and spread):
absolute times on the shared CPU machine drift 2-10x between minutes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

NAMES = {
    "overhead": "ddp-job train vs a bare DDP loop vs Lightning (steps/s)",
    "paired": "ddp-job's loop vs a bare DDP step, alternating blocks in one process (steps/s)",
    "comm": "all-reduce calls/bytes per optimizer step; DDP vs no_sync step time",
    "data": "ImageFolder loader images/s vs what the trainer consumes",
    "checkpoint": "time training is blocked per checkpoint: sync, async, plain torch.save",
    "startup": "launch -> first optimizer step vs launch -> first collective of a bare script",
    "ckpt-waste": "simulated interruptions: waste at ckpt.every=auto's interval vs 1/2x, 2x and the optimum",
    "sync-modes": "DDP ring all-reduce vs an RPC parameter server: step time, counted bytes, N = 2, 3, 4",
    "scaling": "GPU only: ResNet-50 bf16 channels_last images/s and MFU vs batch size",
    "rollback": "bytes the non-finite rollback moves per step beside the update, and the copy it keeps",
    "memory": "ddp vs fsdp (and hsdp) at 1, 2, 4 processes: state and peak memory per rank, estimate, step ratio",
    "traffic": "bytes sent per step within a node and across nodes, ddp/fsdp/hsdp: traffic_worker counts vs formulas",
    "crops": "the device decode path's batched crop vs per-image kernels and roi_align: pixels and ms",
    "stop-latency": "SIGTERM to ddp-job launch at a random moment: time to exit vs step and save time, 2 processes",
}
USAGE = "usage: ddp-job bench NAME [--quick] [options]\n\n" + "".join(f"  {k:<12} {v}\n" for k, v in NAMES.items())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in NAMES:
        print(
            f"ddp-job bench: unknown benchmark {name!r}. Fix: pick one of {', '.join(NAMES)}.\n\n{USAGE}",
            file=sys.stderr,
            end="",
        )
        return 2
    return int(importlib.import_module(f"{__name__}.{name.replace('-', '_')}").main(rest))
