"""Where every rank's step time goes, sampled from outside: ``bench paired``'s workers under py-spy.

    python tools/profile_paired.py [--nprocs 2] [--pairs 120] [--rate 50] [--bare-bucket-view]

py-spy (the ``bench`` extra) samples the Python stacks of every torchrun worker (``--subprocesses``) without
instrumenting them: unlike cProfile it does not slow each Python call, so the parts keep their real
proportions. Each sample inside the trainer's step is attributed to the line of ``job.train.loop.iteration``
or ``job.train.step.train_step`` it is under, each sample inside the bare step to the bare step's line; the table
gives every part's milliseconds per step (samples / rate / steps) for each rank, and the two sides' totals.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from job.bench import common

SIDES = {"job": "alternate.<locals>.job_step", "bare": "BareLoop.step"}
"""The function each side's step runs in (job/bench/paired_worker.py)."""
PART_FRAMES = ("iteration (job/train/loop.py", "train_step (job/train/step.py", "BareLoop.step (job/bench/bare_ddp.py")
_PROCESS = re.compile(r"^process (\d+):")


def attribute(raw_lines: list[str]) -> dict[tuple[str, str], collections.Counter[str]]:
    """{(pid, side): Counter(part -> samples)} from py-spy's raw (collapsed) output. Pure."""
    out: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        # with --subprocesses each sample starts with one "process PID:cmdline" frame per ancestor: the
        # innermost is the worker's
        pids = [m.group(1) for m in map(_PROCESS.match, frames) if m]
        pid = "0"
        if pids:
            pid = pids[-1]
        for side, func in SIDES.items():
            at = [i for i, f in enumerate(frames) if f.startswith(func + " ")]
            if not at:
                continue
            parts = [f for f in frames[at[0] :] if f.startswith(PART_FRAMES)]
            out[(pid, side)][_part(_deepest_step_line(parts))] += int(count)
    return out


def _deepest_step_line(parts: list[str]) -> str:
    """The train_step line if the sample is inside train_step, else the iteration (or bare step) line."""
    inside = [f for f in parts if f.startswith("train_step (")]
    if inside:
        return inside[0]
    if parts:
        return parts[0]
    return "the benchmark's own loop)"


def _part(frame: str) -> str:
    """``train_step (job/train/step.py:85)`` -> ``step.py:85``."""
    return frame.split("/")[-1].rstrip(")")


def source_line(part: str) -> str:
    """The source text of ``file.py:N`` (job/train or job/bench), for the table."""
    name, _, lineno = part.partition(":")
    for base in (common.ROOT / "job" / "train", common.ROOT / "job" / "bench"):
        path = base / name
        if path.exists():
            return path.read_text().splitlines()[int(lineno) - 1].strip()[:70]
    return ""


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--pairs", type=int, default=120)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--bare-bucket-view", action="store_true")
    p.add_argument("--raw", type=Path, default=None, help="also keep py-spy's raw stacks in this file")
    a = p.parse_args(argv)
    spy = shutil.which("py-spy", path=str(common.BIN)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed. Fix: pip install 'ddp-job[bench]' (scripts/setup.sh dev,bench).")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run_dir = tmp / "runs" / "spy"
        args = common.job_train_args(
            run_dir, model="resnet18", image_size=32, batch=32, steps=a.pairs + 1, extra=["--log.every", "5"]
        )
        own = [str(tmp / "out.json"), str(a.pairs), "1", *(["bare-bucket-view"] if a.bare_bucket_view else [])]
        target = common.torchrun_cmd(a.nprocs, ["-m", "job.bench.paired_worker", *own, "--", *args])
        raw = tmp / "spy.txt"
        cmd = [spy, "record", "--subprocesses", "-r", str(a.rate), "-f", "raw", "-o", str(raw), "--", *target]
        subprocess.run(cmd, env=common.child_env(tmp), cwd=common.ROOT, check=True, capture_output=True, timeout=1800)
        per = attribute(raw.read_text().splitlines())
        if a.raw is not None:
            shutil.copyfile(raw, a.raw)
    rows = []
    for (pid, side), parts in sorted(per.items()):
        total = sum(parts.values())
        for part, n in parts.most_common(8):
            rows.append([pid, side, part, source_line(part), f"{1000 * n / a.rate / a.pairs:.1f}", f"{n / total:.1%}"])
        rows.append([pid, side, "total", "", f"{1000 * total / a.rate / a.pairs:.1f}", "100%"])
    common.table(
        f"ms per step by part, py-spy at {a.rate} Hz, {a.nprocs} ranks",
        ["pid", "side", "part", "source", "ms/step", "share"],
        rows,
    )
    common.emit("profile_paired", {"per_process": {f"{pid}/{side}": dict(c) for (pid, side), c in per.items()}})
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
