"""The import graph of job/ has no cycles: between packages (a top-level module such as job/errors.py is a
node of its own), and between the modules of one package. Every import counts, at module level or inside a
function (a deferred import hides a cycle from Python, not from the reader), relative or absolute, and
``from job.pkg import name`` counts as an import of ``job/pkg/name.py`` when that file exists.

Start-up pays for every module imported: importing the trainer leaves out what only some runs use (the image
task's torchvision, with the torch._dynamo it pulls in; TensorBoard; the optional decoders and optimizers)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "job"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _base_of(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module named by ``from BASE import ...`` in the module ``name`` (at ``path``)."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _imported(name: str, path: Path, modules: Mapping[str, Path]) -> Iterator[str]:
    """Every module of job/ that ``name`` imports, anywhere in its body."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(node, name, path)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import job.a.b` imports job.a.b; a name in it is it
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _node(module: str, modules: Mapping[str, Path]) -> str:
    """The package graph's node of a module: its package, or itself for a top-level module."""
    if modules[module].name == "__init__.py" or module.count(".") == 1:
        return module
    return module.rpartition(".")[0]


def _cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None (a plain depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    packages: dict[str, set[str]] = {}
    within: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target in _imported(name, path, modules):
            source, dest = _node(name, modules), _node(target, modules)
            if source != dest:
                packages.setdefault(source, set()).add(dest)
            elif name != source:  # both in one package (a package's __init__ may gather its modules)
                within.setdefault(name, set()).add(target)
    return packages, within


def test_packages_import_each_other_without_a_cycle() -> None:
    packages, _ = _graphs()
    cycle = _cycle(packages)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_modules_of_a_package_import_each_other_without_a_cycle() -> None:
    _, within = _graphs()
    cycle = _cycle(within)
    assert cycle is None, "module import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The parser resolves relative, deferred and ``from pkg import module`` imports: a cycle made of them
    is found."""
    pkg = tmp_path / "job" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "job" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("from . import y\n")
    (pkg / "y.py").write_text("def f():\n    from job.a.z import g\n")
    (pkg / "z.py").write_text("from .x import h\n")
    modules = {_module_name(p, tmp_path): p for p in sorted((tmp_path / "job").rglob("*.py"))}
    graph = {name: set(_imported(name, path, modules)) for name, path in modules.items()}
    assert graph["job.a.x"] == {"job.a.y"} and graph["job.a.y"] == {"job.a.z"} and graph["job.a.z"] == {"job.a.x"}
    assert _cycle(graph) == ["job.a.x", "job.a.y", "job.a.z", "job.a.x"]


# What ``import job.train.run`` must not import: each is imported where a run uses it (an image task's model,
# data and augmentation; the TensorBoard writer; data.decode=device; WebDataset shards; timm's optimizers).
OPTIONAL = ("torchvision", "torch._dynamo", "tensorboard", "torch.utils.tensorboard", "torchcodec", "wids", "timm")


def test_importing_the_trainer_leaves_the_optional_libraries_out() -> None:
    code = "import sys, json, job.train.run; print(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    loaded = set(json.loads(r.stdout))
    assert "job.train.run" in loaded
    assert [name for name in OPTIONAL if name in loaded] == []


def test_the_launcher_reads_the_checkpoint_store_without_importing_dcp() -> None:
    """`ddp-job launch` reads the store (the stop contract) in every pod and Slurm step: torch.distributed.checkpoint
    and DTensor (about half a second of each launcher's start) stay out until a checkpoint's shards are read."""
    code = "import sys, json, job.launchers.torchrun; print(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    loaded = set(json.loads(r.stdout))
    assert {"job.launchers.torchrun", "job.checkpoint.store"} <= loaded
    assert [m for m in ("torch.distributed.checkpoint", "torch.distributed.tensor") if m in loaded] == []
