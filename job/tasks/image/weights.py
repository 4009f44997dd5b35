"""``model.weights``: the initial weights of a fine-tuning run, checked in preflight and loaded before DDP wraps
the model (DDP then broadcasts rank 0's copy; the EMA starts from them).

Three kinds of value. A torchvision weights name (``IMAGENET1K_V2``, ``DEFAULT``) of ``model.name``: torchvision's
own enum gives the URL, torch hub's cache (``$TORCH_HOME/hub/checkpoints``) holds the file; preflight fetches it on
local rank 0 of each node (a download once per node when missing) and the other ranks read the cache after the
process group is up. A path to a state dict file (``torch.save(model.state_dict())``, also as ``{"state_dict": ...}``
or saved from a DDP-wrapped model), or a ddp-job checkpoint: a ``step-N/`` directory, its ``state.pt``, or a run
directory (its newest verified checkpoint).

Shapes must match, with one exception: the classification head. When the weights' head is sized for another number
of classes (every mismatched tensor is in one module and differs only in its first dimension, which is
data.num_classes in the model), the head keeps its fresh initialisation and the log says so. Any other difference
is a ``WeightsError`` naming the first tensor that does not fit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn

from job.checkpoint import store
from job.checkpoint.sharded import SHARDS, read_whole
from job.config import ModelConfig
from job.errors import WeightsError

log = logging.getLogger("job")
TORCHVISION_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
"""How torchvision spells its weights (IMAGENET1K_V1, DEFAULT); anything else is a path."""
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # keys of a state dict saved from a DDP-wrapped or compiled model
StateDict = dict[str, torch.Tensor]


def _error(cfg: ModelConfig, what: str, fix: str) -> WeightsError:
    return WeightsError(f"model.weights={cfg.weights!r}: {what}", fix, setting="model.weights", value=cfg.weights)


# ------------------------------------------------------------------------------------------ sources
def _torchvision_weights(cfg: ModelConfig) -> Any:
    try:
        enum = torchvision.models.get_model_weights(cfg.name)
    except (ValueError, KeyError):
        raise _error(
            cfg,
            f"a torchvision weights name, but model.name={cfg.name!r} is not a torchvision model.",
            "pass a path to a state dict or ddp-job checkpoint for a user model.",
        ) from None
    try:
        return enum[cfg.weights]
    except KeyError:
        raise _error(
            cfg,
            f"{enum.__name__} has no such weights.",
            f"use one of {['DEFAULT', *(w.name for w in enum)]}, or a path to a state dict.",
        ) from None


def torchvision_cache_file(weights: Any) -> Path:
    """Where torch hub keeps (or will keep) a torchvision weights file: torch.hub.load_state_dict_from_url's rule."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name


def _from_torchvision(cfg: ModelConfig, fetch: bool) -> StateDict | None:
    weights = _torchvision_weights(cfg)
    cached = torchvision_cache_file(weights)
    if not fetch and not cached.is_file():
        return None  # local rank 0 fetches it in its preflight; this rank reads the cache in build_parts
    try:
        return dict(weights.get_state_dict(progress=False, weights_only=True))
    except Exception as e:
        raise _error(
            cfg,
            f"cannot fetch {weights.url} into torch hub's cache {cached} ({type(e).__name__}: {str(e)[:200]}).",
            "run once where the network is reachable (the file is then cached), or copy the file to that path; "
            "TORCH_HOME moves the cache (e.g. onto a shared file system).",
        ) from None


def _checkpoint_file(cfg: ModelConfig, path: Path) -> Path:
    if path.is_file():
        return path
    if not path.exists():
        raise _error(
            cfg, "no such file or directory.", "pass an existing state dict file, ddp-job checkpoint or run directory."
        )
    if (path / "state.pt").is_file():
        return path / "state.pt"
    found = store.find_latest(path)
    if found is None:
        raise _error(
            cfg,
            "a directory without state.pt and without a verified step-* checkpoint.",
            "pass a state dict file, a ddp-job step-N/ directory, or a run directory that holds one.",
        )
    return found.path / "state.pt"


def _unwrap(cfg: ModelConfig, file: Path, obj: Any) -> StateDict:
    """The model's tensors in what was saved: a state dict, a ddp-job checkpoint or {"state_dict": ...}."""
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        keys = list(obj)[:6] if isinstance(obj, Mapping) else []
        raise _error(
            cfg,
            f"{file} holds a {type(obj).__name__} {keys or ''}, not a state dict (a mapping of tensor names to tensors).",
            "save the weights with torch.save(model.state_dict(), PATH), or pass a ddp-job checkpoint.",
        )
    state = {str(k): v for k, v in obj.items()}
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def _from_path(cfg: ModelConfig) -> StateDict:
    file = _checkpoint_file(cfg, Path(cfg.weights))
    try:
        if file.name == store.STATE_FILE and (file.parent / SHARDS).is_dir():  # a checkpoint's model is in its shards
            obj = read_whole(file.parent, ("model",))
        else:
            obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise _error(
            cfg,
            f"cannot load {file} ({type(e).__name__}: {str(e).strip()[:200]}).",
            "the file is truncated, corrupt or not a torch.save file of tensors (torch.load(weights_only=True) "
            "refuses pickled objects): save it again with torch.save(model.state_dict(), PATH).",
        ) from None
    return _unwrap(cfg, file, obj)


def read_weights(cfg: ModelConfig, fetch: bool = True) -> StateDict | None:
    """The saved tensors ``model.weights`` names (None: not set, or a torchvision file this rank leaves to local
    rank 0 to fetch, ``fetch=False``).

    Raises:
        WeightsError: unknown weights name, missing, corrupt or not a state dict.
    """
    if not cfg.weights:
        return None
    if TORCHVISION_NAME.fullmatch(cfg.weights) and not Path(cfg.weights).exists():
        return _from_torchvision(cfg, fetch)
    return _from_path(cfg)


# ------------------------------------------------------------------------------------------ matching
def _shape(shape: torch.Size | tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def head_keys(expected: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], num_classes: int) -> list[str]:
    """The tensors to leave at their initialisation because the weights' head has another number of classes.

    A pure function of shapes. Raises ``ValueError`` (turned into WeightsError by the caller) naming the first
    tensor that does not fit: one the model has and the weights lack, one the weights have and the model lacks, or a
    shape difference outside one head module.
    """
    for key, tensor in expected.items():
        if key not in saved:
            raise ValueError(f"the model's tensor {key} ({_shape(tensor.shape)}) is not in the weights")
    for key in saved:
        if key not in expected:
            raise ValueError(f"the weights' tensor {key} ({_shape(saved[key].shape)}) is not in the model")
    differ = [k for k, t in expected.items() if tuple(saved[k].shape) != tuple(t.shape)]
    modules = {k.rpartition(".")[0] for k in differ}
    for key in differ:
        want, got = tuple(expected[key].shape), tuple(saved[key].shape)
        is_head = len(modules) == 1 and want[:1] == (num_classes,) and got[1:] == want[1:] and len(got) == len(want)
        if not is_head:
            raise ValueError(f"tensor {key} is {_shape(got)} in the weights but {_shape(want)} in the model")
    return differ


def fit(cfg: ModelConfig, model: nn.Module, saved: Mapping[str, torch.Tensor], num_classes: int) -> list[str]:
    """``head_keys`` for this model (meta or real), as WeightsError naming the architecture on a mismatch."""
    try:
        return head_keys(model.state_dict(), saved, num_classes)
    except ValueError as e:
        raise _error(
            cfg,
            f"does not fit model.name={cfg.name!r}: {e} (weights of another architecture or configuration).",
            "pass weights saved from this model (same model.name, model.options and model.norm), or leave "
            "model.weights empty.",
        ) from None


def check_weights(cfg: ModelConfig, model: nn.Module, num_classes: int, fetch: bool) -> None:
    """Preflight: the weights load and fit ``model`` (built on the meta device by job.tasks.image.model.check_model)."""
    saved = read_weights(cfg, fetch)
    if saved is not None:
        fit(cfg, model, saved, num_classes)


def load_weights(
    cfg: ModelConfig, model: nn.Module, num_classes: int, is_main: bool, saved: StateDict | None = None
) -> None:
    """Copy ``model.weights`` (``saved``: already read) into ``model`` (before DDP); a head for another number of
    classes stays as built."""
    if saved is None:
        saved = read_weights(cfg)
    if saved is None:
        return
    head = fit(cfg, model, saved, num_classes)
    model.load_state_dict({k: v for k, v in saved.items() if k not in head}, strict=False)
    if not is_main:
        return
    log.info("model.weights=%s: loaded %d tensors into %s", cfg.weights, len(saved) - len(head), cfg.name)
    if head:
        key = head[0]
        log.info(
            "model.weights: head %s re-initialised: the weights have %d classes, data.num_classes=%d",
            key.rpartition(".")[0],
            saved[key].shape[0],
            num_classes,
        )
