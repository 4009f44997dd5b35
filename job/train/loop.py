"""The training loop: a step, then each component at its own cadence, then the stop check at the boundary."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from job.checkpoint.checkpointer import Checkpointer
from job.cluster import stop as stop_protocol
from job.cluster.env import DistEnv
from job.config import JobConfig, config_to_dict
from job.config.plan import Plan
from job.errors import EXIT_OK, EXIT_PREEMPTED, BadInput, EvaluationStopped, FailedAfterStart
from job.observe.metrics import NullWriter, TrainLog, hparams
from job.observe.report import NullReporter, Pace, reported_metrics
from job.observe.status import COMPLETED, Status
from job.observe.status import EARLY_STOP as EARLY_STOP_REASON
from job.observe.watchdog import Watchdog
from job.parallel import ddp, distributed
from job.train.early_stop import EarlyStop
from job.train.evaluate import Evaluator, StopPoll, metric_values
from job.train.parts import Parts
from job.train.preempt import StopRequest
from job.train.step import TrainState, train_step

log = logging.getLogger("job")


@dataclass
class Run:
    """Everything the loop touches; built by ``job.train.run``."""

    cfg: JobConfig
    env: DistEnv
    plan: Plan
    rt: distributed.Runtime
    parts: Parts
    state: TrainState
    batches: Iterator[Any]
    stop: StopRequest
    checkpointer: Checkpointer
    evaluator: Evaluator
    log: TrainLog
    writer: NullWriter
    stop_vote: distributed.StepFlagVote
    reporter: NullReporter
    """Rank 0's progress reports (job.observe.report); a null one on the other ranks."""
    pace: Pace
    early_stop: EarlyStop
    """``train.early_stop``'s count, the same on every rank (job.train.early_stop)."""
    watchdog: Watchdog | None = None
    """Armed around each step once the first step is done (job.observe.watchdog)."""


class End(Enum):
    """Why the loop ends before ``plan.total_steps`` (``iteration`` returns None to go on)."""

    STOP = "stop"
    """The ranks agreed to stop: the stop save, the stop record, 143 (``preempted``); on the last step the run
    is finished instead (``finish``): nothing is left to resume."""
    EARLY_STOP = EARLY_STOP_REASON
    """``train.early_stop``'s metric ran out of patience at this step's evaluation: the run is finished (``finish``)."""


def train_loop(run: Run) -> int:
    """Train to ``plan.total_steps``, to an early stop or to a stop request; returns the exit code (0, or 143 after
    saving)."""
    first_step = run.state.step + 1
    try:
        end = resumed(run)
        if end is End.STOP:  # during the resumed step's evaluation: its checkpoint is the one resumed from
            return preempted(run)
        while end is not End.EARLY_STOP and run.state.step < run.plan.total_steps:
            end = iteration(run)
            if run.state.step == first_step:  # rendezvous, compile and warm-up are over: fail fast from now on
                _first_step_done(run)
            if end is End.STOP and run.state.step < run.plan.total_steps:
                return preempted(run)
        return finish(run, end)
    except BadInput as e:  # training started: checkpoints may be on storage, never "nothing written" (2)
        raise FailedAfterStart.of(e, run.state.step) from e
    finally:
        if run.watchdog is not None:
            run.watchdog.close()


def resumed(run: Run) -> End | None:
    """Before the first step of an attempt: the evaluation of the step resumed from where it was due but its stop
    save came first, counted now as the uninterrupted run counted it; ``End.EARLY_STOP`` where the count is spent
    (a run that stopped early, run again, finishes at once)."""
    step = run.state.step
    if run.early_stop.missed(step) and run.evaluator.due(step):
        try:
            run.evaluator.after_step(step)
        except EvaluationStopped:
            return End.STOP
    if early_stopped(run):
        return End.EARLY_STOP
    return None


def early_stopped(run: Run) -> bool:
    """After the step's evaluation, if one was made: whether ``train.early_stop`` ends the run. Every rank judges
    rank 0's value (job.train.early_stop), so every rank ends after the same step."""
    step = run.state.step
    if run.evaluator.latest_step == step:
        return run.early_stop.judge(step, run.evaluator.latest)
    return run.early_stop.stopped


def _first_step_done(run: Run) -> None:
    """From the first step of an attempt on, a kill loses steps (the launcher reads the mark) and collectives fail
    fast."""
    if run.env.is_main:
        stop_protocol.mark_trained(run.cfg.run_dir, run.state.step)
    _fail_fast(run)


def _fail_fast(run: Run) -> None:
    """The short collective timeout, and the watchdog that reports a stall before NCCL aborts the process."""
    timeout = run.cfg.dist.train_timeout_s
    distributed.set_train_timeout(run.rt, timeout)
    run.watchdog = Watchdog(run.stop, timeout, run.cfg.run_dir, run.env.rank, run.env.world_size)


def iteration(run: Run) -> End | None:
    """One pass of the loop: the step, the stop vote, then each component at its cadence; why the loop ends, or
    None to go on. A stopping step is neither evaluated nor saved periodically: its checkpoint is the stop save's."""
    state, parts = run.state, run.parts
    run.log.before_step()
    if run.watchdog is not None:
        run.watchdog.arm()
    run.stop_vote.start(run.stop.local())
    lr = parts.optimizer.param_groups[0]["lr"]  # the step's own rate: train_step steps the scheduler at its end
    out = train_step(parts, run.batches, run.plan, state, run.cfg.train, run.stop)
    if run.log.due(state.step) or run.checkpointer.due(state.step):  # the count is saved and logged up to date
        parts.guard.check(state.step, state)
    run.log.after_step(state.step, out, lr)
    if run.watchdog is not None:
        # Evaluation and checkpoints take as long as they take; the stop vote is on gloo, which raises on timeout.
        run.watchdog.disarm()
    if stop_agreed(run):  # before the evaluation and the periodic save: the stop save must fit the grace period
        return End.STOP
    try:
        run.evaluator.after_step(state.step)
    except EvaluationStopped:  # a request made during the step or the evaluation: its save comes next
        return End.STOP
    if early_stopped(run):  # its checkpoint is the final one (finish)
        return End.EARLY_STOP
    run.checkpointer.after_step(state.step)
    if state.step < run.plan.total_steps:  # the last step's record takes the final evaluation first (finish)
        run.writer.commit()  # the step's record, complete: every component has added its values
    if run.log.due(state.step):  # after the step's save: a synchronous one is already on storage
        run.reporter.update(status(run))
    return None


def status(run: Run, end: str | None = None) -> Status:
    """The run's status now, from host values only: the log step's scalars, the newest evaluation, the newest
    checkpoint on storage; ``end``: why the run finished (job.observe.status: ``COMPLETED``, ``EARLY_STOP``), None
    while it runs."""
    metrics = reported_metrics(run.log.latest, run.evaluator.latest)
    window_step_s = run.log.latest.get("perf/step_time_s", 0.0)
    return run.pace.status(run.state.step, window_step_s, metrics, run.checkpointer.committed(), end)


def stop_agreed(run: Run) -> bool:
    """At the step boundary, on every rank: stop if any rank had been asked to when the step began (the same
    step everywhere; a request that arrives during the step stops the run after the next one)."""
    run.stop.where = f"the boundary after step {run.state.step}"
    return run.stop_vote.agreed()


def preempted(run: Run) -> int:
    """The stop save of the agreed step, then the stop record (rank 0, once the save is on storage: what every
    launcher reads to tell "saved, requeue me" from a lost save), then exit 143 on every rank."""
    step = run.state.step
    with run.stop.saving():
        run.parts.guard.check(step, run.state)
        reasons = distributed.any_flags(run.stop.reasons(), run.rt)
        log.info("stop requested (%s): saving at step %d and exiting %d", run.stop.reason(), step, EXIT_PREEMPTED)
        if run.checkpointer.saved_step != step:  # else saved already: a stop during the final evaluation (finish)
            run.checkpointer.save(step, stop=True)
        run.writer.commit()
        # torchrun SIGTERMs the other workers as soon as one exits non-zero, and SIGKILLs them 30 s later:
        # nobody exits before rank 0's checkpoint is on disk.
        run.checkpointer.manager.wait()
        run.reporter.close(status(run))
        if run.env.is_main:
            run.stop.record(step, reasons)
            if run.env.launcher == "single":  # no launcher to requeue it: the user resumes it
                log.info("the stop save of step %d is on storage: run the same command again to resume from it", step)
        distributed.barrier(run.rt)
    return EXIT_PREEMPTED


def finish(run: Run, end: End | None = None) -> int:
    """The end of a completed run (``train.steps`` reached, or ``end``: an early stop): final evaluation, the last
    checkpoint, the FINAL line; or, when a stop request arrives during the final evaluation, the stop save of the
    last step and 143 (the next attempt only evaluates).

    A request made before (the last step's stop vote, or during that step) is answered by finishing: the last
    checkpoint is then saved first, so that the training is on storage within the notice even if the final
    evaluation is not."""
    step, is_main = run.state.step, run.env.is_main
    run.parts.guard.check(step, run.state)
    arrived = run.stop.arrivals()  # before the vote: a request landing in between cuts the evaluation
    if distributed.all_reduce_max_flag(run.stop.local(), run.rt):
        run.checkpointer.finish(step)
    run.evaluator.poll = StopPoll(arrived, run.rt.control_group)
    try:
        results = run.evaluator.final(step)
    except EvaluationStopped:
        return preempted(run)
    if is_main and run.parts.ema is not None:  # the headline metric (the task's first) and the loss
        headline = dict.fromkeys((run.parts.metric_names[0], "loss"))
        log.info("EMA %s", metric_values(results, "ema/val/", tuple(headline)))
    run.writer.scalars(step, results)
    run.writer.commit()
    comm = ddp.comm_summary(run.parts.model, run.plan.grad_accum_steps)
    if comm and is_main:
        log.info(comm)
    run.checkpointer.finish(step)
    if is_main:
        log.info(run.checkpointer.overhead())
    reason = COMPLETED
    if end is End.EARLY_STOP:
        reason = End.EARLY_STOP.value
    run.reporter.close(status(run, end=reason))
    run.writer.hparams(hparams(config_to_dict(run.cfg)), {"hparam/" + k: v for k, v in results.items()})
    if is_main:
        run_dir = run.cfg.run_dir
        print(
            f"FINAL step={step} {metric_values(results, 'val/')} val_count={int(results['val/count'])} run_dir={run_dir} "
            f"tensorboard={run_dir / 'tb'}",
            flush=True,
        )
    return EXIT_OK
