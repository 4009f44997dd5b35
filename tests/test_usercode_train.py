"""User code trained by real torchrun processes (CPU, gloo): the example package learns, user data keeps the job's
exact sharding, a user model resumes bitwise after SIGTERM (with channels_last, EMA and ZeRO), and model.weights
starts a run from torchvision's cache or a ddp-job checkpoint, which a resumed run does not load again."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch
from support import EXAMPLE
from support.cli import run_cli, torchrun, user_code_env
from support.runs import assert_bitwise_equal, load_final_state
from test_faults import Job
from test_train import exact_args, exact_tolerance, final, max_abs_diff

pytestmark = pytest.mark.integration

USER_DATA = ["--data.source", "tinyshapes.data:shapes", "--data.options", '{"per_class": 8, "size": 24}']
COMMON = ["--log.progress", "off", "--log.tensorboard", "false", "--doctor.enabled", "false"]


def test_example_package_trains_on_two_processes_above_chance(tmp_path: Path) -> None:
    """examples/tinyshapes/train.yaml as shipped (paths changed), 2 processes with 2 loader workers each. 4 classes:
    chance is 0.25; the run reaches ~0.95 (one process, 60 steps), the threshold leaves room for noise."""
    out = tmp_path / "runs"
    args = ["--config", str(EXAMPLE / "train.yaml"), "--run.output-dir", str(out), *COMMON]
    r = torchrun(2, args, env=user_code_env(tmp_path), timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = final(r.stdout)
    assert res["step"] == 60 and res["count"] == 256, res
    assert res["top1"] >= 0.6, res
    assert load_final_state(out / "tinyshapes")["model"]["14.weight"].shape == (4, 64)


def test_user_dataset_on_two_processes_equals_one_process(tmp_path: Path) -> None:
    """A torchvision model (GroupNorm resnet18) on the example dataset: the job's sampler shards the user's items
    so that 2 processes x micro 8 compute what 1 process x 16 does (as for an ImageFolder, tests/test_train.py)."""
    out = tmp_path / "runs"
    env = user_code_env(tmp_path)
    base = exact_args(tmp_path / "unused", out, "one")
    results = {}
    for name, nproc in (("one", 1), ("two", 2)):
        args = [*base, *USER_DATA, *COMMON]
        args[args.index("one")] = name
        r = run_cli(["train", *args], env=env) if nproc == 1 else torchrun(nproc, args, env=env)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        results[name] = final(r.stdout)
    one, two = (load_final_state(out / n)["model"] for n in ("one", "two"))
    assert max_abs_diff(one, two) < exact_tolerance(out / "one", out / "two")
    assert results["one"]["count"] == results["two"]["count"] == 32
    assert abs(results["one"]["loss"] - results["two"]["loss"]) < 1e-4, results


def _user_model_args(data: Path, out: Path, name: str) -> list[str]:
    return [
        *("--run.output-dir", str(out), "--run.name", name, "--data.path", str(data)),
        *("--data.num-classes", "4", "--data.image-size", "16", "--data.num-workers", "2"),
        *("--model.name", "tinyshapes.model:tiny_cnn", "--model.options", '{"width": 8}'),
        *("--model.channels-last", "true", "--ema.enabled", "true", "--optim.zero", "true"),
        *("--train.steps", "8", "--train.global-batch-size", "16", "--train.micro-batch-size", "4"),
        *("--sched.warmup-steps", "2", "--log.every", "1", *COMMON),
    ]


def test_user_model_on_imagefolder_resumes_bitwise_after_sigterm(
    tmp_path: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user model (BatchNorm) on an ImageFolder, 2 ranks x micro 4 x 2 accumulation steps, augmentation and 2
    workers, channels_last, EMA and ZeRO: stopped by SIGTERM and resumed, it ends bitwise where an uninterrupted
    run does (model, EMA, optimizer, schedule)."""
    monkeypatch.setenv("PYTHONPATH", user_code_env()["PYTHONPATH"])  # Job's processes inherit this environment
    out = tmp_path / "runs"
    started: list[Job] = []
    try:
        ref = Job(tmp_path, [], _user_model_args(tiny_data, out, "ref"))
        started.append(ref)
        chain = _user_model_args(tiny_data, out, "chain")
        first = Job(tmp_path, [], chain)
        started.append(first)
        first.wait_for(r"\[rank 0/2\] INFO step 3/8 ")
        first.signal(signal.SIGTERM)
        _, m = first.wait_for(r"stop requested \(signal SIGTERM[^)]*\): saving at step (\d+)")
        assert first.finish() == 143, first.tail()
        assert int(m[1]) < 8
        second = Job(tmp_path, [], chain)
        started.append(second)
        second.wait_for(rf"resumed from .*step-{int(m[1]):07d}")
        assert second.finish() == 0, second.tail()
        assert ref.finish() == 0, ref.tail()
    finally:
        for job in started:
            job.kill()
    want, got = load_final_state(out / "ref"), load_final_state(out / "chain")
    for key in ("model", "ema", "optimizer", "scheduler"):
        assert_bitwise_equal(want[key], got[key], key)
    assert want["trainer"] == got["trainer"]


def _hub_cache(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """TORCH_HOME with resnet18's IMAGENET1K_V1 file in place (a random 1000-class state dict under torchvision's
    file name: what a download would have left there)."""
    from job.config import ModelConfig
    from job.tasks.image.model import build_model

    home = tmp_path / "torch"
    (home / "hub/checkpoints").mkdir(parents=True)
    torch.manual_seed(7)
    saved = build_model(ModelConfig(name="resnet18"), 1000).state_dict()
    torch.save(saved, home / "hub/checkpoints/resnet18-f37072fd.pth")
    return home, saved


def test_weights_from_the_hub_cache_then_from_a_checkpoint_and_not_on_resume(tmp_path: Path) -> None:
    """resnet18 IMAGENET1K_V1 from the prepared cache on 2 processes with a user dataset: the 1000-class head is
    re-initialised for 4 classes (logged), the rest starts from the weights (a tiny learning rate keeps them close
    after one step). A second run starts from that run's directory (a ddp-job checkpoint); resumed after the source
    is gone, it restores its own checkpoint and never reads model.weights."""
    home, saved = _hub_cache(tmp_path)
    env = user_code_env(tmp_path, TORCH_HOME=str(home))
    out = tmp_path / "runs"
    tiny_lr = ["--optim.lr", "1e-9", "--train.steps", "1", "--ckpt.every", "1"]
    args = [*exact_args(tmp_path, out, "hub"), *USER_DATA, *COMMON, "--model.norm", "batch", *tiny_lr]
    r = torchrun(2, [*args, "--model.weights", "IMAGENET1K_V1"], env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "head fc re-initialised: the weights have 1000 classes, data.num_classes=4" in r.stdout + r.stderr
    hub = load_final_state(out / "hub")["model"]
    assert hub["fc.weight"].shape == (4, 512)
    assert (hub["conv1.weight"] - saved["conv1.weight"]).abs().max() < 1e-6
    assert (hub["layer4.1.conv2.weight"] - saved["layer4.1.conv2.weight"]).abs().max() < 1e-6

    args[args.index("hub")] = "tuned"
    r = run_cli(["train", *args, "--model.weights", str(out / "hub")], env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "re-initialised" not in r.stdout + r.stderr  # 4 classes in both
    tuned = load_final_state(out / "tuned")["model"]
    assert (tuned["fc.weight"] - hub["fc.weight"]).abs().max() < 1e-6
    shutil.rmtree(out / "hub")
    more = [*args, "--model.weights", str(out / "hub"), "--train.steps", "2"]
    r = run_cli(["train", *more], env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "resuming: model.weights" in r.stdout + r.stderr and "resumed from" in r.stdout
    assert final(r.stdout)["step"] == 2
