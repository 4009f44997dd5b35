"""The built-in task: image classification, configured by the ``model`` and ``data`` sections.

A torchvision model by name or a user model by import path (job.tasks.image.model), over an ImageFolder,
WebDataset shards, synthetic tensors or a user dataset (job.data.source), with cross-entropy loss and exact
top-1 / top-5 / loss over the validation set. Beyond the task contract it owns its data pipeline: the
source's own loaders (device-resident synthetic batches, GPU decode, shard readers) and the copy that
normalises uint8 images on the device (``transfer``).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from job.cluster.env import DistEnv
from job.config import JobConfig
from job.config.plan import Plan
from job.data.loaders import Loaders, to_device
from job.data.prefetch import wrap_loaders
from job.data.source import Prepared, build_loaders, datasets, describe_data, prepare_data
from job.errors import BadInput
from job.observe.observer import train_flops_per_sample
from job.tasks.image import model as models
from job.tasks.image import weights

log = logging.getLogger("job")
METRICS = ("top1", "top5", "loss")
"""Validation metrics, in the order the FINAL line prints them."""


class ImageClassification:
    """The image classifier of ``cfg.model`` on ``cfg.data``; ``prepare`` runs in preflight, once."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.num_classes = cfg.data.num_classes
        self.k = min(5, self.num_classes)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
        self.sum_criterion = nn.CrossEntropyLoss(reduction="sum")
        self.prepared: Prepared | None = None
        self.weights_pending = False

    # ------------------------------------------------------------------ preflight (no process group, no writes)
    def prepare(self, env: DistEnv, plan: Plan, cuda: bool) -> None:
        """The checks of the model and data settings, and the data source validated once for the loaders."""
        models.validate_model(self.cfg.model)
        if self.cfg.model.sync_bn and not cuda:
            raise BadInput(
                "model.sync_bn=true needs CUDA (SyncBatchNorm has no CPU kernel).",
                "--model.sync-bn false, or --model.norm group.",
                setting="model.sync_bn",
                value=True,
            )
        self.prepared = prepare_data(self.cfg.data, env.world_size, plan.micro_batch_size, plan.grad_accum_steps, cuda)

    def initial_weights(self, model: nn.Module, env: DistEnv) -> None:
        """model.weights into the preflight's model, read once: now where this rank can read them (a file, or
        torchvision weights that local rank 0 fetches into the node's cache), else after the process group is
        up (``load_pending_weights``), when local rank 0 has fetched them."""
        cfg = self.cfg.model
        if not cfg.weights:
            return
        saved = weights.read_weights(cfg, fetch=env.local_rank == 0)
        if saved is None:  # torchvision weights that this node's local rank 0 fetches
            self.weights_pending = True
            return
        weights.load_weights(cfg, model, self.num_classes, env.is_main, saved)

    def load_pending_weights(self, model: nn.Module, env: DistEnv) -> None:
        if self.weights_pending:
            weights.load_weights(self.cfg.model, model, self.num_classes, env.is_main)
            self.weights_pending = False

    def check_built(self, model: nn.Module) -> None:
        """A user model's output shape, on the preflight's model (job.tasks.image.model.check_built)."""
        models.check_built(self.cfg.model, model, self.num_classes, self.cfg.data.image_size)

    def example_batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The preflight's batch: ``n`` black images of data.image_size (the shapes training sees; the real
        images were checked by the source's preparation)."""
        size = self.cfg.data.image_size
        return torch.zeros(n, 3, size, size, dtype=torch.uint8), torch.zeros(n, dtype=torch.long)

    def describe_data(self) -> str:
        return describe_data(self.cfg.data, self.prepared)

    # ------------------------------------------------------------------ the contract
    def build_model(self) -> nn.Module:
        return models.build_model(self.cfg.model, self.num_classes)

    def dataset(self, split: str) -> Any:
        """The split's map-style dataset (items are uint8 CHW images and int labels); training itself reads
        through ``loaders``."""
        if self.prepared is None:
            raise RuntimeError("ImageClassification.prepare() runs first")
        sets = datasets(self.cfg.data, self.prepared, self.cfg.run.seed, torch.device("cpu"), rank=0)
        return getattr(sets, split)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        loss: torch.Tensor = self.criterion(model(images), labels)
        return loss

    def metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
        images, labels = batch
        logits = model(images).float()
        topk = logits.topk(self.k, dim=1).indices
        n = labels.numel()
        return {
            "top1": ((topk[:, 0] == labels).sum(), n),
            "top5": ((topk == labels[:, None]).any(dim=1).sum(), n),
            "loss": (self.sum_criterion(logits, labels).double(), n),
        }

    def flops_per_item(self) -> float:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = self.build_model()
        return train_flops_per_sample(model, self.cfg.data.image_size, torch.device("meta"))

    # ------------------------------------------------------------------ beyond the contract: its own data path
    def loaders(
        self, rank: int, world_size: int, micro_batch_size: int, seed: int, device: torch.device, grad_accum_steps: int
    ) -> Loaders:
        data = self.cfg.data
        loaders = build_loaders(
            data, rank, world_size, micro_batch_size, seed, device, grad_accum_steps, prepared=self.prepared
        )
        return cast(Loaders, wrap_loaders(loaders, device, data.device_prefetch, self.cfg.model.channels_last))

    def transfer(self, batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(batch, device, self.cfg.model.channels_last)
