"""A stand-in for `python -m job train` under tests/test_launch.py (no torch import: starts in ~50 ms).

Behaviour per rank from LAUNCH_TEST_PLAN = "rank:code[:delay],...": sleep `delay` seconds (default 0),
then exit with `code`. On SIGTERM/SIGINT it records the signal in $LAUNCH_TEST_DIR/signal-<rank> and exits
with LAUNCH_TEST_ON_SIGNAL (143: a worker that "saved"; "own": its planned code, so the codes the
agent reports do not depend on which worker it saw first) or, if that is unset, dies by the signal's
default action. It writes $LAUNCH_TEST_DIR/ready-<rank> once its handlers are installed and its argv to
$LAUNCH_TEST_DIR/argv-<rank>, then waits until every rank is ready before its delay: which worker ends first
never depends on how fast the machine starts them. A worker that exits 143 with LAUNCH_TEST_RUN_DIR set
"saves" as the trainer does: it writes the stop record of step 1 (job.cluster.stop), whose checkpoint the test
made; there rank 0 also marks the attempt trained (its first step done) once ready, unless LAUNCH_TEST_UNTRAINED
is set (workers still starting up).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    rank = int(os.environ["RANK"])
    out = os.environ["LAUNCH_TEST_DIR"]
    plan = {}
    for item in os.environ.get("LAUNCH_TEST_PLAN", "").split(","):
        if item:
            r, code, *delay = item.split(":")
            plan[int(r)] = (int(code), float(delay[0]) if delay else 0.0)
    code, delay = plan.get(rank, (0, 0.0))
    on_signal = os.environ.get("LAUNCH_TEST_ON_SIGNAL")

    def leave(exit_code):
        run_dir = os.environ.get("LAUNCH_TEST_RUN_DIR")
        if exit_code == 143 and run_dir:
            from job.cluster import stop  # no torch: the checkpoint itself is the test's to make

            stop.write_record(Path(run_dir), 1, "signal")
        os._exit(exit_code)

    def handler(signum, _frame):
        with open(os.path.join(out, f"signal-{rank}"), "w") as f:
            f.write(signal.Signals(signum).name)
        if on_signal is None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        leave(code if on_signal == "own" else int(on_signal))

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    with open(os.path.join(out, f"argv-{rank}"), "w") as f:
        json.dump(
            {
                "argv": sys.argv[1:],
                "executable": sys.executable,
                "env": {
                    k: os.environ.get(k)
                    for k in (
                        "TORCHELASTIC_RUN_ID",
                        "WORLD_SIZE",
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                        "TORCHELASTIC_USE_AGENT_STORE",
                        "DDP_JOB_NOTICE_S",
                        "DDP_JOB_ATTEMPT_START",
                    )
                },
            },
            f,
        )
    run_dir = os.environ.get("LAUNCH_TEST_RUN_DIR")
    if run_dir and rank == 0 and not os.environ.get("LAUNCH_TEST_UNTRAINED"):
        from job.cluster import stop

        stop.mark_trained(Path(run_dir), 1)
    open(os.path.join(out, f"ready-{rank}"), "w").close()
    world_size = int(os.environ["WORLD_SIZE"])
    while not all(os.path.exists(os.path.join(out, f"ready-{r}")) for r in range(world_size)):
        time.sleep(0.05)
    time.sleep(delay)
    leave(code)


if __name__ == "__main__":
    sys.exit(main())
