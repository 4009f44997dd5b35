"""Console and TensorBoard logging.

Rank 0 writes TensorBoard events; every other rank gets a null writer, so call sites never check the
rank (torchtitan's pattern). Console lines carry a ``[rank r/w]`` prefix.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import resource
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from job.config import flatten
from job.parallel import distributed

log = logging.getLogger("job")

METRICS_JSONL = "metrics.jsonl"
"""``log.jsonl``: rank 0's step records in the run directory, one JSON object per line."""


def setup_console(rank: int, world_size: int) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}/{world_size}] %(levelname)s %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("job")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


class NullWriter:
    """What non-zero ranks (and a run with no metrics sink) get."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def commit(self) -> None:
        pass

    def text(self, tag: str, text: str, step: int = 0) -> None:
        pass

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter(NullWriter):
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(log_dir), max_queue=1000)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self._w.add_text(tag, text, step)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        # run_name="." keeps the hparams event in the same directory as the scalars.
        self._w.add_hparams(hparams, metrics, run_name=".")

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class JsonlSink(NullWriter):
    """Each step's record as one JSON object per line (``{"step": N, "time": unix s, "<tag>": value, ...}``),
    appended to ``path`` by a thread of its own: the training thread only queues the record. Non-finite values
    are written as null (JSON has no NaN), which pandas reads as NaN."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", encoding="utf-8")
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="metrics-jsonl", daemon=True)
        self._thread.start()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        record: dict[str, float | None] = {"step": step, "time": round(time.time(), 3)}
        record.update({k: v if math.isfinite(v) else None for k, v in values.items()})
        self._queue.put(json.dumps(record))

    def _write(self) -> None:
        while (line := self._queue.get()) is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._file.close()


class StepRecords(NullWriter):
    """The one home of a step's scalars: every component (training log, observer, evaluation, checkpoint
    cadence, final results) adds its values to the record of the step; the record goes to each sink (TensorBoard,
    ``metrics.jsonl``, the experiment trackers) once, when the loop commits the step or a later step's values arrive."""

    def __init__(self, sinks: list[NullWriter], tensorboard: NullWriter) -> None:
        self.sinks, self.tensorboard = sinks, tensorboard
        self.step: int | None = None
        self.record: dict[str, float] = {}

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.step is not None and step != self.step:
            self.commit()
        self.step = step
        self.record.update({k: float(v) for k, v in values.items()})

    def commit(self) -> None:
        if self.step is not None and self.record:
            for sink in self.sinks:
                sink.scalars(self.step, self.record)
        self.step, self.record = None, {}

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.tensorboard.text(tag, text, step)

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        for sink in self.sinks:  # the end of a completed run, to each sink that takes it
            sink.hparams(hparams, metrics)

    def flush(self) -> None:
        self.commit()
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        self.commit()
        for sink in self.sinks:
            sink.close()


def build_writer(
    tensorboard: bool, is_main: bool, run_dir: Path, jsonl: bool = False, trackers: Sequence[NullWriter] = ()
) -> NullWriter:
    """Rank 0's step records, to TensorBoard (``log.tensorboard``), ``metrics.jsonl`` (``log.jsonl``) and the
    experiment trackers' sinks (``job.observe.trackers``)."""
    if not is_main or not (tensorboard or jsonl or trackers):
        return NullWriter()
    tb: NullWriter = NullWriter()
    sinks: list[NullWriter] = [*trackers]
    if tensorboard:
        tb = TensorBoardWriter(run_dir / "tb")
        sinks.append(tb)
    if jsonl:
        sinks.append(JsonlSink(run_dir / METRICS_JSONL))
    return StepRecords(sinks, tb)


def hparams(config: dict[str, Any]) -> dict[str, Any]:
    """The config as TensorBoard hparams: dotted names, values TensorBoard can show (others as text)."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(config).items()}


def memory_mb(device: torch.device) -> dict[str, float]:
    """This process's memory: resident and peak resident set, and on CUDA the allocator's peaks (MiB)."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        rss = peak_rss
    out = {"rss_mb": rss, "peak_rss_mb": peak_rss, "peak_alloc_mb": 0.0, "peak_reserved_mb": 0.0}
    if device.type == "cuda":
        out["peak_alloc_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    return out


def peak_memory_mb(device: torch.device) -> float:
    """The one number the training log shows: the allocator's peak on CUDA, the peak resident set on CPU."""
    mem = memory_mb(device)
    if device.type == "cuda":
        return mem["peak_alloc_mb"]
    return mem["peak_rss_mb"]


class StepTimer:
    """Accumulates wall time per optimizer step and the part spent waiting for data."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.total_s = 0.0
        self.data_s = 0.0
        self._t0 = time.perf_counter()

    def start_step(self) -> None:
        self._t0 = time.perf_counter()

    def add_data_wait(self, seconds: float) -> None:
        self.data_s += seconds

    def end_step(self) -> None:
        self.total_s += time.perf_counter() - self._t0
        self.steps += 1

    def summary(self, global_batch_size: int) -> dict[str, float]:
        steps = max(self.steps, 1)
        step_s = self.total_s / steps
        return {
            "perf/step_time_s": step_s,
            "perf/samples_per_s": global_batch_size / step_s if step_s > 0 else 0.0,
            "perf/data_wait_frac": self.data_s / self.total_s if self.total_s > 0 else 0.0,
        }


class TrainLog:
    """The training log's cadence: TensorBoard scalars and ONE console line every ``every`` steps and at the
    last step. The line carries the cross-rank facts of the observer when it published at the same step,
    and names the slowest rank when it stands out (busy ``STRAGGLER_RATIO`` x the median or more)."""

    STRAGGLER_RATIO = 1.2

    def __init__(
        self,
        every: int,
        total_steps: int,
        global_batch_size: int,
        device: torch.device,
        writer: NullWriter,
        observer: Any,
        progress: Any = None,
    ) -> None:
        self.every, self.total_steps, self.global_batch_size = every, total_steps, global_batch_size
        self.device, self.writer, self.observer, self.progress = device, writer, observer, progress
        self.timer = StepTimer()
        self.loss_sum = torch.zeros((), device=device)
        self.finite_steps = torch.zeros((), device=device)
        """The window's steps that were not skipped: the divisor of the loss (a skipped step adds no loss)."""
        self.extra_sums: dict[str, torch.Tensor] = {}
        """The task's extra loss values (``loss`` returned ``(loss, {name: value})``), summed like the loss."""
        self.latest: dict[str, float] = {}
        """The newest log step's scalars (host values): what a progress report carries."""

    def before_step(self) -> None:
        self.timer.start_step()

    def after_step(self, step: int, out: Any, lr: float) -> None:
        """After optimizer step ``step`` on every rank; ``out`` is the step's ``StepOutput``."""
        self.timer.add_data_wait(out.data_wait_s)
        self.timer.end_step()
        cross_rank = self.observer.step_done(step, self.timer)  # straggler/throughput/memory, profiler, progress file
        self.loss_sum += torch.where(out.finite, out.loss, 0.0)  # a skipped step adds nothing, without the host
        self.finite_steps += out.finite
        for name, value in out.extras.items():
            kept = torch.where(out.finite, value.float(), 0.0)
            if name in self.extra_sums:
                self.extra_sums[name] += kept
            else:
                self.extra_sums[name] = kept
        if self.progress is not None:
            self.progress.update(1)
        if self.due(step):
            self._emit(step, out, lr, cross_rank)

    def due(self, step: int) -> bool:
        """Whether ``step`` is a log step."""
        return step % self.every == 0 or step == self.total_steps

    def _emit(self, step: int, out: Any, lr: float, cross_rank: dict[str, float] | None) -> None:
        names = sorted(self.extra_sums)  # the same on every rank: the same task code returned them
        # Each rank's loss is the mean over its own items: the mean over ranks is the global batch's (one
        # all-reduce, at log steps only). The skipped steps are the same on every rank.
        sums = distributed.mean_over_ranks(torch.stack([self.loss_sum.float(), *(self.extra_sums[n] for n in names)]))
        # One transfer for the device values.
        finite_steps, grad_norm, loss_sum, *extra_sums = torch.cat(
            [torch.stack([self.finite_steps.float(), out.grad_norm.detach().float()]), sums]
        ).tolist()
        scalars = {  # the task's extra values first: a name of the job's own (train/loss, train/lr) wins
            **{f"train/{n}": _mean(v, finite_steps) for n, v in zip(names, extra_sums, strict=True)},
            "train/loss": _mean(loss_sum, finite_steps),
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "perf/peak_memory_mb": peak_memory_mb(self.device),
            **self.timer.summary(self.global_batch_size),
        }
        self.writer.scalars(step, scalars)
        self.latest = scalars
        line = (
            f"step {step}/{self.total_steps} loss {scalars['train/loss']:.4f} lr {lr:.4g} "
            f"{scalars['perf/samples_per_s']:.1f} samples/s data-wait {100 * scalars['perf/data_wait_frac']:.1f}%"
        )
        log.info(line + _cross_rank_facts(cross_rank, self.STRAGGLER_RATIO))
        self.loss_sum.zero_()
        self.finite_steps.zero_()
        self.extra_sums.clear()
        self.timer.reset()


def _mean(total: float, steps: float) -> float:
    """The window's mean over its steps that were not skipped; NaN when every one was."""
    if steps == 0:
        return float("nan")
    return total / steps


def _cross_rank_facts(s: dict[str, float] | None, ratio: float) -> str:
    """What the observer adds to the line: per-device throughput and MFU; the slowest rank if it stands out."""
    if not s:
        return ""
    text = f", {s['perf/samples_per_s_per_device']:.1f} samples/s/device"
    if "perf/mfu" in s:
        text += f", MFU {s['perf/mfu']:.1%}"
    if s["straggler/busy_s_max"] >= ratio * s["straggler/busy_s_median"] > 0:
        text += (
            f"; straggler: rank {int(s['straggler/slowest_rank'])} busy {s['straggler/busy_s_max']:.3f} s "
            f"(median {s['straggler/busy_s_median']:.3f} s)"
        )
    return text
