"""The task contract as a user's task meets it (job.tasks.contract), in real torchrun runs on gloo: ``loss``
and ``metrics`` get the user's own module in preflight and training alike."""

from __future__ import annotations

import re
from pathlib import Path

from support.cli import run_cli, torchrun, user_code_env
from support.runs import load_final_state
from test_train import TOL, max_abs_diff

COMMON = ["--log.progress", "off", "--doctor.enabled", "false", "--data.num-workers", "0", "--log.tensorboard", "false"]


def test_a_loss_that_reads_the_models_attributes_trains_on_two_processes(tmp_path: Path) -> None:
    """The loss reads ``model.config`` and calls ``model.residual``: attributes of the user's module, which the
    DDP wrapper does not have. The forward still runs through DDP, so gradients are all-reduced: 2 processes
    train what 1 process does."""
    out = tmp_path / "runs"
    args = ["--task.name", "support.user_tasks:ReadsModel", "--run.output-dir", str(out), *COMMON]
    args += ["--train.global-batch-size", "8", "--train.steps", "3", "--optim.lr", "0.2"]
    two = torchrun(2, [*args, "--run.name", "two"], env=user_code_env(tmp_path))
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert re.search(r"^FINAL step=3 val_mse=", two.stdout, re.M), two.stdout[-2000:]
    one = run_cli(["train", *args, "--run.name", "one"], env=user_code_env(tmp_path))
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]
    diff = max_abs_diff(load_final_state(out / "one")["model"], load_final_state(out / "two")["model"])
    assert diff < TOL, diff
