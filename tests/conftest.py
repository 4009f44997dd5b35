"""Fixtures shared by the tests (their helpers are in tests/support/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import make_data

from job.bench import crops as crops_bench

# The files that take longest, longest first (their wall times in a full run of the suite; the image file's
# includes its podman build), then the rest in collection order. `pytest -n 3 --dist loadfile
# --no-loadscope-reorder` (scripts/test.sh) hands files to workers in this order; a long file handed out last
# keeps one worker busy after the others are done. Without --no-loadscope-reorder xdist sorts the files by
# their number of tests instead, and the image build started in the last third of the run.
SLOW_FIRST = (
    "test_image.py",
    "test_k8s_trainjob_sim.py",
    "test_benchmarks.py",
    "test_slurm.py",
    "test_k8s_sim.py",
    "test_train.py",
    "test_fsdp.py",
    "test_faults.py",
    "test_tasks.py",
    "test_hsdp.py",
    "test_stop.py",
    "test_third_party_vision.py",
    "test_third_party_text.py",
    "test_observe.py",
    "test_dcp.py",
    "test_step.py",
    "test_parallel.py",
    "test_launch.py",
    "test_report.py",
    "test_usercode_train.py",
    "test_task_contract.py",
    "test_trackers.py",
    "test_cadence_train.py",
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
