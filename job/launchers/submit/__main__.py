"""``python -m job.launchers.submit``: the same as ``ddp-job submit``."""

import sys

from job.errors import run_command
from job.launchers.submit.command import main

sys.exit(run_command("submit", main, sys.argv[1:]))
