"""Build a torchvision classification model by name. No devices, no DDP here: train.py wraps it."""

from __future__ import annotations

from typing import cast

import torch
import torchvision
from torch import nn

from job.config import ModelConfig
from job.errors import BadInput


def available_models() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


_RESNETS = ("resnet", "resnext", "wide_resnet")  # the families that take norm_layer and zero_init_residual


def validate_model(cfg: ModelConfig) -> None:
    """The model settings that can be checked without building anything.

    Raises:
        BadInput: unknown model name (the message lists close matches), or a norm the model does not take.
    """
    names = available_models()
    if cfg.name not in names:
        close = [n for n in names if cfg.name.split("_")[0][:4] in n][:8]
        raise BadInput(
            f"model.name={cfg.name!r} is not a torchvision classification model.",
            f"pick one of e.g. {close or names[:8]} (full list: torchvision.models.list_models()).",
            setting="model.name",
            value=cfg.name,
        )
    if cfg.norm == "group" and not cfg.name.startswith(_RESNETS):
        raise BadInput(
            f"model.norm='group' is supported for ResNet-family models, not model.name={cfg.name!r}.",
            "use model.norm=batch.",
            setting="model.norm",
            value=cfg.norm,
        )


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A randomly initialised torchvision classifier (weights are never downloaded).

    Raises:
        BadInput: see ``validate_model``.
    """
    validate_model(cfg)
    kwargs: dict[str, object] = {"weights": None, "num_classes": num_classes}
    if cfg.zero_init_residual and cfg.name.startswith(_RESNETS):
        kwargs["zero_init_residual"] = True
    if cfg.norm == "group":
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(min(32, channels), channels)
    model = torchvision.models.get_model(cfg.name, **kwargs)
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return cast(nn.Module, model)
