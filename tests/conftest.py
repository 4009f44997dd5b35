"""Fixtures shared by the tests (their helpers are in tests/support/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import make_data


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 classes x 16 train images of 16x16 px (and the default val split)."""
    return make_data(tmp_path_factory.mktemp("data") / "tiny")
