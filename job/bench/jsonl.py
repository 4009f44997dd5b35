"""Follow a benchmark's log and copy its JSON object lines to stdout as they are written (tools/gpu_run.sh).

The command writes its whole output to its log file, not to a pipe: a child process that outlives the command
(a torchrun worker after a timeout) can hold a pipe open forever, never a file. This follower reads the file as
it grows and writes every complete line that is a JSON object (a benchmark's result; ``common.emit`` and
``common.emit_point`` print one per line), flushed at once, so results.jsonl holds each result as soon as it is
printed and nothing else: no traceback, no log line, no half line of a killed writer. It stops once ``DONE``
exists (the script creates it when the command has ended), after reading what the log holds by then.

    python -m job.bench.jsonl LOG DONE >> results.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

POLL_S = 0.2


def json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # not JSON, or not UTF-8
        return False


def follow(log: Path, done: Path, out: TextIO, poll_s: float = POLL_S) -> int:
    """Copy ``log``'s JSON object lines to ``out`` until ``done`` exists; the number copied."""
    pending, pos, copied = b"", 0, 0
    while True:
        finished = done.exists()  # checked first: all the log holds by then is read below
        if log.exists():
            with log.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            *lines, pending = (pending + chunk).split(b"\n")
            if finished:
                lines.append(pending)  # a last line without its newline
            for line in lines:
                if json_object(line):
                    out.write(line.decode() + "\n")
                    out.flush()
                    copied += 1
        if finished:
            return copied
        time.sleep(poll_s)


def main(argv: list[str]) -> int:
    follow(Path(argv[0]), Path(argv[1]), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
