"""Experiment trackers (MLflow, Weights & Biases): more sinks of the one step record (``metrics.StepRecords``).

Rank 0 only. The training thread hands each committed record to ``TrackerSink.scalars``, which appends it to a
bounded queue and returns: no I/O, no waiting. One daemon thread per tracker opens the tracker's run (created on
a fresh start, resumed when the run resumes from a checkpoint), sends the params and tags once, then the queued
records in batches. A tracker that fails keeps its records queued (the oldest dropped past ``MAX_PENDING``), is
logged once at WARNING with the setting to fix, again at most every ``FAILURE_REPEAT_S``, and retried with
backoff; training goes on. ``close`` sends what is left, waiting at most twice the tracker's timeout.

One tracker run per training run: its id, and the newest step the tracker has, live in ``<run_dir>/trackers.json``
(``RunsFile``). A resumed attempt reuses the id and never sends a step the tracker already has: after a crash, the
steps between the resumed checkpoint and the crash keep the values the tracker got first (MLflow never overwrites
a metric value; W&B drops a step below its newest).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import SecretBytes, SecretStr

from job.cluster.env import DistEnv
from job.config import JobConfig, config_to_dict, flatten
from job.errors import EXIT_OK, EXIT_PREEMPTED, BadInput
from job.observe.metrics import NullWriter

log = logging.getLogger("job")

RUNS_FILE = "trackers.json"
"""``<run_dir>/trackers.json``: each tracker's run id and the newest step it has (``RunsFile``)."""
MAX_PENDING = 10_000
"""Records a tracker that is down keeps queued (hours of log steps); past it the oldest are dropped and counted."""
FAILURE_REPEAT_S = 300.0
"""A tracker that keeps failing is logged again at most this often, with the count of failures in between."""
BATCH_RECORDS = 20
"""Records per request: a failed request resends at most these (MLflow appends a value sent twice)."""
RETRY_MAX_S = 60.0
CLOSE_RETRY_S = 0.5
"""Once closing, a failed try is repeated this often until close's wait runs out."""
"""The longest wait between two tries of a tracker that is down (doubling from one second)."""
_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


# ------------------------------------------------------------------ what a run records there
def params(cfg: JobConfig) -> dict[str, str]:
    """The resolved config, flattened to dotted names, as strings: a secret setting (``SecretStr``) left out and
    the user:password of any URL in a value replaced by ``***``."""
    typed = flatten(cfg.model_dump())
    out: dict[str, str] = {}
    for name, value in flatten(config_to_dict(cfg)).items():
        if isinstance(typed.get(name), (SecretStr, SecretBytes)):
            continue
        out[name] = without_credentials(value if isinstance(value, str) else json.dumps(value))
    return out


def without_credentials(text: str) -> str:
    """``text`` with the user information of every URL in it (``scheme://user:password@host``) replaced."""
    return _CREDENTIALS.sub(r"\g<scheme>***@", text)


def tags(cfg: JobConfig, env: DistEnv) -> dict[str, str]:
    """What a tracker shows about the run's setting: launcher, world size, strategy, the checkpoint location and
    the git commit where known."""
    out = {
        "launcher": env.launcher,
        "world_size": str(env.world_size),
        "strategy": cfg.train.strategy,
        "checkpoint_dir": without_credentials(str(cfg.run_dir.absolute())),
    }
    commit = git_commit(os.environ)
    if commit:
        out["git_commit"] = commit
    return out


GIT_COMMIT_VAR = "DDP_JOB_GIT_COMMIT"
"""The commit of the code that runs, where the image or the submitter knows it; else ``git rev-parse HEAD``."""


def git_commit(environ: Mapping[str, str]) -> str:
    """``GIT_COMMIT_VAR``, else the commit of the working directory's git checkout, else empty."""
    if environ.get(GIT_COMMIT_VAR):
        return environ[GIT_COMMIT_VAR]
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if r.returncode != 0:
        return ""
    return r.stdout.strip()


# ------------------------------------------------------------------ settings
def mlflow_uri(cfg: JobConfig, environ: Mapping[str, str]) -> str:
    return cfg.trackers.mlflow_tracking_uri or environ.get("MLFLOW_TRACKING_URI", "")


def check(cfg: JobConfig, environ: Mapping[str, str]) -> None:
    """Bad tracker settings fail before anything is written (exit 2): a tracker asked for whose package is not
    installed, MLflow without a tracking server."""
    t = cfg.trackers
    for on, name, package in ((t.mlflow, "mlflow", "mlflow"), (t.wandb, "wandb", "wandb")):
        if on and importlib.util.find_spec(package) is None:
            raise BadInput(
                f"trackers.{name}=true but the {package} package is not installed.",
                "install the trackers extra (pip install 'ddp-job[trackers]'), or set trackers." + name + "=false.",
                setting=f"trackers.{name}",
                value="true",
            )
    if t.mlflow and not mlflow_uri(cfg, environ):
        raise BadInput(
            "trackers.mlflow=true but no tracking server is named.",
            "set trackers.mlflow_tracking_uri (or export MLFLOW_TRACKING_URI), e.g. http://mlflow:5000.",
            setting="trackers.mlflow_tracking_uri",
            value="",
        )


# ------------------------------------------------------------------ the run's tracker ids
class RunsFile:
    """``<run_dir>/trackers.json``: ``{tracker: {"run_id": str, "last_step": int}}``, replaced atomically; shared by
    the trackers' threads (one lock)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / RUNS_FILE
        self._lock = threading.Lock()

    def read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return data

    def get(self, tracker: str) -> dict[str, Any]:
        entry = self.read().get(tracker)
        if isinstance(entry, dict):
            return entry
        return {}

    def update(self, tracker: str, **fields: Any) -> None:
        with self._lock:
            data = self.read()
            data[tracker] = {**data.get(tracker, {}), **fields}
            tmp = self.path.with_name(f".{RUNS_FILE}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1) + "\n")
            os.replace(tmp, self.path)

    def forget(self) -> None:
        """A fresh start (no checkpoint to resume): the ids of an earlier run in this directory are not reused."""
        with self._lock:
            self.path.unlink(missing_ok=True)


# ------------------------------------------------------------------ the trackers
Record = tuple[int, int, dict[str, float]]
"""(step, Unix time in ms, scalars) of one committed step."""


class Tracker(Protocol):
    """One tracker's client calls; every call may raise (the sink's thread catches, logs and retries)."""

    name: str
    fix: str
    """The settings to check when it fails (named in the warning)."""

    def start(self, run_id: str | None) -> str:
        """Create the tracker's run (``run_id`` None) or resume it; return the run's id."""
        ...

    def describe(self) -> None:
        """Send the params and tags (once per attempt, after ``start``)."""
        ...

    def send(self, records: list[Record]) -> None: ...

    def finish(self, completed: bool) -> None: ...


class MlflowTracker:
    """MLflow through ``MlflowClient`` (no global active run): ``create_run`` once, ``log_batch`` per batch,
    ``set_terminated`` at the end (FINISHED, or KILLED after a stop: the next attempt sets it RUNNING again)."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, str], tags: dict[str, str]) -> None:
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.params, self.tags = params, tags
        self.fix = f"trackers.mlflow_tracking_uri={without_credentials(uri)} (or MLFLOW_TRACKING_URI) and the server"
        self.run_id = ""
        self._client: Any = None

    def start(self, run_id: str | None) -> str:
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            experiment = client.get_experiment_by_name(self.experiment)
            if experiment is None:
                experiment_id = client.create_experiment(self.experiment)
            else:
                experiment_id = experiment.experiment_id
            run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return run_id

    def describe(self) -> None:
        from mlflow.entities import Param, RunTag

        have = self._client.get_run(self.run_id).data.params  # a param once written cannot change: the missing ones
        new = [Param(k, v[:_MLFLOW_PARAM_LENGTH]) for k, v in self.params.items() if k not in have]
        for i in range(0, len(new), 100):  # log_batch takes at most 100 params
            self._client.log_batch(self.run_id, params=new[i : i + 100])
        self._client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in self.tags.items()])

    def send(self, records: list[Record]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, t, step) for step, t, values in records for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def finish(self, completed: bool) -> None:
        if completed:
            self._client.set_terminated(self.run_id, status="FINISHED")
        else:
            self._client.set_terminated(self.run_id, status="KILLED")


_MLFLOW_PARAM_LENGTH = 6000
"""MLflow's longest param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH)."""


class WandbTracker:
    """Weights & Biases: ``wandb.init(id=..., resume="allow")`` with the id this run keeps, ``run.log(..., step=)``
    per record, ``run.finish``. Console capture and system metrics off: the job logs its own."""

    name = "wandb"

    def __init__(
        self,
        project: str,
        mode: Literal["", "online", "offline"],
        directory: Path,
        run_name: str,
        params: dict[str, str],
        tags: dict[str, str],
    ) -> None:
        self.project, self.directory, self.run_name = project or None, directory, run_name
        self.mode: Literal["online", "offline"] | None = None  # None: WANDB_MODE, else online
        if mode != "":
            self.mode = mode
        self.params, self.tags = params, tags
        self.timeout_s = 30.0
        self.new_id = uuid.uuid4().hex[:16]
        """The id of a run started fresh: the same for every try of this attempt (a failed try leaves files)."""
        self.fix = "WANDB_API_KEY, trackers.wandb_project (or WANDB_PROJECT) and trackers.wandb_mode (or WANDB_MODE)"
        self._run: Any = None

    def start(self, run_id: str | None) -> str:
        import wandb

        if run_id is None:
            run_id = self.new_id
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", x_disable_stats=True, init_timeout=self.timeout_s)
        self._run = wandb.init(
            id=run_id,
            resume="allow",
            project=self.project,
            mode=self.mode,
            dir=str(self.directory),
            name=self.run_name,
            config={**self.params, **{f"tags.{k}": v for k, v in self.tags.items()}},
            tags=[f"{k}={v}"[:64] for k, v in self.tags.items()],  # W&B refuses a tag over 64 characters
            settings=settings,
            reinit="create_new",
        )
        return run_id

    def describe(self) -> None:
        pass  # wandb.init took the config and tags

    def send(self, records: list[Record]) -> None:
        for step, _, values in records:
            self._run.log(values, step=step)

    def finish(self, completed: bool) -> None:
        exit_code = EXIT_OK
        if not completed:  # a stop, or a failure: the run goes on in the next attempt
            exit_code = EXIT_PREEMPTED
        self._run.finish(exit_code=exit_code)


# ------------------------------------------------------------------ the sink
class _Failures:
    """A tracker's failure log: the first failure at WARNING with the settings to check, repeats at most every
    ``repeat_s`` with their count, and the recovery."""

    def __init__(self, tracker: Tracker, repeat_s: float) -> None:
        self.tracker, self.repeat_s = tracker, repeat_s
        self.failing = False
        self._count = 0
        self._logged_at = 0.0

    def failed(self, error: Exception, pending: int) -> None:
        self._count += 1
        now = time.monotonic()
        reason = without_credentials(f"{type(error).__name__}: {error}")[:500]
        if not self.failing:
            log.warning(
                "%s tracker failed: %s. Training goes on; %d record(s) kept and retried (check %s)",
                self.tracker.name,
                reason,
                pending,
                self.tracker.fix,
            )
        elif now - self._logged_at >= self.repeat_s:
            log.warning("%s tracker still failing (%d tries): %s", self.tracker.name, self._count, reason)
        else:
            return
        self.failing, self._logged_at = True, now

    def succeeded(self) -> None:
        if self.failing:
            log.info("%s tracker recovered after %d failed tries", self.tracker.name, self._count)
        self.failing, self._count = False, 0


class TrackerSink(NullWriter):
    """One tracker's queue and the daemon thread that feeds it (the module docstring says how)."""

    def __init__(
        self, tracker: Tracker, runs: RunsFile, resumed: bool, timeout_s: float, max_pending: int = MAX_PENDING
    ) -> None:
        self.tracker, self.runs, self.timeout_s = tracker, runs, timeout_s
        known = runs.get(tracker.name)
        self.run_id: str | None = None
        self.last_step = -1
        """The newest step the tracker has: a record of this step or an earlier one is not sent again."""
        if resumed and known.get("run_id"):
            self.run_id, self.last_step = str(known["run_id"]), int(known.get("last_step", -1))
        self.dropped = 0
        self.completed = False
        self._seq = 0
        self._pending: collections.deque[tuple[int, Record]] = collections.deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._started = self._described = False
        self._close_by = math.inf
        self._failures = _Failures(tracker, FAILURE_REPEAT_S)
        self._thread = threading.Thread(target=self._run, name=f"tracker-{tracker.name}", daemon=True)
        self._thread.start()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Queue the step's record; returns at once."""
        with self._lock:
            if len(self._pending) == self._pending.maxlen:
                self.dropped += 1
            self._seq += 1
            self._pending.append((self._seq, (step, int(time.time() * 1000), dict(values))))
        self._wake.set()

    def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
        self.completed = True  # only a completed run reports its final hparams (job.train.loop.finish)

    def close(self) -> None:
        """Send what is queued and end the tracker's run, waiting at most two request timeouts."""
        self._close_by = time.monotonic() + 2 * self.timeout_s
        self._closing.set()
        self._wake.set()
        self._thread.join(2 * self.timeout_s)
        if self._thread.is_alive() or self._pending:
            log.warning(
                "%s tracker: exiting with %d record(s) not sent (their steps are in metrics.jsonl and TensorBoard)",
                self.tracker.name,
                len(self._pending),
            )

    def _run(self) -> None:
        delay = 1.0
        while True:
            if self._failures.failing:
                self._wake.wait(delay)  # retry after the backoff, or at once when closing
            else:
                self._wake.wait()
            self._wake.clear()
            try:
                self._round()
            except Exception as e:  # a tracker's failure, whatever its type, never reaches training
                self._failures.failed(e, len(self._pending))
                if self._closing.is_set():
                    if time.monotonic() + CLOSE_RETRY_S >= self._close_by:
                        return
                    delay = CLOSE_RETRY_S  # closing: tries until close's wait runs out
                else:
                    delay = min(2 * delay, RETRY_MAX_S)
                continue
            self._failures.succeeded()
            delay = 1.0
            if self._closing.is_set():
                self._finish()
                return

    def _round(self) -> None:
        """Start the tracker's run if not yet, describe it, then send every queued record it does not have."""
        if not self._started:
            self.run_id = self.tracker.start(self.run_id)
            self.runs.update(self.tracker.name, run_id=self.run_id, last_step=self.last_step)
            self._started = True
        if not self._described:
            self.tracker.describe()
            self._described = True
        with self._lock:
            queued = list(self._pending)
        if not queued:
            return
        for i in range(0, len(queued), BATCH_RECORDS):
            chunk = queued[i : i + BATCH_RECORDS]
            batch = [r for _, r in chunk if r[0] > self.last_step]
            if batch:
                self.tracker.send(batch)
                self.last_step = batch[-1][0]
                self.runs.update(self.tracker.name, last_step=self.last_step)
            with self._lock:  # what was sent (or skipped) leaves the queue; records queued meanwhile stay
                while self._pending and self._pending[0][0] <= chunk[-1][0]:
                    self._pending.popleft()

    def _finish(self) -> None:
        try:
            self.tracker.finish(self.completed)
        except Exception as e:
            self._failures.failed(e, 0)
        if self.dropped:
            log.warning("%s tracker: %d record(s) dropped while it was down", self.tracker.name, self.dropped)


def build(cfg: JobConfig, env: DistEnv, resumed: bool, environ: Mapping[str, str]) -> list[NullWriter]:
    """Rank 0's tracker sinks (none elsewhere, nor with every tracker off); ``resumed``: the run resumes from a
    checkpoint, so the tracker runs in ``<run_dir>/trackers.json`` go on."""
    t = cfg.trackers
    if not env.is_main or not (t.mlflow or t.wandb):
        return []
    runs = RunsFile(cfg.run_dir)
    if not resumed:
        runs.forget()
    p, g = params(cfg), tags(cfg, env)
    trackers: list[Tracker] = []
    if t.mlflow:
        _bound_mlflow_requests(t.timeout_s)
        experiment = t.mlflow_experiment or environ.get("MLFLOW_EXPERIMENT_NAME", "") or "Default"
        trackers.append(MlflowTracker(mlflow_uri(cfg, environ), experiment, cfg.run.name, p, g))
    if t.wandb:
        directory = Path(t.wandb_dir or environ.get("WANDB_DIR", "") or cfg.run_dir)
        w = WandbTracker(t.wandb_project, t.wandb_mode, directory, cfg.run.name, p, g)
        w.timeout_s = t.timeout_s
        trackers.append(w)
    return [TrackerSink(tracker, runs, resumed, t.timeout_s) for tracker in trackers]


def _bound_mlflow_requests(timeout_s: float) -> None:
    """MLflow's client retries a failed request for minutes by default: one try per round, bounded by the
    tracker's timeout (the sink retries itself). A value the user exported wins."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(timeout_s))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
