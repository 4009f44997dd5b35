"""``ddp-job evaluate``: a checkpoint's exact validation metrics, on demand, at any world size and under any launcher.

The run's own parts and evaluation: the config tree picks the task, data and model as for ``train`` (the run's
``config.yaml`` as ``--config`` gives the run's); ``ckpt.path`` picks the checkpoint, else the newest valid one in
the run directory. The model (and its EMA with ``ema.enabled``) is loaded from the checkpoint and evaluated by
``job.train.evaluate``, the code of a run's final evaluation: the ``EVAL`` line carries the values the run's FINAL
line printed for that step, and ``eval/step-NNNNNNN.json`` in the run directory holds every result.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from job.checkpoint import store as ckpt
from job.checkpoint.resume import agree_on_checkpoint
from job.cluster.env import DistEnv, detect_env
from job.config import JobConfig, load_config
from job.config.plan import make_plan
from job.errors import EXIT_OK, BadInput
from job.observe import metrics
from job.parallel import distributed
from job.tasks.load import load_task
from job.tasks.preflight import check_task
from job.train.evaluate import Evaluator
from job.train.loop import metric_values
from job.train.parts import build_parts

log = logging.getLogger("job")


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None, cfg: JobConfig | None = None) -> int:
    """Evaluate the checkpoint the config names; every check of the input runs before any process group."""
    environ = os.environ if environ is None else environ
    if cfg is None:
        cfg = load_config(argv, environ)
    env = detect_env(environ)
    metrics.setup_console(env.rank, env.world_size)
    found = find_checkpoint(cfg)
    saved = checkpoint_state(found, cfg)
    plan = make_plan(cfg, env.world_size)
    task = load_task(cfg)
    checked = check_task(task, cfg, env, plan, torch.cuda.is_available(), load_weights=False)
    rt = distributed.setup(env, cfg.dist)
    try:
        agree_on_checkpoint(found, rt.control_group)
        parts = build_parts(cfg, env, plan, rt, task, checked, initial_weights=False)
        parts.raw_model.load_state_dict(saved["model"])
        if parts.ema is not None:
            parts.ema.load_state_dict(saved["ema"])
        results = Evaluator(parts, 0, 0, metrics.NullWriter()).results()
        if env.is_main:
            report(results, found, cfg, env)
        distributed.barrier(rt)
    finally:
        distributed.teardown()
    return EXIT_OK


def find_checkpoint(cfg: JobConfig) -> ckpt.Found:
    """``ckpt.path`` (it must verify), else the newest valid checkpoint in the run directory."""
    if not cfg.ckpt.path:
        found = ckpt.find_latest(cfg.run_dir)
        if found is None:
            raise BadInput(
                f"no valid checkpoint in the run directory {cfg.run_dir} (ckpt.path is empty: the newest there is "
                "evaluated).",
                "name the run (run.output_dir, run.name, or --config <run dir>/config.yaml), or set ckpt.path to a "
                "step-NNNNNNN directory.",
                setting="ckpt.path",
                value="",
            )
        return found
    path = Path(cfg.ckpt.path)
    match = ckpt.STEP_DIR.match(path.name)
    ok, reason, manifest = ckpt.verify(path)
    if match is None or not ok:
        why = reason or "its name is not step-NNNNNNN"
        raise BadInput(
            f"ckpt.path={cfg.ckpt.path!r} is not a complete checkpoint: {why}.",
            "set ckpt.path to a step-NNNNNNN directory a run wrote completely (it holds manifest.json).",
            setting="ckpt.path",
            value=cfg.ckpt.path,
        )
    return ckpt.Found(int(match.group(1)), path, manifest)


def checkpoint_state(found: ckpt.Found, cfg: JobConfig) -> dict[str, Any]:
    """The checkpoint's state (on the CPU); with ``ema.enabled`` it must hold an EMA."""
    saved = ckpt.load_state(found)
    if "model" not in saved:  # train.strategy=fsdp: the model is every rank's shards (job.checkpoint.sharded)
        raise BadInput(
            f"the checkpoint {found.path} holds its model as every rank's shards (a train.strategy=fsdp run); "
            "ddp-job evaluate reads whole-model checkpoints only.",
            "resume the run with ddp-job train: its final evaluation is the same exact evaluation, under fsdp too.",
            setting="ckpt.path",
            value=str(found.path),
        )
    if cfg.ema.enabled and saved.get("ema") is None:
        raise BadInput(
            f"ema.enabled=true, but the checkpoint {found.path} holds no EMA.",
            "evaluate it with ema.enabled=false.",
            setting="ema.enabled",
            value=True,
        )
    return saved


def report(results: dict[str, float], found: ckpt.Found, cfg: JobConfig, env: DistEnv) -> None:
    """The EVAL line (the FINAL line's values) and every result in the run directory's ``eval/`` (rank 0)."""
    if "ema/val/count" in results:
        log.info("EMA %s", metric_values(results, "ema/val/"))
    out = cfg.run_dir / "eval" / f"{found.path.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"step": found.step, "checkpoint": str(found.path), "world_size": env.world_size, "results": results}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"EVAL step={found.step} {metric_values(results, 'val/')} val_count={int(results['val/count'])} "
        f"checkpoint={found.path} results={out}",
        flush=True,
    )
