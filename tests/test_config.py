"""Config: precedence of every pair of layers, unknown keys at every level, bad types, missing file, batch plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError
from support.cli import base_env, run_cli

from job.config import JobConfig, config_to_dict, dump_config, flatten, load_config
from job.config.load import setting_names
from job.config.plan import make_plan
from job.errors import BadInput


def yaml_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


# --- precedence: defaults < YAML < env < CLI, each pair checked both ways -----------------------------


def test_default_when_nothing_set() -> None:
    assert load_config([], {}).optim.lr == 0.1


def test_yaml_beats_default(tmp_path: Path) -> None:
    assert load_config(["--config", str(yaml_file(tmp_path, "optim: {lr: 0.2}"))], {}).optim.lr == 0.2


def test_env_beats_default() -> None:
    assert load_config([], {"JOB_OPTIM__LR": "0.3"}).optim.lr == 0.3


def test_cli_beats_default() -> None:
    assert load_config(["--optim.lr", "0.4"], {}).optim.lr == 0.4


def test_env_beats_yaml_and_yaml_alone_holds(tmp_path: Path) -> None:
    f = str(yaml_file(tmp_path, "optim: {lr: 0.2}"))
    assert load_config(["--config", f], {"JOB_OPTIM__LR": "0.3"}).optim.lr == 0.3
    assert load_config(["--config", f], {"JOB_OPTIM__MOMENTUM": "0.5"}).optim.lr == 0.2  # env for another field


def test_cli_beats_yaml_either_order(tmp_path: Path) -> None:
    f = str(yaml_file(tmp_path, "optim: {lr: 0.2}"))
    assert load_config(["--config", f, "--optim.lr", "0.4"], {}).optim.lr == 0.4
    assert load_config(["--optim.lr", "0.4", "--config", f], {}).optim.lr == 0.4


def test_cli_beats_env_and_env_alone_holds() -> None:
    assert load_config(["--optim.lr", "0.4"], {"JOB_OPTIM__LR": "0.3"}).optim.lr == 0.4
    assert load_config(["--optim.momentum", "0.5"], {"JOB_OPTIM__LR": "0.3"}).optim.lr == 0.3


def test_all_layers_merge_per_field(tmp_path: Path) -> None:
    f = str(yaml_file(tmp_path, "optim: {lr: 0.2, weight_decay: 0.01}\ntrain: {steps: 7}"))
    cfg = load_config(["--config", f, "--train.steps", "9"], {"JOB_OPTIM__LR": "0.3"})
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.train.steps, cfg.optim.momentum) == (0.3, 0.01, 9, 0.9)


def test_kebab_case_cli_and_snake_case_env() -> None:
    cfg = load_config(["--train.global-batch-size", "32"], {"JOB_TRAIN__MICRO_BATCH_SIZE": "8"})
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (32, 8)


@pytest.mark.parametrize(
    "argv",
    [
        ["--run.output_dir", "/x/out", "--train.global_batch_size", "32", "--data.num_workers=3"],
        ["--run.output-dir", "/x/out", "--train.global-batch-size", "32", "--data.num-workers=3"],
        ["--run.output_dir=/x/out", "--train.global-batch-size=32", "--data.num_workers", "3"],
    ],
)
def test_flags_take_the_snake_case_spelling_too(argv: list[str]) -> None:
    cfg = load_config(argv, {})
    assert (cfg.run.output_dir, cfg.train.global_batch_size, cfg.data.num_workers) == (Path("/x/out"), 32, 3)


def _settings() -> list[tuple[str, str, object]]:
    return [
        (section, name, getattr(getattr(JobConfig(), section), name))
        for section, model in JobConfig.model_fields.items()
        for name in model.annotation.model_fields
    ]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "section, name, default",
    [s for s in _settings() if "_" in s[1] and isinstance(s[2], (bool, int, float, str, Path))],
)
def test_every_field_takes_both_spellings(section: str, name: str, default: object) -> None:
    value = str(default).lower() if isinstance(default, bool) else str(default)
    snake = load_config([f"--{section}.{name}", value], {})
    kebab = load_config([f"--{section}.{name.replace('_', '-')}={value}"], {})
    assert snake == kebab == load_config([], {f"JOB_{section.upper()}__{name.upper()}": value})


def test_misspelt_flag_names_the_closest_one() -> None:
    with pytest.raises(BadInput) as e:
        load_config(["--run.outptu-dir", "x"], {})
    assert e.value.setting == "--run.outptu-dir" and "did you mean --run.output-dir?" in e.value.fix


# --- unknown keys, wrong types, files ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, named",
    [
        ("optimm: {lr: 0.1}", "optimm"),
        ("optim: {lrr: 0.1}", "optim.lrr"),
        ("data: {path: x, nmu_classes: 3}", "data.nmu_classes"),
    ],
)
def test_unknown_yaml_keys_rejected(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(BadInput, match=named.replace(".", r"\.")):
        load_config(["--config", str(yaml_file(tmp_path, text))], {})


def test_unknown_env_key_rejected() -> None:
    with pytest.raises(BadInput, match=r"optim\.lrr"):
        load_config([], {"JOB_OPTIM__LRR": "0.1"})


@pytest.mark.parametrize("name", ["JOB_OPTIMX__LR", "job_optimx__lr", "JOB_OPTIM_LR", "JOB_TRAIN_STEPS"])
def test_env_var_of_an_unknown_section_rejected(name: str) -> None:
    with pytest.raises(BadInput) as e:
        load_config([], {name: "0.1"})
    assert e.value.setting == name and e.value.value == "0.1"
    assert f"{name}='0.1'" in str(e.value)
    assert ", ".join(JobConfig.model_fields) in e.value.fix and "JOB_OPTIM__LR" in e.value.fix


def test_job_variables_of_other_tools_are_left_alone() -> None:
    """A CI system's JOB_NAME or the service links of a Kubernetes Service named "job" are not settings."""
    foreign = {
        "JOB_NAME": "nightly",
        "JOB_URL": "http://ci/job/1",
        "JOB_SERVICE_HOST": "10.0.0.1",
        "JOB_PORT": "tcp://x",
    }
    assert load_config([], foreign) == load_config([], {})


def test_job_variables_the_project_reads_itself_are_not_config() -> None:
    from job.config.load import NON_CONFIG_ENV

    assert "JOB_TRACEBACK" in NON_CONFIG_ENV
    assert load_config([], {name: "1" for name in NON_CONFIG_ENV}) == load_config([], {})


@pytest.mark.parametrize("argv", [["--optim.lrr", "0.1"], ["--optimm.lr", "0.1"], ["--steps", "3"]])
def test_unknown_cli_flag_rejected(argv: list[str]) -> None:
    with pytest.raises(BadInput, match=argv[0]):
        load_config(argv, {})


@pytest.mark.parametrize(
    "argv, env, setting, value",
    [
        (["--train.steps", "ten"], {}, "train.steps", "ten"),
        ([], {"JOB_OPTIM__LR": "fast"}, "optim.lr", "fast"),
        (["--train.precision", "fp8"], {}, "train.precision", "fp8"),
        (["--optim.lr", "-1"], {}, "optim.lr", "-1"),
        (["--train.stop-signals", "SIGFOO"], {}, "train.stop_signals", "SIGFOO"),
    ],
)
def test_wrong_values_name_setting_and_value(argv: list[str], env: dict[str, str], setting: str, value: str) -> None:
    with pytest.raises(BadInput) as e:
        load_config(argv, env)
    assert setting in str(e.value) and value in str(e.value)


def test_wrong_type_in_yaml(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"train\.global_batch_size.*'many'"):
        load_config(["--config", str(yaml_file(tmp_path, "train: {global_batch_size: many}"))], {})


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no such file"):
        load_config(["--config", str(tmp_path / "nope.yaml")], {})


def test_config_that_is_a_directory_is_named(tmp_path: Path) -> None:
    yaml_file(tmp_path, "train: {steps: 7}")
    with pytest.raises(BadInput) as e:
        load_config(["--config", str(tmp_path)], {})
    assert str(e.value).startswith(f"--config {tmp_path} is a directory, not a YAML file.")
    assert str(tmp_path / "c.yaml") in e.value.fix


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="mapping"):
        load_config(["--config", str(yaml_file(tmp_path, "- a\n- b"))], {})


def test_config_is_frozen() -> None:
    cfg = load_config([], {})
    with pytest.raises(ValidationError):
        cfg.train.steps = 5  # type: ignore[misc]


def test_every_shipped_config_loads_with_its_values() -> None:
    files = sorted(Path(__file__).parents[1].glob("configs/*.yaml"))
    assert [f.name for f in files] == [
        "container.yaml",
        "cpu-smoke.yaml",
        "lm-cpu.yaml",
        "lm-fsdp.yaml",
        "lm-hsdp.yaml",
        "resnet50-imagenet.yaml",
        "synthetic-benchmark.yaml",
    ]
    for f in files:
        written = flatten(yaml.safe_load(f.read_text()))
        loaded = flatten(config_to_dict(load_config(["--config", str(f)], {})))
        assert written, f
        assert {k: loaded.get(k) for k in written} == written, f


# --- plan: derived values -------------------------------------------------------------------------------


@pytest.mark.parametrize("gbs, micro, world, accum", [(64, 0, 1, 1), (64, 0, 2, 1), (64, 16, 2, 2), (64, 8, 1, 8)])
def test_plan_derives_accumulation(gbs: int, micro: int, world: int, accum: int) -> None:
    cfg = load_config(["--train.global-batch-size", str(gbs), "--train.micro-batch-size", str(micro)], {})
    plan = make_plan(cfg, world)
    assert plan.grad_accum_steps == accum
    assert plan.micro_batch_size * plan.grad_accum_steps * world == gbs


@pytest.mark.parametrize("gbs, micro, world", [(64, 0, 3), (64, 24, 1), (60, 16, 2)])
def test_plan_rejects_non_divisible_batches_with_numbers(gbs: int, micro: int, world: int) -> None:
    cfg = load_config(["--train.global-batch-size", str(gbs), "--train.micro-batch-size", str(micro)], {})
    with pytest.raises(BadInput) as e:
        make_plan(cfg, world)
    msg = str(e.value)
    assert f"train.global_batch_size={gbs}" in msg and str(world) in msg


def test_linear_lr_scaling() -> None:
    cfg = load_config(["--optim.lr", "0.1", "--optim.lr-scaling", "linear", "--train.global-batch-size", "1024"], {})
    assert make_plan(cfg, 8).lr == pytest.approx(0.4)


# --- CLI surface ----------------------------------------------------------------------------------------


def test_help_documents_every_field() -> None:
    r = run_cli(["train", "--help"])
    assert r.returncode == 0, r.stderr
    for section, model in JobConfig.model_fields.items():
        for name, field in model.annotation.model_fields.items():  # type: ignore[union-attr]
            flag = f"--{section}.{name.replace('_', '-')}"
            assert flag in r.stdout, flag
            assert f"--{section}.{name}" in r.stdout, name  # the snake_case spelling is listed too
            first_words = " ".join((field.description or "").split()[:3])
            assert first_words and first_words in " ".join(r.stdout.split()), (flag, first_words)
    assert "None}" not in r.stdout, "an optional setting shows its type, not {type,None}"
    assert "--train.max-time duration" in r.stdout


def test_config_show_prints_resolved_yaml(tmp_path: Path) -> None:
    f = yaml_file(tmp_path, "train: {steps: 7}")
    r = run_cli(["config", "show", "--config", str(f), "--optim.lr", "0.5"], env=base_env(JOB_RUN__NAME="shown"))
    assert r.returncode == 0, r.stderr
    assert "steps: 7" in r.stdout and "lr: 0.5" in r.stdout and "name: shown" in r.stdout
    assert r.stdout == dump_config(load_config(["--config", str(f), "--optim.lr", "0.5"], {"JOB_RUN__NAME": "shown"}))


def test_bad_config_exits_2_without_traceback() -> None:
    r = run_cli(["train", "--optim.lr", "abc"])
    assert r.returncode == 2
    assert "optim.lr" in r.stderr and "abc" in r.stderr and "Traceback" not in r.stderr


def test_max_time_is_a_duration_naming_the_setting() -> None:
    from job.config.schema import parse_duration

    assert [parse_duration(t) for t in ("90", "90s", "1.5h", "1h30m", "2d")] == [90, 90, 5400, 5400, 172800]
    for bad in ("0", "-5", "1h30", "soon", ""):
        with pytest.raises(ValueError, match="not a positive duration"):
            parse_duration(bad)
    assert load_config(["--train.max-time", "1h30m"], {}).train.max_time_s == 5400
    assert load_config([], {}).train.max_time_s is None
    with pytest.raises(BadInput, match=r"train\.max_time"):
        load_config(["--train.max-time", "soon"], {})


def test_nested_settings_are_named_down_to_their_leaves() -> None:
    """A setting that is itself a model (``train.early_stop``) is a flag, and so is each field below it: the
    unknown-flag check and the snake_case spellings know them all."""

    class Stop(BaseModel):
        metric: str = "loss"
        patience: int = 3

    class Train(BaseModel):
        steps: int = 1
        early_stop: Stop = Stop()

    class Root(BaseModel):
        train: Train = Train()

    assert setting_names(Root, "train") == [
        "train.steps",
        "train.early_stop",
        "train.early_stop.metric",
        "train.early_stop.patience",
    ]


def test_a_compile_mode_needs_the_inductor_backend() -> None:
    assert load_config(["--model.compile-backend", "aot_eager"], {}).model.compile_backend == "aot_eager"
    with pytest.raises(BadInput) as e:
        load_config(["--model.compile-backend", "aot_eager", "--model.compile-mode", "max-autotune"], {})
    text = f"{e.value} {e.value.fix}"
    assert "model.compile_mode='max-autotune'" in text and "model.compile_backend='aot_eager'" in text, text
    assert "set model.compile_backend inductor" in text, text
