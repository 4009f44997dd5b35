"""Where checkpoints and run directories may live: a file system path, local or shared.

A URL there (``s3://bucket/prefix``) would be taken for a relative path: ``Path("s3://b/p")`` is ``s3:/b/p``, a
directory named ``s3:`` in the working directory, which a pod loses with its disk. Such a value is refused where it
is read, naming the setting, until object storage is a run directory of its own."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

FIX = (
    "use a local path or one on a shared POSIX file system (NFS, Lustre, Amazon EFS or FSx, a ReadWriteMany "
    "PersistentVolumeClaim); object storage is not read or written directly, and a checkpoint commits by renaming "
    "its directory, which bucket mounts such as Mountpoint for Amazon S3 do not do"
)


def url_scheme(value: str) -> str | None:
    """The scheme of ``value`` if it is a URL (``s3``, ``gs``, ``https``, ...), else None."""
    m = _URL.match(value)
    if m is None:
        return None
    return m.group(1)


def refusal(value: str) -> str | None:
    """What is wrong with ``value`` as a file system path, or None if it is one."""
    scheme = url_scheme(value)
    if scheme is None:
        return None
    return f"{value!r} is a URL ({scheme}://), not a file system path; {FIX}"


def path_argument(value: str) -> Path:
    """argparse's ``type`` for an option that names a file system path: a URL is refused there, and argparse names
    the option and exits 2 before anything is written."""
    problem = refusal(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return Path(value)
