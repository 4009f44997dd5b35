"""Cost of the trainer's per-step gradient norm on resnet18's gradients, one CPU thread, median of 15:
``clip_grad_norm_(max_norm=inf)`` (also rescales every gradient by 1) vs ``get_total_norm`` (the norm alone,
what the trainer computes when train.grad_clip_norm is 0).

    OMP_NUM_THREADS=1 python -m benchmarks.profile_grad_norm
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


def median_ms(f, n: int = 15) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


print(
    f"clip_grad_norm_(inf): {median_ms(lambda: torch.nn.utils.clip_grad_norm_(params, float('inf'), foreach=True)):.1f} ms"
)
print(f"get_total_norm:       {median_ms(lambda: torch.nn.utils.get_total_norm(grads, foreach=True)):.1f} ms")
