"""The pins: constraints.txt is what the image and CI install, so it must match pyproject.toml's ranges and the
environment the tests run in (scripts/lock.sh --check walks the installed dependency closure of the project and
its dev and bench extras and compares it with the file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_constraints_match_pyproject_and_the_installed_closure() -> None:
    env = {"PATH": "/usr/bin:/bin", "VENV": str(Path(sys.executable).parent.parent)}
    r = subprocess.run(["bash", str(ROOT / "scripts/lock.sh"), "--check"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\nFix: run scripts/lock.sh and commit constraints.txt"


def test_torch_pins_are_the_required_ones() -> None:
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1", {k: pins[k] for k in ("torch", "torchvision")}
    assert "lightning" in pins, "the bench extra (Lightning, the overhead benchmark's reference) must be pinned"
