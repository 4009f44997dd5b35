"""The pins: constraints.txt is what the image and CI install, so it must match pyproject.toml's ranges and the
environment the tests run in (scripts/lock.sh --check walks the installed dependency closure of the project and
its dev and bench extras and compares it with the file).

The wheel a user installs holds ``job`` and its metadata, nothing else in site-packages. It is built from a copy of
the checkout with its top-level folders (a stray top-level package is found by ``[tool.setuptools.packages.find]``
exactly as in a real build), so the checkout is not touched: no ``build/`` or ``*.egg-info`` left there, none read.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import ROOT

# Build outputs, environments and run data at the root of a checkout: never part of the source.
NOT_SOURCE = {".git", ".venv", ".pytest_cache", "build", "dist", "runs", "data", "logs"}


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


def _not_source(directory: str, names: list[str]) -> set[str]:
    skip = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    if Path(directory) == ROOT:
        skip |= NOT_SOURCE & set(names)
    return skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_not_source, symlinks=True)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(tmp), "."]
    r = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = tmp.glob("ddp_job-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_holds_job_and_its_metadata_only(wheel: zipfile.ZipFile) -> None:
    top = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1, top
    assert top - dist_info == {"job"}, f"top-level names besides job: {sorted(top - dist_info - {'job'})}"


def test_wheel_holds_every_module_of_job(wheel: zipfile.ZipFile) -> None:
    """Every module of the package is installed, the benchmarks behind ``ddp-job bench`` included."""
    here = {p.relative_to(ROOT).as_posix() for p in (ROOT / "job").rglob("*.py") if "__pycache__" not in p.parts}
    inside = {n for n in wheel.namelist() if n.endswith(".py")}
    assert "job/bench/__init__.py" in inside
    assert inside == here, sorted(here ^ inside)


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
