"""The reference: a hand-written DDP loop doing the trainer's work (run under torchrun).

Same model (torchvision, random init), synthetic uint8 images normalised on the device, batch, precision,
memory format and optimizer (SGD momentum 0.9, weight decay 1e-4, foreach) as ``ddp-job train``; nothing
else: no scheduler, clipping, logging, checkpoints or stop checks. Writes per-step times (rank 0) and every rank's
per-step CPU seconds as JSON.
Also the startup reference: prints the wall time of the first collective and of the first optimizer step.
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

from benchmarks.common import reference_args  # noqa: E402


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
    torch.manual_seed(0)
    model = torchvision.models.get_model(a.model, weights=None, num_classes=10).to(device)
    mf = torch.channels_last if a.channels_last else torch.contiguous_format
    model = model.to(memory_format=mf)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, **({"fused": True} if cuda else {"foreach": True})
    )
    micro = a.batch // world
    g = torch.Generator().manual_seed(rank)
    n = max(micro * 4, 16)
    images = torch.randint(0, 256, (n, 3, a.image_size, a.image_size), dtype=torch.uint8, generator=g).to(device)
    labels = torch.randint(0, 10, (n,), generator=g).to(device)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    loss_fn = torch.nn.CrossEntropyLoss()
    times: list[float] = []
    cpu_times: list[float] = []  # CPU seconds of this process (all threads) per step, loop bookkeeping included
    t_first_step = 0.0
    cpu0 = time.process_time()
    for step in range(a.steps):
        t0 = time.perf_counter()
        i = (step * micro) % (n - micro + 1)
        x = (images[i : i + micro].contiguous(memory_format=mf).float() - mean) / std
        y = labels[i : i + micro]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # one host sync per step, like the trainer's finite check
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
