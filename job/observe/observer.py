"""Seeing into a running job: stragglers, throughput/MFU, memory, profiler traces, and who stalled on a timeout.

All ranks measure, rank 0 writes (its TensorBoard writer; the others hold a NullWriter). Every
``observe.every`` steps (default ``log.every``) one small ``all_gather`` over the CPU control group
(gloo: no GPU stream sync) collects each rank's window averages; on a GPU that step first waits for its own
gradients, to read the window's busy times (below).

Why "busy time" and not step time: DDP's gradient all-reduce makes every rank's step last as long as the
slowest one's, so step times cannot name a straggler. Each rank therefore timestamps the moment its own
gradients are ready (a post-accumulate-grad hook on the first parameter, whose gradient backward computes
last) and reports busy = data wait + forward + backward up to that moment, and wait = the rest (the
all-reduce wait, optimizer step). The rank with the largest busy time is the one the others wait for.
On a GPU both ends of the busy span are CUDA events on the current stream (``job.observe.stopwatch``): the
host's clock would time the queueing of the kernels, not their run. The events are read when the observer
publishes, never on the steps in between, so those steps add no host synchronisation.

Each rank also keeps ``run_dir/progress/rank-NNNNN`` current (one ``pwrite``, no rename, per phase): its
last completed step, whether its gradients for the next step are ready, what it does between steps (an
evaluation, a save: ``Observer.mark``), and how many of these records it has written. Every rank writes the same
records in the same order, so on a collective timeout the rank(s) with the fewest are the ones the others wait
for: ``explain_timeouts`` reads them all and names them, and where they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from job.cluster.env import DistEnv
from job.config import JobConfig
from job.errors import CollectiveTimeout, JobError, is_collective_timeout
from job.observe.metrics import memory_mb
from job.observe.stopwatch import Stopwatch, stopwatch

log = logging.getLogger("job")

# Dense bf16 peak TFLOP/s per device, for MFU when observe.peak_tflops is 0 (vendor data sheets).
PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
    "L4": 121.0,
    "V100": 125.0,
}
_FIELDS = ("step_s", "busy_s", "data_wait_frac", "peak_alloc_mb", "peak_reserved_mb", "rss_mb", "peak_rss_mb", "cpu_s")
"""One rank's window averages, in the order of the all_gather. ``cpu_s``: CPU seconds per step of the rank's
process, all its threads (gloo, TensorBoard writer, checkpoint writer; not DataLoader workers): unlike step time
it does not grow when other processes take the cores, so it is what benchmarks compare under load."""


def gpu_peak_tflops(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


def train_flops_per_sample(model: nn.Module, image_size: int, device: torch.device) -> float:
    """Forward FLOPs of one sample counted by torch.utils.flop_counter, x3 for forward + backward.
    Eval mode and no_grad: BatchNorm statistics and gradients stay untouched."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(1, 3, image_size, image_size, device=device))
    finally:
        model.train(was_training)
    return 3.0 * float(counter.get_total_flops())


def summarize(
    rows: list[list[float]], global_batch: int, flops_per_sample: float, peak_tflops: float
) -> dict[str, float]:
    """Rank 0's scalars from every rank's window averages (``rows[rank]`` ordered as ``_FIELDS``). Pure."""
    world = len(rows)
    col = {f: [r[i] for r in rows] for i, f in enumerate(_FIELDS)}
    busy = col["busy_s"]
    slow = max(range(world), key=lambda r: busy[r])
    med = statistics.median(busy)
    step_s = max(col["step_s"])
    out = {
        "straggler/busy_s_min": min(busy),
        "straggler/busy_s_median": med,
        "straggler/busy_s_max": busy[slow],
        "straggler/slowest_rank": float(slow),
        "straggler/spread": busy[slow] / med if med > 0 else 1.0,
        "straggler/step_s_min": min(col["step_s"]),
        "straggler/step_s_median": statistics.median(col["step_s"]),
        "straggler/step_s_max": step_s,
        "perf/samples_per_s_global": global_batch / step_s if step_s > 0 else 0.0,
        "mem/peak_alloc_mb_max": max(col["peak_alloc_mb"]),
        "mem/peak_reserved_mb_max": max(col["peak_reserved_mb"]),
        "mem/rss_mb_max": max(col["rss_mb"]),
        "perf/cpu_s_per_step_median": statistics.median(col["cpu_s"]),
        "perf/cpu_s_per_step_max": max(col["cpu_s"]),
        "mem/peak_rss_mb_max": max(col["peak_rss_mb"]),
    }
    out["perf/samples_per_s_per_device"] = out["perf/samples_per_s_global"] / world
    if flops_per_sample > 0:
        tflops = flops_per_sample * out["perf/samples_per_s_per_device"] / 1e12
        out["perf/tflops_per_device"] = tflops
        if peak_tflops > 0:
            out["perf/mfu"] = tflops / peak_tflops
    if world <= 64:  # per-rank series; beyond that min/median/max and the slowest rank say enough
        for r in range(world):
            for f in ("busy_s", "data_wait_frac", "peak_alloc_mb", "peak_rss_mb", "cpu_s"):
                out[f"rank/{r}/{f}"] = col[f][r]
    return out


def no_mark(phase: str) -> None:
    """Where there is no progress file to mark (``Observer.mark``): ``ddp-job evaluate``, a test, a tool."""


class Observer:
    """One per rank; the training loop calls ``step_done`` after every optimizer step and ``close`` at the end."""

    def __init__(
        self,
        cfg: JobConfig,
        env: DistEnv,
        control_group: Any,
        model: nn.Module,
        device: torch.device,
        global_batch: int,
        writer: Any,
        start_step: int,
        flops_per_sample: float = 0.0,
        clock: Stopwatch | None = None,
    ) -> None:
        """``flops_per_sample``: training FLOPs per item (the task's ``flops_per_item``; 0: no MFU). ``clock``:
        what times the busy spans, the device's own stopwatch unless a test hands in another."""
        self.cfg, self.env, self.group, self.device, self.writer = cfg, env, control_group, device, writer
        self.every = cfg.observe.every or cfg.log.every
        self.global_batch = global_batch
        self.next_step = start_step + 1
        self._clock = clock or stopwatch(device)
        self._last_end = time.perf_counter()
        self._last_cpu = time.process_time()
        self._busy_from: Any = self._clock.point()
        self._grads_at: Any = None
        self._busy: list[tuple[Any, Any]] = []
        """This window's busy spans, one (start, gradients ready) pair of clock points per step, read at publish."""
        self._seen_data = 0.0
        self._window = [0.0, 0.0, 0, 0.0]  # step_s, data_s, steps, cpu_s
        self._prof: Any = None
        self._prof_end = 0
        self.flops = flops_per_sample
        self.peak_tflops = cfg.observe.peak_tflops or gpu_peak_tflops(device)
        progress = cfg.run_dir / "progress"
        progress.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(progress / f"rank-{env.rank:05d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._seq = 0
        self._write_progress(start_step, -1)
        first = next(p for p in model.parameters() if p.requires_grad)
        first.register_post_accumulate_grad_hook(self._grads_ready)
        if env.is_main:
            log.info(
                "observe: %.3g GFLOP per training sample, peak %s TFLOP/s per device, stats every %d steps",
                self.flops / 1e9,
                self.peak_tflops or "unknown (no MFU)",
                self.every,
            )

    # --- hooks ---
    def _grads_ready(self, _param: torch.Tensor) -> None:
        self._grads_at = self._clock.point()  # each micro-batch's backward: the last one's counts
        self._write_progress(self.next_step - 1, self.next_step)

    def mark(self, phase: str) -> None:
        """This rank has begun ``phase`` between steps (every rank marks the same phases in the same order):
        what a stall report says of a rank that stalls there."""
        self._write_progress(self.next_step - 1, -1, phase)

    def _write_progress(self, done: int, grads: int, phase: str = "") -> None:
        self._seq += 1
        line = f"done={done} grads={grads} seq={self._seq} t={time.time():.3f} phase={phase[:_PHASE_MAX]}"
        os.pwrite(self._fd, (line + "\n").ljust(_PROGRESS_BYTES).encode(), 0)  # covers a longer earlier line

    # --- per step ---
    def step_done(self, step: int, timer: Any) -> dict[str, float] | None:
        """After optimizer step ``step`` (every rank); on the steps it publishes, rank 0 gets the statistics."""
        now, cpu, end = time.perf_counter(), time.process_time(), self._grads_at
        if end is None:  # a step without a backward pass: busy all along
            end = self._clock.point()
        self._busy.append((self._busy_from, end))
        self._busy_from, self._grads_at = self._clock.point(), None
        w = self._window
        w[0] += now - self._last_end
        # metrics.StepTimer accumulates data wait since its last reset (at each log step).
        w[1] += timer.data_s if timer.steps == 1 else timer.data_s - self._seen_data
        w[2] += 1
        w[3] += cpu - self._last_cpu
        self._last_cpu = cpu
        self._seen_data = timer.data_s
        self._last_end = now
        self.next_step = step + 1
        self._write_progress(step, -1)
        self._profile(step)
        if step % self.every == 0:
            return self._publish(step)
        return None

    def _publish(self, step: int) -> dict[str, float] | None:
        """Gather every rank's window; rank 0 writes the cross-rank statistics and returns them."""
        step_s, data_s, n, cpu_s = self._window
        n = max(n, 1)
        busy_s = sum(self._clock.seconds(a, b) for a, b in self._busy)  # on a GPU: waits for this step's gradients
        self._busy = []
        data_frac = data_s / step_s if step_s > 0 else 0.0
        window = {"step_s": step_s / n, "busy_s": busy_s / n, "data_wait_frac": data_frac, "cpu_s": cpu_s / n}
        window.update(memory_mb(self.device))
        mine = [window[f] for f in _FIELDS]
        self._window = [0.0, 0.0, 0, 0.0]
        t = torch.tensor(mine, dtype=torch.float64)
        rows = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, t, group=self.group)
        if not self.env.is_main:
            return None
        scalars = summarize([r.tolist() for r in rows], self.global_batch, self.flops, self.peak_tflops)
        self.writer.scalars(step, scalars)
        return scalars

    def _profile(self, step: int) -> None:
        o = self.cfg.observe
        if o.profile_start and step == o.profile_start and self._prof is None:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            # TensorBoard's profile plugin reads <logdir>/plugins/profile/<run>/*.pt.trace.json; one run per window.
            out = self.cfg.run_dir / "tb" / "plugins" / "profile" / f"step-{step:07d}"
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(
                activities=acts, on_trace_ready=tensorboard_trace_handler(str(out), worker_name=f"rank{self.env.rank}")
            )
            self._prof.start()
            self._prof_end = step + o.profile_steps
        elif self._prof is not None and step >= self._prof_end:
            self._stop_profiler()

    def _stop_profiler(self) -> None:
        if self._prof is not None:
            self._prof.stop()  # on_trace_ready writes the trace
            self._prof = None

    def close(self) -> None:
        self._stop_profiler()
        os.close(self._fd)


# --- collective timeouts -------------------------------------------------------------------------------

_LINE = re.compile(r"done=(-?\d+) grads=(-?\d+) seq=(\d+) t=([\d.]+) phase=(.*)")
_PHASE_MAX = 96
_PROGRESS_BYTES = 192
"""One record's bytes, padded: each overwrites the last in place."""


def _doing(done: int, grads_ready: bool, phase: str) -> str:
    if phase:
        return phase
    if grads_ready:
        return f"gradients of step {done + 1} ready, waiting in its all-reduce"
    return f"computing step {done + 1}"


def stall_report(run_dir: Path, world_size: int, now: float | None = None) -> str:
    """Which ranks the others were waiting for, from the progress files. Pure apart from reading them."""
    now = time.time() if now is None else now
    state: dict[int, tuple[int, str, int, float]] = {}
    missing = []
    for r in range(world_size):
        try:
            m = _LINE.search((run_dir / "progress" / f"rank-{r:05d}").read_text())
        except OSError:
            m = None
        if m is None:
            missing.append(r)
            continue
        done, grads, seq = int(m.group(1)), int(m.group(2)), int(m.group(3))
        state[r] = (done, _doing(done, grads == done + 1, m.group(5).strip()), seq, float(m.group(4)))
    parts = [
        f"rank {r}: completed step {d}, {doing}, last progress {now - t:.1f} s ago"
        for r, (d, doing, _, t) in sorted(state.items())
    ]
    if missing:
        parts.append(f"no progress file for rank(s) {missing} (never started a step, or {run_dir} is not shared)")
    if not state:
        return "; ".join(parts)
    behind = min(seq for _, _, seq, _ in state.values())
    stalled = sorted(r for r, (_, _, seq, _) in state.items() if seq == behind)
    if len(stalled) == len(state) and not missing:
        verdict = "all ranks reached the same point: the stall is in the collective itself (network)"
    else:
        verdict = f"stalled: rank(s) {stalled} (the others wait for them)"
    return verdict + ". " + "; ".join(parts)


@contextlib.contextmanager
def explain_timeouts(cfg: JobConfig, env: DistEnv) -> Iterator[None]:
    """Turn a collective timeout into an error that names the stalled rank(s); other errors pass through."""
    try:
        yield
    except Exception as e:
        if isinstance(e, JobError) or not is_collective_timeout(e):
            raise  # ours say what happened already (a DataLoader stall is this rank's input pipeline, not the network)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CollectiveTimeout(
            f"collective timed out on rank {env.rank} ({first}). {stall_report(cfg.run_dir, env.world_size)}.",
            "look at the stalled rank's log and host; raise dist.train_timeout_s if it is only slow. NCCL flight "
            "recorder dumps (TORCH_FR_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_FR_DUMP_TEMP_FILE) "
            "show the last collectives per rank; see docs/doctor.md.",
            setting="dist.train_timeout_s",
            value=cfg.dist.train_timeout_s,
        ) from e
