"""The real CLI in subprocesses: a clean environment, ``ddp-job ARGS``, ``torchrun ... -m job train ARGS``, and
``ddp-job make-data`` for small image folders."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from job.cluster.env import LAUNCHER_VAR_PREFIXES
from support import EXAMPLE, ROOT
from support.ci import bin_path


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


def user_code_env(tmp_path: Path | None = None, **extra: str) -> dict[str, str]:
    """``base_env`` with the example package and tests/support/user_cases.py importable (``support.user_cases``),
    as a user's PYTHONPATH would."""
    env = base_env(tmp_path, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
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
    """An image folder from ``ddp-job make-data`` at ``out`` (kept if it is already there)."""
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
