"""Exit codes of every ddp-job command, and the exception for bad input.

| code | name             | meaning                                                   | launcher action   |
|------|------------------|-----------------------------------------------------------|-------------------|
| 0    | EXIT_OK          | training finished                                         | done              |
| 1    | EXIT_FAILURE     | unexpected error (traceback printed)                      | restart may help  |
| 2    | EXIT_BAD_INPUT   | bad config / environment / data: nothing started/written  | do not retry      |
| 124  | EXIT_TIMEOUT     | a collective timed out: a peer stopped participating      | restart           |
| 143  | EXIT_PREEMPTED   | stopped on request after saving a checkpoint: resume me   | requeue / restart |

143 = 128 + SIGTERM: Kubernetes' ``restartPolicy: ExitCode`` retries codes >= 128 and fails the job for
1-127, so bad input (2) is permanent while a preempted job is restarted.
"""

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_TIMEOUT = 124
EXIT_PREEMPTED = 143


class BadInput(Exception):
    """Bad config, environment or data. ``str(err)`` is the whole user-facing message: it names the
    setting or variable, the bad value and the fix. The CLI prints it without a traceback and exits 2."""


class NonFiniteError(RuntimeError):
    """More than ``train.max_nonfinite_skips`` updates were skipped for a non-finite loss or gradient norm."""
