"""The job's configuration: the typed schema (``schema``), how it is loaded (``load``), the values derived from it
and the world size (``plan``), and what a path to a run directory or checkpoint may be (``location``)."""

from job.config.load import config_to_dict, dump_config, flatten, load_config
from job.config.schema import (
    CkptConfig,
    DataConfig,
    DdpConfig,
    DistConfig,
    DoctorConfig,
    EmaConfig,
    FsdpConfig,
    JobConfig,
    LogConfig,
    ModelConfig,
    ObserveConfig,
    OptimConfig,
    ReportConfig,
    RunConfig,
    SchedConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "CkptConfig",
    "DataConfig",
    "DdpConfig",
    "DistConfig",
    "DoctorConfig",
    "EmaConfig",
    "FsdpConfig",
    "JobConfig",
    "LogConfig",
    "ModelConfig",
    "ObserveConfig",
    "OptimConfig",
    "ReportConfig",
    "RunConfig",
    "SchedConfig",
    "TaskConfig",
    "TrainConfig",
    "config_to_dict",
    "dump_config",
    "flatten",
    "load_config",
]
