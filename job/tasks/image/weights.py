"""``model.weights``: the initial weights of a fine-tuning run, checked in preflight and loaded before DDP wraps
the model (DDP then broadcasts rank 0's copy; the EMA starts from them).

Three kinds of value. A torchvision weights name (``IMAGENET1K_V2``, ``DEFAULT``) of ``model.name``: torchvision's
own enum gives the URL, torch hub's cache (``$TORCH_HOME/hub/checkpoints``) holds the file; preflight fetches it on
local rank 0 of each node (a download once per node when missing) and the other ranks read the cache after the
process group is up. Or a path: a safetensors file (``ddp-job export``), a state dict
file or a ddp-job checkpoint, read by job.checkpoint.weights.

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

from job.checkpoint import weights as files
from job.config import ModelConfig

log = logging.getLogger("job")
TORCHVISION_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
"""How torchvision spells its weights (IMAGENET1K_V1, DEFAULT); anything else is a path."""
StateDict = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------------------ sources
def _torchvision_weights(cfg: ModelConfig) -> Any:
    try:
        enum = torchvision.models.get_model_weights(cfg.name)
    except (ValueError, KeyError):
        raise files.error(
            cfg,
            f"a torchvision weights name, but model.name={cfg.name!r} is not a torchvision model.",
            "pass a path to a state dict or ddp-job checkpoint for a user model.",
        ) from None
    try:
        return enum[cfg.weights]
    except KeyError:
        raise files.error(
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
        raise files.error(
            cfg,
            f"cannot fetch {weights.url} into torch hub's cache {cached} ({type(e).__name__}: {str(e)[:200]}).",
            "run once where the network is reachable (the file is then cached), or copy the file to that path; "
            "TORCH_HOME moves the cache (e.g. onto a shared file system).",
        ) from None


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
    return files.read_file(cfg)


# ------------------------------------------------------------------------------------------ matching
def head_keys(expected: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], num_classes: int) -> list[str]:
    """The tensors to leave at their initialisation because the weights' head has another number of classes.

    A pure function of shapes. Raises ``ValueError`` (turned into WeightsError by the caller) naming the first
    tensor that does not fit: one the model has and the weights lack, one the weights have and the model lacks, or a
    shape difference outside one head module.
    """
    wrong = files.missing_or_extra(expected, saved)
    if wrong:
        raise ValueError(wrong)
    differ = [k for k, t in expected.items() if tuple(saved[k].shape) != tuple(t.shape)]
    modules = {k.rpartition(".")[0] for k in differ}
    for key in differ:
        want, got = tuple(expected[key].shape), tuple(saved[key].shape)
        is_head = len(modules) == 1 and want[:1] == (num_classes,) and got[1:] == want[1:] and len(got) == len(want)
        if not is_head:
            raise ValueError(
                f"tensor {key} is {files.shape_text(got)} in the weights but {files.shape_text(want)} in the model"
            )
    return differ


def fit(cfg: ModelConfig, model: nn.Module, saved: Mapping[str, torch.Tensor], num_classes: int) -> list[str]:
    """``head_keys`` for this model (meta or real), as WeightsError naming the architecture on a mismatch."""
    try:
        return head_keys(model.state_dict(), saved, num_classes)
    except ValueError as e:
        raise files.error(
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
