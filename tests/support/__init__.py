"""What the tests share besides pytest's fixtures: helpers (``support.ci``, ``support.cli``, ``support.runs``), the
validators of the Kubernetes manifests, and the workers and user code that the tests' jobs run.

Tests import it as ``support`` (pytest puts tests/ on sys.path); a job's subprocess finds it the same way when
tests/ is on its PYTHONPATH (``support.cli.user_code_env``)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""

EXAMPLE = ROOT / "examples/tinyshapes"
"""The worked example of a user package (docs/user-code.md)."""
