"""``ddp-job submit`` / ``python -m job.launchers.submit``: submit training to Slurm with submitit: its argument
helpers (``args``), the submitted task (``task``) and its command line (``command``).

    ddp-job submit --nodes 2 --gpus-per-node 8 --partition gpu --time 240 -- --config configs/x.yaml
    ddp-job submit --gpus-per-node 0 --tasks-per-node 2 --sweep optim.lr=0.1,0.2 --wait -- --train.steps 50

One submitit task per GPU (CPU: ``--tasks-per-node``); each task is one rank and runs
``ddp-job train`` in-process (``job.train.run.main``) with the env contract (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*) exported by
``submitit.helpers.TorchDistributedEnvironment`` (without its one-GPU-per-task CUDA_VISIBLE_DEVICES:
the trainer picks ``cuda:LOCAL_RANK`` itself and NCCL wants to see the peers' GPUs).

Preemption and time limits (why it is built like this):
* submitit asks Slurm for ``--signal=USR2@<signal-delay>`` (or ``SUBMITIT_PREEMPT_SIGNAL``) and installs
  a handler for it that, on global rank 0, calls ``checkpoint()``, runs ``scontrol requeue`` and exits
  at once. Left alone, that would throw away the steps since the last periodic checkpoint.
* So the task does not silently replace it but *chains* it: it takes that signal out of the trainer's
  ``--train.stop-signals`` (the trainer would overwrite the handler), and installs a handler that touches
  ``run_dir/STOP`` (every rank checks it at the next step boundary, all stop after the same step, rank 0
  saves). When training returns 143 ("saved, resume me"), rank 0 calls submitit's original handler,
  which calls ``checkpoint()`` (resubmit the same task: it resumes from the newest checkpoint on disk,
  so nothing is saved there and no collective runs) and requeues. If training has not returned within
  ``--preempt-grace`` seconds, an alarm calls submitit's handler anyway (the periodic checkpoints remain).
* SIGTERM (``scontrol requeue``/``scancel``/preemption by Slurm) stays a trainer stop signal: the ranks
  save and exit 143; Slurm requeues the job itself (or it was cancelled). A task that exits 143 writes
  no submitit result, so a requeued job is not mistaken for a finished one.
"""
