"""The Lightning reference (run under torchrun): the same work as job/bench/bare_ddp.py through
``lightning.Trainer`` (strategy ddp, no logger/checkpointing/progress bar). Per-step times are measured
by a callback from batch start to batch end, written by rank 0 as JSON."""

from __future__ import annotations

import json
import os
import time

import lightning as L  # noqa: N812 (the name Lightning's own docs use)
import torch
import torchvision
from torch.utils.data import DataLoader, TensorDataset

from job.bench.common import reference_args


class Net(L.LightningModule):
    def __init__(self, model: str, channels_last: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torchvision.models.get_model(model, weights=None, num_classes=10)
        self.mf = torch.channels_last if channels_last else torch.contiguous_format
        self.net = self.net.to(memory_format=self.mf)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255, persistent=False)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def training_step(self, batch, _idx):  # type: ignore[no-untyped-def]
        x, y = batch
        x = (x.contiguous(memory_format=self.mf).float() - self.mean) / self.std
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        kw = {"fused": True} if torch.cuda.is_available() else {"foreach": True}
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, **kw)


class StepTimes(L.Callback):
    """Seconds from one batch's end to the next one's: the whole loop, Lightning's fetch and host-to-device copy
    of the batch included (on_train_batch_start comes after the copy). No host read of the loss here: the bare
    loop never reads it and the trainer reads it at log steps only, so on CUDA a read per step would add a
    synchronisation the other two do not have. The first interval starts at the first batch's start."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, trainer, module, batch, idx):  # type: ignore[no-untyped-def]
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):  # type: ignore[no-untyped-def]
        now = time.perf_counter()
        assert self._last is not None
        self.times.append(now - self._last)
        self._last = now


def main() -> None:
    a = reference_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    micro = a.batch // world
    g = torch.Generator().manual_seed(0)
    n = max(a.batch * 4, 64)
    ds = TensorDataset(
        torch.randint(0, 256, (n, 3, a.image_size, a.image_size), dtype=torch.uint8, generator=g),
        torch.randint(0, 10, (n,), generator=g),
    )
    cb = StepTimes()
    trainer = L.Trainer(
        accelerator="auto",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=1,
        strategy="ddp",
        precision="bf16-mixed" if a.precision == "bf16" else "32-true",
        max_steps=a.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[cb],
    )
    trainer.fit(
        Net(a.model, a.channels_last), DataLoader(ds, batch_size=micro, shuffle=True, drop_last=True, num_workers=0)
    )
    if trainer.global_rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_times": cb.times, "world_size": world}, f)


if __name__ == "__main__":
    main()
