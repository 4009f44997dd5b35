"""Worker for tests/test_launch.py's elastic-restart test: a real gloo process group; the first time
rank 1 runs (no marker file yet) it crashes after one all_reduce, so torchrun must restart the group
(--max-restarts) and the second round must build a fresh process group and finish."""

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    marker = os.path.join(os.environ["LAUNCH_TEST_DIR"], "crashed-once")
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    print(
        f"RESTART-OK rank={dist.get_rank()} round={os.environ['TORCHELASTIC_RESTART_COUNT']} sum={t.item():.0f}"
        f" agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
