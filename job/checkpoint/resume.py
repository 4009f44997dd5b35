"""What a resume must restore beyond weights: RNG states, and the refusal of incompatible resumes."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from job.config import JobConfig, config_to_dict, flatten
from job.errors import BadInput, CheckpointLoadError

log = logging.getLogger("job")

# Settings that may differ between the saved run and the resumed one without changing the math:
# where things live, how processes are launched, logging, checkpoint cadence, the training horizon.
MAY_CHANGE = (
    "run.name",
    "run.output_dir",
    "dist.",
    "data.path",
    "data.num_workers",
    "data.prefetch_factor",
    "data.pin_memory",
    "data.loader_timeout_s",
    "train.steps",
    "train.eval_every",
    "train.early_stop.",  # when the run ends, as train.steps; another metric or mode counts afresh (job.train.early_stop)
    "train.stop_signals",
    "train.max_time",  # one attempt's budget: the next attempt may have another
    "train.max_nonfinite_skips",
    "ckpt.",
    "log.",
    "trackers.",  # where the step records are also sent: the tracker run's id lives in the run directory
    "doctor.",
    "observe.",
    "debug.",
    "data.device_prefetch",
    "data.decode",  # same samples, crops and flips; decoders differ only in IDCT rounding (tests/test_decode.py)
    "ddp.comm_stats",  # copy overlap / a counting hook: same math
    "model.weights",  # initial weights only: a resumed run restores its own checkpoint and never reads them
    "train.strategy",  # one checkpoint format for ddp and fsdp (job.checkpoint.sharded): same math, other sums
    "fsdp.",
    "train.activation_checkpointing",  # recomputes the same forward: same math, the same state-dict keys
    "model.compile",  # and its mode and backend: the same graph run by other kernels, the same state-dict keys
)

# Settings that change the math: a resume with another value is refused (ckpt.allow_config_change allows it).
# Every setting is in MAY_CHANGE (by prefix) or here (by name): a new setting must be classified in one of them
# (tests/test_resume_settings.py). A checkpoint saved before a setting existed resumes while that setting holds
# its default.
MUST_MATCH = frozenset(
    {
        *("data.augment", "data.image_size", "data.num_classes", "data.source", "data.synthetic_train_size"),
        *("data.synthetic_val_size", "data.train_shards", "data.val_shards"),
        *("ddp.bucket_cap_mb", "ddp.comm_hook", "ddp.gradient_as_bucket_view", "ddp.powersgd_rank"),
        *("ddp.powersgd_start_iter", "ddp.static_graph", "ema.decay", "ema.enabled", "ema.every"),
        *("model.channels_last", "model.name", "model.norm", "model.sync_bn", "model.zero_init_residual"),
        *("optim.betas", "optim.lr", "optim.lr_scaling", "optim.lr_scaling_base", "optim.momentum", "optim.name"),
        *("optim.nesterov", "optim.trust_coeff", "optim.weight_decay", "optim.zero"),
        *("report.enabled", "report.file", "report.slurm_comment", "report.slurm_every_s", "report.trainjob"),
        *("run.seed", "sched.div_factor", "sched.final_div_factor", "sched.gamma", "sched.milestones"),
        *("sched.min_lr_factor", "sched.name", "sched.pct_start", "sched.step_size", "sched.warmup_start_factor"),
        *("sched.warmup_steps", "task.name", "train.global_batch_size", "train.grad_clip_norm"),
        *("train.label_smoothing", "train.micro_batch_size", "train.precision", "train.tf32"),
    }
)


def unclassified(keys: Iterable[str]) -> list[str]:
    """The settings among ``keys`` (flattened, ``section.field``) that are neither MAY_CHANGE nor MUST_MATCH."""
    return sorted(k for k in keys if not k.startswith(MAY_CHANGE) and k not in MUST_MATCH)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states in types that ``torch.load(weights_only=True)`` accepts."""
    _, np_keys, np_pos, np_has_gauss, np_gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def config_differences(saved: dict[str, Any], current: JobConfig) -> list[str]:
    """The settings that differ and must match. A setting the checkpoint predates differs only where it is not
    at its default now."""
    a, b = flatten(saved), flatten(config_to_dict(current))
    defaults = flatten(config_to_dict(type(current).model_construct()))
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: checkpoint {a.get(k)!r} -> now {b.get(k)!r}"
        for k in keys
        if a.get(k) != b.get(k) and not k.startswith(MAY_CHANGE) and not (k not in a and b.get(k) == defaults.get(k))
    ]


def map_data_position(
    trainer: dict[str, Any], saved_plan: dict[str, Any], world_size: int, micro_batch_size: int
) -> int:
    """This layout's ``micro_batches_in_epoch`` for a position saved with another world size / micro batch.

    A position is "samples consumed in the epoch" = micro-batches x saved world size x saved micro batch
    (job.data.sampler: a row of W x m samples per micro-batch, the same global order for every W). It maps onto
    the new layout when that count is a whole number of new rows; saves happen at optimizer-step
    boundaries, so this holds whenever train.global_batch_size is unchanged.

    Raises:
        BadInput: the position falls inside a row of the new layout.
    """
    saved_row = int(saved_plan["world_size"]) * int(saved_plan["micro_batch_size"])
    samples = int(trainer["micro_batches_in_epoch"]) * saved_row
    row = world_size * micro_batch_size
    if samples % row:
        raise BadInput(
            f"cannot map the saved data position ({samples} samples into epoch {trainer.get('epoch')}, saved with "
            f"world_size={saved_plan['world_size']} x micro batch {saved_plan['micro_batch_size']}) onto "
            f"world_size={world_size} x micro batch {micro_batch_size}: {samples} is not a multiple of {row}.",
            f"keep train.global_batch_size={saved_plan.get('global_batch_size')} and choose "
            f"train.micro_batch_size so that it divides the position, or resume with {saved_plan['world_size']} processes.",
            setting="train.micro_batch_size",
            value=micro_batch_size,
        )
    return samples // row


def row_changed(saved: dict[str, Any], world_size: int, micro_batch_size: int) -> bool:
    """Whether a micro-batch of this layout takes another number of samples than one of the ``saved`` layout
    (``world_size`` and ``plan``, as a checkpoint's manifest and its layout hold them): the data position, counted
    in micro-batches, must then be mapped (``map_data_position``)."""
    plan = saved["plan"]
    return int(saved["world_size"]) * int(plan["micro_batch_size"]) != world_size * micro_batch_size


def check_resumable(
    manifest: dict[str, Any], cfg: JobConfig, world_size: int, micro_batch_size: int | None = None
) -> None:
    """Refuse a resume that would silently change the run; say what differs and which flag allows it.

    World-size changes: the data position is stored per optimizer step and each global batch holds the
    same samples whatever the world size (see job.data.sampler), so a resume with another world size continues
    the same sample sequence as long as train.global_batch_size is unchanged. Per-rank RNG streams
    cannot be mapped and are re-seeded.
    """
    diffs = config_differences(manifest.get("config", {}), cfg)
    if diffs and not cfg.ckpt.allow_config_change:
        raise BadInput(
            f"the newest checkpoint (step {manifest.get('step')}) was written with a different config:\n  "
            + "\n  ".join(diffs),
            "restore those settings, use a new run.name, or pass --ckpt.allow-config-change true.",
            setting="ckpt.allow_config_change",
            value=False,
        )
    saved_ws = manifest.get("world_size")
    if saved_ws != world_size and not cfg.ckpt.allow_world_size_change:
        raise BadInput(
            f"the newest checkpoint (step {manifest.get('step')}) was written with world_size={saved_ws}, "
            f"this run has world_size={world_size}.",
            f"launch {saved_ws} processes, or pass "
            f"--ckpt.allow-world-size-change true (supported: the data position is mapped by samples consumed, so "
            f"with train.global_batch_size unchanged each sample is trained on as often and in the same order; "
            f"per-rank RNG streams are re-seeded, so dropout masks differ from the uninterrupted run's, and only a "
            f"model without dropout matches it up to floating-point summation order).",
        )
    if micro_batch_size is not None:
        _check_position(manifest, world_size, micro_batch_size)
    if cfg.optim.zero and "optimizer" in sharded_parts(manifest):
        raise BadInput(
            f"the newest checkpoint (step {manifest.get('step')}) holds the optimizer state as every rank's shards "
            "(written without optim.zero); ZeroRedundancyOptimizer loads a whole optimizer state.",
            "resume with --optim.zero false (after the resume, a later save may switch it on again).",
            setting="optim.zero",
            value=True,
        )


def _check_position(manifest: dict[str, Any], world_size: int, micro_batch_size: int) -> None:
    """The checkpoint's data position maps onto this layout where a micro-batch takes another number of samples
    (another world size or micro batch): raises BadInput where it cannot (``map_data_position``)."""
    trainer, saved_plan, saved_ws = manifest.get("trainer"), manifest.get("plan"), manifest.get("world_size")
    if not trainer or not saved_plan or saved_ws is None:  # an older manifest: the load maps it
        return
    if row_changed({"world_size": saved_ws, "plan": saved_plan}, world_size, micro_batch_size):
        map_data_position(trainer, saved_plan, world_size, micro_batch_size)


SHARDS_HOLD = "shards"
"""The manifest's list of what the checkpoint's shards hold (written by job.checkpoint.checkpointer)."""


def sharded_parts(manifest: dict[str, Any]) -> list[str]:
    """What a checkpoint's shards hold (``model``, ``optimizer``, ``ema``), read from its manifest: the first
    sharded checkpoints (fsdp only) did not list them, and held the model and the optimizer."""
    if SHARDS_HOLD in manifest:
        return list(manifest[SHARDS_HOLD])
    if any(name.startswith("shards/") for name in manifest.get("files", {})):
        return ["model", "optimizer"]
    return []


def find_resume(cfg: JobConfig, world_size: int, micro_batch_size: int) -> Any:
    """The checkpoint to resume from (a ``job.checkpoint.store.Found``) or None; refusals raise BadInput.

    Runs in preflight, before any process group or write: a refused resume leaves the run directory as
    it was. Sizes only: once the process group is up, the ranks hash it together and agree (``settle``).
    """
    from job.checkpoint import store as ckpt

    if not cfg.ckpt.resume:
        existing = ckpt.scan(cfg.run_dir)
        if existing:
            # Not refused (benchmarks re-run with resume=false on purpose), but a later resume would pick
            # these up, and a save of a step that exists keeps the one on disk.
            log.warning(
                "ckpt.resume=false: ignoring %d checkpoint(s) in %s (newest %s); a later run with ckpt.resume=true "
                "resumes from the newest of all. Use a new run.name to keep runs apart.",
                len(existing),
                cfg.run_dir,
                existing[0][1].name,
            )
        return None
    found = ckpt.find_latest(cfg.run_dir, hashes=False)  # sizes only: the ranks hash it together (settle)
    if found is not None:
        check_resumable(found.manifest, cfg, world_size, micro_batch_size)
    return found


def settle(
    found: Any,
    run_dir: Path | None,
    rank: int,
    world_size: int,
    group: Any = None,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """Every rank: the checkpoint to resume from, ``found`` (sizes checked in preflight) or an older one, hashed by
    all ranks together. Each rank hashes its share of the files that are not verified as they are read
    (job.checkpoint.store.hashed_on_resume, .share), one small all-gather shares the verdicts, and a file found
    corrupt by any rank makes every rank fall back to the next older checkpoint in ``run_dir`` (None: none)
    (``check``: whether that one may be resumed, as preflight checked ``found``). Nothing is deleted.

    Raises:
        CheckpointLoadError: the ranks found different checkpoints, or none verifies.
    """
    import torch.distributed as dist

    from job.checkpoint import store as ckpt

    while True:
        agree_on_checkpoint(found, group)
        if found is None:
            return None
        hashed = ckpt.hashed_on_resume(found.manifest["files"])
        mine = ckpt.check_hashes(found.path, found.manifest, ckpt.share(hashed, rank, world_size))
        verdicts: list[Any] = [None] * world_size
        dist.all_gather_object(verdicts, mine, group=group)
        bad = [f"rank {r}: {why}" for r, why in enumerate(verdicts) if why]
        if not bad:
            return found
        found = older_than(found, run_dir, bad, check)


def older_than(found: Any, run_dir: Path | None, bad: list[str], check: Callable[[Any], None] | None = None) -> Any:
    """Every rank, once all ranks refused ``found`` (``bad``: what each found): the next older checkpoint in
    ``run_dir``, its sizes checked, not yet hashed (``check``: whether it may be resumed).

    Raises:
        CheckpointLoadError: there is none.
    """
    from job.checkpoint import store as ckpt

    log.warning("skipping checkpoint %s: %s", found.path, "; ".join(bad))
    older = None
    if run_dir is not None:
        older = ckpt.find_latest(run_dir, hashes=False, below=found.step)
    if older is None:
        raise CheckpointLoadError(
            f"checkpoint {found.path} is corrupt ({'; '.join(bad)}) and no older one verifies.",
            f"restore the step-* directories of {found.path.parent} from a copy, or move them away to start "
            "afresh (nothing was deleted).",
        )
    if check is not None:
        check(older)
    return older


def agree_on_checkpoint(found: Any, group: Any = None) -> None:
    """All ranks must resume from the same step (each scanned the run directory itself): a shared
    filesystem that shows ranks different directories would otherwise train diverged replicas."""
    import torch.distributed as dist

    step = -1 if found is None else int(found.step)
    t = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    newest, oldest = int(t[0]), -int(t[1])
    if newest != oldest:
        raise CheckpointLoadError(
            f"ranks found different newest checkpoints (steps {oldest} to {newest}; -1 = none). The run directory "
            f"must be on a filesystem every rank sees the same way.",
            "put run.output_dir on shared storage.",
            setting="run.output_dir",
        )
