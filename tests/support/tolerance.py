"""How far apart two float32 runs of the same training may end when they differ only in the order of their sums.

Two runs that split a global batch differently (1 process against N, one micro-batch against several) compute
the same gradients with float32 sums taken in other orders, and with kernels that block a matrix product
differently for another batch size. Rounding alone then separates them. The bound here is derived from the
computation, not from one machine's result, so it holds on any CPU's kernels:

- A float32 sum of ``n`` terms, reordered, moves by about ``sqrt(n) * u * sum|terms|`` (``u`` = 2**-24, the unit
  roundoff): rounding errors add like a random walk (N. J. Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., section 4.2). ``terms`` is the number of products that feed one gradient element: the
  items of the global batch times the widest fan-in of the model. ``SIGMAS`` random-walk deviations cover the
  largest of many parameters.
- Each step moves a parameter by ``lr * |v|``, where SGD's velocity ``v = momentum * v + g`` (torch's SGD:
  ``v = g`` at the first step) and ``|g| <= grad_norm + weight_decay * |theta|``. The per-step errors add up over
  the steps: the bound is proportional to the path the parameters travel, read from the run's own
  ``metrics.jsonl`` (``train/lr`` and ``train/grad_norm`` of every step: run with ``--log.jsonl true --log.every 1``).

A real bug (a sample lost or counted twice, a missing average, a double accumulation) moves a parameter by a
part of a whole update, many times this bound: the tests that use it also check that.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff: half of ``torch.finfo(torch.float32).eps``."""
SIGMAS = 6.0
"""Random-walk deviations allowed: a 6-sigma rounding error is rarer than one in 10**8 parameters."""


def step_records(run_dir: Path) -> list[dict[str, float]]:
    """The per-step training records of a run's ``metrics.jsonl`` (those with a gradient norm), in step order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r for r in records if "train/grad_norm" in r]
    assert steps, f"{run_dir / 'metrics.jsonl'} has no train/grad_norm: run with --log.jsonl true --log.every 1"
    return sorted(steps, key=lambda r: r["step"])


def update_path(
    records: list[dict[str, float]], momentum: float, weight_decay: float = 0.0, param_norm: float = 0.0
) -> float:
    """An upper bound of the sum over steps of one parameter's update, ``sum_t lr_t * |v_t|``."""
    velocity, path = 0.0, 0.0
    for record in records:
        grad = record["train/grad_norm"] + weight_decay * param_norm
        velocity = momentum * velocity + grad
        path += record["train/lr"] * velocity
    return path


def summation_order_tolerance(
    runs: list[Path],
    terms: int,
    momentum: float,
    weight_decay: float = 0.0,
    params: dict[str, torch.Tensor] | None = None,
) -> float:
    """The largest difference rounding alone may leave between the final parameters of ``runs`` (the runs differ
    in their order of summation only). ``params``: a final state, for weight decay's share of each step."""
    param_norm = 0.0
    if params is not None:
        param_norm = max(float(p.double().norm()) for p in params.values() if p.is_floating_point())
    path = max(update_path(step_records(run), momentum, weight_decay, param_norm) for run in runs)
    # Each run is off the exact result by up to the bound, so the two are off each other by twice it.
    return 2 * SIGMAS * math.sqrt(terms) * UNIT_ROUNDOFF * path
