"""Experiment trackers against the real things: an MLflow tracking server (``mlflow server``, SQLite backend, local
artifact root) started here on a port of its own and read back with ``MlflowClient``, and Weights & Biases in
offline mode read back with the library's own reader of its run files (no network).

A 2-process run stopped (exit 143) and resumed is ONE tracker run with one value per step, equal to the step's
record in metrics.jsonl; a server that stops answering mid-run stops neither training nor the tracker's run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ephemeral_port_reserve import reserve
from mlflow.tracking import MlflowClient
from support.cli import base_env
from support.runs import tiny_args

from job.cluster.env import detect_env
from job.config import JobConfig, load_config
from job.errors import EXIT_OK, EXIT_PREEMPTED, BadInput
from job.observe import trackers

STEPS = 4
TINY = [
    *tiny_args(),
    "--train.global-batch-size",
    "8",
    "--train.steps",
    str(STEPS),
    "--log.every",
    "1",
    "--log.jsonl",
    "true",
    "--log.tensorboard",
    "false",
    "--doctor.enabled",
    "false",
]
LAUNCH_2 = [sys.executable, "-m", "job", "launch", "--standalone", "--nproc-per-node", "2", "--"]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1:``port`` with its SQLite store and artifacts under ``root``; no job executor
    (the GenAI scorer jobs, which need the full ``mlflow`` package)."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, reserve()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        (self.root / "artifacts").mkdir(parents=True, exist_ok=True)
        cmd = [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--default-artifact-root",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=base_env(self.root, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=5) as r:  # one try: the client retries
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("mlflow server did not answer in 180 s: " + (self.root / "server.log").read_text()[-3000:])

    def signal_group(self, sig: int) -> None:
        """``sig`` to the server and its workers (uvicorn/gunicorn children)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    s = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    s.start()
    yield s
    s.stop()


def mlflow_env(tmp_path: Path, uri: str, experiment: str) -> dict[str, str]:
    """The variables a user exports (MLflow's own names); MLflow's client retries bounded like the job's."""
    return base_env(tmp_path, MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME=experiment)


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def jsonl(run_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl by step (a step written twice fails the caller's count check)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines}


# --- pure ------------------------------------------------------------------------------------------------


def test_params_are_the_flat_config_without_credentials() -> None:
    cfg = load_config(["--trackers.mlflow-tracking-uri", "https://alice:s3cret@mlflow.example:5000"], {})
    p = trackers.params(cfg)
    assert p["optim.lr"] == json.dumps(cfg.optim.lr) and p["train.strategy"] == "ddp"
    assert p["trackers.mlflow_tracking_uri"] == "https://***@mlflow.example:5000"
    assert not any("s3cret" in v or "alice" in v for v in p.values())


def test_mlflow_without_a_server_is_bad_input_naming_the_setting() -> None:
    cfg = load_config(["--trackers.mlflow", "true"], {})
    with pytest.raises(BadInput) as e:
        trackers.check(cfg, {})
    assert e.value.setting == "trackers.mlflow_tracking_uri" and "MLFLOW_TRACKING_URI" in e.value.fix
    trackers.check(cfg, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"})  # the library's own variable is enough


# --- real runs: the MLflow server, W&B offline --------------------------------------------------------------


def test_stopped_and_resumed_2_process_run_is_one_run_in_each_tracker(tmp_path: Path, server: MlflowServer) -> None:
    """Attempt 1 stops after step 1 (train.max_time spent: exit 143, the stop save); attempt 2 resumes to the end.
    MLflow holds one run and W&B (offline) one run id: every step once, with the value of the step's record in
    metrics.jsonl; the params, the tags, the final validation, the end state."""
    run_dir = tmp_path / "runs" / "r"
    args = [*TINY, "--run.output-dir", str(run_dir.parent), "--run.name", "r"]
    args += ["--trackers.mlflow", "true", "--trackers.wandb", "true"]
    env = mlflow_env(tmp_path, server.uri, "resume")
    home = tmp_path / "wandb-home"  # W&B's settings, cache and data: nothing outside the test's directory
    env.update(WANDB_MODE="offline", WANDB_PROJECT="trackers-test", WANDB_CONFIG_DIR=str(home / "config"))
    env.update(WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))
    env.pop("WANDB_API_KEY", None)
    first = subprocess.run(
        [*LAUNCH_2, *args, "--train.max-time", "0.001"], env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == EXIT_PREEMPTED, (first.stdout + first.stderr)[-4000:]
    run_id = json.loads((run_dir / trackers.RUNS_FILE).read_text())["mlflow"]["run_id"]
    client = MlflowClient(server.uri)
    assert client.get_run(run_id).info.status == "KILLED"  # stopped, to be resumed
    second = subprocess.run([*LAUNCH_2, *args], env=env, capture_output=True, text=True, timeout=600)
    out = second.stdout + second.stderr
    assert second.returncode == EXIT_OK, out[-4000:]
    assert "resumed from" in out and "tracker failed" not in out
    records = jsonl(run_dir)
    assert sorted(records) == list(range(1, STEPS + 1))
    cfg = load_config(args, {})
    check_mlflow_run(client, run_id, records, cfg, run_dir)
    check_wandb_run(run_dir, records, cfg)


def check_mlflow_run(
    client: MlflowClient, run_id: str, records: dict[int, dict[str, Any]], cfg: JobConfig, run_dir: Path
) -> None:
    experiment = client.get_experiment_by_name("resume")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        assert history(client, run_id, key) == [(s, pytest.approx(records[s][key], rel=1e-6)) for s in records], key
    assert history(client, run_id, "val/count") == [(STEPS, records[STEPS]["val/count"])]
    assert run.data.params["optim.lr"] == json.dumps(cfg.optim.lr)
    assert run.data.params["trackers.mlflow"] == "true" and run.data.params["train.steps"] == str(STEPS)
    t = run.data.tags
    assert (t["launcher"], t["world_size"], t["strategy"]) == ("torchrun", "2", "ddp")
    assert t["checkpoint_dir"] == str(run_dir.absolute())
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    assert t.get("git_commit") == (head.stdout.strip() if head.returncode == 0 else None)  # where known


def check_wandb_run(run_dir: Path, expected: dict[int, dict[str, Any]], cfg: JobConfig) -> None:
    """Both attempts' offline files carry the one run id kept in trackers.json (what `wandb sync` uploads as one
    run); together every step once; the config as W&B's config, the tags as W&B's tags."""
    run_id = json.loads((run_dir / trackers.RUNS_FILE).read_text())["wandb"]["run_id"]
    attempts = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [a.name.rsplit("-", 1)[1] for a in attempts] == [run_id, run_id], attempts
    records = [wandb_records(a / f"run-{run_id}.wandb") for a in attempts]
    history = [r["history"] for rs in records for r in rs if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == list(range(1, STEPS + 1))
    for h in history:
        assert h["item"]["train/loss"] == pytest.approx(expected[h["step"]["num"]]["train/loss"], rel=1e-6)
    assert [r["exit"]["exit_code"] for rs in records for r in rs if r["type"] == "exit"] == [EXIT_PREEMPTED, 0]
    run = next(r["run"] for r in records[0] if r["type"] == "run")
    assert run["run_id"] == run_id and run["project"] == "trackers-test" and run["display_name"] == "r"
    assert run["config"]["update"]["optim.lr"] == json.dumps(cfg.optim.lr)
    assert run["config"]["update"]["tags.checkpoint_dir"] == str(run_dir.absolute())
    assert {"launcher=torchrun", "strategy=ddp", "world_size=2"} <= set(run["tags"])


def test_a_server_that_stops_answering_neither_stops_training_nor_loses_steps(
    tmp_path: Path, server: MlflowServer
) -> None:
    """The server is frozen (SIGSTOP: connections hang) once the tracker has step 1 and until the run has trained
    its last step: training goes on, the tries fail one after another and the failure is logged once with the
    setting to fix; thawed, the queued steps reach it (each once) before the run ends."""
    steps = 12
    run_dir = tmp_path / "runs" / "down"
    args = [*TINY, "--run.output-dir", str(run_dir.parent), "--run.name", "down", "--trackers.mlflow", "true"]
    args += ["--train.steps", str(steps), "--trackers.timeout-s", "2"]
    # Rank 0 sleeps before each step after the first: the run outlasts the tracker's timeout while it is frozen.
    args += ["--debug.straggler-rank", "0", "--debug.straggler-delay-s", "1"]
    args += ["--debug.straggler-steps", ",".join(str(s) for s in range(2, steps + 1))]
    env = mlflow_env(tmp_path, server.uri, "down")
    log_path = tmp_path / "train.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "job", "train", *args], env=env, stdout=log, stderr=log)
    client = MlflowClient(server.uri)
    try:
        run_id = _wait_for(lambda: _step_one(client, run_dir), proc, log_path)
        server.signal_group(signal.SIGSTOP)
        try:  # frozen while the run trains to its last step: several tries fail meanwhile
            _wait_for(lambda: f"step {steps}/{steps} loss" in log_path.read_text() or None, proc, log_path)
        finally:
            server.signal_group(signal.SIGCONT)
        assert proc.wait(600) == EXIT_OK, log_path.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log_path.read_text()
    assert out.count("mlflow tracker failed") == 1, out[-4000:]
    assert "check trackers.mlflow_tracking_uri=" + server.uri in out
    tries = re.search(r"mlflow tracker recovered after (\d+) failed tries", out)
    assert tries is not None and int(tries.group(1)) >= 2, out[-4000:]  # retried, and logged once
    assert history(client, run_id, "train/loss") == [
        (s, pytest.approx(jsonl(run_dir)[s]["train/loss"])) for s in range(1, steps + 1)
    ]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_resumed_run_never_sends_a_step_the_tracker_has(tmp_path: Path, server: MlflowServer) -> None:
    """After a crash the run resumes from an older checkpoint and trains some steps again: the tracker keeps the
    values it got first for them and takes the steps after them. A fresh start in the same directory (no
    checkpoint) is a new tracker run."""
    run_dir = tmp_path / "runs" / "replay"
    cfg = load_config(
        ["--run.output-dir", str(run_dir.parent), "--run.name", "replay", "--trackers.mlflow", "true"],
        {"JOB_TRACKERS__MLFLOW_TRACKING_URI": server.uri, "JOB_TRACKERS__MLFLOW_EXPERIMENT": "replay"},
    )
    run_dir.mkdir(parents=True)
    env = detect_env({})

    def attempt(resumed: bool, steps: range, scale: float) -> None:
        (sink,) = trackers.build(cfg, env, resumed, {})
        for step in steps:
            sink.scalars(step, {"x": scale * step})
        sink.close()

    attempt(False, range(1, 5), 1.0)  # steps 1-4 reach the tracker, then the crash
    attempt(True, range(3, 7), 10.0)  # resumed from the checkpoint of step 2: 3 and 4 again, then 5 and 6
    client = MlflowClient(server.uri)
    run_id = json.loads((run_dir / trackers.RUNS_FILE).read_text())["mlflow"]["run_id"]
    assert history(client, run_id, "x") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)]
    assert json.loads((run_dir / trackers.RUNS_FILE).read_text())["mlflow"]["last_step"] == 6
    attempt(False, range(1, 3), 100.0)  # a fresh start: a run of its own
    experiment = client.get_experiment_by_name("replay")
    assert len(client.search_runs([experiment.experiment_id])) == 2
    assert history(client, run_id, "x")[-1] == (6, 60.0)


def _step_one(client: MlflowClient, run_dir: Path) -> str | None:
    """The tracker's run id once the tracker has step 1."""
    try:
        run_id = json.loads((run_dir / trackers.RUNS_FILE).read_text())["mlflow"]["run_id"]
    except (OSError, ValueError, KeyError):
        return None
    if client.get_metric_history(run_id, "train/loss"):
        return str(run_id)
    return None


def _wait_for(probe: Any, proc: subprocess.Popen[bytes], log_path: Path, limit_s: float = 300) -> Any:
    """``probe()``'s first truthy value, while the training process runs."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        assert proc.poll() is None, f"training ended first ({proc.returncode}): " + log_path.read_text()[-4000:]
        time.sleep(0.1)
    raise AssertionError("not seen in time: " + log_path.read_text()[-4000:])


def wandb_records(run_file: Path) -> list[dict[str, Any]]:
    """The records of a W&B run file (``run-<id>.wandb``), read by W&B's own reader (``wandb leet inspect``)."""
    r = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
