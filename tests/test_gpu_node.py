"""A node that shows GPUs while CUDA is unusable exits 2 naming the driver found and the one required; a node
without GPU signs, or GPUs hidden on purpose, trains on the CPU. The node is a faked environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from support.ci import bin_path
from support.cli import base_env

from job.cluster.gpu import MIN_DRIVER, driver_version, gpu_signs, require_usable_cuda
from job.errors import EXIT_BAD_INPUT, BadInput

OLD_DRIVER = """NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023
GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)
"""
OPEN_DRIVER = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.82.07  Release Build\n"


@pytest.mark.parametrize(
    ("environ", "dev", "shown"),
    [
        ({}, ["nvidia0", "nvidia1", "nvidiactl", "null"], ["/dev/nvidia0", "/dev/nvidia1"]),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, ["null"], ["CUDA_VISIBLE_DEVICES=0,1"]),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-3f2a"}, [], ["NVIDIA_VISIBLE_DEVICES=GPU-3f2a"]),
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, ["null"], []),  # the nvidia/cuda images' default, CPU hosts too
        ({"NVIDIA_VISIBLE_DEVICES": "void"}, [], []),
        ({"CUDA_VISIBLE_DEVICES": ""}, ["nvidia0"], []),  # hidden on purpose
        ({"CUDA_VISIBLE_DEVICES": "-1", "NVIDIA_VISIBLE_DEVICES": "0"}, ["nvidia0"], []),
        ({}, ["nvidiactl", "nvidia-uvm"], []),
    ],
)
def test_gpu_signs(environ: dict[str, str], dev: list[str], shown: list[str]) -> None:
    assert gpu_signs(environ, dev) == shown


def test_driver_version_from_the_proc_file() -> None:
    assert driver_version(OLD_DRIVER) == "535.104.05"
    assert driver_version(OPEN_DRIVER) == "580.82.07"
    assert driver_version(None) is None


def test_gpu_node_with_unusable_cuda_is_refused_naming_both_drivers() -> None:
    with pytest.raises(BadInput) as e:
        require_usable_cuda({"CUDA_VISIBLE_DEVICES": "0"}, ["nvidia0"], OLD_DRIVER, False, "13.0")
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert e.value.value == "535.104.05"
    text = str(e.value)
    assert "535.104.05" in text and MIN_DRIVER[13] in text and "CUDA_VISIBLE_DEVICES=" in text
    with pytest.raises(BadInput) as e:
        require_usable_cuda({}, ["nvidia0"], None, False, "12.8")
    assert e.value.value == "none loaded" and MIN_DRIVER[12] in str(e.value)


@pytest.mark.parametrize(
    ("environ", "dev", "cuda_available", "build"),
    [
        ({"CUDA_VISIBLE_DEVICES": "0"}, ["nvidia0"], True, "13.0"),  # usable
        ({}, ["null"], False, "13.0"),  # a CPU node
        ({"CUDA_VISIBLE_DEVICES": ""}, ["nvidia0"], False, "13.0"),  # GPUs hidden on purpose
        ({}, ["nvidia0"], False, None),  # a CPU-only torch build
    ],
)
def test_usable_or_cpu_nodes_pass(environ: dict[str, str], dev: list[str], cuda_available: bool, build: str) -> None:
    require_usable_cuda(environ, dev, OLD_DRIVER, cuda_available, build)


def test_train_on_a_node_showing_a_gpu_without_cuda_exits_2(tmp_path: Path) -> None:
    if torch.cuda.is_available() or torch.version.cuda is None:
        pytest.skip("needs a CUDA build of torch without a usable GPU (this machine can use CUDA)")
    args = ["train", "--data.source", "synthetic", "--run.output-dir", str(tmp_path), "--train.steps", "1"]
    env = base_env(tmp_path, CUDA_VISIBLE_DEVICES="0")
    r = subprocess.run([bin_path("ddp-job"), *args], env=env, text=True, capture_output=True, timeout=300)
    assert r.returncode == EXIT_BAD_INPUT, r.stderr[-2000:]
    assert "CUDA_VISIBLE_DEVICES=0" in r.stderr and MIN_DRIVER[int(torch.version.cuda.split(".")[0])] in r.stderr
    assert not any(tmp_path.glob("*/config.yaml"))  # refused before anything was written
