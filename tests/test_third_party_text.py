"""Hugging Face transformers models under ddp and fsdp: GPT-2, Llama and BERT (whose position ids are a buffer),
tiny configs built in code (examples/hf_models.py; nothing downloaded), 2 processes on gloo
(tests/support/third_party.py: the runs and the checks). transformers skips its own initialisation on the meta
device, so under fsdp these models are built on the CPU, the reason logged."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import third_party

from job import cli
from job.config import load_config
from job.parallel import fsdp
from job.tasks.contract import Bound

MODELS = ["gpt2", "llama", "bert"]


@pytest.fixture(scope="module", params=MODELS)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict[str, str]]:
    model = request.param
    out = tmp_path_factory.mktemp(model)
    return model, out, third_party.train(model, out)


@pytest.mark.integration
def test_both_strategies_start_from_the_models_own_init(runs: tuple[str, Path, dict[str, str]]) -> None:
    model, out, logs = runs
    third_party.check_initial(model, out)
    assert "initialises differently on the meta device" in logs["fsdp"]


@pytest.mark.integration
def test_fsdp_ends_within_fp32_tolerance_of_ddp(runs: tuple[str, Path, dict[str, str]]) -> None:
    model, out, _ = runs
    diff, tol = third_party.check_within_tolerance(model, out)
    print(f"\n{model}: ddp and fsdp {diff:.3g} apart after {third_party.STEPS} steps (tolerance {tol:.3g})")


@pytest.mark.integration
def test_a_resumed_fsdp_run_ends_bitwise_equal_to_the_uninterrupted_one(
    runs: tuple[str, Path, dict[str, str]], tmp_path: Path
) -> None:
    _, out, logs = runs
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


def test_units_default_to_the_models_no_split_modules_below_the_settings_and_the_task() -> None:
    """fsdp.units, else the task's shard_units, else the model's _no_split_modules (GPT2Block), less a block
    holding a tied parameter (FSDP shards a parameter in one unit only)."""
    model = third_party.hf_models.gpt2()
    blocks = list(model.transformer.h)

    class Units(third_party.hf_models.ThirdParty):
        def shard_units(self, m: object) -> list[object]:
            return [model.transformer.wte]

    plain = Bound(third_party.hf_models.task(model="gpt2"), "plain")
    units = Bound(Units(model="gpt2"), "units")
    assert len(blocks) == 2
    assert fsdp.unit_modules(model, load_config([], {}), plain) == blocks
    assert fsdp.unit_modules(model, load_config([], {}), units) == [model.transformer.wte]
    named = load_config(["--fsdp.units", "[GPT2MLP]"], {})
    assert fsdp.unit_modules(model, named, units) == [b.mlp for b in blocks]
    bert = third_party.hf_models.bert()  # names BertEmbeddings too, whose word embeddings its output layer shares
    assert "BertEmbeddings" in bert._no_split_modules
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    assert fsdp.unit_modules(bert, load_config([], {}), plain) == list(bert.bert.encoder.layer)
