"""The training run: building its parts, the step, the loop, evaluation; ``run.main`` is ``ddp-job train``."""
