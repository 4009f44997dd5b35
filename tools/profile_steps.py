"""Where every rank's step time goes: ``ddp-job train`` and the bare DDP loop under cProfile, one profile per
rank, the same work as ``bench overhead``; per rank, milliseconds per step in each part of the loop.

    python tools/profile_steps.py [--nprocs 2] [--steps 40] [--model resnet18] [--image-size 32] [--batch 32]

The parts are functions of the trainer (``job/``) and of torch that both programs call (forward, backward,
optimizer step). cProfile adds about a microsecond per Python call to both programs alike, so read the
differences between the rows, not their absolute size. One JSON line last.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import runpy
import sys
import tempfile
from pathlib import Path
from typing import Any

from job.bench import common
from job.bench.overhead import HERE

# (label, file name ending, function name): the parts of one step, trainer first, then what both programs call.
PARTS = [
    ("trainer: train_step (whole optimizer step)", "job/train/step.py", "train_step"),
    ("trainer:   next batch (generator)", "job/data/loaders.py", "batches"),
    ("trainer:   to_device (normalise)", "job/data/loaders.py", "to_device"),
    ("trainer:   gradient norm (non-finite guard)", "job/train/step.py", "_unscale_and_norm"),
    ("trainer:   update (scaler, optimizer, scheduler)", "job/train/step.py", "_update"),
    ("trainer: training log (TensorBoard, console)", "job/observe/metrics.py", "after_step"),
    ("trainer: observer (progress file, stats gather)", "job/observe/observer.py", "step_done"),
    ("trainer: observer gradient hook", "job/observe/observer.py", "_grads_ready"),
    ("trainer: stop-flag agreement", "job/train/loop.py", "stop_agreed"),
    ("trainer: evaluation cadence", "job/train/evaluate.py", "after_step"),
    ("trainer: checkpoint cadence", "job/checkpoint/checkpointer.py", "after_step"),
    ("both: DDP forward", "torch/nn/parallel/distributed.py", "forward"),
    ("both: backward", "torch/_tensor.py", "backward"),
    ("both: optimizer step", "torch/optim/optimizer.py", "wrapper"),
    ("bare: the whole loop", "job/bench/bare_ddp.py", "main"),
]


def profiled_main() -> None:
    """In each rank (under torchrun): run the target under cProfile, write OUT/<kind>-rank<R>.prof."""
    out, kind, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    prof = cProfile.Profile()
    prof.enable()
    try:
        if kind == "job":
            from job import cli

            cli.main(["train", *args])  # main returns; the console entrypoint would os._exit before the dump
        else:
            sys.argv = [str(HERE / "bare_ddp.py"), *args]
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        prof.disable()
        prof.dump_stats(out / f"{kind}-rank{os.environ.get('RANK', '0')}.prof")


def per_step_ms(path: Path, steps: int) -> dict[str, float]:
    """Cumulative milliseconds per step of each part in one rank's profile (absent parts are left out)."""
    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for label, file_end, func in PARTS:
        cum = sum(v[3] for (file, _, name), v in stats.items() if name == func and file.endswith(file_end))
        if cum > 0:
            out[label] = 1000 * cum / steps
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--timeout", type=float, default=1200)
    a = p.parse_args(argv)
    ranks = range(a.nprocs)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        job_args = common.job_train_args(
            tmp / "runs" / "job", model=a.model, image_size=a.image_size, batch=a.batch, steps=a.steps
        )
        bare_args = ["--model", a.model, "--image-size", str(a.image_size), "--batch", str(a.batch)]
        bare_args += ["--steps", str(a.steps), "--out", str(tmp / "bare.json")]
        env = common.child_env(tmp)
        for kind, args in (("job", [*job_args, "--log.every", "5"]), ("bare", bare_args)):
            target = [str(Path(__file__).resolve()), "--rank-profile", str(tmp), kind, *args]
            common.run(common.torchrun_cmd(a.nprocs, target), env, a.timeout)
        result = {
            f"{k}-rank{r}": per_step_ms(tmp / f"{k}-rank{r}.prof", a.steps) for k in ("job", "bare") for r in ranks
        }
    cols = list(result)
    rows = [[label, *(f"{result[c][label]:.1f}" if label in result[c] else "" for c in cols)] for label, _, _ in PARTS]
    common.table(
        f"ms per step under cProfile: {a.model} {a.image_size}px batch {a.batch}, {a.nprocs} procs, {a.steps} steps",
        ["part", *cols],
        rows,
    )
    common.emit("profile_steps", {"nprocs": a.nprocs, "steps": a.steps, "ms_per_step": result})
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-profile"]:
        del sys.argv[1]
        profiled_main()
    else:
        raise SystemExit(main(sys.argv[1:]))
