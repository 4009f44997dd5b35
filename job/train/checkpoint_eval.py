"""``ddp-job evaluate``: a checkpoint's exact validation metrics, on demand, at any world size and under any launcher.

The run's own parts and evaluation: the config tree picks the task, data and model as for ``train`` (the run's
``config.yaml`` as ``--config`` gives the run's); ``ckpt.path`` picks the checkpoint, else the newest valid one in
the run directory. The model (and its EMA with ``ema.enabled``) is loaded from the checkpoint and evaluated by
``job.train.evaluate``, the code of a run's final evaluation: the ``EVAL`` line carries the values the run's FINAL
line printed for that step, and ``eval/step-NNNNNNN.json`` in the run directory holds every result. Checkpoints of
either strategy load into either (job.checkpoint.sharded), at any world size.
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
from job.checkpoint.resume import settle
from job.checkpoint.sharded import SHARDS, Sharded, held_parts
from job.cluster.env import DistEnv, detect_env
from job.config import JobConfig, load_config
from job.config.plan import make_plan
from job.errors import EXIT_OK, BadInput
from job.observe import metrics
from job.parallel import distributed
from job.tasks.load import load_task
from job.tasks.preflight import check_task
from job.train.evaluate import Evaluator, metric_values
from job.train.parts import build_parts

log = logging.getLogger("job")


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None, cfg: JobConfig | None = None) -> int:
    """Evaluate the checkpoint the config names; every check of the input runs before any process group."""
    environ = os.environ if environ is None else environ
    if cfg is None:
        cfg = load_config(argv, environ, command="evaluate")
    env = detect_env(environ)
    metrics.setup_console(env.rank, env.world_size)
    found = find_checkpoint(cfg)
    saved = checkpoint_state(found, cfg)
    plan = make_plan(cfg, env.world_size)
    task = load_task(cfg)
    checked = check_task(task, cfg, env, plan, torch.cuda.is_available(), load_weights=False)
    rt = distributed.setup(env, cfg.dist)
    try:
        # The ranks hash the checkpoint together, each its share (job.checkpoint.resume.settle).
        settled = settle(found, None if cfg.ckpt.path else cfg.run_dir, env.rank, env.world_size, rt.control_group)
        if settled is not found:  # an older one: the newest was corrupt
            found, saved = settled, checkpoint_state(settled, cfg)
        parts = build_parts(cfg, env, plan, rt, task, checked, initial_weights=False)
        # Either strategy's checkpoint (shards, or a whole state.pt) into this run's model, sharded or not.
        Sharded(parts.raw_model, None, env.rank, rt.control_group, ema=parts.ema).load(
            found.path, saved, found.manifest.get("files", {})
        )
        results = Evaluator(parts, 0, 0, metrics.NullWriter()).results(found.step)
        if env.is_main:
            report(results, found, cfg, env)
        distributed.barrier(rt)
    finally:
        distributed.teardown()
    return EXIT_OK


def find_checkpoint(cfg: JobConfig) -> ckpt.Found:
    """``ckpt.path`` (it must be complete), else the newest complete checkpoint in the run directory; sizes only,
    the ranks hash it together once the process group is up."""
    if not cfg.ckpt.path:
        found = ckpt.find_latest(cfg.run_dir, hashes=False)
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
    if not path.is_dir():
        raise BadInput(
            f"ckpt.path={cfg.ckpt.path!r}: no such directory.",
            f"check the path; the run's checkpoints are the step-NNNNNNN directories of {cfg.run_dir}, or leave "
            "ckpt.path empty to evaluate the newest valid one there.",
            setting="ckpt.path",
            value=cfg.ckpt.path,
        )
    match = ckpt.STEP_DIR.match(path.name)
    ok, reason, manifest = ckpt.inspect(path)
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
    """The checkpoint's state.pt (on the CPU); with ``ema.enabled`` the checkpoint must hold an EMA, in its shards
    or (a checkpoint written before them) in state.pt."""
    saved = ckpt.load_state(found)
    has_ema = saved.get("ema") is not None
    if (found.path / SHARDS).is_dir():
        has_ema = has_ema or "ema" in held_parts(found.path)
    if cfg.ema.enabled and not has_ema:
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
