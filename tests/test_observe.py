"""Observability on real 2-process torchrun runs (CPU, gloo): a rank slowed on purpose is named as the
straggler in the TensorBoard scalars (read back with TensorBoard's EventAccumulator), a profiler window
writes per-rank traces where TensorBoard's profile plugin looks, and a collective timeout says which rank
stalled. Plus the pure pieces: the summary statistics and the stall verdict from progress files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.cli import base_env, make_data, torchrun

from job.observe.observer import stall_report, summarize

TINY = [
    "--data.num-classes",
    "4",
    "--data.image-size",
    "16",
    "--data.num-workers",
    "0",
    "--train.global-batch-size",
    "8",
    "--model.name",
    "resnet18",
    "--ckpt.every",
    "0",
]


def run_args(data: Path, run_dir: Path, *more: str) -> list[str]:
    """The tiny run's arguments writing to ``run_dir``, then ``more``."""
    return ["--data.path", str(data), *TINY, "--run.output-dir", str(run_dir.parent), "--run.name", run_dir.name, *more]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("observe-data") / "tiny")


def used_rates(lr: float, warmup_steps: int, steps: int) -> list[float]:
    """The rate each step of a warmup + cosine run uses, from the job's own scheduler on a stand-in optimizer."""
    import torch

    from job.config.schema import SchedConfig
    from job.train.optim import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(optimizer, SchedConfig(name="cosine", warmup_steps=warmup_steps), steps)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# --- pure ------------------------------------------------------------------------------------------------


def test_summarize_names_the_busiest_rank_and_derives_throughput() -> None:
    # fields: step_s, busy_s, data_wait_frac, peak_alloc_mb, peak_reserved_mb, rss_mb, peak_rss_mb, cpu_s
    rows = [
        [1.0, 0.40, 0.1, 0, 0, 100, 120, 0.7],
        [1.0, 0.95, 0.5, 0, 0, 110, 130, 0.9],
        [0.9, 0.50, 0.0, 0, 0, 90, 95, 0.6],
    ]
    s = summarize(rows, global_batch=96, flops_per_sample=2e9, peak_tflops=100.0)
    assert (
        s["straggler/slowest_rank"] == 1 and s["straggler/busy_s_max"] == 0.95 and s["straggler/busy_s_median"] == 0.5
    )
    assert s["straggler/spread"] == pytest.approx(1.9)
    assert s["perf/samples_per_s_global"] == pytest.approx(96.0) and s[
        "perf/samples_per_s_per_device"
    ] == pytest.approx(32.0)
    assert s["perf/tflops_per_device"] == pytest.approx(2e9 * 32 / 1e12) and s["perf/mfu"] == pytest.approx(
        2e9 * 32 / 1e12 / 100
    )
    assert s["rank/1/data_wait_frac"] == 0.5 and s["mem/peak_rss_mb_max"] == 130
    assert s["perf/cpu_s_per_step_median"] == 0.7 and s["perf/cpu_s_per_step_max"] == 0.9 and s["rank/2/cpu_s"] == 0.6
    assert "perf/mfu" not in summarize(rows, 96, 2e9, 0.0)  # no peak known: no MFU, but still TFLOP/s


def _progress(prog: Path, rank: int, done: int, grads: int, seq: int, t: float, phase: str = "") -> None:
    (prog / f"rank-{rank:05d}").write_text(f"done={done} grads={grads} seq={seq} t={t} phase={phase}\n")


def test_stall_report_names_the_rank_that_never_reached_the_collective(tmp_path: Path) -> None:
    prog = tmp_path / "progress"
    prog.mkdir()
    _progress(prog, 0, 7, 8, 31, 100.0)
    _progress(prog, 1, 7, -1, 30, 90.0)
    _progress(prog, 2, 7, 8, 31, 100.0)
    text = stall_report(tmp_path, 4, now=101.0)
    assert text.startswith("stalled: rank(s) [1]")
    assert "rank 1: completed step 7, computing step 8, last progress 11.0 s ago" in text
    assert "no progress file for rank(s) [3]" in text
    _progress(prog, 1, 7, 8, 31, 100.0)
    _progress(prog, 3, 7, 8, 31, 100.0)
    assert stall_report(tmp_path, 4, now=101.0).startswith("all ranks reached the same point")


def test_stall_report_names_a_rank_stalled_between_steps_and_where(tmp_path: Path) -> None:
    """Between steps every rank is at the same step: the count of records tells the one behind, its phase where."""
    prog = tmp_path / "progress"
    prog.mkdir()
    _progress(prog, 0, 60, -1, 250, 10.0, "evaluating after step 60")
    _progress(prog, 1, 60, -1, 251, 12.0, "evaluated its shard, waiting in the evaluation's all-reduce")
    text = stall_report(tmp_path, 2, now=300.0)
    assert text.startswith("stalled: rank(s) [0]"), text
    assert "rank 0: completed step 60, evaluating after step 60, last progress 290.0 s ago" in text
    assert "rank 1: completed step 60, evaluated its shard, waiting in the evaluation's all-reduce" in text


class _Where:
    def __init__(self) -> None:
        self.where = "the boundary after step 60"
        self.signal_at: float | None = None
        self.answered = False


def _watch_stop(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path, answer: str) -> str:
    """A watchdog (deadline 0.4 s, unarmed as between steps) given a stop signal; ``answer``: what the loop
    does then, "" nothing. What it wrote to stderr within 1.5 s, or until it dumped (a loaded machine)."""
    import time

    from job.observe import watchdog

    monkeypatch.setattr(watchdog, "UNANSWERED_STOP_S", 0.5)
    where = _Where()
    dog = watchdog.Watchdog(where, 0.5, tmp_path, 0, 1)
    try:
        where.signal_at = time.monotonic()
        end = time.monotonic() + 1.5
        while time.monotonic() < end or (answer == "" and not dog._stacks_written and time.monotonic() < end + 60):
            if answer == "moves":
                where.where = f"step {time.monotonic()}"
            elif answer == "agrees":
                where.answered = True
            time.sleep(0.05)
    finally:
        dog.close()
    return capfd.readouterr().err


@pytest.mark.parametrize("answer", ["", "moves", "agrees"])
def test_a_stop_signal_left_unanswered_writes_the_ranks_stacks(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path, answer: str
) -> None:
    err = _watch_stop(monkeypatch, capfd, tmp_path, answer)
    dumped = "most recent call first" in err
    assert dumped == (answer == ""), err
    if dumped:  # every thread: this one (the loop stand-in, asleep in _watch_stop) and the watchdog's own
        assert re.search(r'test_observe\.py", line \d+ in _watch_stop', err), err
        assert re.search(r'watchdog\.py", line \d+ in _check_stop_answered', err), err


# --- real runs ---------------------------------------------------------------------------------------------


def test_slowed_rank_is_the_straggler_and_profiler_writes_traces(tmp_path: Path, data: Path) -> None:
    delay = 2.0
    run_dir = tmp_path / "runs" / "slow"
    r = torchrun(
        2,
        run_args(
            data,
            run_dir,
            "--train.steps",
            "4",
            "--log.every",
            "2",
            "--debug.straggler-delay-s",
            str(delay),
            "--debug.straggler-rank",
            "1",
            "--observe.profile-start",
            "1",
            "--observe.profile-steps",
            "1",
        ),
        env=base_env(tmp_path),
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (
        "doctor: 0 FAIL" in r.stdout and json.loads((run_dir / "doctor.json").read_text())["world_size"] == 2
    )  # train's quick phase
    s = scalars(run_dir / "tb")
    slowest = s["straggler/slowest_rank"]
    assert [step for step, _ in slowest] == [2, 4]
    assert all(v == 1 for _, v in slowest), slowest

    def logged(tag: str) -> list[float]:
        """The values of a scalar logged at every log step (2 and 4), so that no check below runs on none."""
        assert [step for step, _ in s.get(tag, [])] == [2, 4], (tag, s.get(tag))
        return [v for _, v in s[tag]]

    busy0, busy1 = logged("rank/0/busy_s"), logged("rank/1/busy_s")
    assert all(b1 - b0 > 0.5 * delay for b0, b1 in zip(busy0, busy1)), (busy0, busy1)
    # the fast rank spent the delay waiting: its step takes as long as the slow rank's
    assert all(v > delay for v in logged("straggler/step_s_min")), s["straggler/step_s_min"]
    # CPU time counts work, not waiting: the straggler's sleep is in its busy time but not in its CPU seconds
    cpu1 = logged("rank/1/cpu_s")
    assert all(0 < c1 < b1 - 0.5 * delay for c1, b1 in zip(cpu1, busy1)), (cpu1, busy1)
    assert all(v > 0 for v in logged("perf/cpu_s_per_step_median")), s["perf/cpu_s_per_step_median"]
    for tag in (
        "perf/samples_per_s_global",
        "perf/samples_per_s_per_device",
        "perf/tflops_per_device",
        "mem/peak_rss_mb_max",
        "rank/0/data_wait_frac",
        "rank/1/data_wait_frac",
    ):
        assert all(v >= 0 for v in logged(tag)), tag
    assert s["mem/peak_rss_mb_max"][-1][1] > 50  # a torch process holds far more than 50 MiB
    assert "perf/mfu" not in s  # CPU: no peak FLOP/s known, so no made-up MFU
    # TensorBoard's profile plugin: <logdir>/plugins/profile/<run>/<worker>.<ts>.pt.trace.json, one per rank
    traces = sorted((run_dir / "tb" / "plugins" / "profile").glob("*/*.pt.trace.json"))
    assert sorted(p.name.split(".")[0] for p in traces) == ["rank0", "rank1"], traces
    assert {p.parent.name for p in traces} == {"step-0000001"}
    trace = json.loads(traces[0].read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::convolution_backward" in names and "schemaVersion" in trace


def test_collective_timeout_names_the_stalled_rank(tmp_path: Path, data: Path) -> None:
    run_dir = tmp_path / "runs" / "hang"
    r = torchrun(
        2,
        run_args(
            data,
            run_dir,
            "--train.steps",
            "6",
            "--log.every",
            "1",
            "--doctor.enabled",
            "false",
            "--dist.train-timeout-s",
            "2",
            "--debug.straggler-delay-s",
            "12",
            "--debug.straggler-rank",
            "1",
            "--debug.straggler-steps",
            "3",
        ),
        env=base_env(tmp_path),
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    # the in-job watchdog reports before the collective's own timeout (job.observe.watchdog) and exits 124
    assert "exitcode  : 124" in out, out[-3000:]
    # Whichever rank's watchdog fires first reports every rank's progress (the straggler's own may be first).
    line = next((ln for ln in out.splitlines() if re.search(r"watchdog: rank \d made no progress", ln)), None)
    assert line is not None, out[-5000:]
    assert "stalled: rank(s) [1]" in line and "rank 1: completed step 2, computing step 3" in line, line
    assert "rank 0: completed step 2, gradients of step 3 ready, waiting in its all-reduce" in line, line


def test_a_rank_stalled_in_evaluation_is_named_and_leaves_its_stacks(tmp_path: Path, data: Path) -> None:
    """Rank 0 sleeps before its final evaluation's first forward. Rank 1, done with its first batch, times out in
    the evaluation's vote before its second (the ranks vote before each batch: job.train.evaluate) and names rank
    0 and where it is; the agent then SIGTERMs rank 0, still asleep, and before the agent's SIGKILL 30 s later rank
    0's watchdog writes where it was."""
    run_dir = tmp_path / "runs" / "evalhang"
    r = torchrun(
        2,
        run_args(
            data,
            run_dir,
            "--train.steps",
            "2",
            "--doctor.enabled",
            "false",
            "--dist.train-timeout-s",
            "10",
            "--debug.straggler-delay-s",
            "300",
            "--debug.straggler-rank",
            "0",
            "--debug.straggler-in",
            "eval",
        ),
        env=base_env(tmp_path),
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    line = next((ln for ln in out.splitlines() if "collective timed out on rank 1" in ln), None)
    assert line is not None, out[-5000:]
    assert "stalled: rank(s) [0]" in line and "rank 0: completed step 2, voting before its validation batch 1," in line
    assert "rank 1: completed step 2, voting before its validation batch 2," in line, line
    assert "rank 0: a stop signal landed" in out, out[-5000:]
    assert re.search(r'job/train/debug\.py", line \d+ in __call__', out), out[-5000:]
    assert re.search(r'job/train/evaluate\.py", line \d+ in evaluate', out), out[-5000:]


def test_metrics_jsonl_holds_one_record_per_log_step(tmp_path: Path, data: Path) -> None:
    """2 ranks, log.jsonl on: metrics.jsonl has one line per log step (2 and 4), each the whole step's record,
    the training log's, the observer's and the evaluation's values together, equal to what TensorBoard holds
    for that step (TensorBoard keeps float32)."""
    run_dir = tmp_path / "runs" / "jsonl"
    args = run_args(data, run_dir, "--train.steps", "4", "--log.every", "2", "--train.eval-every", "2")
    args += ["--log.jsonl", "true", "--optim.lr", "0.1", "--sched.name", "cosine", "--sched.warmup-steps", "3"]
    r = torchrun(2, args, env=base_env(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # what pandas.read_json(path, lines=True) parses
    assert [rec["step"] for rec in records] == [2, 4]
    for rec in records:
        assert {"step", "time", "train/loss", "train/lr", "straggler/slowest_rank", "val/loss", "val/top1"} <= set(rec)
    # train/lr is the rate the step used (the scheduler steps at the end of each step), not the next step's
    assert [rec["train/lr"] for rec in records] == pytest.approx([used_rates(0.1, 3, 4)[s - 1] for s in (2, 4)])
    tb = scalars(run_dir / "tb")
    for rec in records:
        at_step = {tag: v for tag, events in tb.items() for s, v in events if s == rec["step"]}
        at_step = {tag: v for tag, v in at_step.items() if not tag.startswith("hparam/")}
        assert set(at_step) == set(rec) - {"step", "time"}, set(at_step) ^ (set(rec) - {"step", "time"})
        for tag, v in at_step.items():
            assert rec[tag] == pytest.approx(v, rel=1e-6, abs=1e-6), tag
