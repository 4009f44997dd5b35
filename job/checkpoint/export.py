"""``ddp-job export``: a checkpoint's model (or its EMA) as one full, unsharded state dict in a safetensors file, for
inference or fine-tuning elsewhere, and for ``model.weights`` of this job (job.checkpoint.weights reads it).

Both checkpoint layouts are read (job.checkpoint.store, job.checkpoint.sharded): ``shards/`` (torch.distributed.checkpoint,
every rank's shards) when the step directory has one, else the model in ``state.pt``. Only the tensors exported
are read: the shards are read without a process group into full tensors built from DCP's metadata for the
``model`` (or ``ema.module``) entries alone, and ``state.pt`` is memory-mapped, so the optimizer state is never
held in memory.

The keys are the plain module's (no ``module.``, ``_orig_mod.`` or FSDP names): the file loads with
``model.load_state_dict(safetensors.torch.load_file(path))`` into the task's unwrapped model. Tensors that share
storage (tied weights: the language model's head and embedding) are written as separate copies, which
safetensors requires; loading both names into the tied model writes the same values twice.

The file is written beside its destination under a temporary name, fsynced and renamed: a crash leaves the
destination as it was. The checkpoint is only read.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from job.checkpoint import store
from job.checkpoint.sharded import SHARDS
from job.config import location
from job.errors import BadInput, CheckpointLoadError

log = logging.getLogger("job")

StateDict = dict[str, torch.Tensor]
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""Key prefixes of a state dict saved from a DDP-wrapped or compiled model (stripped when every key has one)."""
WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
"""Module names wrappers insert inside keys (compile, activation checkpointing, FSDP1): never the plain module's."""
MODEL = ("model",)
EMA = ("ema", "module")
"""Where the model and the EMA's module live in a sharded checkpoint (job.checkpoint.sharded.Sharded.state_dict)."""


@dataclass(frozen=True)
class Exported:
    """What ``export`` wrote: the file, how many tensors and bytes, and its header metadata."""

    out: Path
    tensors: int
    bytes: int
    metadata: dict[str, str]


def plain_names(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the plain module's keys: wrapper prefixes and inserted wrapper names removed."""
    for prefix in WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    for part in WRAPPER_PARTS:
        state = {k.replace(part, ""): v for k, v in state.items()}
    return state


def find_checkpoint(path: Path) -> store.Found:
    """The checkpoint ``--checkpoint`` names: a step directory (verified), or a run directory's newest valid one.

    Raises:
        BadInput: naming ``--checkpoint``: no such directory, a step directory that does not verify, or a run
            directory without a valid checkpoint.
    """
    if not path.is_dir():
        raise _bad_checkpoint(
            path, "is not a directory.", "pass a run directory or one of its step-NNNNNNN/ directories."
        )
    if store.STEP_DIR.match(path.name) or (path / store.MANIFEST).exists():
        ok, reason, manifest = store.verify(path)
        if not ok:
            raise _bad_checkpoint(
                path,
                f"does not verify: {reason}.",
                "pass the run directory to export its newest valid checkpoint, or another step directory.",
            )
        return store.Found(int(manifest.get("step", 0)), path, manifest)
    found = store.find_latest(path)
    if found is None:
        raise _bad_checkpoint(
            path,
            "holds no step-NNNNNNN/ checkpoint that verifies.",
            "pass the run directory of a run that saved a checkpoint (its run.output_dir/run.name).",
        )
    return found


def _bad_checkpoint(path: Path, what: str, fix: str) -> BadInput:
    return BadInput(f"--checkpoint {path} {what}", fix, setting="--checkpoint", value=str(path))


def read_model(step_dir: Path, ema: bool = False) -> StateDict:
    """The full model (``ema``: the EMA's copy) of the checkpoint in ``step_dir``, with the plain module's keys.

    Raises:
        BadInput: naming ``--ema`` when ``ema`` is asked of a checkpoint without one.
        CheckpointLoadError: the checkpoint holds no model or cannot be read.
    """
    if (step_dir / SHARDS).is_dir():
        state = _from_shards(step_dir / SHARDS, EMA if ema else MODEL)
    else:
        state = _from_state_file(step_dir / store.STATE_FILE, ema)
    if not state and ema:
        raise BadInput(
            f"--ema: checkpoint {step_dir} holds no EMA (its run trained with ema.enabled: false).",
            "export the model without --ema, or export a checkpoint of a run with ema.enabled: true.",
            setting="--ema",
            value=True,
        )
    if not state:
        raise CheckpointLoadError(
            f"checkpoint {step_dir} holds no model.", "pass a checkpoint written by ddp-job train."
        )
    return plain_names(state)


def _from_shards(shards: Path, where: tuple[str, ...]) -> StateDict:
    """The tensors under ``where`` in a DCP checkpoint, as full tensors, read on this process alone."""
    reader = FileSystemReader(shards)
    metadata = reader.read_metadata()
    wanted: StateDict = {}
    for key, meta in metadata.state_dict_metadata.items():
        path = tuple(str(p) for p in (metadata.planner_data or {}).get(key, (key,)))
        if isinstance(meta, TensorStorageMetadata) and path[: len(where)] == where and len(path) == len(where) + 1:
            wanted[path[-1]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not wanted:
        return {}
    nested: dict[str, Any] = wanted
    for part in reversed(where):  # the nesting DCP flattened on save: {"model": {...}} or {"ema": {"module": {...}}}
        nested = {part: nested}
    try:
        with warnings.catch_warnings():  # DCP warns that it reads on one process: what is meant here
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(nested, storage_reader=reader, no_dist=True)
    except Exception as e:
        raise CheckpointLoadError(
            f"reading the shards of {shards} failed ({type(e).__name__}: {str(e).strip()[:300]}).",
            "pass another checkpoint (the run directory's newest valid one is found by passing the run directory).",
        ) from e
    return wanted


def _from_state_file(file: Path, ema: bool) -> StateDict:
    """The model (or EMA) in ``state.pt``, memory-mapped: the optimizer state beside it is never read into memory."""
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointLoadError(
            f"{file} cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {str(e).strip()[:300]}).",
            "pass a checkpoint written by ddp-job train.",
        ) from None
    if not isinstance(saved, dict):
        return {}
    if not ema:
        return dict(saved.get("model") or {})
    averaged = saved.get("ema") or {}  # AveragedModel's state dict: module.* and n_averaged
    return {k.removeprefix("module."): v for k, v in averaged.items() if k.startswith("module.")}


def untied(state: StateDict) -> StateDict:
    """Contiguous tensors, none sharing storage with another (safetensors refuses shared storage): a tensor whose
    storage an earlier one uses (a tied weight, or views of one buffer) is copied."""
    seen: set[int] = set()
    out: StateDict = {}
    for key, tensor in state.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen and tensor.numel() > 0:
            tensor = tensor.clone()
        seen.add(storage)
        out[key] = tensor.contiguous()
    return out


def write_atomic(state: StateDict, out: Path, metadata: dict[str, str]) -> None:
    """``state`` as a safetensors file at ``out``: written under a temporary name beside it, fsynced, renamed."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(untied(state), tmp, metadata=metadata)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def header(found: store.Found, ema: bool) -> dict[str, str]:
    """The file's metadata: where its tensors come from (safetensors keeps str to str)."""
    train = found.manifest.get("config", {}).get("train", {})
    return {
        "format": "pt",  # what transformers' loaders expect of a PyTorch state dict
        "step": str(found.step),
        "strategy": str(train.get("strategy", "")),
        "world_size": str(found.manifest.get("world_size", "")),
        "weights": "ema" if ema else "model",
        "source": str(found.path.resolve()),
    }


def export(checkpoint: Path, out: Path, ema: bool = False) -> Exported:
    """Write the model (``ema``: its EMA) of ``checkpoint`` (a run or step directory) to the safetensors file ``out``.

    Raises:
        BadInput: naming ``--checkpoint``, ``--out`` or ``--ema`` with the fix.
    """
    found = find_checkpoint(checkpoint)
    _check_out(out, found.path)
    state = read_model(found.path, ema)
    metadata = header(found, ema)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(state, out, metadata)
    size = sum(t.numel() * t.element_size() for t in state.values())
    return Exported(out, len(state), size, metadata)


def _check_out(out: Path, step_dir: Path) -> None:
    if out.is_dir():
        raise BadInput(
            f"--out {out} is a directory.", "pass a file name, e.g. model.safetensors.", setting="--out", value=str(out)
        )
    if out.resolve().is_relative_to(step_dir.resolve()):
        raise BadInput(
            f"--out {out} is inside the checkpoint {step_dir}, which export never modifies (and keep-last deletes).",
            "write the file outside the run's step directories.",
            setting="--out",
            value=str(out),
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddp-job export",
        description="Write a checkpoint's model (or its EMA) as one full, unsharded state dict in a safetensors "
        "file, for inference, fine-tuning elsewhere, or model.weights of this job. Either checkpoint layout "
        "(its shards/, or the state.pt of a checkpoint written before them) at any world size.",
    )
    p.add_argument(
        "--checkpoint",
        type=location.path_argument,
        required=True,
        metavar="DIR",
        help="a run directory (its newest checkpoint that verifies) or one step-NNNNNNN/ directory",
    )
    p.add_argument(
        "--out",
        type=location.path_argument,
        required=True,
        metavar="FILE",
        help="the safetensors file to write (e.g. model.safetensors)",
    )
    p.add_argument(
        "--ema", action="store_true", help="export the EMA of the weights (ema.enabled) instead of the model"
    )
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``ddp-job export``; errors are raised for job.errors.run_command (bad input: exit 2)."""
    a = build_parser().parse_args(argv)
    done = export(a.checkpoint, a.out, a.ema)
    meta = done.metadata
    print(
        f"export: {done.out}: {done.tensors} tensors, {done.bytes / 2**20:.1f} MiB, the {meta['weights']} of step "
        f"{meta['step']} ({meta['strategy']}, {meta['world_size']} process(es)) from {meta['source']}"
    )
    return 0
