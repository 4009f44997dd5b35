"""Fixtures shared by the tests (their helpers are in tests/support/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import make_data

from job.bench import crops as crops_bench


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 classes x 16 train images of 16x16 px (and the default val split)."""
    return make_data(tmp_path_factory.mktemp("data") / "tiny")


@pytest.fixture(scope="session")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, int], ...]:
    """(path, label) of eight real JPEGs of eight sizes, fine detail in every channel (job.bench.crops)."""
    root = tmp_path_factory.mktemp("ragged")
    samples = []
    for i, (h, w) in enumerate(crops_bench.RAGGED_SIZES):
        path = root / f"{i}.jpg"
        crops_bench.write_jpeg(path, h, w, i)
        samples.append((str(path), i))
    return tuple(samples)
