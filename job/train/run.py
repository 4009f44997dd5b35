"""The training job, top to bottom as the data flows:

config -> environment/rendezvous -> data -> model -> optimizer -> loop -> checkpoint -> logging.

``main(argv)`` is what ``ddp-job train`` and ``python -m job train`` run, as a torchrun worker or a
single plain process. Everything that can be wrong with the input is checked before any process group
or device work, and before anything is written to the run directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from job.checkpoint import store as ckpt
from job.parallel import distributed
from job.doctor import run as doctor
from job.observe import metrics
from job.observe import observer as observe
from job.parallel import ddp as parallel
from job.config import JobConfig, config_to_dict, dump_config, load_config
from job.data.loaders import build_loaders, check_train_size, to_device, validate_data
from job.launchers.env import DistEnv, detect_env
from job.train.ema import build_ema
from job.errors import EXIT_OK, EXIT_PREEMPTED, BadInput, NonFiniteError
from job.train.model import build_model, validate_model
from job.train.optim import build_optimizer, build_scheduler
from job.config.plan import Plan, make_plan
from job.data.prefetch import wrap_loaders
from job.train.preempt import StopRequest
from job.checkpoint.resume import agree_on_checkpoint, find_resume, map_data_position, rng_state, set_rng_state

log = logging.getLogger("job")


@dataclass
class TrainState:
    """What the loop advances; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    micro_batches_in_epoch: int = 0
    """Micro-batches this rank consumed in ``epoch``: resume continues at exactly the next sample."""
    samples_seen: int = 0
    nonfinite_skips: int = 0


def preflight(cfg: JobConfig, env: DistEnv) -> Plan:
    """Every check that needs no process group, device or write: bad input fails here with exit 2, before
    the doctor's quick checks (which write doctor.json) and before run() writes config.yaml."""
    plan = make_plan(cfg, env.world_size)
    parallel.validate(cfg, env.world_size, torch.cuda.is_available())
    validate_model(cfg.model)
    if cfg.model.sync_bn and not torch.cuda.is_available():
        raise BadInput("model.sync_bn=true needs CUDA (SyncBatchNorm has no CPU kernel).",
                       "--model.sync-bn false, or --model.norm group.", setting="model.sync_bn", value=True)
    if cfg.train.precision == "fp16" and not torch.cuda.is_available():
        raise BadInput("train.precision='fp16' needs CUDA (fp16 autocast on CPU is not supported).",
                       "use bf16 or fp32 on CPU.", setting="train.precision", value="fp16")
    layout = validate_data(cfg.data)
    check_train_size(cfg.data, layout, env.world_size, plan.micro_batch_size, plan.grad_accum_steps)
    run_dir = cfg.run_dir
    existing = next((p for p in [run_dir, *run_dir.parents] if p.exists()), None)
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)):
        raise BadInput(
            f"run directory {run_dir} cannot be created or written ({existing} is not a writable directory).",
            "set run.output_dir (--run.output-dir / JOB_RUN__OUTPUT_DIR) to a writable directory.",
            setting="run.output_dir", value=cfg.run.output_dir,
        )
    return plan


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    # --- config ---
    cfg = load_config(argv, environ)
    # --- environment / rendezvous ---
    env = detect_env(environ)
    metrics.setup_console(env.rank, env.world_size)
    plan = preflight(cfg, env)
    found = find_resume(cfg, env.world_size, plan.micro_batch_size)  # refusals exit 2 before any write
    rt = doctor.setup_checked(cfg, env, environ)  # distributed.setup inside the quick preflight checks
    try:
        log.info("%s pid=%d", env.describe(rt.backend), os.getpid())
        if rt.device.type == "cpu" and cfg.dist.backend == "auto":
            log.info("no GPU visible: training on CPU with gloo") if env.is_main else None
        with observe.explain_timeouts(cfg, env):  # a collective timeout names the stalled rank
            return run(cfg, env, plan, rt, found)
    finally:
        distributed.teardown()


def run(cfg: JobConfig, env: DistEnv, plan: Plan, rt: distributed.Runtime, found: ckpt.Found | None = None) -> int:
    run_dir = cfg.run_dir
    device = rt.device
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        log.info("plan: %s", plan.describe())
    stop = StopRequest(run_dir)
    # torchrun --max-restarts restarts workers after ANY non-zero exit, 143 included: a restarted group that
    # finds the stop file must not delete it as stale and train on while its node is being drained.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted and distributed.all_reduce_max_flag(stop.stop_file.exists(), rt):
        log.info("stop file %s present after a worker-group restart: exiting %d without training", stop.stop_file, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    if env.is_main:
        stop.clear_stale_file()
    distributed.barrier(rt)
    stop.install(cfg.train.stop_signals)
    stop.where = "start-up (before the first step)"

    # --- data ---
    distributed.seed_all(cfg.run.seed)
    loaders = build_loaders(cfg.data, env.rank, env.world_size, plan.micro_batch_size, cfg.run.seed, device,
                            plan.grad_accum_steps)
    loaders = wrap_loaders(loaders, device, cfg.data.device_prefetch, cfg.model.channels_last)

    # --- model ---
    torch.manual_seed(cfg.run.seed)  # identical init everywhere (DDP also broadcasts rank 0's weights)
    raw_model = build_model(cfg.model, cfg.data.num_classes).to(device)
    model = parallel.wrap_model(raw_model, cfg, rt)  # DDP with its knobs/comm hook, or the dp baseline
    train_model: nn.Module = torch.compile(model, mode=cfg.model.compile_mode) if cfg.model.compile else model

    # --- optimizer ---
    optimizer = build_optimizer(raw_model, cfg.optim, plan.lr, device)
    scheduler = build_scheduler(optimizer, cfg.sched, plan.total_steps)
    ema = build_ema(raw_model, cfg.ema)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)

    # --- checkpoint: resume ---
    async_save = cfg.ckpt.async_save == "on" or (cfg.ckpt.async_save == "auto" and device.type == "cuda")
    manager = ckpt.CheckpointManager(run_dir, cfg.ckpt.keep_last, async_save, env.is_main, cfg.ckpt.debug_write_delay_s)
    manager.clean_stale_tmp()
    stop.busy = manager.in_flight
    state = TrainState()
    saved_step = [-1]  # decided identically on every rank (save() runs a collective)
    agree_on_checkpoint(found, rt.control_group)
    if found is not None:
        saved = ckpt.load_state(found)
        raw_model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
        ema.load(saved.get("ema")) if ema is not None else None
        state = TrainState(**saved["trainer"])
        if saved["world_size"] != env.world_size:  # allowed by check_resumable: same samples, new split
            state.micro_batches_in_epoch = map_data_position(saved["trainer"], saved["trainer_plan"], env.world_size, plan.micro_batch_size)
        if saved["trainer_plan"]["total_steps"] == plan.total_steps:
            scheduler.load_state_dict(saved["scheduler"])
        else:  # a new horizon (e.g. --train.steps raised): replay the schedule for it
            for _ in range(state.step):
                scheduler.step()
        if saved["world_size"] == env.world_size:
            set_rng_state(saved["rng"][env.rank])
        saved_step[0] = found.step
        log.info("resumed from %s (step %d, epoch %d)", found.path, state.step, state.epoch)
    del found

    # --- logging ---
    writer = metrics.build_writer(cfg.log.tensorboard, env.is_main, run_dir)
    writer.text("config", "```\n" + dump_config(cfg) + "\n```", state.step)
    observer = observe.Observer(cfg, env, rt.control_group, raw_model, device, plan.global_batch_size, writer, state.step)

    def save(step: int) -> None:
        saved_step[0] = step
        parallel.before_save(optimizer)  # ZeRO: gather the optimizer state shards to rank 0 (a collective)
        rngs: list[Any] = [None] * env.world_size
        dist.all_gather_object(rngs, rng_state(device), group=rt.control_group)
        meta = {"world_size": env.world_size, "config": config_to_dict(cfg), "torch": torch.__version__,
                "trainer": asdict(state), "plan": asdict(plan)}  # what preflight checks a resume against
        manager.save(step, lambda: {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "trainer": asdict(state),
            "trainer_plan": asdict(plan),
            "world_size": env.world_size,
            "rng": rngs,
            "ema": ema.state_dict() if ema is not None else None,
        }, meta)

    # --- loop ---
    batches = _batches(loaders, state)
    autocast = _autocast(cfg.train.precision, device)
    timer = metrics.StepTimer()
    loss_sum = torch.zeros((), device=device)
    first_step_done = False
    exit_code = EXIT_OK
    progress = _progress(cfg, env, state.step, plan.total_steps)
    while state.step < plan.total_steps:
        timer.start_step()
        model.train()
        step_loss = torch.zeros((), device=device)
        for micro in range(plan.grad_accum_steps):
            stop.where = f"step {state.step + 1} micro-batch {micro + 1}/{plan.grad_accum_steps}"
            t0 = time.perf_counter()
            images, labels = to_device(next(batches), device, cfg.model.channels_last)
            timer.add_data_wait(time.perf_counter() - t0)
            # Gradients are all-reduced only on the last micro-step: no_sync() on the others.
            sync = contextlib.nullcontext() if micro == plan.grad_accum_steps - 1 else model.no_sync()
            with sync:
                with autocast:
                    loss = criterion(train_model(images), labels) / plan.grad_accum_steps
                if state.step + 1 in cfg.train.inject_nan_at_steps:
                    loss = loss * float("nan")
                scaler.scale(loss).backward()
            step_loss += loss.detach()
        scaler.unscale_(optimizer)
        if cfg.train.grad_clip_norm > 0:
            grad_norm = nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.train.grad_clip_norm, foreach=True)
        else:  # the norm alone (logged, finite check): clip_grad_norm_ with inf would also rescale every gradient by 1
            grad_norm = nn.utils.get_total_norm([p.grad for p in raw_model.parameters() if p.grad is not None], foreach=True)
        # One host sync per step: every rank holds the same all-reduced gradients, so all decide alike.
        finite = bool(torch.isfinite(grad_norm) & torch.isfinite(step_loss))
        if finite or scaler.is_enabled():
            scaler.step(optimizer)  # with fp16 the scaler itself skips non-finite steps
        else:
            state.nonfinite_skips += 1
            log.warning("step %d: non-finite loss or gradient norm; update skipped (%d/%d)",
                        state.step + 1, state.nonfinite_skips, cfg.train.max_nonfinite_skips)
            if state.nonfinite_skips > cfg.train.max_nonfinite_skips:
                raise NonFiniteError(
                    f"step {state.step + 1}: more than train.max_nonfinite_skips={cfg.train.max_nonfinite_skips} "
                    f"updates skipped for non-finite loss/gradients.",
                    "lower optim.lr, enable train.grad_clip_norm, or check the data. The newest checkpoint holds "
                    "only finite values.", setting="train.max_nonfinite_skips", value=cfg.train.max_nonfinite_skips)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        state.step += 1
        stop.where = f"the bookkeeping after step {state.step}"
        ema.update(raw_model, state.step) if ema is not None else None
        state.samples_seen += plan.global_batch_size
        timer.end_step()
        observer.step_done(state.step, timer)  # straggler/throughput/memory stats, profiler window, progress file
        if finite:
            loss_sum += step_loss
        if not first_step_done:
            distributed.set_train_timeout(rt, cfg.dist.train_timeout_s)
            first_step_done = True
        progress.update(1) if progress else None

        if state.step % cfg.log.every == 0 or state.step == plan.total_steps:
            scalars = {
                "train/loss": loss_sum.item() / max(timer.steps, 1),
                "train/lr": optimizer.param_groups[0]["lr"],
                "train/grad_norm": float(grad_norm),
                "perf/peak_memory_mb": metrics.peak_memory_mb(device),
                **timer.summary(plan.global_batch_size),
            }
            writer.scalars(state.step, scalars)
            log.info("step %d/%d loss %.4f lr %.4g %.1f samples/s data-wait %.1f%%", state.step, plan.total_steps,
                     scalars["train/loss"], scalars["train/lr"], scalars["perf/samples_per_s"], 100 * scalars["perf/data_wait_frac"])
            loss_sum.zero_()
            timer.reset()
        if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and state.step < plan.total_steps:
            writer.scalars(state.step, evaluate(raw_model, loaders.val, device, cfg, autocast))
            if ema is not None:
                writer.scalars(state.step, {f"ema/{k}": v for k, v in evaluate(ema.module, loaders.val, device, cfg, autocast).items()})
        # --- checkpoint / preemption, at the step boundary, the same step on every rank ---
        stop.where = f"the boundary after step {state.step}"
        if distributed.all_reduce_max_flag(stop.local(), rt):
            log.info("stop requested (%s): saving at step %d and exiting %d", stop.reason(), state.step, EXIT_PREEMPTED)
            save(state.step)
            # torchrun SIGTERMs the other workers as soon as one exits non-zero, and SIGKILLs them 30 s later:
            # nobody exits before rank 0's checkpoint is on disk.
            manager.wait()
            distributed.barrier(rt)
            exit_code = EXIT_PREEMPTED
            break
        if cfg.ckpt.every and state.step % cfg.ckpt.every == 0 and state.step < plan.total_steps:
            save(state.step)

    if progress:
        progress.close()
    if exit_code == EXIT_OK:
        results = evaluate(raw_model, loaders.val, device, cfg, autocast)
        if ema is not None:
            results.update({f"ema/{k}": v for k, v in evaluate(ema.module, loaders.val, device, cfg, autocast).items()})
            log.info("EMA val_top1=%.4f val_loss=%.4f", results["ema/val/top1"], results["ema/val/loss"]) if env.is_main else None
        writer.scalars(state.step, results)
        comm = parallel.comm_summary(model, plan.grad_accum_steps)
        if comm and env.is_main:
            log.info(comm)
        if saved_step[0] != state.step:
            save(state.step)
        writer.hparams(metrics.flatten(config_to_dict(cfg)), {"hparam/" + k: v for k, v in results.items()})
        if env.is_main:
            print(f"FINAL step={state.step} val_top1={results['val/top1']:.4f} val_top5={results['val/top5']:.4f} "
                  f"val_loss={results['val/loss']:.4f} val_count={int(results['val/count'])} run_dir={run_dir} tensorboard={run_dir / 'tb'}", flush=True)
    manager.wait()
    observer.close()
    writer.close()
    stop.restore()
    return exit_code


def _batches(loaders: Any, state: TrainState) -> Iterator[Any]:
    """Endless micro-batches for this rank, advancing ``state.epoch``/``micro_batches_in_epoch`` as consumed."""
    sampler = loaders.train_sampler
    while True:
        sampler.set_position(state.epoch, state.micro_batches_in_epoch)
        for batch in loaders.train:
            state.micro_batches_in_epoch += 1
            yield batch
        state.epoch += 1
        state.micro_batches_in_epoch = 0


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _progress(cfg: JobConfig, env: DistEnv, start: int, total: int) -> Any:
    import sys

    enabled = cfg.log.progress == "on" or (cfg.log.progress == "auto" and sys.stdout.isatty())
    if not (enabled and env.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, device: torch.device, cfg: JobConfig, autocast: Any) -> dict[str, float]:
    """Exact over all ranks: each rank holds a disjoint shard; sums and counts are all-reduced, never means.

    Runs the unwrapped model: shards may differ in length, and DDP's forward would broadcast buffers, a
    collective every rank must join the same number of times.
    """
    was_training = model.training
    model.eval()
    k = min(5, cfg.data.num_classes)
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss_sum, top1, topk, count
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for batch in loader:
        images, labels = to_device(batch, device, cfg.model.channels_last)
        with autocast:
            logits = model(images)
        logits = logits.float()
        topk = logits.topk(k, dim=1).indices
        totals[0] += criterion(logits, labels).double()
        totals[1] += (topk[:, 0] == labels).sum()
        totals[2] += (topk == labels[:, None]).any(dim=1).sum()
        totals[3] += labels.numel()
    dist.all_reduce(totals)
    loss_sum, top1, topk_hits, count = totals.tolist()
    model.train(was_training)
    count = max(count, 1.0)
    return {"val/loss": loss_sum / count, "val/top1": top1 / count, "val/top5": topk_hits / count, "val/count": count}
