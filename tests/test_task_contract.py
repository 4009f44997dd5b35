"""The task contract as a user's task meets it (job.tasks.contract), in real torchrun runs on gloo: ``loss``
and ``metrics`` get the user's own module in preflight and training alike."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from support.cli import run_cli, torchrun, user_code_env
from support.runs import assert_bitwise_equal, assert_same_end, load_final_state
from support.tolerance import summation_order_tolerance
from test_train import max_abs_diff

COMMON = ["--log.progress", "off", "--doctor.enabled", "false", "--data.num-workers", "0", "--log.tensorboard", "false"]


def test_a_loss_that_reads_the_models_attributes_trains_on_two_processes(tmp_path: Path) -> None:
    """The loss reads ``model.config`` and calls ``model.residual``: attributes of the user's module, which the
    DDP wrapper does not have. The forward still runs through DDP, so gradients are all-reduced: 2 processes
    train what 1 process does."""
    out = tmp_path / "runs"
    args = ["--task.name", "support.user_tasks:ReadsModel", "--run.output-dir", str(out), *COMMON]
    args += ["--train.global-batch-size", "8", "--train.steps", "3", "--optim.lr", "0.2"]
    args += ["--log.jsonl", "true", "--log.every", "1"]  # the steps' sizes, for the tolerance
    two = torchrun(2, [*args, "--run.name", "two"], env=user_code_env(tmp_path))
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert re.search(r"^FINAL step=3 val_mse=", two.stdout, re.M), two.stdout[-2000:]
    one = run_cli(["train", *args, "--run.name", "one"], env=user_code_env(tmp_path))
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]
    model = load_final_state(out / "one")["model"]
    diff = max_abs_diff(model, load_final_state(out / "two")["model"])
    # 8 items x a fan-in of 8 feed each gradient element; SGD's default momentum 0.9 and weight decay 1e-4.
    tol = summation_order_tolerance([out / "one", out / "two"], 8 * 8, 0.9, 1e-4, model)
    print(f"\nmax |param diff| 1 proc vs 2 procs: {diff:.3g} (tolerance {tol:.3g})")
    assert diff < tol, (diff, tol)
    assert tol < 1e-3  # far below what a lost or repeated sample moves (an update of about 1 here)


def _one_sgd_step(
    tmp_path: Path, name: str, nproc: int, micro: int, counted: bool = True, clip: float = 0.0
) -> dict[str, torch.Tensor]:
    """The model after one plain SGD step at LR 1 of the ragged-token task over the global batch of 8: the
    initial weights minus the step's gradient (clipped to the norm ``clip`` where given)."""
    out = tmp_path / "runs"
    options = json.dumps({"counted": counted})
    args = ["--task.name", "support.user_tasks:TokenSum", "--task.options", options, *COMMON]
    args += ["--train.grad-clip-norm", str(clip)]
    args += ["--run.output-dir", str(out), "--run.name", name, "--train.steps", "1", "--train.global-batch-size", "8"]
    args += ["--train.micro-batch-size", str(micro), "--optim.lr", "1", "--optim.momentum", "0"]
    args += ["--optim.weight-decay", "0", "--sched.name", "constant", "--log.jsonl", "true", "--log.every", "1"]
    if nproc == 1:
        r = run_cli(["train", *args], env=user_code_env(tmp_path))
    else:
        r = torchrun(nproc, args, env=user_code_env(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    model: dict[str, torch.Tensor] = load_final_state(out / name)["model"]
    return model


def test_a_summed_loss_is_normalised_by_the_global_count_of_the_step(tmp_path: Path) -> None:
    """Ragged sequences (2 to 12 tokens): the gradient of the mean over the global batch's tokens, whether the
    8 items come as one batch in one process, as 4 micro-batches of 2 in one process, or as one micro-batch of 2
    on each of 4 processes. The mean of per-micro-batch means (the plain accumulation of a mean loss) is not."""
    whole = _one_sgd_step(tmp_path, "whole", 1, 8)
    micro = _one_sgd_step(tmp_path, "micro", 1, 2)
    ranks = _one_sgd_step(tmp_path, "ranks", 4, 2)
    means = _one_sgd_step(tmp_path, "means", 1, 2, counted=False)
    # At LR 1 a parameter's change is its gradient: differences of the models are differences of gradients.
    got = {"1 x 4 micro-steps": max_abs_diff(whole, micro), "4 processes x 1": max_abs_diff(whole, ranks)}
    bug = max_abs_diff(whole, means)
    # Each gradient element sums the 8 sequences' tokens (up to 11 each) x a fan-in of 8; plain SGD.
    tol = summation_order_tolerance([tmp_path / "runs" / n for n in ("whole", "micro", "ranks")], 8 * 11 * 8, 0.0)
    print(f"\nmax |grad diff| vs the whole batch: {got}; mean of micro-batch means: {bug:.3g}; tolerance {tol:.3g}")
    assert all(d < tol for d in got.values()), (got, tol)
    assert bug > 100 * tol  # the token counts are ragged enough for the weighting to matter


def test_a_summed_loss_is_normalised_before_clipping(tmp_path: Path) -> None:
    """Clipping applies to the mean gradient, not to the accumulated sum: clipped to 0.01 and to 0.02 (both far
    below the norm of a fresh model's gradient), the two updates point the same way and differ by a vector of
    norm 0.01, to fp32 rounding of the ~300 parameters (1e-6). Normalising after clipping would scale both by
    1/count (about 1/60 here), and the difference with them."""
    low = _one_sgd_step(tmp_path, "clip-low", 1, 2, clip=0.01)
    high = _one_sgd_step(tmp_path, "clip-high", 1, 2, clip=0.02)
    diff = torch.cat([(low[k].double() - high[k].double()).flatten() for k in low]).norm().item()
    assert abs(diff - 0.01) < 1e-5, diff


def _resumed_at_step_3(tmp_path: Path, task: str, *extra: str) -> tuple[Path, str, str]:
    """(runs, ref's stdout, chain's stdout): ``task`` trained 6 steps ("ref"), and again from ref's step-3
    checkpoint ("chain": mid-epoch, 16 steps an epoch)."""
    out = tmp_path / "runs"
    args = ["--task.name", task, "--task.options", '{"n_train": 64}', *COMMON, "--run.output-dir", str(out)]
    args += ["--train.steps", "6", "--train.global-batch-size", "4", "--ckpt.every", "3", *extra]
    ref = run_cli(["train", *args, "--run.name", "ref"], env=user_code_env(tmp_path))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    shutil.copytree(out / "ref", out / "chain", ignore=shutil.ignore_patterns("step-*6", "tb"))
    assert sorted(p.name for p in (out / "chain").glob("step-*")) == ["step-0000003"]
    chain = run_cli(["train", *args, "--run.name", "chain"], env=user_code_env(tmp_path))
    assert chain.returncode == 0, (chain.stdout + chain.stderr)[-3000:]
    assert "resumed from" in chain.stdout + chain.stderr
    return out, ref.stdout, chain.stdout


def test_a_random_collate_resumes_bitwise_mid_epoch(tmp_path: Path) -> None:
    """The collate draws noise in 2 DataLoader workers, whose streams restart with every iter(): a run resumed
    from its step-3 checkpoint ends bitwise where the uninterrupted run does."""
    out, ref, chain = _resumed_at_step_3(tmp_path, "support.user_tasks:NoisyCollate", "--data.num-workers", "2")
    assert_same_end(out / "ref", ref, out / "chain", chain)


def test_the_tasks_own_state_is_checkpointed_and_its_loss_sees_the_step(tmp_path: Path) -> None:
    """The task counts its loss calls and weighs its loss by that count and by the step it was told: saved in
    every checkpoint and restored on resume, so the resumed run ends bitwise where the uninterrupted one does."""
    out, ref, chain = _resumed_at_step_3(tmp_path, "support.user_tasks:Curriculum")
    assert_same_end(out / "ref", ref, out / "chain", chain)
    saved = [load_final_state(out / name)["task"] for name in ("ref", "chain")]
    assert_bitwise_equal(saved[0], saved[1], "task")
    assert saved[0]["step"] == 6 and saved[0]["epoch"] == 0
    assert saved[0]["calls"] > 6  # preflight's and DDP's start-up calls count too


def _in_process_steps(tmp_path: Path, task: str, steps: int) -> Any:
    """The run's parts after ``steps`` training steps of ``task`` in this process (1 rank, batch 8), and the
    model's state before them."""
    from job.cluster.env import detect_env
    from job.config import load_config
    from job.config.plan import make_plan
    from job.parallel import distributed
    from job.train.parts import build_parts
    from job.train.step import TrainState, train_step

    args = ["--task.name", task, "--run.output-dir", str(tmp_path), *COMMON]
    cfg = load_config([*args, "--train.global-batch-size", "8"], {})
    env = detect_env({})
    plan = make_plan(cfg, 1)
    rt = distributed.setup(env, cfg.dist)
    seen = []
    try:
        parts = build_parts(cfg, env, plan, rt)
        before = {k: v.clone() for k, v in parts.raw_model.state_dict().items()}
        state = TrainState()
        batches = parts.loaders.batches(state)
        for _ in range(steps):
            train_step(parts, batches, plan, state, cfg.train)
            seen.append(getattr(parts.task.task, "epoch", None))
    finally:
        distributed.teardown()
    return parts, before, seen


def test_frozen_modules_keep_their_batchnorm_statistics(tmp_path: Path) -> None:
    """The backbone is in no parameter group (frozen) and in ``frozen_modules``: 2 training steps change the head
    and leave every backbone tensor, BatchNorm's running statistics and counter included, as it was."""
    parts, before, _ = _in_process_steps(tmp_path, "support.user_tasks:FrozenBackbone", 2)
    after = parts.raw_model.state_dict()
    assert {k for k in before if k.startswith("0.1.running")} == {"0.1.running_mean", "0.1.running_var"}
    for key in before:
        assert torch.equal(before[key], after[key]) == key.startswith("0."), key


def test_before_step_names_the_epoch_the_steps_batches_come_from(tmp_path: Path) -> None:
    """64 items, 8 a step: steps 1-8 are epoch 0, step 9 the first of epoch 1 (told before its first batch)."""
    _, _, epochs = _in_process_steps(tmp_path, "support.user_tasks:Curriculum", 9)
    assert epochs == [0] * 8 + [1]


def test_every_member_the_job_asks_of_a_users_task_is_in_the_documented_table() -> None:
    """docs/tasks.md's contract table has a row for each member a user's task may have, and none for the
    members only the built-in tasks are asked for."""
    from job.tasks.contract import BUILTIN, OPTIONAL, REQUIRED

    doc = (Path(__file__).parents[1] / "docs" / "tasks.md").read_text()
    rows = "\n".join(line for line in doc.splitlines() if line.startswith("| `"))
    assert [m for m in REQUIRED + OPTIONAL if f"`{m}(" not in rows] == []
    assert [m for m in BUILTIN if f"`{m}(" in rows] == []


def test_a_users_task_is_not_asked_for_the_builtin_tasks_members(tmp_path: Path) -> None:
    """A user's task with methods named prepare, loaders and example_batch trains with the job's own data path."""
    out = tmp_path / "runs"
    args = ["--task.name", "support.user_tasks:NamesBuiltinMembers", "--run.output-dir", str(out), *COMMON]
    r = run_cli(["train", *args, "--train.global-batch-size", "8", "--train.steps", "1"], env=user_code_env(tmp_path))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_generic_code_reads_no_image_setting() -> None:
    """channels_last and the image probe of DDP's start-up passes are the image task's (job.tasks.image)."""
    root = Path(__file__).parents[1] / "job"
    for path in (root / "train" / "parts.py", root / "parallel" / "ddp.py"):
        text = path.read_text()
        assert "channels_last" not in text and "image_size" not in text, path


def test_items_that_stop_collating_after_the_first_two_exit_2_writing_nothing(tmp_path: Path) -> None:
    """Items 0 and 1 collate, later ones are wider: preflight collates items spread over each split, so the run
    exits 2 before the run directory (config.yaml, doctor.json, tb/) exists."""
    out = tmp_path / "runs"
    args = ["--task.name", "support.user_tasks:LaterItemsDoNotCollate", "--run.output-dir", str(out), *COMMON]
    r = run_cli(
        ["train", *args, "--train.global-batch-size", "8", "--doctor.enabled", "true"], env=user_code_env(tmp_path)
    )
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert "do not collate" in r.stderr, r.stderr[-2000:]
    assert not out.exists()


def test_the_docs_show_commands_as_they_run_after_setup() -> None:
    """Every command shown in README.md and docs/ (a code line or a table cell of three words or more, not a usage
    line with [options]) runs the venv's ddp-job, never plain torchrun (which exits 1 for bad input and
    preemption). Exempt: the image's and the pods' pages (ddp-job is on their PATH) and the benchmarks' records of
    what ran."""
    root = Path(__file__).parents[1]
    command = re.compile(r"(?:^|`)[ \t]*(?:\$ )?(?:[A-Z_]+=\S+ )*((?:[\w.-]+/)*(?:ddp-job|torchrun)) ([^`\n]*)", re.M)
    exempt = {"docker.md", "kubernetes.md", "benchmarks.md"}
    wrong = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if path.name in exempt:
            continue
        text = path.read_text()
        for m in command.finditer(text):
            before = text[: m.start()]
            continued = before.rstrip("\n `").endswith("\\")  # a line of a longer command (srun ... \)
            prose = before.endswith(("Plain ", "plain "))  # a sentence about torchrun
            if len(m[2].split()) < 2 or "[" in m[2] or continued or prose:
                continue
            if m[1] not in (".venv/bin/ddp-job", ".venv/bin/torchrun"):
                wrong.append(f"{path.name}: {m[0].strip()[:80]}")
    assert wrong == [], "\n".join(wrong)
