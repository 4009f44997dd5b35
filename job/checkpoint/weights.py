"""``model.weights`` as a file or checkpoint: read into a state dict with the plain module's keys, and, for every
task that does not load its weights itself, loaded strictly into the model preflight built.

What a path may name: a safetensors file (``ddp-job export`` writes one), a ``torch.save`` state dict (also as
``{"state_dict": ...}`` or saved from a DDP-wrapped model), or a ddp-job checkpoint: a ``step-N/`` directory (its
``shards/``, read by job.checkpoint.export, or the ``state.pt`` of an older one), its ``state.pt``, or a run directory (its
newest verified checkpoint).

The image task owns its weights (torchvision names, a head for another number of classes: job.tasks.image.weights)
and reads files through ``read_file``. Every other task (``causal_lm``, a user's task) gets ``load_strict``: the
same names and shapes as its model, or a ``WeightsError`` (exit 2) naming the file and the first tensor that does
not fit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from job.checkpoint import export, store
from job.checkpoint.sharded import SHARDS
from job.config import ModelConfig
from job.errors import JobError, WeightsError

log = logging.getLogger("job")
StateDict = dict[str, torch.Tensor]
SAFETENSORS = ".safetensors"


def error(cfg: ModelConfig, what: str, fix: str) -> WeightsError:
    return WeightsError(f"model.weights={cfg.weights!r}: {what}", fix, setting="model.weights", value=cfg.weights)


def _source(cfg: ModelConfig, path: Path) -> Path:
    """The file, or the checkpoint's step directory, that ``path`` names."""
    if path.is_file():
        if path.name == store.STATE_FILE and (
            (path.parent / SHARDS).is_dir() or (path.parent / store.MANIFEST).exists()
        ):
            return path.parent  # a checkpoint's state.pt: its model may be in the shards beside it; verified as one
        return path
    if not path.exists():
        raise error(
            cfg, "no such file or directory.", "pass an existing state dict file, ddp-job checkpoint or run directory."
        )
    if (path / store.STATE_FILE).is_file():
        return path
    found = store.find_latest(path)  # verified
    if found is None:
        raise error(
            cfg,
            "a directory without state.pt and without a verified step-* checkpoint.",
            "pass a state dict file, a ddp-job step-N/ directory, or a run directory that holds one.",
        )
    return found.path


def _unwrap(cfg: ModelConfig, file: Path, obj: Any) -> StateDict:
    """The model's tensors in what was saved: a state dict, a ddp-job checkpoint or {"state_dict": ...}."""
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        keys = list(obj)[:6] if isinstance(obj, Mapping) else []
        raise error(
            cfg,
            f"{file} holds a {type(obj).__name__} {keys or ''}, not a state dict (a mapping of tensor names to tensors).",
            "save the weights with torch.save(model.state_dict(), PATH), or pass a ddp-job checkpoint.",
        )
    return {str(k): v for k, v in obj.items()}


def _from_torch_file(cfg: ModelConfig, file: Path) -> StateDict:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise error(
            cfg,
            f"cannot load {file} ({type(e).__name__}: {str(e).strip()[:200]}).",
            "the file is truncated, corrupt or not a torch.save file of tensors (torch.load(weights_only=True) "
            "refuses pickled objects): save it again with torch.save(model.state_dict(), PATH).",
        ) from None
    return _unwrap(cfg, file, obj)


def _from_safetensors(cfg: ModelConfig, file: Path) -> StateDict:
    from safetensors.torch import load_file

    try:
        return load_file(file, device="cpu")
    except Exception as e:
        raise error(
            cfg,
            f"cannot load {file} as safetensors ({type(e).__name__}: {str(e).strip()[:200]}).",
            "the file is truncated or corrupt: write it again (ddp-job export --checkpoint RUN_DIR --out FILE).",
        ) from None


def _from_checkpoint(cfg: ModelConfig, step_dir: Path) -> StateDict:
    try:
        return export.read_model(step_dir)
    except JobError as e:
        raise error(cfg, f"cannot read the model of checkpoint {step_dir}: {e.what}", e.fix) from None


def _verified(cfg: ModelConfig, source: Path) -> Path:
    """``source``, where it is a checkpoint's step directory, checked against its manifest (sizes and sha256, as
    ``ddp-job export`` and a resume check it)."""
    if source.is_dir() and (source / store.MANIFEST).exists():
        ok, reason, _ = store.verify(source)
        if not ok:
            raise error(
                cfg,
                f"checkpoint {source} does not verify: {reason}.",
                "pass the run directory to load its newest valid checkpoint, or another step directory.",
            )
    return source


def read_file(cfg: ModelConfig) -> StateDict:
    """The tensors of the file or checkpoint ``model.weights`` names, with the plain module's keys.

    Raises:
        WeightsError: missing, corrupt, or not a state dict.
    """
    source = _verified(cfg, _source(cfg, Path(cfg.weights)))
    if source.is_dir() and (source / SHARDS).is_dir():
        state = _from_checkpoint(cfg, source)
    elif source.is_dir():
        state = _from_torch_file(cfg, source / store.STATE_FILE)
    elif source.suffix == SAFETENSORS:
        state = _from_safetensors(cfg, source)
    else:
        state = _from_torch_file(cfg, source)
    return export.plain_names(state)


def shape_text(shape: torch.Size | tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def missing_or_extra(expected: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> str:
    """The first tensor the model has and the weights lack, or the weights have and the model lacks ("": none)."""
    for key, tensor in expected.items():
        if key not in saved:
            return f"the model's tensor {key} ({shape_text(tensor.shape)}) is not in the weights"
    for key in saved:
        if key not in expected:
            return f"the weights' tensor {key} ({shape_text(saved[key].shape)}) is not in the model"
    return ""


def mismatch(expected: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> str:
    """The first tensor that does not fit ("" when all do): missing, extra, or of another shape."""
    wrong = missing_or_extra(expected, saved)
    for key, tensor in expected.items():
        if not wrong and tuple(saved[key].shape) != tuple(tensor.shape):
            wrong = f"tensor {key} is {shape_text(saved[key].shape)} in the weights but {shape_text(tensor.shape)} in the model"
    return wrong


def load_strict(cfg: ModelConfig, model: nn.Module, task_name: str, is_main: bool) -> None:
    """``model.weights`` into ``model`` (before any wrapper), every tensor by name and shape.

    Raises:
        WeightsError: the file cannot be read, or a tensor does not fit (named with the file and the fix).
    """
    saved = read_file(cfg)
    wrong = mismatch(model.state_dict(), saved)
    if wrong:
        raise error(
            cfg,
            f"does not fit the model of task.name={task_name!r}: {wrong} (weights of another model or task.options).",
            "pass weights exported from a run of this task with the same options (ddp-job export), or leave "
            "model.weights empty.",
        )
    model.load_state_dict(saved, strict=True)
    if is_main:
        log.info("model.weights=%s: loaded %d tensors", cfg.weights, len(saved))
