"""The pins: constraints.txt is what the image and CI install, so it must match pyproject.toml's ranges and the
environment the tests run in (scripts/lock.sh --check walks the installed dependency closure of the project and
its dev and bench extras and compares it with the file)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import ROOT


def test_constraints_match_pyproject_and_the_installed_closure() -> None:
    env = {"PATH": "/usr/bin:/bin", "VENV": str(Path(sys.executable).parent.parent)}
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/lock.sh"), "--check"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\nFix: run scripts/lock.sh and commit constraints.txt"


def test_torch_pins_are_the_required_ones() -> None:
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1", {k: pins[k] for k in ("torch", "torchvision")}
    assert "lightning" in pins, "the bench extra (Lightning, the overhead benchmark's reference) must be pinned"


def _reading_order() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme[readme.index("## Reading order") : readme.index("Optimizers, ZeRO, communication hooks")]


def test_readme_reading_order_names_every_module() -> None:
    """Every module of job/ appears in the README's reading order (as `pkg/` followed by its file names, or
    as a path), and every name there exists: the documented layout is the real one."""
    import re

    text = _reading_order()
    named: set[str] = set()
    for block in re.split(r"\n(?=\d+\. )", text):
        package = re.search(r"`job/([a-z_]+)/`", block)
        for name in re.findall(r"`([a-z_]+\.py)`", block):
            named.add(f"job/{package.group(1)}/{name}" if package else f"job/{name}")
        named.update(re.findall(r"`(job/[a-z_/]+\.py)`", block))
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "job").rglob("*.py") if p.name != "__init__.py"}
    assert modules - named == set(), "modules missing from the README's reading order"
    assert named - modules == set(), "the README's reading order names files that do not exist"


def test_readme_lists_the_real_config_sections() -> None:
    from job.config import JobConfig

    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("with the sections `") + len("with the sections `") :].split("`", 1)[0].split()
    assert listed == list(JobConfig.model_fields)
