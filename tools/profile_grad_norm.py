"""Cost of the trainer's per-step gradient norm on resnet18's gradients, one CPU thread, median of 15:
``clip_grad_norm_(max_norm=inf)`` (also rescales every gradient by 1) vs ``get_total_norm`` (the norm alone,
what the trainer computes when train.grad_clip_norm is 0), and the cheaper checks that were considered for the
non-finite guard: the per-tensor norms alone, per-tensor sums, AMP's fused non-finite check, and one norm over
the gradients laid out flat (what DDP's buckets hold with gradient_as_bucket_view; reaching them needs DDP
internals). Each case is timed twice, interleaved, because this machine's speed drifts.

    OMP_NUM_THREADS=1 python tools/profile_grad_norm.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torchvision


def median_ms(f: Callable[[], Any], n: int = 15) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def cases() -> dict[str, Callable[[], Any]]:
    """Each check over resnet18's gradients after one backward, by name."""
    model = torchvision.models.resnet18(num_classes=10)
    model(torch.randn(16, 3, 32, 32)).sum().backward()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    buckets = list(flat.chunk(2))  # resnet18's gradients fill 2 buckets of <= 25 MiB
    found_inf, one = torch.zeros(1), torch.ones(1)
    return {
        "clip_grad_norm_(inf)": lambda: torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=True),
        "get_total_norm (the trainer)": lambda: torch.nn.utils.get_total_norm(grads, foreach=True),
        "_foreach_norm only": lambda: torch._foreach_norm(grads),
        "per-tensor sums": lambda: torch.stack([g.sum() for g in grads]).sum(),
        "amp non-finite check": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one),
        "norm of the flat buckets": lambda: torch.linalg.vector_norm(torch.stack([b.norm() for b in buckets])),
    }


def main() -> None:
    torch.set_num_threads(1)
    checks = cases()
    for round_ in (1, 2):
        for name, f in checks.items():
            print(f"round {round_}  {name:30s} {median_ms(f):6.2f} ms")


if __name__ == "__main__":
    main()
