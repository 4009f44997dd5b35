"""timm models under ddp and fsdp: a ViT, a ConvNeXt and a ResNet with BatchNorm, tiny configs built in code
(examples/hf_models.py; nothing downloaded), 2 processes on gloo (tests/support/third_party.py: the runs and the
checks). These build on the meta device under fsdp; the ResNet's running statistics are buffers, broadcast from
rank 0 as DDP does, so they resume bitwise and the checkpoint holds the model the FINAL line evaluated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import third_party
from support.cli import run_cli

from job import cli

MODELS = ["vit", "convnext", "resnet"]


@pytest.fixture(scope="module", params=MODELS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict[str, str]]:
    model = request.param
    out = tmp_path_factory.mktemp(model)
    return model, out, third_party.train(model, out)


@pytest.mark.integration
def test_both_strategies_start_from_the_models_own_init(runs: tuple[str, Path, dict[str, str]]) -> None:
    model, out, logs = runs
    third_party.check_initial(model, out)
    assert "model built on the meta device" in logs["fsdp"], logs["fsdp"][-3000:]


@pytest.mark.integration
def test_fsdp_ends_within_fp32_tolerance_of_ddp(runs: tuple[str, Path, dict[str, str]]) -> None:
    model, out, _ = runs
    diff, tol = third_party.check_within_tolerance(model, out)
    print(f"\n{model}: ddp and fsdp {diff:.3g} apart after {third_party.STEPS} steps (tolerance {tol:.3g})")


@pytest.mark.integration
def test_a_resumed_fsdp_run_ends_bitwise_equal_to_the_uninterrupted_one(
    runs: tuple[str, Path, dict[str, str]], tmp_path: Path
) -> None:
    """For the ResNet, its BatchNorm running statistics included (buffers of the model state)."""
    model, out, logs = runs
    assert "resumed from" in logs["resumed"]
    third_party.check_resumed(out, tmp_path)


@pytest.mark.integration
def test_the_export_loads_strictly_into_the_librarys_class_and_gives_the_runs_loss(
    runs: tuple[str, Path, dict[str, str]], tmp_path: Path
) -> None:
    model, out, _ = runs
    exported = tmp_path / f"{model}.safetensors"
    assert cli.main(["export", "--checkpoint", str(out / "fsdp"), "--out", str(exported)]) == 0
    want, got = third_party.val_loss(out / "fsdp"), third_party.exported_loss(model, exported)
    assert abs(got - want) <= third_party.eval_tolerance(want), (got, want)


@pytest.mark.integration
@pytest.mark.parametrize("runs", ["resnet"], indirect=True)
def test_evaluate_of_an_fsdp_batchnorm_checkpoint_gives_the_final_lines_values(
    runs: tuple[str, Path, dict[str, str]], tmp_path: Path
) -> None:
    """The FINAL line evaluated rank 0's running statistics; the checkpoint holds the same ones, so ``ddp-job
    evaluate`` of it, same world size and strategy, computes the same values bit for bit."""
    _, out, _ = runs
    run_dir = out / "fsdp"
    step = third_party.step_dir(out, "fsdp", third_party.STEPS)
    r = run_cli(
        ["evaluate", "--config", str(run_dir / "config.yaml"), "--dist.nproc-per-node", "2", "--ckpt.path", str(step)],
        env=third_party.env(tmp_path),
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    results = json.loads((run_dir / "eval" / f"{step.name}.json").read_text())["results"]
    assert results["val/loss"] == third_party.val_loss(run_dir)
