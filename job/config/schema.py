"""The job's configuration: one typed, frozen pydantic-settings tree.

Precedence, lowest to highest (stated once, here):

    field defaults  <  YAML file (--config PATH)  <  JOB_SECTION__FIELD env vars  <  CLI --section.field VALUE

Every section rejects unknown keys (``extra="forbid"``): pydantic's nested models would otherwise drop a
YAML typo such as ``optim: {lrr: 0.1}`` silently. The YAML source of pydantic-settings skips a missing file
silently too, so ``load_config`` checks ``--config`` itself. Field docstrings become ``--help`` text.

This module only parses and validates. Values derived from the config and the world size (micro batch,
accumulation steps, scaled LR) live in ``job.config.plan``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)
from typing_extensions import TypeAliasType

from job.cluster.stop import SIGNAL_NAMES, STOP_SIGNALS
from job.config import location
from job.usercode import is_import_path

_SECTION = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

BUILTIN_SOURCES = ("synthetic", "imagefolder", "webdataset")
"""The data.source values the job reads itself; any other value must be a package.module:callable import path."""
BUILTIN_TASKS = ("image_classification", "causal_lm")
"""The task.name values the job ships (job.tasks); any other value must be a package.module:callable import path."""


DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
"""The units a duration setting may carry (no unit: seconds)."""


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a positive number with an optional unit of ``DURATION_UNITS`` ("90s", "1.5h"), or
    several with units, largest first ("1h30m")."""
    raw = str(text).strip().lower()
    parts = _DURATION_PART.findall(raw)
    seconds = float("nan")
    if parts and "".join(n + u for n, u in parts) == raw and (len(parts) == 1 or all(u for _, u in parts)):
        seconds = sum(float(n) * DURATION_UNITS.get(u, 1.0) for n, u in parts)
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"{text!r} is not a positive duration; write a number with s, m, h or d, e.g. 6h, 30m or 1h30m"
        )
    return seconds


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")


def _file_path(value: str) -> str:
    """``value`` where a file system path is required; a URL is refused (job.config.location)."""
    problem = location.refusal(value)
    if problem is not None:
        raise ValueError(problem)
    return value


duration = TypeAliasType("duration", str)
"""A duration (90s, 30m, 1h30m, 2d or seconds): its own name, so that --help shows it, not {str,None}."""


class RunConfig(BaseModel):
    """What this run is called and where it writes."""

    model_config = _SECTION
    name: str = "default"
    """Run name; the run directory is <output_dir>/<name>. Re-using a name resumes that run."""
    output_dir: Path = Path("runs")
    """Directory that holds run directories (checkpoints, TensorBoard events, resolved config)."""
    seed: int = 0
    """Base seed: model init, data order and augmentation derive from it (per rank where it matters)."""

    @field_validator("output_dir", mode="before")
    @classmethod
    def _output_dir_is_a_path(cls, v: object) -> object:
        # Before pydantic's conversion: Path("s3://b/p") is "s3:/b/p", a local directory named "s3:".
        _file_path(str(v))
        return v

    @field_validator("name")
    @classmethod
    def _name_is_a_directory_name(cls, v: str) -> str:
        if not v or "/" in v or v in (".", ".."):
            raise ValueError(f"run.name={v!r} must be a plain directory name without '/'")
        return v


class TaskConfig(BaseModel):
    """The training problem: model, data, loss and metrics (contract: docs/tasks.md)."""

    model_config = _SECTION
    name: str = "image_classification"
    """image_classification: the built-in image classifier, configured by the model and data sections; causal_lm:
    a small GPT-style language model over a token file (task.options); package.module:callable: a user task, called
    as callable(**task.options), that returns an object with build_model, dataset, loss and metrics."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the task (causal_lm: path, seq_len, n_layer, ...; a user task: its own); a mapping in
    YAML, JSON on the command line and in JOB_TASK__OPTIONS, e.g. '{"seq_len": 64}'."""

    @field_validator("name")
    @classmethod
    def _known_task(cls, v: str) -> str:
        if v in BUILTIN_TASKS or is_import_path(v):
            return v
        raise ValueError(
            f"task.name={v!r} is neither one of {list(BUILTIN_TASKS)} nor a package.module:callable import path "
            "(a user task, e.g. mypkg.tasks:Segmentation)"
        )


class DistConfig(BaseModel):
    """Process group and launch."""

    model_config = _SECTION
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend; auto picks nccl when CUDA is available, gloo otherwise."""
    nproc_per_node: int = Field(0, ge=0)
    """Processes per node when ddp-job launches itself; 0 = one per visible GPU (1 on CPU)."""
    init_timeout_s: float = Field(600.0, gt=0)
    """Collective timeout until the first step completes (rendezvous, first compile)."""
    train_timeout_s: float = Field(300.0, gt=0)
    """Collective timeout after the first step: a rank that stops participating fails the others within this."""


class DataConfig(BaseModel):
    """Training and validation data."""

    model_config = _SECTION
    source: str = "imagefolder"
    """imagefolder: an ImageNet-layout directory (path/train, path/val); webdataset: .tar shards read by index
    (train_shards / val_shards; docs/webdataset.md); synthetic: random tensors on the device;
    package.module:callable: a user dataset, called as callable(split="train"|"val", path=data.path, **data.options)
    (contract: docs/user-code.md)."""
    path: Path = Path("data/shapes")
    """ImageFolder root that holds train/ and val/, or (webdataset) the directory of train.json and val.json
    (see ddp-job make-data); passed to a user dataset as path."""
    train_shards: str = ""
    """webdataset: the training shards: a wids index JSON (path or http(s)/s3/gs URL, shard URLs relative to it),
    or a local directory whose *.tar files are the shards. Empty: <path>/train.json, else the directory <path>/train."""
    val_shards: str = ""
    """webdataset: the validation shards, as train_shards. Empty: <path>/val.json, else the directory <path>/val."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for a user dataset (data.source as package.module:callable); a mapping in YAML, JSON
    on the command line and in JOB_DATA__OPTIONS, e.g. '{"min_size": 64}'."""
    num_classes: int = Field(10, ge=2)
    """Number of classes; must match the class folders."""
    image_size: int = Field(32, ge=8)
    """Train crop and val resize size in pixels."""
    num_workers: int = Field(2, ge=0)
    """DataLoader worker processes per rank (decode + augmentation happen there)."""
    augment: bool = True
    """Random resized crop + horizontal flip on the training set."""
    synthetic_train_size: int = Field(1024, ge=1)
    """Samples in the synthetic training set."""
    synthetic_val_size: int = Field(256, ge=1)
    """Samples in the synthetic validation set."""
    prefetch_factor: int = Field(2, ge=1)
    """Batches each worker prepares ahead."""
    pin_memory: bool = True
    """Page-locked host batches for asynchronous copies (CUDA only)."""
    loader_timeout_s: float = Field(600.0, ge=0)
    """Fail (instead of hanging) when DataLoader workers deliver no batch for this long; 0 waits forever."""
    device_prefetch: bool = True
    """Copy the next batch to the GPU on a side CUDA stream while this one computes (no-op on CPU). With
    data.decode=gpu/device: decode the next batch in a background thread (on a side stream on CUDA) instead of
    inside the step."""
    decode: Literal["auto", "cpu", "gpu", "device"] = "auto"
    """Where image files are decoded and augmented. cpu: PIL in the DataLoader workers. gpu: the workers only read
    the JPEG bytes and draw each sample's crop and flip; the batch is decoded (nvJPEG, through torchcodec) and
    cropped, resized and flipped on the GPU (needs CUDA). device: that path on whichever device trains, CPU
    included. auto: gpu with CUDA, torchcodec and an all-JPEG dataset, else cpu; the log says which and why."""

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        if v in BUILTIN_SOURCES or is_import_path(v):
            return v
        raise ValueError(
            f"data.source={v!r} is neither one of {list(BUILTIN_SOURCES)} nor a package.module:callable import "
            "path (a user dataset function, e.g. mypkg.data:make_dataset)"
        )


class ModelConfig(BaseModel):
    """The network."""

    model_config = _SECTION
    name: str = "resnet18"
    """A torchvision classification model name (resnet18, resnet50, mobilenet_v3_small, ...), or a user model as
    package.module:callable, called as callable(num_classes=N, **model.options) (contract: docs/user-code.md)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the model builder (a user callable, or torchvision's, e.g. {dropout: 0.2}); JSON on
    the command line and in JOB_MODEL__OPTIONS, e.g. '{"width": 64}'."""
    weights: str = ""
    """Initial weights (fine-tuning): a torchvision weights name of model.name (IMAGENET1K_V1, DEFAULT; from the torch
    hub cache, downloaded once when missing), or a path to a state dict file, a ddp-job checkpoint (step-N/ or its
    state.pt) or a ddp-job run directory (its newest checkpoint). A head sized for another number of classes is
    re-initialised; a resumed run restores its own checkpoint instead. Empty: random initialisation."""
    channels_last: bool = False
    """NHWC memory format for model and inputs (faster convolutions with bf16/fp16 on GPUs)."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode (inductor's: other backends take none)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend: inductor generates kernels; aot_eager captures forward and backward (Dynamo and
    AOTAutograd, where graph breaks and hook or checkpoint conflicts show) and runs the captured graphs eagerly,
    with no code generation: a quick check that a model compiles, or a way to tell an inductor bug from a
    capture one. eager: Dynamo alone."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm (batch statistics over all ranks; CUDA only)."""
    norm: Literal["batch", "group"] = "batch"
    """Normalisation layers of ResNet-family models: batch, or group (GroupNorm, 32 groups: no batch statistics,
    so results do not depend on how the batch is split over ranks)."""
    zero_init_residual: bool = False
    """Zero-initialise the last BN of each residual block (ResNets; Goyal et al. 2017)."""

    @field_validator("weights")
    @classmethod
    def _weights_are_not_a_url(cls, v: str) -> str:
        return _file_path(v)

    @model_validator(mode="after")
    def _mode_is_inductors(self) -> ModelConfig:
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ValueError(
                f"model.compile_mode={self.compile_mode!r} with model.compile_backend={self.compile_backend!r}: "
                "the modes are inductor's. Fix: set model.compile_backend inductor, or model.compile_mode default"
            )
        return self


class OptimConfig(BaseModel):
    """Optimizer."""

    model_config = _SECTION
    name: Literal["sgd", "adamw", "lars", "lamb"] = "sgd"
    """sgd, adamw, or the large-batch optimizers lars / lamb (timm.optim.Lars / timm.optim.Lamb)."""
    lr: float = Field(0.1, gt=0)
    """Peak learning rate (before scaling by global batch, see lr_scaling)."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """linear: lr x global_batch_size / lr_scaling_base (Goyal et al. 2017); sqrt: lr x sqrt(that ratio)."""
    lr_scaling_base: int = Field(256, ge=1)
    """Reference batch size of the LR scaling rule."""
    momentum: float = Field(0.9, ge=0, lt=1)
    """SGD momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(1e-4, ge=0)
    """Weight decay; never applied to norm and bias parameters."""
    trust_coeff: float = Field(0.001, gt=0)
    """lars: trust coefficient of the layer-wise LR ratio."""
    zero: bool = False
    """Shard optimizer state over ranks (torch ZeroRedundancyOptimizer); checkpoints stay complete (consolidated)."""


class SchedConfig(BaseModel):
    """Learning-rate schedule (from torch.optim.lr_scheduler)."""

    model_config = _SECTION
    name: Literal["cosine", "step", "multistep", "onecycle", "constant"] = "cosine"
    """Schedule after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from warmup_start_factor x lr to lr."""
    warmup_start_factor: float = Field(0.1, gt=0, le=1)
    """LR factor at step 0 of the warmup."""
    min_lr_factor: float = Field(0.0, ge=0, le=1)
    """cosine: final LR as a fraction of the peak."""
    step_size: int = Field(30, ge=1)
    """step: decay every step_size optimizer steps."""
    gamma: float = Field(0.1, gt=0, le=1)
    """step, multistep: decay factor."""
    milestones: tuple[int, ...] = ()
    """multistep: optimizer steps (absolute, after any warmup) at which the LR is multiplied by gamma."""
    pct_start: float = Field(0.3, gt=0, lt=1)
    """onecycle: fraction of the steps spent raising the LR (its own warmup; keep warmup_steps 0)."""
    div_factor: float = Field(25.0, ge=1)
    """onecycle: initial LR = lr / div_factor."""
    final_div_factor: float = Field(1e4, ge=1)
    """onecycle: final LR = initial LR / final_div_factor."""

    @model_validator(mode="after")
    def _schedule_consistent(self) -> SchedConfig:
        if self.name == "onecycle" and self.warmup_steps:
            raise ValueError(
                f"sched.warmup_steps={self.warmup_steps} with sched.name='onecycle': one-cycle has its own "
                "warmup. Fix: set sched.warmup_steps 0 and use sched.pct_start"
            )
        if self.name == "multistep":
            m = self.milestones
            if not m or list(m) != sorted(set(m)) or m[0] <= self.warmup_steps:
                raise ValueError(
                    f"sched.milestones={list(m)} must be strictly increasing optimizer steps after "
                    f"sched.warmup_steps={self.warmup_steps}. Fix: e.g. --sched.milestones '[30,60]'"
                )
        return self


class EarlyStopConfig(BaseModel):
    """Ends training, as finished (exit 0), once a validation metric has stopped improving (job.train.early_stop)."""

    model_config = _SECTION
    metric: str | None = None
    """The validation metric to watch, as the VAL and FINAL lines name it (val_loss, val_top1, val_perplexity); it
    is evaluated every train.eval_every steps. None: off, the run trains to train.steps."""
    mode: Literal["min", "max"] = "min"
    """min: an improvement is a lower value (a loss); max: a higher one (an accuracy)."""
    patience: int = Field(3, ge=1)
    """Evaluations in a row without improvement after which the run ends (after the step of the last of them)."""
    min_delta: float = Field(0.0, ge=0)
    """The least change over the best value so far that counts as an improvement."""


class TrainConfig(BaseModel):
    """The loop."""

    model_config = _SECTION
    steps: int = Field(100, ge=1)
    """Optimizer steps to train for (the run ends at this step, also after resumes)."""
    global_batch_size: int = Field(64, ge=1)
    """Samples per optimizer step over all ranks = micro_batch_size x grad_accum_steps x world_size."""
    micro_batch_size: int = Field(0, ge=0)
    """Samples per rank per forward pass; 0 = global_batch_size / world_size (no accumulation)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, bf16 autocast, or fp16 autocast with a GradScaler."""
    grad_clip_norm: float = Field(0.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    """Cross-entropy label smoothing."""
    strategy: Literal["ddp", "fsdp", "dp"] = "ddp"
    """ddp: DistributedDataParallel (one process per GPU); fsdp: parameters, gradients and optimizer state sharded
    over the ranks (FSDP2 fully_shard, the fsdp section; docs/sharding.md); dp: single-process nn.DataParallel over
    the visible GPUs, a baseline for comparison only (refused on CPU and with more than one process)."""
    activation_checkpointing: bool = False
    """Recompute each unit's activations in backward instead of keeping them (torch's non-reentrant
    checkpoint), under ddp and fsdp: activation memory of about one unit's inputs per unit, for one more
    forward of every unit per micro-batch. The units are fsdp.units, else the task's shard_units(model);
    with neither it is refused (docs/sharding.md)."""
    tf32: bool = False
    """Allow TF32 for fp32 matmuls and convolutions on CUDA (faster, ~10-bit mantissa); false = full fp32."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N steps (0: only at the end)."""
    max_nonfinite_skips: int = Field(10, ge=0)
    """Skip updates with a non-finite loss or gradient norm up to this many times, then stop with an error (checked
    at log and checkpoint steps). With fp16, GradScaler's overflow skips count too, and the limit is on skips in a
    row."""
    stop_signals: tuple[str, ...] = STOP_SIGNALS
    """Signals that request save-and-exit (exit code 143). Remove one to leave it to another handler."""
    early_stop: EarlyStopConfig = Field(default_factory=EarlyStopConfig)
    """Early stopping: end the run once train.early_stop.metric stops improving (off by default)."""
    max_time: duration | None = None
    """The time budget of one attempt, from the attempt's start (the launcher's, else the process's; a duration: 90s, 30m, 1h30m, 2d or seconds; None:
    none). When spent, the ranks agree on a step, save and exit 143 with reason time-budget, and the launcher
    requeues: an attempt fits a scheduler's time limit. Unlike Lightning's max_time it does not end training."""

    @field_validator("max_time")
    @classmethod
    def _max_time_is_a_duration(cls, v: str | None) -> str | None:
        if v is not None:
            parse_duration(v)
        return v

    @property
    def max_time_s(self) -> float | None:
        if self.max_time is None:
            return None
        return parse_duration(self.max_time)

    @field_validator("stop_signals")
    @classmethod
    def _known_signals(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [s for s in v if s not in SIGNAL_NAMES]
        if bad:
            raise ValueError(f"unknown signal(s) {bad}; choose from {list(SIGNAL_NAMES)}")
        return v


class CkptConfig(BaseModel):
    """Checkpoints."""

    model_config = _SECTION
    every: int | Literal["auto"] = 0
    """Save every N optimizer steps (0: only at the end and on preemption), or auto: the interval that wastes
    least for the measured save cost and ckpt.mtbf (Daly's optimum, docs/checkpoint-interval.md)."""
    mtbf: str = "24h"
    """ckpt.every=auto: mean time between failures of this job (a duration: 90s, 30m, 6h, 2d or seconds);
    refined from the launcher's restart counts, less the restarts after a stop save, once the job has failed."""
    grace_s: float = Field(0.0, ge=0)
    """Seconds from a stop signal to the launcher's hard kill, where known (Slurm --signal lead time, the pod's
    terminationGracePeriodSeconds; 0: unknown). ckpt.every=auto warns when a measured save does not fit in it."""
    keep_last: int = Field(3, ge=1)
    """Keep the newest K complete checkpoints (never deletes the only valid one)."""
    resume: bool = True
    """Resume from the newest valid checkpoint in the run directory."""
    async_save: Literal["auto", "on", "off"] = "auto"
    """Write checkpoints in a background thread after a host copy; auto = on with CUDA, off on CPU."""
    allow_world_size_change: bool = False
    """Allow resuming with a different world size (data position is mapped by samples seen)."""
    allow_config_change: bool = False
    """Allow resuming when training-relevant settings differ from the checkpoint's config."""
    path: str = ""
    """``ddp-job evaluate``: the checkpoint to evaluate (a step-NNNNNNN directory); empty: the newest valid one in
    the run directory. Training ignores it (it resumes from the run directory)."""

    @field_validator("path")
    @classmethod
    def _path_is_not_a_url(cls, v: str) -> str:
        return _file_path(v)

    @field_validator("every", mode="before")
    @classmethod
    def _every_is_steps_or_auto(cls, v: Any) -> Any:
        if v == "auto":
            return v
        try:
            steps = int(v)
        except (TypeError, ValueError):
            steps = -1
        if steps < 0 or str(v).strip() != str(steps):
            raise ValueError(f"{v!r} is neither a step count >= 0 nor auto")
        return steps

    @field_validator("mtbf")
    @classmethod
    def _mtbf_is_a_duration(cls, v: str) -> str:
        parse_duration(v)
        return v

    @property
    def mtbf_s(self) -> float:
        return parse_duration(self.mtbf)


class LogConfig(BaseModel):
    """Console, TensorBoard and metrics.jsonl."""

    model_config = _SECTION
    every: int = Field(10, ge=1)
    """Log training scalars every N steps."""
    tensorboard: bool = True
    """Write TensorBoard events to <run_dir>/tb (rank 0 only)."""
    jsonl: bool = False
    """Also append each log step's record (every scalar of the step) to <run_dir>/metrics.jsonl, one JSON object
    per line (rank 0 only, written by a thread of its own): pandas.read_json(path, lines=True) reads it."""
    progress: Literal["auto", "on", "off"] = "auto"
    """tqdm progress bar on rank 0 (auto: only when stdout is a terminal)."""


class TrackersConfig(BaseModel):
    """Experiment trackers beside TensorBoard (docs/trackers.md): each log step's record, the validation and final
    metrics, the resolved config as params and the run's tags, sent by rank 0 from a thread of its own. One tracker
    run per training run across every preemption: its id is kept in <run_dir>/trackers.json. An empty setting
    takes the tracker's own environment variable, so what a user already exports applies."""

    model_config = _SECTION
    mlflow: bool = False
    """Send the run to an MLflow tracking server."""
    mlflow_tracking_uri: str = ""
    """The MLflow tracking server (http://host:5000); empty: MLFLOW_TRACKING_URI. Credentials go in
    MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD, never here (the config is logged)."""
    mlflow_experiment: str = ""
    """The MLflow experiment (created if missing); empty: MLFLOW_EXPERIMENT_NAME, else MLflow's Default."""
    wandb: bool = False
    """Send the run to Weights & Biases (WANDB_API_KEY from the environment)."""
    wandb_project: str = ""
    """The W&B project; empty: WANDB_PROJECT, else W&B's own default."""
    wandb_mode: Literal["", "online", "offline"] = ""
    """online, or offline (files only, `wandb sync` uploads them later); empty: WANDB_MODE, else online."""
    wandb_dir: str = ""
    """Where W&B writes its files; empty: WANDB_DIR, else the run directory."""
    timeout_s: float = Field(10.0, gt=0)
    """A tracker request that takes longer fails (and is retried later): the longest a stop or the run's end waits
    for a tracker that is down. Training itself never waits for a tracker."""


class DdpConfig(BaseModel):
    """DistributedDataParallel knobs and gradient communication (see docs/efficiency.md)."""

    model_config = _SECTION
    bucket_cap_mb: float = Field(25.0, gt=0)
    """Gradient bucket size in MiB: larger = fewer, bigger all-reduces; smaller = earlier overlap with backward."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into the communication buckets: no bucket-to-gradient copy per step and one
    gradient-sized buffer less (the bare-loop comparison in docs/benchmarks.md measures the copy)."""
    static_graph: bool = False
    """Promise the set of used parameters never changes (lets DDP skip per-step graph checks)."""
    comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    """Gradient communication: none (fp32 all-reduce), bf16/fp16 compression, or PowerSGD low-rank compression."""
    powersgd_rank: int = Field(1, ge=1)
    """powersgd: matrix approximation rank (higher = more accurate, more traffic)."""
    powersgd_start_iter: int = Field(10, ge=2)
    """powersgd: plain all-reduce for this many iterations before compressing."""
    comm_stats: bool = False
    """Count gradient all-reduce calls per optimizer step and log them at the end (a counting comm hook)."""


class FsdpConfig(BaseModel):
    """Sharding under train.strategy=fsdp (torch.distributed.fsdp.fully_shard; docs/sharding.md)."""

    model_config = _SECTION
    units: tuple[str, ...] = ()
    """Class names of the modules sharded as one unit each (their parameters are gathered together), e.g.
    [Block]; empty: the task's shard_units(model), else the blocks a Hugging Face model names in its
    _no_split_modules, else the root alone. The root is always a unit too."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gathered again for backward): less memory, one
    all-gather more per unit and micro-batch."""
    replicate_degree: int = Field(0, ge=0)
    """HSDP: how many copies of the sharded model the job holds (the device mesh's outer dimension, torchtitan's
    data_parallel_replicate_degree); gradients are reduce-scattered within a shard group, then all-reduced across
    the copies. 0: world_size / shard_degree. replicate_degree x shard_degree must be the world size."""
    shard_degree: int = Field(0, ge=0)
    """Ranks each copy is sharded over (consecutive ranks: one node's processes). 0: world_size / replicate_degree;
    both 0: shard within a node, replicate across nodes (one node: shard over all ranks). docs/sharding.md."""


class EmaConfig(BaseModel):
    """Exponential moving average of the weights, evaluated and checkpointed alongside the model."""

    model_config = _SECTION
    enabled: bool = False
    """Keep an EMA copy of parameters and buffers (torch.optim.swa_utils.AveragedModel)."""
    decay: float = Field(0.999, gt=0, lt=1)
    """ema = decay x ema + (1 - decay) x weights, per update."""
    every: int = Field(1, ge=1)
    """Update the EMA every N optimizer steps."""


class DoctorConfig(BaseModel):
    """Preflight checks: `ddp-job doctor`, and a quick phase at the start of train (see docs/doctor.md)."""

    model_config = _SECTION
    enabled: bool = True
    """train: run the quick checks (topology, versions, rendezvous, all-reduce correctness, /dev/shm, storage) first."""
    rendezvous_timeout_s: float = Field(60.0, gt=0)
    """Retry resolving MASTER_ADDR and connecting to MASTER_PORT this long (pods start before their DNS names exist)."""
    comm_sizes_kb: tuple[int, ...] = ()
    """ddp-job doctor: all-reduce message sizes (KiB) timed for algorithm/bus bandwidth; empty: the backend's own
    (job.doctor.communication.SWEEPS: up to 1 GiB on NCCL, where NVLink needs large messages; small on gloo)."""
    comm_iters: int = Field(0, ge=0)
    """ddp-job doctor: timed all-reduce iterations per size, after untimed warm-ups; 0: the backend's own count."""


class ObserveConfig(BaseModel):
    """Training observability: straggler statistics, throughput/MFU, memory, profiler window (job/observe.py)."""

    model_config = _SECTION
    every: int = Field(0, ge=0)
    """Gather per-rank step times/memory every N steps (0: every log.every steps)."""
    peak_tflops: float = Field(0.0, ge=0)
    """Peak dense TFLOP/s of one device for MFU; 0: looked up for known GPUs, no MFU on CPU."""
    profile_start: int = Field(0, ge=0)
    """Profile the steps after this many completed steps with torch.profiler (0: off); traces in <run_dir>/tb."""
    profile_steps: int = Field(3, ge=1)
    """Number of steps in the profiler window."""


class ReportConfig(BaseModel):
    """Progress reports from rank 0, sent off the training thread (docs/progress.md): the status file, the Slurm
    job's comment under Slurm, a Kubeflow TrainJob's status. A place that cannot be reached is logged and training
    goes on."""

    model_config = _SECTION
    enabled: bool = True
    """Report the run's progress at all (off: no report of any kind, no reporting thread)."""
    file: bool = True
    """Keep <run_dir>/status.json current: progress, ETA, metrics, the newest checkpoint and its age (replaced
    atomically at most once a second)."""
    slurm_comment: bool = True
    """Under Slurm (SLURM_JOB_ID set): a one-line summary in the job's comment (scontrol update; `scontrol show
    job` shows it). Replaces a comment given at submission; off leaves the comment alone."""
    slurm_every_s: float = Field(60.0, ge=1)
    """At most one comment update per this many seconds (and the final one): each update is an RPC to slurmctld,
    which serves the whole cluster's jobs and commands."""
    trainjob: bool = True
    """In a Kubeflow TrainJob whose controller has the TrainJobStatus gate on (it then sets the three
    KUBEFLOW_TRAINER_SERVER_* variables): the progress in the TrainJob's status.trainerStatus, at most one request
    per 5 s (docs/kubernetes.md). Without those variables there is nothing to report to."""


class DebugConfig(BaseModel):
    """TESTING AND DEBUGGING AIDS ONLY: faults injected on purpose (all off by default; nothing here belongs in
    a production config). Each aid is installed only when set, so the training step pays nothing when off."""

    model_config = _SECTION
    nan_at_steps: tuple[int, ...] = ()
    """Make the loss NaN at these (1-based) optimizer steps (exercises the non-finite skip)."""
    straggler_delay_s: float = Field(0.0, ge=0)
    """Sleep this long before the forward pass on straggler_rank (makes it a straggler)."""
    straggler_rank: int = Field(-1, ge=-1)
    """The rank that sleeps (-1: none)."""
    straggler_steps: tuple[int, ...] = ()
    """Delay only these (1-based) steps; empty: every step."""
    straggler_in: Literal["train", "eval"] = "train"
    """Where straggler_rank sleeps: before a training step's first forward, or before the first forward of each
    evaluation (the evaluation after step N counts as step N + 1 for straggler_steps)."""
    ckpt_write_delay_s: float = Field(0.0, ge=0)
    """The checkpoint writer sleeps this long before writing (lands signals during a save)."""
    signal_group_at_worker_start: Literal["", "train", "val"] = ""
    """The first DataLoader worker of this loader sends SIGTERM to its rank's process group as it starts, before
    it can ignore stop signals: a launcher's group signal landing while the workers start ("": off)."""
    ckpt_save_delay_s_by_rank: tuple[Annotated[float, Field(ge=0)], ...] = ()
    """Rank i sleeps the i-th value (seconds; none past the end) in each save, before it returns to training:
    gives the ranks different save stalls (ckpt.every=auto must still save on every rank at the same steps)."""
    fail_load_rank: int = Field(-1, ge=-1)
    """This rank fails to load its checkpoint shards on resume (-1: none)."""


class JobConfig(BaseSettings):
    """ddp-job configuration. Precedence: defaults < --config YAML < JOB_SECTION__FIELD env < --section.field CLI."""

    model_config = SettingsConfigDict(
        env_prefix="JOB_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        cli_kebab_case=True,
        cli_implicit_flags=False,
        cli_exit_on_error=False,
        cli_avoid_json=True,
        cli_hide_none_type=True,  # an optional setting shows its type alone (--train.max-time duration)
        nested_model_default_partial_update=False,
    )
    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """The training problem."""
    dist: DistConfig = Field(default_factory=DistConfig)
    """Distributed setup."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Data."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer."""
    sched: SchedConfig = Field(default_factory=SchedConfig)
    """LR schedule."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Training loop."""
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    """Checkpointing."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    trackers: TrackersConfig = Field(default_factory=TrackersConfig)
    """Experiment trackers (MLflow, Weights & Biases)."""
    ddp: DdpConfig = Field(default_factory=DdpConfig)
    """DDP knobs and communication hooks."""
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    """Sharding under train.strategy=fsdp."""
    ema: EmaConfig = Field(default_factory=EmaConfig)
    """Weight EMA."""
    doctor: DoctorConfig = Field(default_factory=DoctorConfig)
    """Preflight checks."""
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    """Observability."""
    report: ReportConfig = Field(default_factory=ReportConfig)
    """Progress reports."""
    debug: DebugConfig = Field(default_factory=DebugConfig)
    """TESTING AND DEBUGGING AIDS ONLY (faults injected on purpose): never set them in a real run."""

    @property
    def run_dir(self) -> Path:
        return self.run.output_dir / self.run.name

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first. CliApp puts the CLI above all of these.
        return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)
