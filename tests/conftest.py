"""Fixtures shared by the tests (their helpers are in tests/support/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import make_data

from job.bench import crops as crops_bench

# The files that take longest (minutes each: an image build, clusters, multi-process chains), started first:
# `pytest -n 3 --dist loadfile` hands files to workers in collection order, and a long file handed out last
# keeps one worker busy after the others are done.
SLOW_FIRST = (
    "test_image.py",
    "test_k8s_trainjob_sim.py",
    "test_slurm.py",
    "test_hsdp.py",
    "test_k8s_sim.py",
    "test_fsdp.py",
    "test_third_party_text.py",
    "test_third_party_vision.py",
    "test_trackers.py",
    "test_faults.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the slow files first (a stable sort: the order within a file, and of the rest, is kept)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


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
