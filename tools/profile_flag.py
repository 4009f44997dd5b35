"""Latency of the trainer's per-step stop-flag agreement: a 1-element MAX all-reduce on a second gloo group
(job.parallel.distributed.all_reduce_max_flag), when both ranks arrive together and after uneven compute.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/profile_flag.py
"""

import statistics
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
g = dist.new_group(backend="gloo")
aligned = []
for _ in range(300):
    dist.barrier(group=g)
    t = torch.tensor([0], dtype=torch.int32)
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    aligned.append(time.perf_counter() - t0)
x = torch.randn(512, 512)
skewed = []
for _ in range(100):
    for _ in range(20):
        x @ x
    t = torch.tensor([0], dtype=torch.int32)
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    skewed.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(f"aligned: median {statistics.median(aligned) * 1e6:.0f} us, p90 {sorted(aligned)[270] * 1e6:.0f} us")
    print(f"after compute (includes waiting for the slower rank): median {statistics.median(skewed) * 1e6:.0f} us")
dist.destroy_process_group()
