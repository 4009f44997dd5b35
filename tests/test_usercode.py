"""User code in the job: import paths, the model and dataset contracts, model.weights, and every bad input of
these ending in exit 2 with the setting, the value and the fix named, before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from PIL import Image
from support import EXAMPLE, ROOT

from job.cluster.env import LAUNCHER_VAR_PREFIXES
from job.config import DataConfig, ModelConfig, load_config
from job.data import usersource
from job.data.source import build_loaders
from job.errors import BadInput, UserCodeError, WeightsError
from job.tasks.image import weights
from job.tasks.image.model import build_model, check_model
from job.usercode import is_import_path, resolve

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


def test_import_paths_and_the_builtin_sources() -> None:
    assert is_import_path("pkg.mod:build") and is_import_path("m:Class.create")
    assert not is_import_path("resnet18") and not is_import_path("pkg.mod:") and not is_import_path("a b:c")
    assert load_config(["--data.source", "tinyshapes.data:shapes"], {}).data.source == "tinyshapes.data:shapes"
    with pytest.raises(BadInput, match=r"data\.source") as err:
        load_config(["--data.source", "imagefolders"], {})
    assert err.value.exit_code == 2 and "import path" in str(err.value)


def test_options_come_from_yaml_env_and_cli(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("model: {options: {width: 8}}\ndata: {options: {per_class: 2}}\n")
    cfg = load_config(["--config", str(yaml_file)], {"JOB_DATA__OPTIONS": '{"per_class": 3}'})
    assert (cfg.model.options, cfg.data.options) == ({"width": 8}, {"per_class": 3})
    cfg = load_config(["--config", str(yaml_file), "--model.options", '{"width": 4, "dropout": 0.1}'], {})
    assert cfg.model.options == {"width": 4, "dropout": 0.1}


def test_user_model_is_built_with_its_options_and_checked_on_meta() -> None:
    cfg = ModelConfig(name="tinyshapes.model:tiny_cnn", options={"width": 4}, channels_last=True)
    model = build_model(cfg, 5)
    assert model[0].out_channels == 4 and model[-1].out_features == 5
    assert check_model(cfg, 5, 32)[-1].weight.device.type == "meta"
    with pytest.raises(UserCodeError, match=r"2 x 4 logits") as err:
        check_model(ModelConfig(name="support.user_cases:model_with_wrong_output"), 4, 32)
    assert err.value.setting == "model.name" and "tensor of shape [2, 5]" in err.value.what


def test_resolve_names_what_is_missing() -> None:
    with pytest.raises(UserCodeError, match="no module named 'nosuchpkg'"):
        resolve("model.name", "nosuchpkg.models:net")
    with pytest.raises(UserCodeError, match=r"tinyshapes.model has no attribute 'nope'") as err:
        resolve("model.name", "tinyshapes.model:nope")
    assert "tiny_cnn" in err.value.fix
    with pytest.raises(UserCodeError, match="is a int, not a callable"):
        resolve("data.source", "support.user_cases:NOT_CALLABLE")


def test_items_are_checked_against_the_contract() -> None:
    cfg = DataConfig(source="support.user_cases:tensor_images", num_classes=4)
    image = Image.new("L", (7, 5))
    assert usersource.to_item(cfg, (image, 3), "x")[0].shape == (3, 5, 7)  # grey PIL -> RGB CHW
    assert usersource.to_item(cfg, [torch.zeros(3, 4, 6, dtype=torch.uint8), torch.tensor(2)], "x")[1] == 2
    bad = [
        ((torch.zeros(4, 6, 3, dtype=torch.uint8), 0), "uint8 tensor of shape \\[4, 6, 3\\]"),
        ((torch.zeros(3, 4, 6), 0), "torch.float32 tensor"),
        ((image, 4), r"label 4 is outside \[0, data.num_classes=4\)"),
        ((image, True), "not an int"),
        ((image, 1.0), "not an int"),
        ((image,), "tuple of 1 elements"),
    ]
    for item, message in bad:
        with pytest.raises(UserCodeError, match=message) as err:
            usersource.to_item(cfg, item, "train[0]")
        assert err.value.setting == "data.source" and err.value.fix


def test_user_data_keeps_the_seeded_augmentation_and_sharding() -> None:
    """Tensors of varying sizes come out at data.image_size; the same (epoch, index) gives the same crop with and
    without workers, and two ranks' shards together are the single-process batches."""
    cfg = DataConfig(source="support.user_cases:tensor_images", num_classes=4, image_size=16, num_workers=0)

    def batches(rank: int, world: int, micro: int, **over: object) -> list[torch.Tensor]:
        loaders = build_loaders(cfg.model_copy(update=over), rank, world, micro, seed=3, device=CPU)
        return [images for images, _ in loaders.train]

    one = batches(0, 1, 8)
    assert [tuple(b.shape) for b in one] == [(8, 3, 16, 16)] * 3
    assert torch.equal(torch.stack(batches(0, 1, 8, num_workers=2)), torch.stack(one))
    r0, r1 = batches(0, 2, 4), batches(1, 2, 4)
    assert len(r0) == len(r1) == len(one)
    assert torch.equal(torch.stack([torch.cat([a, b]) for a, b in zip(r0, r1)]), torch.stack(one))
    loaders = build_loaders(cfg, 0, 1, 5, seed=3, device=CPU)
    assert sum(len(labels) for _, labels in loaders.val) == loaders.val_info.total == 24


# --- model.weights --------------------------------------------------------------------------------------------


def _model(num_classes: int = 4, width: int = 4) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = ModelConfig(name="tinyshapes.model:tiny_cnn", options={"width": width})
    return cfg, build_model(cfg, num_classes)


def test_head_for_another_number_of_classes_is_left_to_its_init_and_other_mismatches_are_named() -> None:
    _, model4 = _model(4)
    _, model10 = _model(10)
    assert weights.head_keys(model4.state_dict(), model10.state_dict(), 4) == ["14.weight", "14.bias"]
    assert weights.head_keys(model4.state_dict(), model4.state_dict(), 4) == []
    _, wide = _model(4, width=8)
    with pytest.raises(ValueError, match=r"tensor 0.weight is 8x3x3x3 in the weights but 4x3x3x3 in the model"):
        weights.head_keys(model4.state_dict(), wide.state_dict(), 4)
    fewer = dict(model4.state_dict())
    del fewer["1.running_mean"]
    with pytest.raises(ValueError, match=r"the model's tensor 1.running_mean \(4\) is not in the weights"):
        weights.head_keys(model4.state_dict(), fewer, 4)


def test_weights_from_state_dict_files_and_ddp_job_checkpoints(tmp_path: Path) -> None:
    cfg, source = _model(10)
    sd = source.state_dict()
    files = {
        "plain.pt": sd,
        "ddp.pt": {f"module.{k}": v for k, v in sd.items()},  # saved from a DDP-wrapped model
        "lightning.ckpt": {"state_dict": sd, "epoch": 3},
    }
    step = tmp_path / "run" / "step-0000004"
    step.mkdir(parents=True)
    torch.save({"model": sd, "trainer": {"step": 4}}, step / "state.pt")
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
    for path in [*(tmp_path / n for n in files), step, step / "state.pt"]:
        _, target = _model(4)
        weights.load_weights(cfg.model_copy(update={"weights": str(path)}), target, 4, is_main=True)
        got = target.state_dict()
        assert all(torch.equal(got[k], v) for k, v in sd.items() if not k.startswith("14.")), path
        assert got["14.weight"].shape == (4, 16), path  # the 10-class head was not loaded
    with pytest.raises(WeightsError, match=r"without state\.pt and without a verified step"):
        weights.read_weights(cfg.model_copy(update={"weights": str(tmp_path / "run")}))  # no manifest: unverified


def test_torchvision_weights_come_from_torchs_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepared cache (what a download leaves), never the network: resnet18's IMAGENET1K_V1 file name."""
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cfg = ModelConfig(name="resnet18", weights="IMAGENET1K_V1")
    entry = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    cached = weights.torchvision_cache_file(entry)
    assert cached == tmp_path / "torch/hub/checkpoints/resnet18-f37072fd.pth"
    assert weights.read_weights(cfg, fetch=False) is None  # other local ranks: left to local rank 0
    cached.parent.mkdir(parents=True)
    saved = build_model(ModelConfig(), 1000).state_dict()
    torch.save(saved, cached)
    target = build_model(ModelConfig(), 4)
    weights.load_weights(cfg, target, 4, is_main=True)
    assert torch.equal(target.state_dict()["conv1.weight"], saved["conv1.weight"])
    with pytest.raises(WeightsError, match=r"ResNet18_Weights has no such weights") as err:
        weights.read_weights(cfg.model_copy(update={"weights": "IMAGENET9K"}))
    assert "IMAGENET1K_V1" in err.value.fix


# --- bad input through the CLI: exit 2, named, nothing written -------------------------------------------------

DATA = [
    "--data.num-classes",
    "4",
    "--data.image-size",
    "16",
    "--data.num-workers",
    "0",
    "--train.global-batch-size",
    "16",
]
USER_DATA = ["--data.source", "tinyshapes.data:shapes", "--data.options", '{"per_class": 8}', *DATA]
USER_MODEL = ["--model.name", "tinyshapes.model:tiny_cnn"]


def _weights_file(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"{kind}.pt"
    if kind == "corrupt":
        torch.save(_model(4)[1].state_dict(), path)
        path.write_bytes(path.read_bytes()[:300])
    elif kind == "other":  # the same model twice as wide: another architecture
        torch.save(_model(4, width=32)[1].state_dict(), path)
    elif kind == "pickle":
        torch.save({"model": {"w": Fraction(1, 3)}}, path)  # a pickled object: refused by weights_only=True
    return str(path)


BAD = {
    "unimportable module": (
        ["--model.name", "nosuchpkg.models:net", *USER_DATA],
        "model.name",
        "no module named 'nosuchpkg'",
    ),
    "missing attribute": (["--data.source", "tinyshapes.data:nope", *DATA], "data.source", "no attribute 'nope'"),
    "model signature": (
        ["--model.name", "support.user_cases:model_without_num_classes", *USER_DATA],
        "model.name",
        "cannot be called as support.user_cases:model_without_num_classes(num_classes=...)",
    ),
    "model options": (
        [*USER_MODEL, "--model.options", '{"depth": 3}', *USER_DATA],
        "model.name",
        "unexpected keyword argument 'depth'",
    ),
    "not a module": (
        ["--model.name", "support.user_cases:model_that_is_not_a_module", *USER_DATA],
        "model.name",
        "dict",
    ),
    "model output": (
        ["--model.name", "support.user_cases:model_with_wrong_output", *USER_DATA],
        "model.name",
        "not 2 x 4 logits",
    ),
    "dataset signature": (
        [*USER_MODEL, "--data.source", "support.user_cases:data_without_split", *DATA],
        "data.source",
        "cannot be called as support.user_cases:data_without_split(split=..., path=...)",
    ),
    "iterable dataset": (
        [*USER_MODEL, "--data.source", "support.user_cases:data_iterable", *DATA],
        "data.source",
        "not a map-style dataset",
    ),
    "empty dataset": (
        [*USER_MODEL, "--data.source", "support.user_cases:data_empty", *DATA],
        "data.source",
        "is empty",
    ),
    "image shape": (
        [*USER_MODEL, "--data.source", "support.user_cases:data_channels_last", *DATA],
        "data.source",
        r"train[0]: the image is a torch.uint8 tensor of shape [20, 20, 3]",
    ),
    "image type": (
        [*USER_MODEL, "--data.source", "support.user_cases:data_float_images", *DATA],
        "data.source",
        "torch.float32 tensor",
    ),
    "label range": (
        [*USER_MODEL, "--data.source", "support.user_cases:data_label_out_of_range", *DATA],
        "data.source",
        "the label 7 is outside [0, data.num_classes=4)",
    ),
    "weights missing": ([*USER_MODEL, *USER_DATA, "--model.weights", "{tmp}/none.pt"], "model.weights", "no such file"),
    "weights corrupt": ([*USER_MODEL, *USER_DATA, "--model.weights", "{corrupt}"], "model.weights", "cannot load"),
    "weights pickle": ([*USER_MODEL, *USER_DATA, "--model.weights", "{pickle}"], "model.weights", "weights_only"),
    "weights architecture": (
        [*USER_MODEL, *USER_DATA, "--model.weights", "{other}"],
        "model.weights",
        "tensor 0.weight is 32x3x3x3 in the weights but 16x3x3x3 in the model",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_user_code_exits_2_naming_setting_and_fix_before_writing(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """In-process through the real CLI entry point (as tests/test_faults.py's table), with no process group
    allowed to start."""
    import torch.distributed as dist

    from job import cli

    args, setting, message = BAD[case]
    subs = {"{tmp}": str(tmp_path)}
    for kind in ("corrupt", "other", "pickle"):
        if any(f"{{{kind}}}" in a for a in args):
            subs[f"{{{kind}}}"] = _weights_file(tmp_path, kind)
    for key, value in subs.items():
        args = [a.replace(key, value) for a in args]
    for k in [k for k in os.environ if k.startswith(("JOB_", *LAUNCHER_VAR_PREFIXES))]:
        monkeypatch.delenv(k)

    def no_process_group(*a: object, **kw: object) -> None:
        raise AssertionError("a process group was started before the input was checked")

    monkeypatch.setattr(dist, "init_process_group", no_process_group)
    out = tmp_path / "runs"
    rc = cli.main(["train", *args, "--run.output-dir", str(out), "--log.tensorboard", "false"])
    err = capfd.readouterr().err
    assert rc == 2, err[-3000:]
    assert f"{setting}=" in err and message in err and "Fix:" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not out.exists(), sorted(out.rglob("*"))


def test_the_example_package_imports_nothing_of_the_job() -> None:
    modules = sorted(f"tinyshapes.{p.stem}" for p in (EXAMPLE / "tinyshapes").glob("*.py") if p.stem != "__init__")
    assert modules == ["tinyshapes.data", "tinyshapes.model"]
    # A fresh interpreter, so that nothing this test process imported counts: import every module of the
    # example, then list the job's modules that came with them (directly or through any other import).
    probe = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "print(sorted(m for m in sys.modules if m == 'job' or m.startswith('job.')))"
    )
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE)}
    r = subprocess.run([sys.executable, "-c", probe], env=env, cwd=EXAMPLE, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_a_resume_may_name_other_initial_weights_but_not_other_options() -> None:
    """model.weights only starts a run; a resumed one restores its checkpoint, so the value may change (a moved
    file). model.options builds the model: a change is refused like any other."""
    from job.checkpoint.resume import config_differences
    from job.config import config_to_dict

    saved = config_to_dict(load_config(["--model.weights", "a.pt"], {}))
    assert config_differences(saved, load_config(["--model.weights", "b.pt"], {})) == []
    changed = config_differences(saved, load_config(["--model.weights", "a.pt", "--model.options", '{"w": 2}'], {}))
    assert changed == ["model.options.w: checkpoint None -> now 2"]
