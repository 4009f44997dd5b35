"""The training job, top to bottom as the data flows, in one pass down the package:

config -> environment -> preflight (no process group, no writes) -> process group -> quick doctor checks
-> parts (data, model, optimizer) -> restore -> loop (step, log, eval, stop, checkpoint) -> final report.

``main(argv)`` is what ``ddp-job train`` and ``python -m job train`` run, as a torchrun worker or a
single plain process. Everything that can be wrong with the input is checked before any process group
or device work, and before anything is written to the run directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from job.checkpoint import cadence
from job.checkpoint import store as ckpt
from job.checkpoint.checkpointer import Checkpointer
from job.checkpoint.resume import check_resumable, find_resume, older_than, settle
from job.checkpoint.sharded import Sharded
from job.checkpoint.states import Layout, OptimizerState, Progress, RngStates, Schedule, States
from job.cluster import gpu
from job.cluster.env import DistEnv, detect_env, interruptions, stop_notice_s
from job.cluster.stop import clear_record
from job.config import JobConfig, config_to_dict, dump_config, load_config
from job.config.load import run_and_attempt
from job.config.plan import Plan, make_plan
from job.doctor import phases as doctor
from job.errors import EXIT_PREEMPTED, BadInput, CorruptCheckpointError
from job.observe import metrics, report, trackers
from job.observe import observer as observe
from job.parallel import ddp as parallel
from job.parallel import distributed, fsdp, memory
from job.tasks.contract import Bound
from job.tasks.load import load_task
from job.tasks.preflight import Checked, check_task
from job.train import debug, early_stop
from job.train.evaluate import Evaluator, StopPoll
from job.train.loop import Run, train_loop
from job.train.parts import Parts, build_parts
from job.train.preempt import StopRequest, attempt_age_s
from job.train.step import TrainState

log = logging.getLogger("job")


@dataclass(frozen=True)
class Preflight:
    """What preflight computed, once, for the run: nothing here is computed again."""

    plan: Plan
    task: Bound
    checked: Checked
    found: ckpt.Found | None
    """The checkpoint to resume from (None: a fresh run)."""


def preflight(cfg: JobConfig, env: DistEnv) -> Preflight:
    """Every check that needs no process group, device or write: bad input fails here with exit 2, before
    the doctor's quick checks (which write doctor.json) and before run() writes config.yaml."""
    cuda = torch.cuda.is_available()
    gpu.check_node(os.environ)  # a GPU node whose CUDA is unusable would train on the CPU
    plan = make_plan(cfg, env.world_size)
    parallel.validate(cfg, env.world_size, cuda, env.local_world_size)
    if cfg.train.precision == "fp16" and not cuda:
        raise BadInput(
            "train.precision='fp16' needs CUDA (fp16 autocast on CPU is not supported).",
            "use bf16 or fp32 on CPU.",
            setting="train.precision",
            value="fp16",
        )
    _check_run_dir(cfg)
    trackers.check(cfg, os.environ)
    if cfg.ckpt.every == "auto":
        cadence.check_grace(*grace(cfg), cfg.debug.ckpt_write_delay_s)
    found = find_resume(cfg, env.world_size, plan.micro_batch_size)  # refusals exit 2 before any write
    if found is not None and cfg.model.weights and env.is_main:
        log.info("resuming: model.weights=%s is not loaded (the checkpoint holds the weights)", cfg.model.weights)
    task = load_task(cfg)
    checked = check_task(task, cfg, env, plan, cuda, load_weights=found is None)
    early_stop.check(cfg, task, checked.metric_names)
    fsdp.check_units(checked.model, cfg, task)
    if cfg.doctor.enabled:
        check_memory(cfg, env, task, checked, cuda)
    return Preflight(plan, task, checked, found)


def memory_estimates(
    cfg: JobConfig, world_size: int, task: Bound, checked: Checked, local_world_size: int
) -> tuple[memory.MemoryEstimate, memory.MemoryEstimate] | None:
    """(ddp, fsdp) bytes per device of the model preflight built, activations scaled from the preflight batch to
    one micro-batch, fsdp on the run's mesh (HSDP across nodes: job.parallel.fsdp.mesh_shape); None under dp (one
    process, many GPUs: no per-device arithmetic here)."""
    if cfg.train.strategy == "dp":
        return None
    plan = make_plan(cfg, world_size)
    try:
        units = fsdp.unit_modules(checked.model, cfg, task)
    except BadInput:  # units that do not exist under ddp: fsdp would refuse them (check_units)
        units = []
    activations = round(checked.saved_bytes_per_item * plan.micro_batch_size)
    _, shard_degree = fsdp.mesh_shape(cfg.fsdp, world_size, local_world_size)
    setup = memory.setup_of(cfg, world_size, plan.grad_accum_steps, shard_degree)
    return memory.both(checked.model, units, setup, activations)


def check_memory(cfg: JobConfig, env: DistEnv, task: Bound, checked: Checked, cuda: bool) -> None:
    """The doctor's memory verdict, before any process group: a ddp run that cannot fit its device where fsdp
    would is exit 2 naming train.strategy (job.parallel.memory.require_fits)."""
    estimates = memory_estimates(cfg, env.world_size, task, checked, env.local_world_size)
    if estimates is None:
        return
    try:
        device = distributed.pick_device(env, distributed.pick_backend(cfg.dist, cuda))
    except BadInput:  # no device for this rank: the doctor's topology check names it
        return
    memory.require_fits(cfg.train.strategy, *estimates, memory.capacity_bytes(device, env.local_world_size))


def _check_run_dir(cfg: JobConfig) -> None:
    run_dir = cfg.run_dir
    existing = next((p for p in [run_dir, *run_dir.parents] if p.exists()), None)
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK)):
        raise BadInput(
            f"run directory {run_dir} cannot be created or written ({existing} is not a writable directory).",
            "set run.output_dir (--run.output-dir / JOB_RUN__OUTPUT_DIR) to a writable directory.",
            setting="run.output_dir",
            value=cfg.run.output_dir,
        )


def preflight_probes(pre: Preflight | None = None) -> doctor.Probes:
    """What the doctor checks of this job's model and data, handed to it (the doctor imports neither): what
    ``pre`` computed, else (``ddp-job doctor``) the config's task built on the meta device."""
    if pre is not None:
        checked, task = pre.checked, pre.task
        return doctor.Probes(
            build_model=lambda _cfg: checked.model,
            describe_data=lambda _cfg: checked.data,
            memory=lambda cfg, world_size, local: memory_estimates(cfg, world_size, task, checked, local),
        )
    once: dict[str, tuple[Bound, Checked]] = {}

    def checked_task(cfg: JobConfig) -> tuple[Bound, Checked]:
        """The task checked as train's preflight checks it, once for the data and the memory checks."""
        if not once:
            task = load_task(cfg)
            once["task"] = task, check_task(task, cfg, detect_env({}), make_plan(cfg, 1), torch.cuda.is_available())
        return once["task"]

    return doctor.Probes(
        build_model=_meta_model,
        describe_data=lambda cfg: checked_task(cfg)[1].data,
        memory=lambda cfg, world_size, local: memory_estimates(cfg, world_size, *checked_task(cfg), local),
    )


def _meta_model(cfg: JobConfig) -> Any:
    task = load_task(cfg)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return task.build_model()


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None, cfg: JobConfig | None = None) -> int:
    """``cfg``: the config of ``argv`` when the caller parsed it already (the command line does)."""
    environ = os.environ if environ is None else environ
    # --- config ---
    if cfg is None:
        cfg = load_config(argv, environ)
    # --- environment / rendezvous ---
    env = detect_env(environ)
    metrics.setup_console(env.rank, env.world_size)
    pre = preflight(cfg, env)
    quick = None
    if cfg.doctor.enabled:  # the doctor's quick checks, around the process group created here
        quick = doctor.quick_local(cfg, env, environ, preflight_probes(pre))
    os.environ.update(distributed.flight_recorder_env(os.environ, cfg.run_dir))  # read at process-group creation
    rt = distributed.setup(env, cfg.dist)
    try:
        if quick is not None:
            doctor.quick_group(cfg, env, rt, quick)
        log.info("%s pid=%d", env.describe(rt.backend), os.getpid())
        if rt.device.type == "cpu" and cfg.dist.backend == "auto" and env.is_main:
            log.info("no GPU visible: training on CPU with gloo")
        with observe.explain_timeouts(cfg, env):  # a collective timeout names the stalled rank
            return run(cfg, env, pre, rt)
    finally:
        distributed.teardown()


def run(cfg: JobConfig, env: DistEnv, pre: Preflight, rt: distributed.Runtime) -> int:
    """Build the run, restore it, train. Cleanup (signal handlers, writers, an in-flight save) runs on every
    exit path, exceptions included."""
    stop = StopRequest(cfg.run_dir, cfg.train.max_time_s, attempt_age_s(os.environ))
    if _drained_after_restart(stop, rt):
        return EXIT_PREEMPTED
    pre = settle_resume(cfg, env, pre, rt)
    start_run_dir(cfg, env, pre.plan, stop, rt)
    with contextlib.ExitStack() as cleanup:
        return train_loop(build_run(cfg, env, pre, rt, stop, cleanup))


def settle_resume(cfg: JobConfig, env: DistEnv, pre: Preflight, rt: distributed.Runtime) -> Preflight:
    """``pre`` with the checkpoint preflight found (by sizes) hashed by all ranks together, or the older one every
    rank falls back to where a rank found a file corrupt (job.checkpoint.resume.settle); before anything is written."""

    def resumable(found: ckpt.Found) -> None:
        check_resumable(found.manifest, cfg, env.world_size, pre.plan.micro_batch_size)

    found = settle(pre.found, cfg.run_dir, env.rank, env.world_size, rt.control_group, resumable)
    return replace(pre, found=found)


def restore(
    checkpointer: Checkpointer, found: ckpt.Found, cfg: JobConfig, env: DistEnv, plan: Plan, rt: distributed.Runtime
) -> None:
    """Restore ``found``, or, where every rank refused one of its shards as it read it, the newest older checkpoint
    that loads (each is verified as it is read: job.checkpoint.verified)."""

    def resumable(older: ckpt.Found) -> None:
        check_resumable(older.manifest, cfg, env.world_size, plan.micro_batch_size)

    while True:
        try:
            checkpointer.restore(found)
            return
        except CorruptCheckpointError as e:
            older = older_than(found, cfg.run_dir, e.found, resumable)
            found = settle(older, cfg.run_dir, env.rank, env.world_size, rt.control_group, resumable)


def build_run(
    cfg: JobConfig,
    env: DistEnv,
    pre: Preflight,
    rt: distributed.Runtime,
    stop: StopRequest,
    cleanup: contextlib.ExitStack,
) -> Run:
    """Every part of the loop, restored from ``pre.found``; what needs closing is registered on ``cleanup``."""
    plan, found = pre.plan, pre.found
    stop.install(cfg.train.stop_signals)
    cleanup.callback(stop.restore)
    stop.where = "start-up (before the first step)"
    parts = build_parts(cfg, env, plan, rt, pre.task, pre.checked, initial_weights=found is None)
    state = TrainState()
    counter = _early_stop(cfg, env, plan, rt, pre.task, parts.metric_names)
    debug.install(cfg.debug, env.rank, parts, state)
    sinks = trackers.build(cfg, env, found is not None, os.environ)
    writer = cleanup.enter_context(
        contextlib.closing(metrics.build_writer(cfg.log.tensorboard, env.is_main, cfg.run_dir, cfg.log.jsonl, sinks))
    )
    checkpointer = _checkpointer(cfg, env, plan, rt, parts, state, writer, counter)
    debug.install_checkpoint(cfg.debug, env.rank, checkpointer)
    cleanup.callback(checkpointer.manager.close)
    stop.busy = checkpointer.manager.in_flight
    if found is not None:
        restore(checkpointer, found, cfg, env, pre.plan, rt)
    checkpointer.start(state.step)
    writer.text("config", "```\n" + dump_config(cfg) + "\n```", state.step)
    observer = observe.Observer(
        cfg,
        env,
        rt.control_group,
        parts.raw_model,
        parts.device,
        plan.global_batch_size,
        writer,
        state.step,
        parts.task.flops_per_item(),
    )
    cleanup.callback(observer.close)
    checkpointer.mark = observer.mark
    progress = _progress(cfg, env, state.step, plan.total_steps)
    if progress is not None:
        cleanup.callback(progress.close)
    train_log = metrics.TrainLog(
        cfg.log.every, plan.total_steps, plan.global_batch_size, parts.device, writer, observer, progress
    )
    evaluator = Evaluator(parts, cfg.train.eval_every, plan.total_steps, writer, observer.mark, env.is_main)
    evaluator.poll = StopPoll(stop.local, rt.control_group)  # a stop request ends an evaluation at a batch boundary
    batches = parts.loaders.batches(state)
    cleanup.callback(batches.close)  # ends the data pipeline's threads (job.data.decode_ahead) on every exit
    vote = distributed.StepFlagVote(rt)
    reporter = report.build_reporter(cfg, env, os.environ)
    cleanup.callback(reporter.close)  # a run that ends in an error still sends its newest status, bounded
    pace = report.Pace(plan.total_steps)
    return Run(
        cfg,
        env,
        plan,
        rt,
        parts,
        state,
        batches,
        stop,
        checkpointer,
        evaluator,
        train_log,
        writer,
        vote,
        reporter,
        pace,
        counter,
    )


def _early_stop(
    cfg: JobConfig, env: DistEnv, plan: Plan, rt: distributed.Runtime, task: Bound, metric_names: tuple[str, ...]
) -> early_stop.EarlyStop:
    """``train.early_stop``'s count, its metric checked again: on the meta device it is known only once the model
    is materialised (job.tasks.preflight.check_values)."""
    early_stop.check(cfg, task, metric_names)
    return early_stop.EarlyStop(
        cfg.train.early_stop,
        plan.total_steps,
        task.name,
        env.is_main,
        agree=lambda values: distributed.broadcast_from_main(values, rt),
    )


def _drained_after_restart(stop: StopRequest, rt: distributed.Runtime) -> bool:
    """torchrun --max-restarts restarts workers after ANY non-zero exit, 143 included: a restarted group that
    finds the stop file must not train on while its node is being drained (job.cluster.stop)."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted and distributed.all_reduce_max_flag(stop.stop_file.exists(), rt):
        log.info(
            "stop file %s present after a worker-group restart: exiting %d without training",
            stop.stop_file,
            EXIT_PREEMPTED,
        )
        return True
    return False


def start_run_dir(cfg: JobConfig, env: DistEnv, plan: Plan, stop: StopRequest, rt: distributed.Runtime) -> None:
    """Rank 0 creates the run directory and writes the resolved config (``config.yaml``: the run; ``attempt.yaml``:
    how this attempt was launched); every rank waits for it."""
    if env.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        run_yaml, attempt_yaml = run_and_attempt(cfg)
        (cfg.run_dir / "config.yaml").write_text(run_yaml)
        (cfg.run_dir / "attempt.yaml").write_text(attempt_yaml)
        log.info("plan: %s", plan.describe())
        stop.discard_honoured()
        clear_record(cfg.run_dir)  # a record speaks only for the attempt that wrote it (job.cluster.stop)
    distributed.barrier(rt)


def _checkpointer(
    cfg: JobConfig,
    env: DistEnv,
    plan: Plan,
    rt: distributed.Runtime,
    parts: Parts,
    state: TrainState,
    writer: metrics.NullWriter,
    counter: early_stop.EarlyStop,
) -> Checkpointer:
    """The checkpoint registry (one line per stateful part, in restore order) and its cadence."""
    layout = Layout(env.world_size, plan)
    states = States()
    states.add("layout", layout)
    states.add("trainer", Progress(state, layout, plan.micro_batch_size))
    # Model, optimizer and EMA: every rank's own shards, under either strategy (job.checkpoint.sharded). Under
    # optim.zero the optimizer's state is consolidated on rank 0 into state.pt (job.parallel.ddp.before_save).
    sharded_optimizer = None if cfg.optim.zero else parts.optimizer
    fail = cfg.debug.fail_load_rank == env.rank
    sharded = Sharded(parts.raw_model, sharded_optimizer, env.rank, rt.control_group, fail, parts.ema)
    if cfg.optim.zero:
        states.add("optimizer", OptimizerState(parts.optimizer, parallel.before_save))
    states.add("scheduler", Schedule(parts.scheduler, layout, state))
    states.add("scaler", parts.scaler)
    states.add("rng", RngStates(parts.device, env.rank, env.world_size, rt.control_group, layout))
    if parts.task.stateful():  # the task's own state: a teacher, a memory bank, a curriculum counter
        states.add("task", parts.task.task)
    states.add("early_stop", counter, optional=True)  # absent from a checkpoint written before early stopping
    async_save = cfg.ckpt.async_save == "on" or (cfg.ckpt.async_save == "auto" and parts.device.type == "cuda")
    manager = ckpt.CheckpointManager(
        cfg.run_dir, cfg.ckpt.keep_last, async_save, env.is_main, cfg.debug.ckpt_write_delay_s, sharded
    )
    manager.clean_stale_tmp()

    def meta() -> dict[str, Any]:  # what preflight checks a resume against, readable without loading state.pt
        return {
            "world_size": env.world_size,
            "config": config_to_dict(cfg),
            "torch": torch.__version__,
            "trainer": asdict(state),
            "plan": asdict(plan),
        }

    return Checkpointer(manager, states, _cadence(cfg, rt, writer), plan.total_steps, meta)


def _cadence(cfg: JobConfig, rt: distributed.Runtime, writer: metrics.NullWriter) -> cadence.Fixed | cadence.Auto:
    if cfg.ckpt.every != "auto":
        return cadence.Fixed(cfg.ckpt.every)
    return cadence.Auto(
        cfg.ckpt.mtbf_s,
        interruptions(os.environ),
        grace(cfg)[0],
        agree=lambda values: distributed.broadcast_from_main(values, rt),
        report=writer.scalars,
    )


def grace(cfg: JobConfig) -> tuple[float, str]:
    """The stop notice a save must fit in and where it comes from: ``ckpt.grace_s`` where set, else what the
    launcher states (0: unknown)."""
    return stop_notice_s(cfg.ckpt.grace_s, os.environ)


def _progress(cfg: JobConfig, env: DistEnv, start: int, total: int) -> Any:
    enabled = cfg.log.progress == "on" or (cfg.log.progress == "auto" and sys.stdout.isatty())
    if not (enabled and env.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
