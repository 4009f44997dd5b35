"""The reference: a hand-written DDP loop doing the trainer's work (run under torchrun).

Same model (torchvision, random init), synthetic uint8 images normalised on the device, batch, precision,
memory format and optimizer (SGD momentum 0.9, weight decay 1e-4, foreach) as ``ddp-job train``; nothing
else: no scheduler, clipping, logging, checkpoints or stop checks. Writes per-step times (rank 0) and every rank's
per-step CPU seconds as JSON.
Also the startup reference: prints the wall time of the first collective and of the first optimizer step.
``BareLoop`` is the loop's step, which ``job/bench/paired_worker.py`` alternates with the trainer's.
"""

from __future__ import annotations

import json
import os
import time

T_START = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchvision  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from job.bench.common import reference_args  # noqa: E402


class BareLoop:
    """The hand-written step on its own model, DDP wrapper and optimizer (the process group must exist)."""

    def __init__(
        self,
        model: str,
        image_size: int,
        micro_batch_size: int,
        device: torch.device,
        *,
        channels_last: bool = False,
        bf16: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        cuda = device.type == "cuda"
        self.device, self.micro, self.bf16 = device, micro_batch_size, bf16
        self.mf = torch.channels_last if channels_last else torch.contiguous_format
        torch.manual_seed(0)
        net = torchvision.models.get_model(model, weights=None, num_classes=10).to(device, memory_format=self.mf)
        self.ddp = DDP(
            net, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=gradient_as_bucket_view
        )
        kind = {"fused": True} if cuda else {"foreach": True}
        self.opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, **kind)
        g = torch.Generator().manual_seed(dist.get_rank())
        self.n = max(micro_batch_size * 4, 16)
        shape = (self.n, 3, image_size, image_size)
        self.images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
        self.labels = torch.randint(0, 10, (self.n,), generator=g).to(device)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.loss_sum = torch.zeros((), device=device)

    def step(self, step: int) -> None:
        i = (step * self.micro) % (self.n - self.micro + 1)
        x = (self.images[i : i + self.micro].contiguous(memory_format=self.mf).float() - self.mean) / self.std
        y = self.labels[i : i + self.micro]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # Summed on the device, read by nobody: like the trainer, which reads its loss once per log step.
        self.loss_sum += loss.detach().float()


def main() -> None:
    a = reference_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "OMP_NUM_THREADS" not in os.environ:  # the trainer's rule: one CPU share per local rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    flag = torch.ones(1, device=device)
    dist.all_reduce(flag)
    t_collective = time.time()
    bare = BareLoop(
        a.model, a.image_size, a.batch // world, device, channels_last=a.channels_last, bf16=a.precision == "bf16"
    )
    times: list[float] = []
    cpu_times: list[float] = []  # CPU seconds of this process (all threads) per step, loop bookkeeping included
    t_first_step = 0.0
    cpu0 = time.process_time()
    for step in range(a.steps):
        t0 = time.perf_counter()
        bare.step(step)
        times.append(time.perf_counter() - t0)
        cpu1 = time.process_time()
        cpu_times.append(cpu1 - cpu0)
        cpu0 = cpu1
        if step == 0:
            t_first_step = time.time()
    cpu_per_rank: list[list[float] | None] = [None] * world
    dist.all_gather_object(cpu_per_rank, cpu_times)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "step_times": times,
                    "cpu_times_per_rank": cpu_per_rank,
                    "t_python_start": T_START,
                    "t_first_collective": t_collective,
                    "t_first_step": t_first_step,
                    "world_size": world,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
