"""job.launchers.submit without Slurm: sweeps, the run argv, the stop-signal override, bad input."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from job.errors import BadInput
from job.launchers.submit.args import (
    parse_sweep,
    run_argv,
    run_dir_choice,
    split_run_dir_args,
    sweep_runs,
    trainer_stop_signals,
)
from job.launchers.submit.command import build_parser
from job.launchers.submit.task import _SignalChain, node_address
from job.train.preempt import StopRequest


def test_parse_sweep() -> None:
    assert parse_sweep("optim.lr=0.1,0.2") == ("optim.lr", ["0.1", "0.2"])
    for bad in ("optim.lr", "lr=0.1", "optim.lr=", "optim.lr=,"):
        with pytest.raises(BadInput, match=r"section\.field=v1,v2"):
            parse_sweep(bad)


def test_sweep_runs_is_a_grid_with_one_run_name_each() -> None:
    runs = sweep_runs("exp", ["optim.lr=0.1,0.2", "train.global_batch_size=8,16"])
    assert [name for name, _ in runs] == [
        "exp-lr=0.1_global_batch_size=8",
        "exp-lr=0.1_global_batch_size=16",
        "exp-lr=0.2_global_batch_size=8",
        "exp-lr=0.2_global_batch_size=16",
    ]
    assert runs[1][1] == ["--optim.lr", "0.1", "--train.global-batch-size", "16"]
    assert sweep_runs("exp", []) == [("exp", [])]


def test_stop_signals_leave_submitits_signal_alone() -> None:
    assert trainer_stop_signals(["--train.steps", "5"], "SIGUSR2") == ["--train.stop-signals", "SIGTERM,SIGINT,SIGUSR1"]
    assert trainer_stop_signals([], "SIGUSR1") == ["--train.stop-signals", "SIGTERM,SIGINT,SIGUSR2"]
    assert trainer_stop_signals(["--train.stop-signals", "SIGTERM"], "SIGUSR2") == []
    with pytest.raises(BadInput, match="includes SIGUSR2"):
        trainer_stop_signals(["--train.stop-signals=SIGTERM,SIGUSR2"], "SIGUSR2")


def test_run_argv_fixes_the_run_directory(tmp_path: Path) -> None:
    argv = run_argv(["--train.steps", "5"], tmp_path, "r1", ["--optim.lr", "0.1"], "SIGUSR2")
    assert argv == [
        "--train.steps",
        "5",
        "--optim.lr",
        "0.1",
        "--run.output-dir",
        str(tmp_path),
        "--run.name",
        "r1",
        "--train.stop-signals",
        "SIGTERM,SIGINT,SIGUSR1",
    ]


def test_node_address_keeps_resolvable_names() -> None:
    assert node_address("localhost") == "localhost"


# `scontrol show node n1` of Slurm 22.05 (Debian 12) for a node of a test cluster whose name does not resolve:
# NodeAddr is where it is reached, NodeHostName only what slurmd calls itself.
SHOW_NODE = """NodeName=n1 Arch=x86_64 CoresPerSocket=1
   CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.31
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=(null)
   NodeAddr=127.0.0.1 NodeHostName=localhost Port=17001 Version=22.05.8
   OS=Linux 6.1.0-27-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.115-1 (2024-11-01)
   RealMemory=1000 AllocMem=0 FreeMem=1536 Sockets=2 Boards=1
   State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug
   BootTime=2026-12-01T08:00:00 SlurmdStartTime=2026-12-02T09:00:00
   LastBusyTime=2026-12-02T09:00:00
   CfgTRES=cpu=2,mem=1000M,billing=2
   AllocTRES=
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s
"""


def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``scontrol`` first on PATH that answers ``show node n1`` as Slurm does (and ``Node X not found`` with
    exit 1 for any other node), logging its arguments. Names do not resolve: no DNS query leaves the machine."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "show-node-n1.txt").write_text(SHOW_NODE)
    script = bindir / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path}/calls"\n'
        f'if [ "$*" = "show node n1" ]; then cat "{tmp_path}/show-node-n1.txt"; exit 0; fi\n'
        'echo "Node $3 not found" >&2\n'
        "exit 1\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")

    def unresolvable(host: str, *args: object, **kwargs: object) -> object:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    return tmp_path / "calls"


def test_node_address_of_an_unresolvable_name_is_its_nodeaddr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_scontrol(tmp_path, monkeypatch)
    assert node_address("n1") == "127.0.0.1"
    assert calls.read_text() == "show node n1\n"


def test_node_address_refuses_a_node_scontrol_does_not_know(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_scontrol(tmp_path, monkeypatch)
    with pytest.raises(BadInput) as e:
        node_address("n9")
    assert (e.value.setting, e.value.value) == ("MASTER_ADDR", "n9")
    assert "`scontrol show node n9` shows no NodeAddr" in e.value.what
    assert calls.read_text() == "show node n9\n"


def test_cli_rejects_bad_input_with_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "job.launchers.submit",
            "--gpus-per-node",
            "2",
            "--tasks-per-node",
            "3",
            "--log-folder",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--tasks-per-node 3 with --gpus-per-node 2" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--run.output-dir", "OUT", "--run.name", "NAME"],
        ["--run.output_dir", "OUT", "--run.name=NAME"],
        ["--run.output-dir=OUT", "--run.name", "NAME"],
        ["--run.output_dir=OUT", "--run.name=NAME"],
    ],
)
def test_the_users_run_directory_is_taken_out_of_the_train_args(args: list[str]) -> None:
    rest, given = split_run_dir_args(["--train.steps", "5", *args, "--optim.lr", "0.1"])
    assert rest == ["--train.steps", "5", "--optim.lr", "0.1"]
    assert given == {"output_dir": "OUT", "name": "NAME"}


def test_a_run_directory_flag_without_value_is_refused() -> None:
    for args in (["--run.output-dir"], ["--run.name="], ["--run.output_dir", "--train.steps", "5"]):
        with pytest.raises(BadInput, match="has no value") as e:
            split_run_dir_args(args)
        assert e.value.setting in ("--run.output-dir", "--run.name", "--run.output_dir")


def test_an_object_store_url_as_the_run_directory_is_refused(tmp_path: Path) -> None:
    """Submit makes the run directory absolute before training sees it (``Path.resolve``): ``s3://b/p`` would become
    ``$PWD/s3:/b/p``, which training accepts. Refused where submit reads it, in either place, with exit 2."""
    for args in (["--run.output-dir", "s3://ckpt/runs"], ["--run.output_dir=gs://ckpt/runs"]):
        with pytest.raises(BadInput, match="is a URL") as e:
            split_run_dir_args(args)
        assert e.value.setting == args[0].split("=")[0] and "://ckpt/runs" in str(e.value.value)
    for option in ("--output-dir", "--log-folder"):
        proc = subprocess.run(
            [sys.executable, "-m", "job.launchers.submit", option, "s3://ckpt/x"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and f"argument {option}: 's3://ckpt/x' is a URL" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_train_args_win_over_submits_defaults_and_conflicts_are_refused(tmp_path: Path) -> None:
    parser = build_parser()
    own = parser.parse_args([])
    assert run_dir_choice(own, {"output_dir": str(tmp_path / "mine"), "name": "r1"}) == (tmp_path / "mine", "r1")
    output_dir, name = run_dir_choice(own, {})
    assert output_dir == Path("runs").resolve() and name.startswith("ddp-job-")
    same = parser.parse_args(["--output-dir", f"{tmp_path}/mine/", "--name", "r1"])
    assert run_dir_choice(same, {"output_dir": str(tmp_path / "mine"), "name": "r1"}) == (tmp_path / "mine", "r1")
    other = parser.parse_args(["--output-dir", str(tmp_path / "theirs")])
    with pytest.raises(
        BadInput, match=r"--output-dir .*theirs and the train argument --run\.output-dir .*mine disagree"
    ):
        run_dir_choice(other, {"output_dir": str(tmp_path / "mine")})
    with pytest.raises(BadInput, match=r"--name a and the train argument --run\.name b disagree"):
        run_dir_choice(parser.parse_args(["--name", "a"]), {"name": "b"})


def _submit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "job.launchers.submit",
            "--log-folder",
            str(tmp_path / "logs"),
            "--gpus-per-node",
            "0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("spelling", [["--run.output-dir", "{d}"], ["--run.output_dir={d}"]])
def test_submit_prints_and_trains_into_the_users_run_directory(tmp_path: Path, spelling: list[str]) -> None:
    """submitit's debug backend submits without Slurm (nothing runs until a result is asked for)."""
    mine = tmp_path / "mine"
    proc = _submit(
        tmp_path,
        "--cluster",
        "debug",
        "--",
        "--train.steps",
        "3",
        *[a.format(d=mine) for a in spelling],
        "--run.name",
        "r1",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"run_dir={mine / 'r1'} " in proc.stdout, proc.stdout
    sweep = _submit(
        tmp_path, "--cluster", "debug", "--sweep", "optim.lr=0.1,0.2", "--", *[a.format(d=mine) for a in spelling]
    )
    assert sweep.returncode == 0, sweep.stderr
    assert sweep.stdout.count(f"run_dir={mine}/ddp-job-") == 2, sweep.stdout


def test_a_failed_task_reports_its_exit_code_as_data(tmp_path: Path) -> None:
    """submitit's local backend runs the task in a subprocess, as on a node: training refuses its input (exit
    2), the task records 2 as its result and submit --wait exits 2 (submitit itself would keep only text)."""
    import submitit

    proc = _submit(
        tmp_path,
        "--cluster",
        "local",
        "--tasks-per-node",
        "1",
        "--wait",
        "--",
        "--data.path",
        str(tmp_path / "no-such-data"),
        "--run.output-dir",
        str(tmp_path / "runs"),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    job_id = proc.stdout.split()[2]
    assert f"job {job_id} done: exit=2" in proc.stdout
    assert f"training failed in job(s) {job_id} (exit 2)" in proc.stderr
    assert submitit.LocalJob(tmp_path / "logs", job_id).results() == [2]
    assert "data.path=" in (tmp_path / "logs" / f"{job_id}_0_log.err").read_text()


@pytest.mark.parametrize(("scontrol_ends", "requeued"), [("kill -TERM $$", True), ("exit 1", False)])
def test_a_requeue_ended_by_slurms_sigterm_leaves_as_requeued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scontrol_ends: str, requeued: bool
) -> None:
    """Slurm ends a job it requeues with SIGTERM to all its processes, the ``scontrol requeue`` that asked included
    (seen on the real cluster under load): the task leaves as after a requeue that returned (SystemExit, no
    result). Any other scontrol failure is still an error."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "scontrol"
    script.write_text(f"#!/bin/sh\n{scontrol_ends}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    chain = _SignalChain(signal.SIGUSR2, tmp_path, 0, 0)
    # What submitit's handler runs to requeue (submitit.slurm.slurm.SlurmJobEnvironment._requeue).
    chain._submitit_handler = lambda signum, frame: subprocess.check_call(["scontrol", "requeue", "8"], timeout=60)
    expected: type[BaseException] = SystemExit
    if not requeued:
        expected = subprocess.CalledProcessError
    with pytest.raises(expected):
        chain.call_submitit(signal.SIGUSR2)


def test_the_deadline_waits_for_a_stop_save(tmp_path: Path) -> None:
    """The submit task's deadline after submitit's signal requeues a run that did not stop in time, but not one
    that is saving to stop: the requeue would bring Slurm's SIGTERM into the save."""
    calls: list[int] = []
    chain = _SignalChain(signal.SIGUSR2, tmp_path, 0, 5)
    chain._submitit_handler = lambda signum, frame: calls.append(signum)
    with StopRequest(tmp_path).saving():
        chain._on_deadline(signal.SIGALRM, None)
    assert calls == []
    chain._on_deadline(signal.SIGALRM, None)  # no save running: training did not stop in time
    assert calls == [signal.SIGUSR2]
