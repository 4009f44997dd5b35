import sys

from job.cli import main

raise SystemExit(main(sys.argv[1:]))
