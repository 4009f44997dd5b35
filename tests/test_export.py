"""``ddp-job export``: a checkpoint's model (or EMA) as one full safetensors state dict, and ``model.weights``
reading it back.

Real torchrun runs on gloo of the causal language model (tests/test_fsdp.py's config: AdamW, clipping,
accumulation, warmup + cosine, EMA, a NaN step skipped):
  fsdp     2 processes, train.strategy=fsdp: its checkpoints are every rank's shards (DCP)
  ddp      1 process, DDP: its checkpoints hold the model in state.pt; the same run as fsdp within fp32 rounding
  tuned    1 process, a fine-tuning run from fsdp's export (model.weights: the safetensors file), without EMA;
           its step 1 is a NaN step the guard skips, so its step-1 checkpoint holds the weights it started from
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.cli import run_cli
from support.lm import make_corpus
from support.runs import assert_bitwise_equal, load_final_state
from test_fsdp import OPTIONS, STEPS, counting_env, max_diff, newest, run, shards, train_args

from job import cli
from job.checkpoint import store


def export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``ddp-job export ARGS`` in this process, through the CLI's own entry (exit codes as the command's)."""
    code = cli.main(["export", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def build_gpt(corpus: Path, **options: Any) -> torch.nn.Module:
    from job.tasks.lm.task import CausalLM

    return CausalLM.from_options({"path": str(corpus), **OPTIONS, **options}).build_model()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("export")
    corpus = make_corpus(out / "corpus")
    logs = {
        "fsdp": run(2, train_args(out, corpus, "fsdp", "--train.strategy", "fsdp"), out),
        "ddp": run(1, train_args(out, corpus, "ddp"), out),
    }
    exported = out / "exported" / "fsdp.safetensors"
    r = run_cli(["export", "--checkpoint", str(out / "fsdp"), "--out", str(exported)])  # the real command
    assert r.returncode == 0, r.stderr[-3000:]
    tune = [
        *("--model.weights", str(exported), "--ema.enabled", "false", "--train.steps", "2"),
        *("--debug.nan-at-steps", "[1]"),  # with train_args' [3]: only step 1 is reached
    ]
    logs["tuned"] = run(1, train_args(out, corpus, "tuned", *tune), out)
    return {"out": out, "corpus": corpus, "logs": logs, "exported": exported, "export_log": r.stdout}


def files_of(step_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(step_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in step_dir.rglob("*")}


@pytest.mark.integration
def test_a_ddp_checkpoint_exports_its_model_bitwise_and_loads_strictly(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = runs["out"] / "ddp"
    step = newest(run_dir)
    before = files_of(step)
    code, text = export(capsys, "--checkpoint", str(run_dir), "--out", str(tmp_path / "ddp.safetensors"))
    assert code == 0, text
    got = load_file(tmp_path / "ddp.safetensors")
    assert_bitwise_equal(got, load_final_state(run_dir)["model"], "model")
    with safe_open(tmp_path / "ddp.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["step"] == str(STEPS) and meta["strategy"] == "ddp" and meta["weights"] == "model"
    assert meta["source"] == str(step.resolve()) and meta["world_size"] == "1"
    model = build_gpt(runs["corpus"])
    model.load_state_dict(got, strict=True)  # the task's unwrapped model, every key, tied head included
    assert model.head.weight is model.wte.weight and torch.equal(model.head.weight, got["head.weight"])
    assert files_of(step) == before and store.verify(step)[0]  # the checkpoint was only read
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.integration
def test_an_fsdp_checkpoint_exports_the_gathered_shards_bitwise_and_ddps_model_within_fp32_rounding(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    out = runs["out"]
    got = load_file(runs["exported"])
    gathered = shards(newest(out / "fsdp"), tmp_path)
    assert_bitwise_equal(got, gathered["model"], "model")
    with safe_open(runs["exported"], "pt") as f:
        meta = f.metadata()
    assert meta["step"] == str(STEPS) and meta["strategy"] == "fsdp" and meta["world_size"] == "2"
    diff = max_diff(got, load_final_state(out / "ddp")["model"])
    moved = max_diff(got, shards(out / "fsdp" / "step-0000002", tmp_path)["model"])
    print(f"\nexported FSDP (2 processes) vs DDP (1 process) model, {STEPS} steps: max |diff| {diff:.3g}")
    assert diff <= 1e-5 and moved > 1e-3, (diff, moved)
    assert "export: " in runs["export_log"] and "fsdp" in runs["export_log"]


@pytest.mark.integration
def test_ema_exports_from_either_layout(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = runs["out"]
    for name in ("fsdp", "ddp"):
        code, text = export(capsys, "--checkpoint", str(out / name), "--out", str(tmp_path / f"{name}.st"), "--ema")
        assert code == 0, text
    fsdp_ema, ddp_ema = load_file(tmp_path / "fsdp.st"), load_file(tmp_path / "ddp.st")
    saved = load_final_state(out / "ddp")["ema"]
    assert_bitwise_equal(ddp_ema, {k.removeprefix("module."): v for k, v in saved.items() if k != "n_averaged"})
    assert_bitwise_equal(fsdp_ema, shards(newest(out / "fsdp"), tmp_path)["ema"]["module"], "fsdp ema")
    assert max_diff(fsdp_ema, load_file(runs["exported"])) > 1e-4  # the EMA, not the model again
    assert max_diff(fsdp_ema, ddp_ema) <= 1e-5
    build_gpt(runs["corpus"]).load_state_dict(fsdp_ema, strict=True)
    with safe_open(tmp_path / "fsdp.st", "pt") as f:
        assert f.metadata()["weights"] == "ema"


@pytest.mark.integration
def test_a_fine_tuning_run_starts_from_the_exported_weights(runs: dict[str, Any]) -> None:
    tuned = runs["out"] / "tuned"
    exported = load_file(runs["exported"])
    first = store.read_checkpoint(tuned / "step-0000001")
    assert first["trainer"]["nonfinite_skips"] == 1  # step 1 did not move the weights
    assert_bitwise_equal(first["model"], exported, "the weights the fine-tuning run started from")
    assert max_diff(load_final_state(tuned)["model"], exported) > 1e-4  # then it trained
    assert f"model.weights={runs['exported']}: loaded {len(exported)} tensors" in runs["logs"]["tuned"]


@pytest.mark.integration
def test_ema_of_a_run_without_one_is_exit_2_naming_the_option(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = export(capsys, "--checkpoint", str(runs["out"] / "tuned"), "--out", str(tmp_path / "x.st"), "--ema")
    assert code == 2, text
    assert "--ema" in text and "ema.enabled" in text and "without --ema" in text
    assert not (tmp_path / "x.st").exists()


@pytest.mark.integration
def test_a_step_directory_exports_that_step_and_a_bad_one_is_exit_2(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = runs["out"] / "fsdp" / "step-0000004"
    code, text = export(capsys, "--checkpoint", str(step), "--out", str(tmp_path / "four.safetensors"))
    assert code == 0, text
    assert_bitwise_equal(load_file(tmp_path / "four.safetensors"), shards(step, tmp_path)["model"], "step 4")
    broken = tmp_path / "run" / "step-0000004"
    shutil.copytree(step, broken)
    shard = broken / "shards" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for bad in (broken, tmp_path / "none"):
        code, text = export(capsys, "--checkpoint", str(bad), "--out", str(tmp_path / "bad.safetensors"))
        assert code == 2 and "--checkpoint" in text and str(bad) in text, text
    code, text = export(capsys, "--checkpoint", str(step), "--out", str(step / "model.safetensors"))
    assert code == 2 and "--out" in text and not (step / "model.safetensors").exists(), text
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.integration
def test_model_weights_naming_a_step_directory_or_its_state_pt_verifies_it_as_export_does(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """A checkpoint as ``model.weights`` is read only when its files match their sha256: a flipped byte in one
    rank's shard is a WeightsError naming the setting and the checkpoint, not weights loaded without a word."""
    from job.checkpoint import weights
    from job.config import ModelConfig
    from job.errors import WeightsError

    step = runs["out"] / "fsdp" / "step-0000004"
    read = weights.read_file(ModelConfig(weights=str(step / "state.pt")))
    assert_bitwise_equal(read, shards(step, tmp_path)["model"], "step 4")
    broken = tmp_path / "run" / "step-0000004"
    shutil.copytree(step, broken)
    shard = broken / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for path in (broken, broken / "state.pt"):
        with pytest.raises(WeightsError) as info:
            weights.read_file(ModelConfig(weights=str(path)))
        err = info.value
        assert err.setting == "model.weights" and "sha256" in err.what and str(broken) in err.what, err
        assert err.exit_code == 2


@pytest.mark.integration
def test_weights_that_do_not_fit_are_exit_2_naming_model_weights_and_the_file(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """Before anything starts: a file of another width, and one missing a tensor."""
    exported = load_file(runs["exported"])
    narrow = tmp_path / "narrow.safetensors"
    save_file({k: v.clone() for k, v in build_gpt(runs["corpus"], n_embd=16).state_dict().items()}, narrow)
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in exported.items() if k != "ln_f.bias"}, missing)
    cases = {narrow: "is 65x16 in the weights but 65x32 in the model", missing: "ln_f.bias (32) is not in the weights"}
    vocab = exported["wte.weight"].shape[0]
    for file, message in cases.items():
        message = message.replace("65", str(vocab))
        args = ["train", *train_args(tmp_path, runs["corpus"], file.stem, "--model.weights", str(file))]
        r = run_cli(args, env=counting_env(tmp_path, tmp_path / file.stem))
        assert r.returncode == 2, r.stderr[-3000:]
        assert f"model.weights={str(file)!r}" in r.stderr and message in r.stderr and "ddp-job export" in r.stderr
        assert not (tmp_path / file.stem / "config.yaml").exists()


def test_tied_and_viewed_tensors_are_written_as_copies_that_load_into_the_tied_model(tmp_path: Path) -> None:
    from job.checkpoint.export import untied, write_atomic

    buffer = torch.arange(12.0)
    tied = torch.nn.Linear(3, 4, bias=False)
    state = {"emb.weight": tied.weight, "head.weight": tied.weight, "a": buffer[:6], "b": buffer[6:]}
    write_atomic(state, tmp_path / "w.safetensors", {"step": "1"})
    got = load_file(tmp_path / "w.safetensors")
    assert_bitwise_equal(got, {k: v.detach() for k, v in state.items()}, "tensors")
    assert untied(state)["a"].untyped_storage().data_ptr() != untied(state)["b"].untyped_storage().data_ptr()
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert f.metadata() == {"step": "1"}
