"""Loading the config: YAML file < ``JOB_*`` environment < ``--section.field`` flags, into the schema.

Three gaps of pydantic-settings are closed here. Its YAML source skips a missing file silently, so
``load_config`` checks ``--config`` itself. Its env source ignores a ``JOB_*`` variable of an unknown section
(``JOB_OPTIMX__LR``), so every ``JOB_*`` variable must belong to a section unless it is one the project
reads itself (``NON_CONFIG_ENV``). Its CLI spells a field one way, ``--run.output-dir`` (kebab case), while
YAML keys, env vars and ``config show`` say ``output_dir``; ``--run.output_dir`` is accepted as well.
Errors name the setting, the bad value and the fix.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliApp,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

from job.config.schema import JobConfig
from job.errors import TRACEBACK_ENV, BadInput

ENV_PREFIX = "JOB_"
NON_CONFIG_ENV = frozenset({TRACEBACK_ENV})
"""``JOB_*`` variables that are not settings: read by the project itself (job.cli), let through unchecked."""


class _MappingEnvSource(EnvSettingsSource):
    """The env source, reading a given mapping instead of os.environ (tests and launchers pass their own)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


def _split_config_arg(argv: Sequence[str]) -> tuple[Path | None, list[str]]:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, rest = pre.parse_known_args(list(argv))
    return known.config, rest


def _sections() -> str:
    return ", ".join(JobConfig.model_fields)


def _check_yaml(path: Path) -> None:
    if path.is_dir():
        files = sorted(str(p) for p in path.glob("*.y*ml"))[:3]
        fix = "pass the path of a YAML file"
        if files:
            fix += f", e.g. one of {', '.join(files)}"
        raise BadInput(f"--config {path} is a directory, not a YAML file.", fix + ".", setting="--config", value=path)
    if not path.is_file():
        raise BadInput(
            f"--config {path}: no such file.",
            "pass an existing YAML file, e.g. configs/cpu-smoke.yaml.",
            setting="--config",
            value=path,
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise BadInput(
            f"--config {path}: not valid YAML ({e}).", "correct the file's syntax.", setting="--config", value=path
        ) from None
    if data is not None and not isinstance(data, dict):
        raise BadInput(
            f"--config {path}: top level must be a mapping of sections (run:, data:, ...), got {type(data).__name__}.",
            "write the file as `section: {field: value}` mappings, e.g. `optim: {lr: 0.1}`.",
            setting="--config",
            value=path,
        )
    for section, value in (data or {}).items():
        if section not in JobConfig.model_fields:
            raise BadInput(
                f"--config {path}: unknown section {section!r}.",
                f"use one of the valid sections: {_sections()}.",
                setting=str(section),
                value=value,
            )


def _meant_as_setting(rest: str) -> bool:
    """Whether ``JOB_<rest>`` was meant as a setting: it uses the nesting delimiter (``JOB_OPTIMX__LR``), or
    starts with a section and one underscore (``JOB_OPTIM_LR``, a typo of ``JOB_OPTIM__LR``). Other ``JOB_*``
    names belong to other tools (a CI system's ``JOB_NAME``, the Kubernetes service links of a Service
    named "job": ``JOB_SERVICE_HOST``) and are none of the config's business."""
    if "__" in rest:
        return True
    return any(rest.startswith(section + "_") for section in JobConfig.model_fields)


def _check_env(environ: Mapping[str, str]) -> None:
    """Every ``JOB_*`` variable meant as a setting names a section (``JOB_SECTION__FIELD``, or ``JOB_SECTION``
    holding JSON), unless the project reads it itself. Case-insensitive, like the env source."""
    for name, value in environ.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NON_CONFIG_ENV:
            continue
        rest = upper[len(ENV_PREFIX) :].lower()
        section = rest.split("__", 1)[0]
        if section not in JobConfig.model_fields and _meant_as_setting(rest):
            raise BadInput(
                f"environment variable {name}={value!r}: {section!r} is not a config section, so the setting "
                "would be ignored.",
                f"spell it JOB_<SECTION>__<FIELD> with one of the sections {_sections()} (e.g. JOB_OPTIM__LR), "
                f"or unset it. JOB_* variables that are not settings: {', '.join(sorted(NON_CONFIG_ENV))}.",
                setting=name,
                value=value,
            )


def _setting_names() -> list[str]:
    """Every setting as ``section.field_name``, nested ones as ``section.field.subfield``."""
    return [name for section in JobConfig.model_fields for name in setting_names(JobConfig, section)]


def setting_names(model: type[BaseModel], name: str, prefix: str = "") -> list[str]:
    """The dotted names of ``model``'s field ``name`` and, where that field is itself a model (a section, or a
    nested setting such as ``train.early_stop``), of every field below it. The sections themselves are not
    settings."""
    annotation = model.model_fields[name].annotation
    dotted = prefix + name
    names = [dotted] if prefix else []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for sub in annotation.model_fields:
            names.extend(setting_names(annotation, sub, dotted + "."))
    return names


def _flag_spellings() -> dict[str, str]:
    """``section.field_name`` (the spelling of YAML keys and env vars) for every kebab-case flag that differs."""
    return {name.replace("_", "-"): name for name in _setting_names() if "_" in name}


def _check_flags(argv: Sequence[str], command: str = "train") -> None:
    """Name an unknown ``--flag`` and the closest known ones (argparse only says "unrecognized arguments")."""
    flags = [f"--{name.replace('_', '-')}" for name in _setting_names()]
    known = {
        "--help",
        *(f"--{section}" for section in JobConfig.model_fields),
        *flags,
        *(f"--{n}" for n in _setting_names()),
    }
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag, flags, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise BadInput(
                f"unknown option {flag}.",
                f"{hint}`ddp-job {command} --help` lists every setting.",
                setting=flag,
                value=arg,
            )


def _problem(e: Any) -> BadInput:
    """One pydantic error as a BadInput naming the setting, its value and the fix."""
    loc = ".".join(str(p) for p in e["loc"])
    if e["type"] != "extra_forbidden":
        flag = "--" + loc.replace("_", "-")
        env = ENV_PREFIX + loc.upper().replace(".", "__")
        return BadInput(
            f"bad value for {loc}: {e.get('input')!r}: {e['msg']}.",
            f"set a valid value in the YAML file, {env} or {flag}.",
            setting=loc,
            value=e.get("input"),
        )
    parent = ".".join(str(p) for p in e["loc"][:-1])
    fields = [n[len(parent) + 1 :] for n in _setting_names() if n.startswith(parent + ".")]
    valid = ""
    if len(e["loc"]) > 1 and fields:
        valid = f" Valid fields of {parent}: {', '.join(f for f in fields if '.' not in f)}."
    elif len(e["loc"]) == 1:
        valid = f" Valid sections: {_sections()}."
    return BadInput(
        f"unknown setting {loc} = {e.get('input')!r}.{valid}",
        "remove it or correct the spelling.",
        setting=loc,
        value=e.get("input"),
    )


def _invalid(err: ValidationError) -> BadInput:
    """All problems in one error. With one problem its fix is the error's; with several each line has its own."""
    problems = [_problem(e) for e in err.errors()]
    first = problems[0]
    if len(problems) == 1:
        return BadInput(f"invalid configuration:\n  {first.what}", first.fix, setting=first.setting, value=first.value)
    lines = "\n  ".join(str(p) for p in problems)
    return BadInput(f"invalid configuration:\n  {lines}", setting=first.setting, value=first.value)


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None, command: str = "train") -> JobConfig:
    """Resolve the config from ``--config`` YAML, ``JOB_*`` env vars and ``--section.field`` flags.

    Args:
        argv: command-line arguments after the subcommand (may hold ``--config PATH``).
        environ: environment to read ``JOB_*`` from; defaults to ``os.environ``.
        command: the ``ddp-job`` command reading it (``train``, ``evaluate``, ``doctor``): its ``--help`` names it.

    Raises:
        BadInput: a missing/invalid YAML file, an unknown key at any level, or a bad value. The message
            names the setting and the value.
    """
    config_path, rest = _split_config_arg(argv)
    if config_path is not None:
        _check_yaml(config_path)
    env = dict(os.environ if environ is None else environ)
    _check_env(env)
    if "--help" not in rest and "-h" not in rest:
        _check_flags(rest, command)

    class _Resolved(JobConfig):
        # A per-call subclass binds the YAML file without mutating JobConfig (pydantic-settings#259).
        # cli_shortcuts: the snake_case spelling of every kebab-case flag (--help lists both).
        model_config = SettingsConfigDict(
            yaml_file=config_path, cli_prog_name=f"ddp-job {command}", cli_shortcuts=_flag_spellings()
        )

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, _MappingEnvSource(settings_cls, env), YamlConfigSettingsSource(settings_cls)

    try:
        resolved = CliApp.run(_Resolved, cli_args=rest)
    except ValidationError as e:
        raise _invalid(e) from None
    except SettingsError as e:
        raise BadInput(
            f"bad command line or JOB_* variable: {e}.",
            f"correct or remove it; `ddp-job {command} --help` lists every setting.",
        ) from None
    # Return the plain JobConfig type so pickling/equality never depend on the per-call subclass.
    return JobConfig.model_construct(**{name: getattr(resolved, name) for name in JobConfig.model_fields})


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json")


def dump_config(cfg: JobConfig) -> str:
    """The resolved config as YAML (what ``ddp-job config show`` prints)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


ATTEMPT_SETTINGS = (
    "dist.nproc_per_node",
    "ckpt.allow_world_size_change",
    "ckpt.allow_config_change",
)
"""How one attempt of a run was launched, not what the run is: the run directory's ``config.yaml`` holds them at
their defaults (``ddp-job evaluate --config`` of it starts as many processes as the machine has devices, and a
later attempt is not allowed what one attempt was), ``attempt.yaml`` the newest attempt's values."""


def run_and_attempt(cfg: JobConfig) -> tuple[str, str]:
    """(``config.yaml``, ``attempt.yaml``) of a run directory as YAML: the resolved config with the
    ``ATTEMPT_SETTINGS`` at their defaults, and those settings as this attempt has them."""
    run = config_to_dict(cfg)
    attempt: dict[str, dict[str, Any]] = {}
    for name in ATTEMPT_SETTINGS:
        section, field = name.split(".")
        attempt.setdefault(section, {})[field] = run[section][field]
        model = type(getattr(cfg, section))
        run[section][field] = model.model_fields[field].get_default(call_default_factory=True)
    return yaml.safe_dump(run, sort_keys=False), yaml.safe_dump(attempt, sort_keys=False)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``: the dotted names used in messages, reports and TensorBoard."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
