"""A stand-in for `python -m job train` under tests/test_launch.py (no torch import: starts in ~50 ms).

Behaviour per rank from LAUNCH_TEST_PLAN = "rank:code[:delay],...": sleep `delay` seconds (default 0),
then exit with `code`. On SIGTERM/SIGINT it records the signal in $LAUNCH_TEST_DIR/signal-<rank> and exits
with LAUNCH_TEST_ON_SIGNAL (143: a worker that "saved"; "own": its planned code, so the codes the
agent reports do not depend on which worker it saw first) or, if that is unset, dies by the signal's
default action. It writes $LAUNCH_TEST_DIR/ready-<rank> once its handlers are installed and its argv to
$LAUNCH_TEST_DIR/argv-<rank>.
"""

import json
import os
import signal
import sys
import time


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

    def handler(signum, _frame):
        with open(os.path.join(out, f"signal-{rank}"), "w") as f:
            f.write(signal.Signals(signum).name)
        if on_signal is None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        os._exit(code if on_signal == "own" else int(on_signal))

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
                        "DDP_JOB_NOTICE_S",
                    )
                },
            },
            f,
        )
    open(os.path.join(out, f"ready-{rank}"), "w").close()
    time.sleep(delay)
    return code


if __name__ == "__main__":
    sys.exit(main())
