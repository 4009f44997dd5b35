"""Loading the config: YAML file < ``JOB_*`` environment < ``--section.field`` flags, into the schema.

The YAML source of pydantic-settings skips a missing file silently, so ``load_config`` checks ``--config``
itself; errors name the setting, the bad value and the fix.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
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
from job.errors import BadInput


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


def _check_yaml(path: Path) -> None:
    if not path.is_file():
        raise BadInput(f"--config {path}: no such file. Fix: pass an existing YAML file, e.g. configs/cpu-smoke.yaml.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise BadInput(f"--config {path}: not valid YAML ({e}). Fix the file's syntax.") from None
    if data is not None and not isinstance(data, dict):
        raise BadInput(f"--config {path}: top level must be a mapping of sections (run:, data:, ...), got {type(data).__name__}.")
    for section in data or {}:
        if section not in JobConfig.model_fields:
            raise BadInput(
                f"--config {path}: unknown section {section!r}. Fix: use one of the valid sections: {', '.join(JobConfig.model_fields)}."
            )


def _describe_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        section = str(e["loc"][0]) if e["loc"] else ""
        if e["type"] == "extra_forbidden":
            model = JobConfig.model_fields.get(section)
            valid = ""
            if model is not None and len(e["loc"]) > 1 and isinstance(model.annotation, type):
                valid = f" Valid fields of {section}: {', '.join(model.annotation.model_fields)}."
            elif len(e["loc"]) == 1:
                valid = f" Valid sections: {', '.join(JobConfig.model_fields)}."
            lines.append(f"unknown setting {loc} = {e.get('input')!r}.{valid} Fix: remove it or correct the spelling.")
        else:
            flag = "--" + loc.replace("_", "-")
            env = "JOB_" + loc.upper().replace(".", "__")
            lines.append(
                f"bad value for {loc}: {e.get('input')!r}: {e['msg']}. "
                f"Fix: set a valid value in the YAML file, {env} or {flag}."
            )
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> JobConfig:
    """Resolve the config from ``--config`` YAML, ``JOB_*`` env vars and ``--section.field`` flags.

    Args:
        argv: command-line arguments after the subcommand (may hold ``--config PATH``).
        environ: environment to read ``JOB_*`` from; defaults to ``os.environ``.

    Raises:
        BadInput: a missing/invalid YAML file, an unknown key at any level, or a bad value. The message
            names the setting and the value.
    """
    config_path, rest = _split_config_arg(argv)
    if config_path is not None:
        _check_yaml(config_path)
    env = dict(os.environ if environ is None else environ)

    class _Resolved(JobConfig):
        # A per-call subclass binds the YAML file without mutating JobConfig (pydantic-settings#259).
        model_config = SettingsConfigDict(yaml_file=config_path, cli_prog_name="ddp-job train")

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
        raise BadInput(_describe_validation_error(e)) from None
    except SettingsError as e:
        raise BadInput(f"bad command line or JOB_* variable: {e}. Fix: correct or remove it; `ddp-job train --help` lists every setting.") from None
    # Return the plain JobConfig type so pickling/equality never depend on the per-call subclass.
    return JobConfig.model_construct(**{name: getattr(resolved, name) for name in JobConfig.model_fields})


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json")


def dump_config(cfg: JobConfig) -> str:
    """The resolved config as YAML (what ``ddp-job config show`` prints and the run directory keeps)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``: the dotted names used in messages, reports and TensorBoard."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
