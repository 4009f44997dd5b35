"""``ddp-job train`` with one per-step extra switched off (ABLATE env var), for tools/profile_overhead.py
(and, through ``apply``, job/bench/paired_worker.py).

ABLATE is a comma-separated subset of:
  stopflag   the per-step stop vote (job.parallel.distributed.StepFlagVote): this rank's flag, no all-reduce
  clip       the per-step gradient norm (get_total_norm; clip_grad_norm_ when clipping): 0 without computing
  observer   the per-step observer work (progress file writes, per-rank stats gather every N steps)
Profiling only: an ablated run is not safe to preempt (stopflag) or to clip (clip).
"""

from __future__ import annotations

import os
import sys

import torch

CHOICES = ("stopflag", "clip", "observer")


def apply(ablate: str) -> None:
    """Switch off the extras named in ``ablate`` (comma-separated CHOICES) in this process."""
    off = {x for x in ablate.split(",") if x}
    unknown = off - set(CHOICES)
    if unknown:
        raise SystemExit(f"ABLATE: unknown {sorted(unknown)}; choose from {', '.join(CHOICES)}")
    from job.observe import observer as observe
    from job.parallel import distributed

    if "stopflag" in off:
        distributed.StepFlagVote.start = lambda self, flag: setattr(self, "_local", flag)  # type: ignore[method-assign]
        distributed.StepFlagVote.agreed = lambda self: getattr(self, "_local", False)  # type: ignore[method-assign]
    if "clip" in off:
        torch.nn.utils.clip_grad_norm_ = lambda params, max_norm, **kw: torch.zeros(())
        torch.nn.utils.get_total_norm = lambda tensors, **kw: torch.zeros(())
    if "observer" in off:
        observe.Observer.step_done = lambda self, step, timer: None  # type: ignore[method-assign]
        observe.Observer._grads_ready = lambda self, _param: None  # type: ignore[method-assign]


def main() -> int:
    from job import cli

    apply(os.environ.get("ABLATE", ""))
    return cli.main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
