"""Worker of the synchronisation-modes benchmark (run under torchrun): one mode per launch.

``--mode ddp``: N ranks train under DDP (bucketed all-reduce of the gradients). ``--mode ps``: rank 0 is a
parameter server built on ``torch.distributed.rpc`` (it holds the parameters and the optimizer), ranks 1..N
are the trainers: each step a trainer pushes its gradients and gets the updated parameters back in the same
call; the server steps once all N gradients of the step are in (synchronous SGD, as PyTorch's batch-updating
parameter-server tutorial). Trainer i of either mode gets the same batches and starts from the same
parameters, so both modes compute the same steps.

Bytes are counted by the kernel, per process: the payload bytes acked (sent) and received of every TCP socket
the process holds (``TCP_INFO``), read before and after the timed steps. gloo on CPU and TensorPipe, pinned to
its TCP transport and basic channel here, carry everything over TCP; NCCL does not (shared memory, NVLink),
so on NCCL only times are reported. Every rank writes ``rank<R>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

TCP_INFO_LEN = 232
BYTES_ACKED_AT = 120  # struct tcp_info: __u64 tcpi_bytes_acked, then __u64 tcpi_bytes_received (linux/tcp.h)


def tcp_bytes() -> tuple[int, int]:
    """(sent, received) payload bytes over all TCP sockets this process holds open now."""
    sent = received = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # the fd closed meanwhile, or is not an inet socket
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
            acked, got = struct.unpack_from("QQ", info, BYTES_ACKED_AT)
            sent, received = sent + acked, received + got
    return sent, received


def build(model: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    built: torch.nn.Module = torchvision.models.get_model(model, weights=None, num_classes=10)
    return built


def batch(a: argparse.Namespace, step: int, trainer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer ``trainer``'s batch of ``step``: the same in both modes."""
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 1009 + trainer)
    x = torch.randn(a.micro, 3, a.image_size, a.image_size, generator=g)
    return x, torch.randint(0, 10, (a.micro,), generator=g)


def optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class Server:
    """The parameters and the optimizer; one SGD step per N pushed gradients, the mean in trainer order."""

    def __init__(self, model: torch.nn.Module, trainers: int, lr: float, window: tuple[int, int]) -> None:
        self.params = list(model.parameters())
        self.opt = optimizer(self.params, lr)
        self.trainers, self.window = trainers, window
        self.lock = threading.Lock()
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.future: torch.futures.Future = torch.futures.Future()
        self.steps = 0
        self.marks: list[tuple[int, int]] = []
        self.done = threading.Event()

    def push(self, trainer: int, grads: list[torch.Tensor]) -> torch.futures.Future:
        with self.lock:
            self.grads[trainer] = grads
            fut = self.future
            if len(self.grads) == self.trainers:
                self.update()
                # counted here, every gradient of this step received and no parameter of it sent yet: the
                # window holds exactly (window[1] - window[0]) steps' worth of each direction
                if self.steps in self.window:
                    self.marks.append(tcp_bytes())
                self.future = torch.futures.Future()
                fut.set_result([p.detach() for p in self.params])
                if self.steps == self.window[1]:
                    self.done.set()
        return fut

    def update(self) -> None:
        for j, p in enumerate(self.params):
            p.grad = torch.stack([self.grads[i][j] for i in range(self.trainers)]).sum(0) / self.trainers
        self.opt.step()
        self.grads.clear()
        self.steps += 1


SERVER: Server | None = None


@rpc.functions.async_execution
def push_pull(trainer: int, grads: list[torch.Tensor]) -> torch.futures.Future:
    assert SERVER is not None
    return SERVER.push(trainer, grads)


def train(a: argparse.Namespace, trainer: int, model: torch.nn.Module, step_fn) -> dict:  # type: ignore[no-untyped-def]
    """Warm-up steps, then the timed ones (bytes counted around them); the step times of the timed steps."""
    times: list[float] = []
    marks = []
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            marks.append(tcp_bytes())
        x, y = batch(a, step, trainer)
        t0 = time.perf_counter()
        step_fn(x, y)
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": times, "marks": marks}


def run_ddp(a: argparse.Namespace) -> tuple[dict, torch.nn.Module]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    raw = build(a.model, a.seed)
    # BatchNorm buffers are not parameters: no broadcast, so the bytes are the gradients' only
    model = DDP(raw, broadcast_buffers=False, bucket_cap_mb=a.bucket_mb)
    opt = optimizer(list(raw.parameters()), a.lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dist.barrier()  # every rank past set-up before the warm-up, so no peer's bytes land before a count starts
    r = train(a, rank, model, step)
    dist.barrier()  # every rank's last segments acked before the count ends (a barrier adds a few bytes)
    r["marks"].append(tcp_bytes())
    r.update(role="rank", index=rank)
    dist.destroy_process_group()
    return r, raw


def rpc_options() -> rpc.TensorPipeRpcBackendOptions:
    # TCP only (no shared-memory transport, no multiplexed channels): every byte passes the counted sockets
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, _transports=["uv"], _channels=["basic"])


def run_ps(a: argparse.Namespace) -> tuple[dict, torch.nn.Module]:
    global SERVER
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = build(a.model, a.seed)
    if rank == 0:
        SERVER = Server(model, world - 1, a.lr, (a.warmup, a.warmup + a.steps))
        rpc.init_rpc("ps", rank=0, world_size=world, rpc_backend_options=rpc_options())
        SERVER.done.wait()
        r: dict = {"role": "server", "index": 0, "step_s": [], "marks": SERVER.marks}
        rpc.shutdown()
        return r, model
    trainer = rank - 1
    rpc.init_rpc(f"trainer{trainer}", rank=rank, world_size=world, rpc_backend_options=rpc_options())
    loss_fn = torch.nn.CrossEntropyLoss()
    params = list(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss_fn(model(x), y).backward()
        new = rpc.rpc_sync("ps", push_pull, args=(trainer, [p.grad for p in params]))
        with torch.no_grad():
            for p, q in zip(params, new):
                p.copy_(q)
                p.grad = None

    r = train(a, trainer, model, step)
    r["marks"].append(tcp_bytes())
    r.update(role="trainer", index=trainer)
    rpc.shutdown()
    return r, model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("ddp", "ps"), required=True)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help=">= 1: the server counts from the end of a step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--save-params", action="store_true", help="write the final parameters (params<R>.pt)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    r, model = (run_ddp if a.mode == "ddp" else run_ps)(a)
    (start_sent, start_recv), (end_sent, end_recv) = r.pop("marks")
    r.update(sent=end_sent - start_sent, received=end_recv - start_recv, steps=a.steps)
    r["grad_bytes"] = sum(q.numel() * q.element_size() for q in model.parameters())
    (a.out / f"rank{rank}.json").write_text(json.dumps(r))
    if a.save_params:
        torch.save({n: q.detach() for n, q in model.named_parameters()}, a.out / f"params{rank}.pt")


if __name__ == "__main__":
    main()
