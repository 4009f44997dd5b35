"""A GPU node whose CUDA is unusable (a driver too old for the torch build, a broken install) is refused: without
this check ``torch.cuda.is_available()`` is False, ``dist.backend=auto`` picks gloo and the job trains on the CPU.

What the node shows is read from values passed in (the environment, the names in /dev, the text of
/proc/driver/nvidia/version), so the decision is a pure function.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from job.errors import BadInput

DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"

MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}
"""The oldest Linux driver for each CUDA major version (NVIDIA's CUDA release notes, minor-version compatibility)."""

_NO_GPUS = ("", "-1", "none", "void", "NoDevFiles")
"""Values of the *_VISIBLE_DEVICES variables that hide every GPU."""

_IMAGE_DEFAULT = "all"
"""NVIDIA_VISIBLE_DEVICES in the nvidia/cuda images, set on CPU machines too: alone it shows no GPU."""


def gpu_signs(environ: Mapping[str, str], dev_names: Iterable[str]) -> list[str]:
    """What shows GPUs on this node: /dev/nvidiaN devices and GPU lists in the environment. None where
    CUDA_VISIBLE_DEVICES hides them (a CPU run on a GPU node, on purpose)."""
    if environ.get("CUDA_VISIBLE_DEVICES") in _NO_GPUS:
        return []
    signs = ["/dev/" + d for d in sorted(dev_names) if re.fullmatch(r"nvidia\d+", d)]
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = environ.get(name)
        if value is not None and value not in _NO_GPUS and value != _IMAGE_DEFAULT:
            signs.append(f"{name}={value}")
    return signs


def driver_version(proc_version: str | None) -> str | None:
    """The kernel driver's version from the text of /proc/driver/nvidia/version, None without a driver."""
    if proc_version is None:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", proc_version)
    if m is None:
        return None
    return m.group(1)


def require_usable_cuda(
    environ: Mapping[str, str],
    dev_names: Iterable[str],
    proc_version: str | None,
    cuda_available: bool,
    cuda_build: str | None,
) -> None:
    """Raise BadInput where the node shows GPUs but CUDA is unusable. ``cuda_build``: ``torch.version.cuda``
    (None for a CPU-only torch, which is a choice, not a failure)."""
    if cuda_available or cuda_build is None:
        return
    signs = gpu_signs(environ, dev_names)
    if not signs:
        return
    major = int(cuda_build.split(".")[0])
    required = MIN_DRIVER.get(major, "?")
    found = driver_version(proc_version) or "none loaded"
    raise BadInput(
        f"this node shows GPUs ({', '.join(signs)}) but CUDA is unusable: NVIDIA driver {found}, while torch's "
        f"CUDA {cuda_build} build needs driver {required} or newer; the job would train on the CPU.",
        f"install NVIDIA driver >= {required} (or a torch build for the installed driver); to train on the CPU on "
        "purpose, hide the GPUs with CUDA_VISIBLE_DEVICES=.",
        setting="NVIDIA driver",
        value=found,
    )


def check_node(environ: Mapping[str, str]) -> None:
    """``require_usable_cuda`` with what this node shows: its /dev entries and its driver's version file."""
    import torch

    try:
        dev_names = os.listdir("/dev")
    except OSError:
        dev_names = []
    proc_version = None
    with contextlib.suppress(OSError):
        proc_version = Path(DRIVER_VERSION_FILE).read_text()
    require_usable_cuda(environ, dev_names, proc_version, torch.cuda.is_available(), torch.version.cuda)
