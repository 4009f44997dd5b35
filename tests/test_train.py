"""The training engine end to end, with real processes: learning, 1-vs-2-process equivalence, exact eval,
TensorBoard events, resume. CPU + gloo."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from support import ROOT
from support.cli import base_env, make_data, run_cli, torchrun
from support.runs import load_final_state, rank_pids, tfevents_writer
from support.tolerance import summation_order_tolerance

pytestmark = pytest.mark.integration

FINAL = re.compile(r"FINAL step=(\d+) val_top1=([\d.]+) val_top5=([\d.]+) val_loss=([\d.]+) val_count=(\d+)")


def final(stdout: str) -> dict[str, float]:
    m = FINAL.search(stdout)
    assert m, f"no FINAL line in:\n{stdout[-3000:]}"
    return {"step": int(m[1]), "top1": float(m[2]), "top5": float(m[3]), "loss": float(m[4]), "count": int(m[5])}


def final_line(stdout: str) -> str:
    """The FINAL line up to its paths."""
    m = FINAL.search(stdout)
    assert m, f"no FINAL line in:\n{stdout[-3000:]}"
    return m[0]


def exact_args(data: Path, out: Path, name: str, **over: str) -> list[str]:
    """A setup that is exact in principle across world sizes: GroupNorm (no batch statistics), no augmentation,
    no dropout, the same samples in every global batch (job.data.loaders's row layout), SGD without momentum noise."""
    args = {
        "--data.path": str(data),
        "--data.num-classes": "4",
        "--data.image-size": "16",
        "--data.augment": "false",
        "--data.num-workers": "0",
        "--model.name": "resnet18",
        "--model.norm": "group",
        "--optim.lr": "0.05",
        "--sched.name": "constant",
        "--train.steps": "4",
        "--train.global-batch-size": "16",
        "--run.output-dir": str(out),
        "--run.name": name,
        "--log.every": "1",
        "--log.jsonl": "true",  # every step's lr and gradient norm: the size of the rounding tolerance
        "--ckpt.every": "0",
        "--log.progress": "off",
    }
    args.update(over)
    return [x for kv in args.items() for x in kv]


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_final_state(run_dir)["model"]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def test_cpu_smoke_config_learns(tmp_path: Path) -> None:
    """configs/cpu-smoke.yaml as shipped (only paths changed) on the README's dataset. 10 classes: chance is
    10 %; the threshold of 50 % is far above chance yet below what the run reaches (0.85 in the README), so
    noise in the few-minute run does not make the test flaky."""
    data = make_data(tmp_path / "shapes", classes=10, per_class=100, size=32)
    r = run_cli(
        [
            "train",
            "--config",
            str(ROOT / "configs/cpu-smoke.yaml"),
            "--data.path",
            str(data),
            "--run.output-dir",
            str(tmp_path / "runs"),
        ],
        env=base_env(tmp_path),
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = final(r.stdout)
    assert res["step"] == 150
    assert res["top1"] >= 0.50, res
    assert res["count"] == 250


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("exact")
    data = make_data(base / "data", classes=4, per_class=16, size=16, val_per_class=5)
    out = base / "runs"
    env = base_env(base)
    runs = {
        "single": ([], 1),  # 1 process, micro 16
        "single_accum": (["--train.micro-batch-size", "8"], 1),  # 1 process, 2 micro-steps of 8
        "ddp2": ([], 2),  # 2 processes x micro 8
    }
    results: dict[str, Path] = {}
    for name, (extra, nproc) in runs.items():
        args = exact_args(data, out, name) + extra
        r = run_cli(["train", *args], env=env) if nproc == 1 else torchrun(nproc, args, env=env)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        results[name] = out / name
        (out / name / "stdout.txt").write_text(r.stdout + r.stderr)
    results["data"] = data
    results["out"] = out
    return results


# Each gradient element of resnet18 sums 16 items x its widest fan-in (512 channels x 3 x 3); SGD's default
# momentum 0.9 and weight decay 1e-4 (exact_args).
RESNET18_TERMS = 16 * 512 * 3 * 3


def exact_tolerance(*runs: Path) -> float:
    """What float summation order alone may leave between runs of exact_args (support/tolerance.py)."""
    return summation_order_tolerance(list(runs), RESNET18_TERMS, 0.9, 1e-4, params(runs[0]))


def test_two_processes_equal_one_process(exact_runs: dict[str, Path]) -> None:
    diff = max_abs_diff(params(exact_runs["single"]), params(exact_runs["ddp2"]))
    tol = exact_tolerance(exact_runs["single"], exact_runs["ddp2"])
    print(f"max |param diff| 1 proc vs 2 procs: {diff:.3g} (tolerance {tol:.3g})")
    assert diff < tol


def test_gradient_accumulation_equals_two_processes(exact_runs: dict[str, Path]) -> None:
    diff = max_abs_diff(params(exact_runs["single_accum"]), params(exact_runs["ddp2"]))
    tol = exact_tolerance(exact_runs["single_accum"], exact_runs["ddp2"])
    print(f"max |param diff| 1 proc x 2 micro-steps vs 2 procs: {diff:.3g} (tolerance {tol:.3g})")
    assert diff < tol


def test_training_changed_the_parameters(exact_runs: dict[str, Path]) -> None:
    """Guards the equivalence tests against comparing two untouched initialisations, and against a tolerance
    as large as a bug's effect: a sample lost or counted twice among the 16 of a step changes its update by about
    1/16, so the tolerance must be far below the parameters' movement (0.41 here)."""
    state = load_final_state(exact_runs["ddp2"])
    torch.manual_seed(0)
    from job.config import ModelConfig
    from job.tasks.image.model import build_model

    init = build_model(ModelConfig(name="resnet18", norm="group"), 4).state_dict()
    movement = max_abs_diff(init, state["model"])
    tol = exact_tolerance(exact_runs["single"], exact_runs["ddp2"])
    print(f"max |param movement| {movement:.3g}, tolerance {tol:.3g}")
    assert movement > 100 * tol


def test_eval_is_exact_across_world_sizes(exact_runs: dict[str, Path]) -> None:
    """4 classes x 5 = 20 val images would split evenly; use 3 ranks' worth of unevenness instead:
    evaluate the same checkpoint with 1 and 2 processes on a 15-image val set."""
    data = exact_runs["data"]
    odd = exact_runs["out"] / "odd-data"
    make_data(odd, classes=4, per_class=16, size=16, val_per_class=5)
    # drop one val image from 3 classes: 17 images, not divisible by 2
    for cls in sorted((odd / "val").iterdir())[:3]:
        sorted(cls.iterdir())[0].unlink()
    env = base_env(exact_runs["out"])
    evals = {}
    for nproc in (1, 2):
        # a copy per evaluation: the runs append to TensorBoard and must not disturb the other tests' run dir
        name = f"eval-{nproc}"
        shutil.copytree(exact_runs["ddp2"], exact_runs["out"] / name)
        args = exact_args(
            odd,
            exact_runs["out"],
            name,
            **{"--ckpt.allow-world-size-change": "true", "--ckpt.allow-config-change": "true"},
        )
        r = run_cli(["train", *args], env=env) if nproc == 1 else torchrun(2, args, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "resumed from" in r.stdout
        evals[nproc] = final(r.stdout)
    assert evals[1]["count"] == evals[2]["count"] == 17
    assert evals[1]["top1"] == evals[2]["top1"]
    assert evals[1]["top5"] == evals[2]["top5"]
    assert evals[1]["loss"] == pytest.approx(evals[2]["loss"], rel=1e-5)
    del data


def test_tensorboard_scalars_from_rank0_only(exact_runs: dict[str, Path]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = exact_runs["ddp2"]
    log = (run_dir / "stdout.txt").read_text()
    pids = rank_pids(log)
    assert set(pids) == {0, 1}, log[-2000:]
    files = list((run_dir / "tb").rglob("events.out.tfevents.*"))
    assert files
    writers = {tfevents_writer(f)[1] for f in files}
    assert writers == pids[0], (writers, pids)
    elsewhere = {tfevents_writer(f)[1] for f in run_dir.parent.rglob("events.out.tfevents.*")}
    assert not elsewhere & pids[1], (elsewhere, pids)
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/samples_per_s",
        "perf/step_time_s",
        "perf/data_wait_frac",
        "perf/peak_memory_mb",
        "val/top1",
        "val/top5",
        "val/loss",
    }
    assert expected <= tags, expected - tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert all(e.value > 0 for e in acc.Scalars("train/loss"))
    assert "config" in " ".join(acc.Tags()["tensors"])  # the resolved config as text


def test_logged_loss_is_the_mean_over_ranks(exact_runs: dict[str, Path]) -> None:
    """train/loss of 2 processes x 8 items is the global batch's mean loss: what 1 process x 16 items and
    1 process x 2 micro-steps of 8 log, up to float summation order (not rank 0's half-batch loss)."""
    from test_observe import scalars

    ddp2 = [v for _, v in scalars(exact_runs["ddp2"] / "tb")["train/loss"]]
    for name in ("single", "single_accum"):
        one = [v for _, v in scalars(exact_runs[name] / "tb")["train/loss"]]
        print(f"train/loss {name}: {one}\ntrain/loss ddp2:   {ddp2}")
        assert ddp2 == pytest.approx(one, rel=1e-5), name


def test_resume_continues_and_ignores_torn_checkpoint(tmp_path: Path, tiny_data: Path) -> None:
    out = tmp_path / "runs"
    env = base_env(tmp_path)
    args = exact_args(tiny_data, out, "resume", **{"--ckpt.every": "5", "--train.steps": "10"})
    first = run_cli(["train", *args], env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = out / "resume"
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-0000005", "step-0000010"]
    torn = run_dir / "step-0000015.tmp-999-1"  # what a crash mid-save leaves behind
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"\0" * 100)
    over = {"--ckpt.every": "5", "--train.steps": "20", "--train.eval-every": "5"}
    args = exact_args(tiny_data, out, "resume", **over)
    second = run_cli(["train", *args], env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step-0000010" in second.stdout
    # 10 steps of 16 of the 64 images: 2 epochs and 2 steps; the console says so, and prints step 15's evaluation
    m = re.search(
        r"resumed from \S+ \(step 10\): (\d+) samples consumed; continuing in epoch (\d+) at its sample (\d+)",
        second.stdout,
    )
    assert m and tuple(map(int, m.groups())) == (160, 2, 32), second.stdout[-3000:]
    vals = re.findall(
        r"INFO VAL step=(\d+) val_top1=[\d.]+ val_top5=[\d.]+ val_loss=[\d.]+ val_count=(\d+)", second.stdout
    )
    assert vals == [("15", str(final(second.stdout)["count"]))], second.stdout[-3000:]
    steps_logged = [int(s) for s in re.findall(r"step (\d+)/20 loss", second.stdout)]
    assert steps_logged == list(range(11, 21))
    assert final(second.stdout)["step"] == 20
    assert not torn.exists()
    third = run_cli(["train", *args], env=env)  # already complete: no step runs again
    assert third.returncode == 0
    assert not re.findall(r"step \d+/20 loss", third.stdout)
    assert final(third.stdout)["step"] == 20


# --- a BatchNorm model at 2 ranks: evaluation and the checkpoint agree -----------------------------------------


BATCHNORM = {
    "--model.norm": "batch",
    "--train.steps": "12",
    "--optim.lr": "0.02",
    "--ema.enabled": "true",
    "--ema.decay": "0.8",
}


@pytest.fixture(scope="module")
def batchnorm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(data, run directory, stdout) of 2 ranks training resnet18 with BatchNorm and EMA: after each step the
    ranks' running statistics differ (each saw its own half of the batch)."""
    base = tmp_path_factory.mktemp("batchnorm")
    data = make_data(base / "data", classes=4, per_class=16, size=16, val_per_class=5)
    r = torchrun(2, exact_args(data, base / "runs", "bn", **BATCHNORM), env=base_env(base))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return data, base / "runs" / "bn", r.stdout


def test_batchnorm_evaluation_describes_the_saved_model(batchnorm_run: tuple[Path, Path, str], tmp_path: Path) -> None:
    """The 2-rank run's final evaluation (every rank on its shard) equals 1 process evaluating the checkpoint it
    saved (a resume of the finished run): every rank evaluated rank 0's statistics, the ones saved."""
    from test_observe import scalars

    data, run_dir, stdout = batchnorm_run
    copy = tmp_path / "runs" / "bn"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("tb"))
    args = exact_args(data, tmp_path / "runs", "bn", **BATCHNORM, **{"--ckpt.allow-world-size-change": "true"})
    r = run_cli(["train", *args], env=base_env(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout
    # config.yaml is the run; this attempt's permission to change the world size is not (attempt.yaml)
    run_yaml, attempt_yaml = (yaml.safe_load((copy / name).read_text()) for name in ("config.yaml", "attempt.yaml"))
    assert run_yaml["ckpt"]["allow_world_size_change"] is False and run_yaml["model"]["norm"] == "batch"
    assert attempt_yaml == {
        "dist": {"nproc_per_node": 0},
        "ckpt": {"allow_world_size_change": True, "allow_config_change": False},
    }
    print(f"\n2 ranks:   {final_line(stdout)}\n1 process: {final_line(r.stdout)}")
    assert final(r.stdout) == final(stdout)
    two, one = scalars(run_dir / "tb"), scalars(copy / "tb")
    for tag in ("val/loss", "val/top1", "ema/val/loss", "ema/val/top1"):
        assert one[tag][-1][0] == two[tag][-1][0] == 12
        assert one[tag][-1][1] == pytest.approx(two[tag][-1][1], rel=1e-6), tag


EVAL = re.compile(r"^EVAL step=(\d+) (.*) val_count=(\d+) checkpoint=(\S+) results=(\S+)$", re.M)


def test_evaluate_command_prints_the_runs_final_values(batchnorm_run: tuple[Path, Path, str], tmp_path: Path) -> None:
    """``ddp-job evaluate --config <run>/config.yaml`` of the 2-rank BatchNorm run's checkpoint, in 1 process
    and in 2 it launches itself: the EVAL line carries the values of the run's FINAL line, and its JSON every
    value TensorBoard holds for the final step (the EMA's too)."""
    from test_observe import scalars

    _, run_dir, stdout = batchnorm_run
    run_final = FINAL.search(stdout)
    assert run_final
    tb = scalars(run_dir / "tb")
    for nproc in ("1", "2"):
        r = run_cli(
            ["evaluate", "--config", str(run_dir / "config.yaml"), "--dist.nproc-per-node", nproc],
            env=base_env(tmp_path),
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        m = EVAL.search(r.stdout)
        assert m, r.stdout[-3000:]
        print(f"\nrun:                  {run_final[0]}\nevaluate ({nproc} process): {m[0]}")
        assert f"step={m[1]} {m[2]} val_count={m[3]}" in run_final[0]
        assert Path(m[4]) == run_dir / "step-0000012"
        results = json.loads(Path(m[5]).read_text())["results"]
        for tag in ("val/loss", "val/top1", "val/top5", "ema/val/loss", "ema/val/top1"):
            assert tb[tag][-1][0] == 12
            assert results[tag] == pytest.approx(tb[tag][-1][1], rel=1e-6), tag


def test_evaluate_without_a_checkpoint_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from job.cli import main

    out = tmp_path / "runs"
    args = ["evaluate", "--data.source", "synthetic", "--run.output-dir", str(out), "--run.name", "none"]
    assert main(args) == 2
    (tmp_path / "step-0000003").mkdir()  # a directory without manifest.json, and a mistyped path
    assert main([*args, "--ckpt.path", str(tmp_path / "step-0000003")]) == 2
    assert main([*args, "--ckpt.path", str(tmp_path / "step-000003")]) == 2
    err = capsys.readouterr().err
    assert f"no valid checkpoint in the run directory {out / 'none'}" in err, err
    assert f"ckpt.path={str(tmp_path / 'step-0000003')!r} is not a complete checkpoint" in err, err
    assert f"ckpt.path={str(tmp_path / 'step-000003')!r}: no such directory" in err, err
    assert not out.exists()
    assert main(["evaluate", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: ddp-job evaluate ")
