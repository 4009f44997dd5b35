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

AdamW (``adamw_tolerance``) normalises each update by the gradient's running magnitude, so the path is not
``lr * |v|`` but ``lr * |m / sqrt(v)|``, and a relative error ``r`` of the gradients moves that ratio by at most
``2 * r * kappa_t`` (below). ``r`` is relative to the sum of the magnitudes of a gradient's terms, so the bound
holds for the elements whose gradient is of that size (a well-conditioned sum); one that cancels by a factor c gets
c times it, and one that cancels below the rounding noise keeps Adam's update size with either sign, which no bound
on the order of sums covers (an exactly zero gradient, an embedding row no item used, stays zero in both runs).

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


def adam_kappa(step: int, betas: tuple[float, float]) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` of Adam's ``step``-th update, and the factor by which a relative error of
    the gradients moves it: ``sqrt(sum_i w_i**2 / w'_i)`` over the steps so far, with ``w`` and ``w'`` the
    bias-corrected weights of the first and second moments (Cauchy-Schwarz). 1 at the first step; it grows towards
    ``(1 - beta1) / sqrt((1 - beta2) * (1 - beta1**2 / beta2))``, 7.3 for the default betas, in long runs."""
    beta1, beta2 = betas
    total = 0.0
    for i in range(1, step + 1):
        w1 = (1 - beta1) * beta1 ** (step - i) / (1 - beta1**step)
        w2 = (1 - beta2) * beta2 ** (step - i) / (1 - beta2**step)
        total += w1 * w1 / w2
    return math.sqrt(total)


def adamw_tolerance(runs: list[Path], terms: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest difference rounding alone may leave between the final parameters of AdamW ``runs`` that differ
    in their order of summation only (clipping included: the norm's own error doubles ``r``). Decoupled weight
    decay scales both runs' parameters alike, shrinking their difference, and is left out."""
    rel = 2 * SIGMAS * math.sqrt(terms) * UNIT_ROUNDOFF
    path = 0.0
    for run in runs:
        records = step_records(run)
        # A skipped (non-finite) step still counts: kappa grows with the step, so this over-estimates.
        path = max(path, sum(r["train/lr"] * 2 * rel * adam_kappa(int(r["step"]), betas) for r in records))
    return 2 * path
