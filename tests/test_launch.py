"""job.launchers.torchrun: torchrun options parsed by torch's own parser, the worker command forced to `-m job train`,
and the workers' exit codes mapped to the job's (docs/design.md).

The integration tests run the real torchrun elastic agent (launch_main in a child process, so signals
hit only it) with 2 workers of tests/support/launch_worker.py, which exits with a code chosen per rank.

Why launch sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where workers may restart (measured 2026-11-29, torch 2.14.1, this machine,
gloo workers of which rank 1 crashes once after its first all_reduce, --max-restarts 2):
* two torchrun agents on loopback, c10d rendezvous: shared store (torch's default) 2 of 6 runs failed
  (one exit 1, one hung until killed at 150 s); with the variable 6 of 6 recovered;
* one agent, --standalone: shared store 2 of 4 runs never recovered (the restarted workers dialled the
  previous round's gloo addresses: "Connection refused", then hung); with the variable 3 of 3 recovered.
test_elastic_restart_recovers below repeats the --standalone case through launch_main.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from job.checkpoint.store import MANIFEST, step_dir_name
from job.cluster import stop
from job.cluster.env import NOTICE_VAR
from job.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, EXIT_TIMEOUT, BadInput
from job.launchers.torchrun import (
    SHUTDOWN_DEFAULT_S,
    _parser,
    agent_env_defaults,
    build_torchrun_args,
    map_exit_codes,
    split_argv,
    standalone_argv,
    worker_notice_s,
)

REPO = Path(__file__).resolve().parents[1]
AGENT = "import sys; from job.launchers.torchrun import launch_main; sys.exit(launch_main(sys.argv[1:], module='tests.support.launch_worker'))"


# --- pure: argument handling and the mapping ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "options", "train"),
    [
        (["--nproc-per-node", "2", "--", "--config", "c.yaml"], ["--nproc-per-node", "2"], ["--config", "c.yaml"]),
        (
            ["--standalone", "--nproc-per-node=2", "--config", "c.yaml"],
            ["--standalone", "--nproc-per-node=2"],
            ["--config", "c.yaml"],
        ),
        (
            ["--nnodes", "2", "--rdzv-backend", "c10d", "--train.steps", "5"],
            ["--nnodes", "2", "--rdzv-backend", "c10d"],
            ["--train.steps", "5"],
        ),
        (["--", "--nproc-per-node", "3"], [], ["--nproc-per-node", "3"]),  # after -- everything is train's
        ([], [], []),
    ],
)
def test_split_argv(argv: list[str], options: list[str], train: list[str]) -> None:
    assert split_argv(argv, _parser()) == (options, train)


def test_worker_command_is_job_train(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    args = build_torchrun_args(["--nproc-per-node", "2", "--max-restarts", "1", "--", "--run.name", "x"])
    assert (args.module, args.training_script, args.training_script_args) == (True, "job", ["train", "--run.name", "x"])
    assert (args.nproc_per_node, args.max_restarts, args.no_python, args.run_path) == ("2", 1, False, False)


@pytest.mark.parametrize(
    ("argv", "script_args"),
    [
        (["--nproc-per-node", "2", "--", "doctor", "--run.name", "x"], ["doctor", "--run.name", "x"]),
        (["--nproc-per-node", "2", "doctor", "--run.name", "x"], ["doctor", "--run.name", "x"]),  # without --
        (["--nproc-per-node", "2", "--", "train", "--run.name", "x"], ["train", "--run.name", "x"]),  # explicit train
        (
            ["--nproc-per-node", "2", "--", "--run.name", "doctor"],
            ["train", "--run.name", "doctor"],
        ),  # a value, not the command
        (["--nproc-per-node", "2"], ["train"]),
    ],
)
def test_first_word_chooses_the_worker_command(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], script_args: list[str]
) -> None:
    for name in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    args = build_torchrun_args(argv)
    assert (args.module, args.training_script, args.training_script_args) == (True, "job", script_args)


def test_pet_variables_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PyTorchJob pod's PET_* become torchrun's defaults, explicit options still win."""
    monkeypatch.setenv("PET_NNODES", "3")
    monkeypatch.setenv("PET_NODE_RANK", "2")
    monkeypatch.setenv("PET_MASTER_ADDR", "demo-master-0")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    args = build_torchrun_args(["--nproc-per-node", "1", "--", "--config", "c.yaml"])
    assert (args.nnodes, args.node_rank, args.master_addr, args.nproc_per_node) == ("3", 2, "demo-master-0", "1")


@pytest.mark.parametrize("option", ["-m", "--module", "--no-python", "--run-path"])
def test_other_targets_are_rejected(option: str) -> None:
    with pytest.raises(BadInput, match=rf"{option}.*python -m job train.*Fix"):
        build_torchrun_args([option, "--nproc-per-node", "2"])


def test_pet_no_python_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NO_PYTHON", "1")
    with pytest.raises(BadInput, match="PET_NO_PYTHON"):
        build_torchrun_args(["--nproc-per-node", "2"])


def test_standalone_argv() -> None:
    argv = standalone_argv(4, ["--config", "c.yaml", "--dist.nproc-per-node", "4"])
    assert argv == ["--standalone", "--nproc-per-node", "4", "--", "--config", "c.yaml", "--dist.nproc-per-node", "4"]
    args = build_torchrun_args(argv)
    assert args.standalone and args.nproc_per_node == "4"
    assert args.training_script_args == ["train", "--config", "c.yaml", "--dist.nproc-per-node", "4"]


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([143, 143], EXIT_PREEMPTED),
        ([143, -15], EXIT_PREEMPTED),  # a peer torchrun terminated after the save is still "resume me"
        ([1, 143], EXIT_FAILURE),  # a rank crashed (e.g. during the save): not resumable as-is
        ([2, 1], EXIT_BAD_INPUT),
        ([1, 2, 143], EXIT_BAD_INPUT),
        ([1, 124], EXIT_TIMEOUT),
        ([124, 2], EXIT_BAD_INPUT),
        ([7, 1], 7),  # the first failure's own code
        ([-9, 1], 137),  # first failure killed by SIGKILL
        ([1, -15], EXIT_FAILURE),  # a peer torchrun terminated after a crash is not "preempted"
        ([], EXIT_FAILURE),
    ],
)
def test_map_exit_codes(codes: list[int], expected: int) -> None:
    assert map_exit_codes(codes) == expected


# --- the real torchrun agent ---------------------------------------------------------------------------


def _agent_env(tmp_path: Path, plan: str, on_signal: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "SLURM_", "TORCH_DISABLE_SHARE", "DDP_JOB_ATTEMPT_START"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        TMPDIR=str(tmp_path),
        LAUNCH_TEST_DIR=str(tmp_path),
        LAUNCH_TEST_PLAN=plan,
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    if on_signal is not None:
        env["LAUNCH_TEST_ON_SIGNAL"] = on_signal
    return env


def _saving_run(tmp_path: Path, checkpoint: bool = True) -> tuple[str, ...]:
    """Train args naming the run directory where the launcher looks for the stop record; a worker that exits 143
    writes the record of step 1 there. With ``checkpoint`` the save of step 1 is on storage (its manifest is made
    here); without, the record names a save that never reached storage."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    if checkpoint:
        (run_dir / step_dir_name(1)).mkdir(parents=True)
        (run_dir / step_dir_name(1) / MANIFEST).write_text("{}")
    return ("--", "--run.output-dir", str(tmp_path / "runs"), "--run.name", "r")


def _launch(
    tmp_path: Path, plan: str, on_signal: str | None = None, extra: tuple[str, ...] = (), trained: bool = True
) -> subprocess.Popen:
    argv = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", *extra]
    env = _agent_env(tmp_path, plan, on_signal)
    if not trained:
        env["LAUNCH_TEST_UNTRAINED"] = "1"
    if (tmp_path / "runs" / "r").is_dir():  # the workers "save" (_saving_run)
        env["LAUNCH_TEST_RUN_DIR"] = str(tmp_path / "runs" / "r")
    return subprocess.Popen(
        [sys.executable, "-c", AGENT, *argv],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.mark.integration
def test_success_runs_job_train_with_the_train_args(tmp_path: Path) -> None:
    extra = ("--shutdown-timeout", "7", "--", "--run.name", "demo", "--train.steps", "3")
    started = time.time()
    rc, out = _finish(_launch(tmp_path, "0:0,1:0", extra=extra))
    assert rc == 0, out
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"argv-{rank}").read_text())
        assert seen["argv"] == ["train", "--run.name", "demo", "--train.steps", "3"]
        assert seen["executable"] == sys.executable
        assert seen["env"]["WORLD_SIZE"] == "2" and seen["env"]["TORCHELASTIC_RUN_ID"]
        # No restarts: torch's shared store, which the agent holds, so no worker port is picked and released.
        assert seen["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] is None
        assert seen["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert seen["env"]["DDP_JOB_NOTICE_S"] == "7"  # --shutdown-timeout: the agent's SIGKILL after a stop signal
        assert started - 1 <= float(seen["env"][stop.ATTEMPT_START_VAR]) <= time.time()  # train.max_time's zero


@pytest.mark.integration
@pytest.mark.parametrize(
    ("plan", "on_signal", "saved", "expected"),
    [
        ("0:0,1:143:1", "own", True, EXIT_PREEMPTED),  # one rank saved and stopped, none crashed: resume me
        ("0:0,1:143:1", "own", False, EXIT_FAILURE),  # 143 returned, but no stop save on storage: lost
        ("0:1,1:143:1", "own", True, EXIT_FAILURE),  # a crashed rank outranks 143: the save may be missing
        # 2 wins over 1: rank 0 fails once both run, torchrun SIGTERMs rank 1, whose bad input exits 2
        ("0:1,1:2:30", "own", None, EXIT_BAD_INPUT),
        # rank 0 fails with 7; torchrun then SIGTERMs rank 1 (dies: -15). The first failure's code, not 143.
        ("0:7,1:0:30", None, None, 7),
    ],
    ids=["143-wins", "143-without-save", "crash-beats-143", "2-wins", "first-failure"],
)
def test_worker_exit_codes_are_mapped(
    tmp_path: Path, plan: str, on_signal: str | None, saved: bool | None, expected: int
) -> None:
    extra = () if saved is None else _saving_run(tmp_path, checkpoint=saved)
    rc, out = _finish(_launch(tmp_path, plan, on_signal, extra))
    assert rc == expected, out
    assert f"exit code {expected}" in out
    if saved is False:
        assert "names step 1, whose checkpoint is not on storage): the save was lost" in out, out


def _wait_ready(tmp_path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"workers never became ready: {proc.communicate()[0]}")
        time.sleep(0.1)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("sig", "on_signal", "expected", "said"),
    [
        (signal.SIGTERM, "143", EXIT_PREEMPTED, "stop save of step 1 (signal)"),  # saved and returned 143: resume me
        # SIGINT tells "saved" (143, read from the workers after torchrun stopped them) from "killed"
        (signal.SIGINT, "143", EXIT_PREEMPTED, "stop save of step 1 (signal)"),
        (signal.SIGINT, None, EXIT_FAILURE, "the save was lost"),  # workers died of the signal: nothing saved
        (signal.SIGTERM, None, EXIT_FAILURE, "the save was lost"),  # killed by SIGTERM: torch says 143, nothing saved
        (signal.SIGTERM, "1", EXIT_FAILURE, "the save was lost"),  # the workers failed: not 128 + SIGTERM
        # the signal came during the last step or the final save: the workers finished and returned 0
        (signal.SIGTERM, "0", EXIT_OK, "the workers finished the run"),
    ],
    ids=["sigterm-saved", "sigint-saved", "sigint-killed", "sigterm-killed", "sigterm-failed", "sigterm-finished"],
)
def test_signal_to_the_agent_reaches_the_workers(
    tmp_path: Path, sig: signal.Signals, on_signal: str | None, expected: int, said: str
) -> None:
    proc = _launch(tmp_path, "0:0:60,1:0:60", on_signal, _saving_run(tmp_path))
    _wait_ready(tmp_path, proc)
    proc.send_signal(sig)
    rc, out = _finish(proc, timeout=120)
    assert rc == expected, out
    assert f"{said}; exit code {expected}" in out, out
    for rank in (0, 1):
        assert (tmp_path / f"signal-{rank}").read_text() == sig.name


@pytest.mark.integration
@pytest.mark.parametrize("checkpoint", [True, False], ids=["resuming", "fresh"])
def test_workers_killed_before_their_first_step_lost_nothing(tmp_path: Path, checkpoint: bool) -> None:
    """Workers killed by the launcher's signal during start-up (before their handlers exist: no trained mark):
    resuming from a checkpoint, that checkpoint is the state they stopped at, so 143 with the launcher's own stop
    record of its step; a fresh run has no save to resume from, so 1."""
    run_dir = tmp_path / "runs" / "r"
    proc = _launch(tmp_path, "0:0:60,1:0:60", None, _saving_run(tmp_path, checkpoint=checkpoint), trained=False)
    _wait_ready(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    rc, out = _finish(proc, timeout=120)
    if checkpoint:
        assert rc == EXIT_PREEMPTED, out
        assert "before the first step: nothing lost since the checkpoint of step 1; exit code 143" in out, out
        assert stop.read_record(run_dir) == stop.Record(1, "signal")
    else:
        assert rc == EXIT_FAILURE, out
        assert "the save was lost" in out and stop.read_record(run_dir) is None, out


@pytest.mark.integration
def test_elastic_restart_recovers(tmp_path: Path) -> None:
    """--max-restarts 1, real gloo workers, rank 1 crashes once: the restarted group must finish. On torch
    2.14.1 with the rendezvous store shared (torch's default) this failed or hung in some runs even with
    --standalone; launch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, set because --max-restarts > 0, makes it
    reliable."""
    env = _agent_env(tmp_path, "", None)
    agent = AGENT.replace("tests.support.launch_worker", "tests.support.launch_restart_worker")
    argv = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1"]
    proc = subprocess.run(
        [sys.executable, "-c", agent, *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=480
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert (tmp_path / "crashed-once").exists()  # the first round really failed
    # Two workers share the pipe: their lines can interleave without a newline between them.
    ok = re.findall(r"RESTART-OK rank=\d round=(\d+) sum=(\d+) agent_store=(True|False)", out)
    assert sorted(ok) == [("1", "16", "False"), ("1", "16", "False")], out  # each round its own store


@pytest.mark.parametrize(
    ("max_restarts", "nnodes", "unshared"),
    [(0, "1", False), (0, "2", False), (1, "1", True), (0, "1:2", True), (0, "2:2", False)],
)
def test_the_store_is_unshared_only_where_workers_can_restart(max_restarts: int, nnodes: str, unshared: bool) -> None:
    """Shared, the agent holds the workers' store port; unshared (a restart may follow), rank 0 of each round
    opens a fresh one at a port the agent picked and released."""
    got = agent_env_defaults(max_restarts, nnodes)
    assert got == ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if unshared else {})


def test_the_workers_notice_is_the_agents_shutdown_timeout_or_the_launchers_if_shorter() -> None:
    assert worker_notice_s(None, {}) == SHUTDOWN_DEFAULT_S
    assert worker_notice_s(None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}) == 100.0
    assert worker_notice_s(50, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}) == 50.0  # the option wins, as in torchrun
    assert worker_notice_s(None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100", NOTICE_VAR: "300"}) == 100.0
    assert worker_notice_s(None, {NOTICE_VAR: "12"}) == 12.0
