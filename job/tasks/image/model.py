"""Build the classifier: a torchvision model by name, or a user model by import path (``package.module:callable``,
job.usercode). No devices, no DDP here: job.train.parts wraps it. ``check_model`` is preflight's look at it before any
process group: built on the meta device (shapes only), and for a user model one forward pass whose output must be
``B x num_classes`` logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torchvision
from torch import nn

from job import usercode
from job.config import ModelConfig
from job.errors import BadInput, UserCodeError

RESERVED_OPTIONS = ("num_classes", "weights")
"""Keywords the job passes itself (model.weights is loaded by the job, job.tasks.image.weights)."""
PROBE_BATCH = 2  # forward-pass check of a user model: two samples (BatchNorm in train mode needs more than one)


def available_models() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


_RESNETS = ("resnet", "resnext", "wide_resnet")  # the families that take norm_layer and zero_init_residual


def validate_model(cfg: ModelConfig) -> None:
    """The model settings that can be checked without building anything.

    Raises:
        BadInput: unknown model name (the message lists close matches), a norm the model does not take, or
            model.options holding a keyword the job passes itself.
        UserCodeError: a user model's module or callable cannot be found.
    """
    reserved = [k for k in RESERVED_OPTIONS if k in cfg.options]
    if reserved:
        raise BadInput(
            f"model.options sets {reserved}, which the job passes itself.",
            "set data.num_classes for the number of classes and model.weights for initial weights.",
            setting="model.options",
            value=cfg.options,
        )
    if usercode.is_import_path(cfg.name):
        usercode.resolve("model.name", cfg.name)
        _torchvision_only(cfg, "norm", cfg.norm != "batch")
        _torchvision_only(cfg, "zero_init_residual", cfg.zero_init_residual)
        return
    names = available_models()
    if cfg.name not in names:
        close = [n for n in names if cfg.name.split("_")[0][:4] in n][:8]
        raise BadInput(
            f"model.name={cfg.name!r} is neither a torchvision classification model nor a package.module:callable "
            "import path.",
            f"pick one of e.g. {close or names[:8]} (full list: torchvision.models.list_models()), or name your "
            f"model function as mypkg.models:build ({usercode.CONTRACT_DOC}).",
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


def _torchvision_only(cfg: ModelConfig, field: str, is_set: bool) -> None:
    if is_set:
        raise BadInput(
            f"model.{field} applies to torchvision models, not the user model model.name={cfg.name!r}.",
            f"leave model.{field} at its default and build the layers you want in your model (pass choices through "
            "model.options).",
            setting=f"model.{field}",
            value=getattr(cfg, field),
        )


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A randomly initialised classifier (weights are loaded by job.tasks.image.weights, never here).

    Raises:
        BadInput: see ``validate_model``; UserCodeError: the user callable failed or returned no module.
    """
    validate_model(cfg)
    if usercode.is_import_path(cfg.name):
        model = _user_model(cfg, num_classes)
    else:
        model = _torchvision_model(cfg, num_classes)
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _torchvision_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    kwargs: dict[str, object] = {**cfg.options, "weights": None, "num_classes": num_classes}
    if cfg.zero_init_residual and cfg.name.startswith(_RESNETS):
        kwargs["zero_init_residual"] = True
    if cfg.norm == "group":
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(min(32, channels), channels)
    try:
        return cast(nn.Module, torchvision.models.get_model(cfg.name, **kwargs))
    except TypeError as e:  # torchvision's builders take **kwargs: an unknown option fails in the constructor
        raise BadInput(
            f"model.options={cfg.options} for model.name={cfg.name!r}: {e}.",
            f"pass only keyword arguments of torchvision.models.{cfg.name} (or of the model class it builds).",
            setting="model.options",
            value=cfg.options,
        ) from None


def _user_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    fn = usercode.resolve("model.name", cfg.name)
    model = usercode.call("model.name", cfg.name, fn, {"num_classes": num_classes, **cfg.options}, "model.options")
    if not isinstance(model, nn.Module):
        raise UserCodeError(
            f"model.name={cfg.name!r} returned a {type(model).__name__}, not a torch.nn.Module.",
            f"return the model itself (an nn.Module mapping B x 3 x H x W floats to B x num_classes logits; "
            f"{usercode.CONTRACT_DOC}).",
            setting="model.name",
            value=cfg.name,
        )
    return model


def check_model(cfg: ModelConfig, num_classes: int, image_size: int) -> nn.Module:
    """Preflight: the model built on the meta device (returned, for its tensor shapes); a user model also runs one
    forward pass there (on the CPU when its forward does not run on meta) and must return B x num_classes.

    Raises:
        BadInput / UserCodeError: see ``build_model``, and a forward pass that fails or returns another shape.
    """
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(cfg, num_classes)
    if usercode.is_import_path(cfg.name):
        _check_output(cfg, _probe(cfg, model, num_classes, image_size), num_classes, image_size)
    return model


def _probe(cfg: ModelConfig, model: nn.Module, num_classes: int, image_size: int) -> object:
    shape = (PROBE_BATCH, 3, image_size, image_size)
    try:
        with torch.no_grad():
            return model(torch.zeros(shape, device="meta"))
    except Exception:  # e.g. .item() or a tensor created on the CPU inside forward: check on the CPU instead
        pass
    with torch.random.fork_rng(devices=[]):
        return _cpu_forward(cfg, build_model(cfg, num_classes), image_size)


def _cpu_forward(cfg: ModelConfig, model: nn.Module, image_size: int) -> object:
    shape = (PROBE_BATCH, 3, image_size, image_size)
    try:
        with torch.no_grad():
            return model(torch.zeros(shape))
    except Exception as e:
        raise UserCodeError(
            f"model.name={cfg.name!r}: the forward pass of a {' x '.join(map(str, shape))} float batch raised "
            f"{type(e).__name__}: {str(e).strip()[:300]}",
            "make the model take B x 3 x data.image_size x data.image_size images (JOB_TRACEBACK=1 prints the "
            "traceback).",
            setting="model.name",
            value=cfg.name,
        ) from e


def check_built(cfg: ModelConfig, model: nn.Module, num_classes: int, image_size: int) -> None:
    """Preflight of the model built once on the CPU: a user model's output for a probe batch must be B x
    num_classes logits (the caller keeps the model's buffers and RNG as they were)."""
    if usercode.is_import_path(cfg.name):
        _check_output(cfg, _cpu_forward(cfg, model, image_size), num_classes, image_size)


def _check_output(cfg: ModelConfig, out: object, num_classes: int, image_size: int) -> None:
    expected = (PROBE_BATCH, num_classes)
    if isinstance(out, torch.Tensor) and tuple(out.shape) == expected:
        return
    got = type(out).__name__
    if isinstance(out, torch.Tensor):
        got = f"a tensor of shape {list(out.shape)}"
    raise UserCodeError(
        f"model.name={cfg.name!r}: a batch of {PROBE_BATCH} images of {image_size} px gave {got}, not "
        f"{PROBE_BATCH} x {num_classes} logits (data.num_classes={num_classes}).",
        "make the model's last layer output num_classes values per image (use the num_classes argument it is "
        "called with) and return that tensor alone.",
        setting="model.name",
        value=cfg.name,
    )


def image_probe(image_size: int, device: torch.device) -> Callable[[nn.Module], torch.Tensor]:
    """A training pass of an image classifier for job.parallel.ddp.settle_buckets: the sum of its logits on 2 zero images."""
    images = torch.zeros(2, 3, image_size, image_size, device=device)  # 2: BatchNorm needs > 1 value per channel

    def probe(model: nn.Module) -> torch.Tensor:
        out: torch.Tensor = model(images).sum()
        return out

    return probe
