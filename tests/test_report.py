"""Progress reports: the real reporter and its threads against sinks that record, block or fail (test doubles
of the *place* a status goes, nothing of the reporter replaced), the real status file and Slurm sinks, and the
status file of real ``ddp-job train`` runs (1 process, and 2 under torchrun on gloo), read while they train."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import threading
import time
from pathlib import Path

import pytest
from support import ROOT
from support.ci import bin_path
from support.cli import base_env, make_data, run_cli
from support.runs import tiny_args

from job.errors import ReportFailed
from job.observe import report
from job.observe.report import SlurmComment, StatusFile, StatusReporter, comment_text, status_record
from job.observe.status import Status

WAIT_S = 30.0
"""How long a test waits for a thread to do what it must (an upper bound against hangs, never a measured time)."""


def status(step: int, total: int = 100, **kw: object) -> Status:
    return Status(step, total, time.time(), 0.5, **kw)  # type: ignore[arg-type]


class Recording:
    """Records what it is sent, with the time; ``gate`` (when given) holds every send until it is set."""

    def __init__(self, name: str = "recording", min_interval_s: float = 0.0, gate: threading.Event | None = None):
        self.name, self.min_interval_s, self.gate = name, min_interval_s, gate
        self.sent: list[tuple[float, Status]] = []
        self.inside = threading.Event()
        self.got = threading.Condition()

    def send(self, status: Status) -> None:
        self.inside.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        with self.got:
            self.sent.append((time.monotonic(), status))
            self.got.notify_all()

    def wait_for(self, pred: object) -> None:
        with self.got:
            assert self.got.wait_for(lambda: pred(self), WAIT_S), f"{self.name}: got {self.steps()}"  # type: ignore[operator]

    def steps(self) -> list[int]:
        return [s.step for _, s in self.sent]


class Failing(Recording):
    """Raises ReportFailed while ``failing`` is set (permanently when ``permanent``), else records."""

    def __init__(self, permanent: bool = False) -> None:
        super().__init__("failing")
        self.failing, self.permanent, self.tries = True, permanent, 0

    def send(self, status: Status) -> None:
        self.tries += 1
        if self.failing:
            with self.got:
                self.got.notify_all()
            raise ReportFailed(self.name, "endpoint answered 503", permanent=self.permanent)
        super().send(status)


class _Clock:
    """The reporter's ``time``, recording the last ``time.monotonic()`` each thread read: a sink reads the time its
    reporter took just before calling it, so its gaps are the reporter's own, not widened or narrowed by when a
    loaded machine lets the sink run."""

    def __init__(self) -> None:
        self.last: dict[int, float] = {}

    def monotonic(self) -> float:
        now = time.monotonic()
        self.last[threading.get_ident()] = now
        return now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


class _Timed(Recording):
    """Records each status with the reporter's time of the send (``_Clock``)."""

    def __init__(self, clock: _Clock, min_interval_s: float) -> None:
        super().__init__("timed", min_interval_s)
        self.clock = clock

    def send(self, status: Status) -> None:
        with self.got:
            self.sent.append((self.clock.last[threading.get_ident()], status))
            self.got.notify_all()


def test_throttle_holds_back_but_never_loses_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most one send per min_interval_s, by the reporter's own clock; the statuses in between are skipped, and
    the newest one goes out when the interval has passed (not only at close)."""
    clock = _Clock()
    monkeypatch.setattr(report, "time", clock)
    sink = _Timed(clock, min_interval_s=0.4)
    r = StatusReporter([sink])
    try:
        for step in range(1, 201):
            r.update(status(step))
            time.sleep(0.005)
        sink.wait_for(lambda s: s.steps() and s.steps()[-1] == 200)
    finally:
        r.close()
    times = [t for t, _ in sink.sent]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g >= 0.4 - 0.001 for g in gaps), gaps  # 1 ms: the clock's rounding, not the machine's speed
    assert sink.steps() == sorted(sink.steps()), "an older status was sent after a newer one"


def test_a_blocked_sink_does_not_block_update_and_latest_wins() -> None:
    """While a sink is stuck inside send, update() keeps returning and the other sink keeps receiving; once it
    is released it gets the newest status, not the ones queued behind it."""
    gate = threading.Event()
    stuck, free = Recording("stuck", gate=gate), Recording("free")
    r = StatusReporter([stuck, free])
    try:
        r.update(status(1))
        assert stuck.inside.wait(WAIT_S)
        for step in range(2, 1001):
            r.update(status(step))  # would never return here if update waited for the stuck sink
        free.wait_for(lambda s: s.steps() and s.steps()[-1] == 1000)
        assert stuck.sent == [], "the stuck sink returned before the gate opened"
        gate.set()
        stuck.wait_for(lambda s: s.steps() and s.steps()[-1] == 1000)
        assert stuck.steps() == [1, 1000], stuck.steps()
    finally:
        gate.set()
        r.close()


def test_failure_logged_once_then_rate_limited_then_recovered(caplog: pytest.LogCaptureFixture) -> None:
    sink = Failing()
    r = StatusReporter([sink], repeat_s=3600)
    caplog.set_level(logging.INFO, logger="job")
    try:
        for step in range(1, 21):
            r.update(status(step))
            with sink.got:
                assert sink.got.wait_for(lambda n=step: sink.tries >= n, WAIT_S)
        sink.failing = False
        r.update(status(21))
        sink.wait_for(lambda s: s.steps() == [21])
    finally:
        r.close()
    warnings = [m for m in caplog.messages if "progress report to failing" in m and "recovered" not in m]
    assert len(warnings) == 1, warnings
    assert "endpoint answered 503" in warnings[0] and "training goes on" in warnings[0]
    assert any("progress report to failing recovered after 20 failed attempt(s)" in m for m in caplog.messages)


def test_repeats_carry_the_count_of_failures_in_between(caplog: pytest.LogCaptureFixture) -> None:
    sink = Failing()
    r = StatusReporter([sink], repeat_s=0.3)
    caplog.set_level(logging.WARNING, logger="job")
    try:
        step = 0
        deadline = time.monotonic() + WAIT_S
        while not any("still failing" in m for m in caplog.messages) and time.monotonic() < deadline:
            step += 1
            r.update(status(step))
            time.sleep(0.02)
    finally:
        r.close()
    repeat = next(m for m in caplog.messages if "still failing" in m)
    count = int(repeat.split("(")[1].split()[0])
    assert count >= 2, repeat  # the failures skipped by the rate limit are counted, not dropped
    assert sum("failed:" in m for m in caplog.messages) == 1


def test_permanent_refusal_stops_the_tries(caplog: pytest.LogCaptureFixture) -> None:
    sink, other = Failing(permanent=True), Recording("other")
    r = StatusReporter([sink, other])
    caplog.set_level(logging.WARNING, logger="job")
    try:
        r.update(status(1))
        with sink.got:
            assert sink.got.wait_for(lambda: sink.tries == 1, WAIT_S)
        for step in range(2, 11):
            r.update(status(step))
        other.wait_for(lambda s: s.steps() and s.steps()[-1] == 10)
    finally:
        late = r.close(status(10, finished=True))
    assert late == []
    assert sink.tries == 1
    assert sum("not trying again" in m for m in caplog.messages) == 1
    assert other.steps()[-1] == 10 and other.sent[-1][1].finished


def test_close_sends_the_final_status_at_once_and_is_bounded() -> None:
    """close() skips the throttle for the final status; a sink stuck forever does not hold the exit longer than
    the wait given, and is named."""
    slow = Recording("throttled", min_interval_s=3600)
    gate = threading.Event()
    stuck = Recording("stuck", gate=gate)
    r = StatusReporter([slow, stuck])
    try:
        r.update(status(1))
        slow.wait_for(lambda s: s.steps() == [1])
        assert stuck.inside.wait(WAIT_S)
        r.update(status(2))
        late = r.close(status(3, finished=True), wait_s=0.5)
        assert late == ["stuck"]
        assert slow.steps() == [1, 3] and slow.sent[-1][1].finished
        assert r.close() == []  # idempotent
    finally:
        gate.set()


def test_status_file_is_replaced_atomically_and_documents_its_fields(tmp_path: Path) -> None:
    path = tmp_path / report.STATUS_FILE
    sink = StatusFile(path)
    s = Status(40, 100, 1_700_000_000.25, 3.0, {"train/loss": 0.5, "val/top1": float("nan")}, 30, 12.5)
    sink.send(s)
    rec = json.loads(path.read_text())
    assert rec == status_record(s)
    assert rec["time"] == "2023-11-14T22:13:20.250+00:00"
    assert rec["progress_percentage"] == 40 and rec["estimated_remaining_s"] == 180
    assert rec["metrics"] == {"train/loss": 0.5, "val/top1": None}  # strict JSON: no NaN
    assert rec["last_checkpoint_step"] == 30 and rec["checkpoint_age_s"] == 12.5
    assert [p.name for p in tmp_path.iterdir()] == [report.STATUS_FILE]
    documented = report.status_record.__doc__ or ""
    assert all(f"``{k}``" in documented for k in rec), "every field of the status file is documented"


def test_status_file_failure_is_reported(tmp_path: Path) -> None:
    sink = StatusFile(tmp_path / "missing-dir" / report.STATUS_FILE)
    with pytest.raises(ReportFailed) as e:
        sink.send(status(1))
    assert "missing-dir" in e.value.reason and not e.value.permanent


def test_comment_text_is_short_and_says_what_matters() -> None:
    s = Status(40, 100, time.time(), 2.0, {"train/loss": 0.41237, "train/lr": 0.1}, 30, 12.4)
    assert comment_text(s) == "ddp-job step 40/100 40% eta 120s ckpt@30 age 12s loss 0.4124"
    done = Status(100, 100, time.time(), 2.0, {}, 100, 0.2, finished=True)
    assert comment_text(done) == "ddp-job done 100/100 100% ckpt@100 age 0s"
    assert len(comment_text(Status(10**30, 10**31, 0.0, 1e30, {"train/loss": 1e300}, 10**30, 1e30))) <= 1024


def test_missing_scontrol_is_a_permanent_failure(tmp_path: Path) -> None:
    sink = SlurmComment("12345", 60.0, scontrol=str(tmp_path / "no-such-scontrol"))
    with pytest.raises(ReportFailed) as e:
        sink.send(status(1))
    assert e.value.permanent and "not on PATH" in e.value.reason


# ------------------------------------------------------------------ real training runs
STEPS = 16


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    """A small run that takes a while on purpose: rank 0 sleeps before each step (a testing aid that does not
    change the math) so that the status file can be read several times while it trains, however fast the
    machine; checkpoints every 4 steps, async with a write slower than the 4 steps, so a save is in flight at some
    log steps."""
    return [
        *tiny_args(data),
        "--train.steps",
        str(STEPS),
        "--train.global-batch-size",
        "8",
        "--run.output-dir",
        str(out),
        "--run.name",
        "r",
        "--log.every",
        "2",
        "--log.progress",
        "off",
        "--ckpt.every",
        "4",
        "--ckpt.keep-last",
        "100",
        "--ckpt.async-save",
        "on",
        "--debug.ckpt-write-delay-s",
        "2.0",
        "--debug.straggler-rank",
        "0",
        "--debug.straggler-delay-s",
        "0.4",
        *extra,
    ]


def poll_status(proc: subprocess.Popen[str], run_dir: Path) -> list[dict]:
    """Every distinct status.json content seen while ``proc`` runs (parsed at once: a torn file fails here), each
    with what was on disk the moment it was read: the complete checkpoints and their manifests' times."""
    path, seen, last = run_dir / report.STATUS_FILE, [], None
    while proc.poll() is None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = None
        if text is not None and text != last:
            rec = json.loads(text)
            rec["on_disk"] = complete_checkpoints(run_dir)
            seen.append(rec)
            last = text
        time.sleep(0.02)
    return seen


def complete_checkpoints(run_dir: Path) -> dict[int, float]:
    """step -> its manifest's mtime, for the checkpoints whose manifest verifies."""
    from job.checkpoint import store

    out = {}
    for step, p in store.scan(run_dir):
        if store.verify(p)[0]:
            out[step] = (p / store.MANIFEST).stat().st_mtime
    return out


CLOCK_SLACK_S = 0.05
"""File times come from the kernel's coarse clock: they may lag time.time() by a tick."""


def check_statuses(seen: list[dict], run_dir: Path, config_mtime: float) -> None:
    running = [s for s in seen if not s["finished"]]
    assert len({s["step"] for s in running}) >= 3, f"too few statuses read while training: {seen}"
    steps = [s["step"] for s in seen]
    assert steps == sorted(steps) and steps[-1] == STEPS
    pct = [s["progress_percentage"] for s in seen]
    assert pct == sorted(pct) and pct[0] < pct[-1] == 100
    etas = [s["estimated_remaining_s"] for s in running if s["estimated_remaining_s"] is not None]
    assert len(etas) >= 2 and etas[-1] < etas[0], f"ETA did not fall: {etas}"
    for s in running:
        assert s["progress_percentage"] == min(100 * s["step"] // STEPS, 99)  # 100 only once finished
        assert s["estimated_remaining_s"] == round((STEPS - s["step"]) * s["step_time_s"])
        assert {"train/loss", "train/lr"} <= s["metrics"].keys()
    for s in seen:
        check_checkpoint_fields(s, config_mtime)
    in_flight = [s for s in running if (s["last_checkpoint_step"] or 0) < 4 * (s["step"] // 4)]
    assert in_flight, "no status was read while an async save was in flight (the slow write is for that)"
    end = seen[-1]
    assert end["finished"] and end["estimated_remaining_s"] == 0 and end["last_checkpoint_step"] == STEPS
    assert max(complete_checkpoints(run_dir)) == STEPS
    assert [p.name for p in run_dir.glob("status.json*")] == ["status.json"]


def check_checkpoint_fields(s: dict, config_mtime: float) -> None:
    """The status names a checkpoint that was complete on disk when it was read (never one still being written),
    and its age dates the checkpoint's state between the previous checkpoint's commit and its own."""
    ckpt, on_disk = s["last_checkpoint_step"], s["on_disk"]
    if ckpt is None:
        assert s["checkpoint_age_s"] is None
        return
    assert ckpt in on_disk, f"status names step {ckpt}, on disk: {sorted(on_disk)}"
    assert ckpt <= s["step"]
    taken = s["wall_time"] - s["checkpoint_age_s"]
    before = [t for step, t in on_disk.items() if step < ckpt]
    assert taken <= on_disk[ckpt] + CLOCK_SLACK_S
    assert taken >= max(before, default=config_mtime) - CLOCK_SLACK_S


@pytest.mark.integration
@pytest.mark.parametrize("nproc", [1, 2])
def test_status_file_of_a_real_run(tmp_path: Path, nproc: int) -> None:
    data = make_data(tmp_path / "shapes", classes=4, per_class=8, size=16)
    out = tmp_path / "runs"
    args = train_args(data, out)
    cmd = [bin_path("ddp-job"), "train", *args]
    if nproc > 1:
        cmd = [bin_path("torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "job", "train", *args]
    log_path = tmp_path / "train.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            cmd, env=base_env(tmp_path), cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, text=True
        )
        try:
            seen = poll_status(proc, out / "r")
        finally:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "progress reports to: status file" in log
    check_statuses(seen, out / "r", (out / "r" / "config.yaml").stat().st_mtime)


@pytest.mark.integration
def test_a_run_goes_on_without_scontrol(tmp_path: Path) -> None:
    """Under Slurm (SLURM_JOB_ID set) with no scontrol on PATH: one warning, no further tries, a complete run."""
    data = make_data(tmp_path / "shapes", classes=4, per_class=8, size=16)
    out = tmp_path / "runs"
    args = [*tiny_args(data), "--train.steps", "6", "--train.global-batch-size", "8", "--log.every", "1"]
    args += ["--run.output-dir", str(out), "--log.progress", "off", "--report.slurm-every-s", "1"]
    env = base_env(tmp_path, SLURM_JOB_ID="4242", PATH=str(Path(bin_path("ddp-job")).parent))
    r = run_cli(["train", *args], env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "progress reports to: status file, slurm comment" in r.stdout
    warned = [line for line in r.stdout.splitlines() if "progress report to slurm comment" in line]
    assert len(warned) == 1 and "not on PATH" in warned[0] and "not trying again" in warned[0], warned
    final = json.loads((out / "default" / report.STATUS_FILE).read_text())
    assert final["finished"] and final["step"] == 6


@pytest.mark.integration
def test_a_resumed_run_reports_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    """Before its first save, a resumed run names the checkpoint it loaded, aged from its own start."""
    data = make_data(tmp_path / "shapes", classes=4, per_class=8, size=16)
    out = tmp_path / "runs"
    args = train_args(data, out, "--ckpt.async-save", "off", "--debug.ckpt-write-delay-s", "0")
    first = run_cli(["train", *args, "--train.steps", "8"], env=base_env(tmp_path))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    log_path = tmp_path / "resumed.log"
    with log_path.open("w") as log_file:
        cmd = [bin_path("ddp-job"), "train", *args, "--train.steps", "12"]
        proc = subprocess.Popen(cmd, env=base_env(tmp_path), cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            seen = poll_status(proc, out / "r")
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-4000:]
    resumed = [s for s in seen if 8 < s["step"] < 12]
    assert resumed and all(s["last_checkpoint_step"] == 8 for s in resumed), seen
    config_mtime = (out / "r" / "config.yaml").stat().st_mtime  # rewritten by the resumed run at its start
    for s in resumed:  # its work since the checkpoint is this attempt's: aged from the start, after config.yaml
        assert 8 in s["on_disk"]
        taken = s["wall_time"] - s["checkpoint_age_s"]
        assert config_mtime - CLOCK_SLACK_S <= taken <= s["wall_time"], "not aged from the resumed run's start"
    assert seen[-1]["finished"] and seen[-1]["last_checkpoint_step"] == 12
