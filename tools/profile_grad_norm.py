"""Cost of the trainer's per-step gradient norm on resnet18's gradients, one CPU thread, median of 15:
``clip_grad_norm_(max_norm=inf)`` (also rescales every gradient by 1) vs ``get_total_norm`` (the norm alone,
what the trainer computes when train.grad_clip_norm is 0), and the cheaper checks that were considered for the
non-finite guard: the per-tensor norms alone, per-tensor sums, AMP's fused non-finite check, and one norm over
the gradients laid out flat (what DDP's buckets hold with gradient_as_bucket_view; reaching them needs DDP
internals). Each case is timed twice, interleaved, because this machine's speed drifts.

    OMP_NUM_THREADS=1 python tools/profile_grad_norm.py
"""

import statistics
import time

import torch
import torchvision

torch.set_num_threads(1)
model = torchvision.models.resnet18(num_classes=10)
model(torch.randn(16, 3, 32, 32)).sum().backward()
params = list(model.parameters())
grads = [p.grad for p in params]
flat = torch.cat([g.reshape(-1) for g in grads])
buckets = list(flat.chunk(2))  # resnet18's gradients fill 2 buckets of <= 25 MiB
found_inf, one = torch.zeros(1), torch.ones(1)


def median_ms(f, n: int = 15) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


CASES = {
    "clip_grad_norm_(inf)": lambda: torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=True),
    "get_total_norm (the trainer)": lambda: torch.nn.utils.get_total_norm(grads, foreach=True),
    "_foreach_norm only": lambda: torch._foreach_norm(grads),
    "per-tensor sums": lambda: torch.stack([g.sum() for g in grads]).sum(),
    "amp non-finite check": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one),
    "norm of the flat buckets": lambda: torch.linalg.vector_norm(torch.stack([b.norm() for b in buckets])),
}
for round_ in (1, 2):
    for name, f in CASES.items():
        print(f"round {round_}  {name:30s} {median_ms(f):6.2f} ms")
