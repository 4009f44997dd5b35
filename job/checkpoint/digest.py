"""Digests taken while bytes are written, checked while they are read: a checkpoint is hashed once, by the rank that
writes each byte, and verified by the rank that reads it, with no pass of its own over the storage.

A file's manifest entry (job.checkpoint.store) is ``{"size": bytes, "sha256": the whole file's}``; a DCP file's
also lists its stored items, ``"items": {"<offset>": [length, sha256]}``, so that a rank reading one item of it
(a resume at another world size reads parts of several files) can verify exactly what it read.

``HashingStream`` wraps a file opened for writing: every byte goes to the file's hash, and to the hash of the current
segment, which ends at each ``tell()``: DCP's writer asks for the position right before and right after each item
(torch.distributed.checkpoint.filesystem._write_item), so each item is one segment. A segment that does not line up
with an item's (offset, length) is refused where the results are matched, never trusted.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass
class FileDigest:
    """What one written file looked like: its size, sha256, and each segment's (offset -> (length, sha256))."""

    size: int
    sha256: str
    items: dict[int, tuple[int, str]] = field(default_factory=dict)

    def entry(self, items: bool = True) -> dict[str, Any]:
        """The file's manifest entry (``items``: with its items' digests, for a DCP file)."""
        out: dict[str, Any] = {"size": self.size, "sha256": self.sha256}
        if items and self.items:
            out["items"] = {str(offset): [length, sha] for offset, (length, sha) in sorted(self.items.items())}
        return out


class HashingStream(io.RawIOBase):
    """A writable binary stream that hashes what passes through it into ``raw`` (see the module's docstring)."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self.raw = raw
        self._whole = hashlib.sha256()
        self._segment = hashlib.sha256()
        self._start = 0
        self._pos = 0
        self.items: dict[int, tuple[int, str]] = {}

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        written = self.raw.write(view)
        n = len(view) if written is None else written
        self._whole.update(view[:n])
        self._segment.update(view[:n])
        self._pos += n
        return n

    def tell(self) -> int:
        self._end_segment()
        return self._pos

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def _end_segment(self) -> None:
        if self._pos > self._start:
            self.items[self._start] = (self._pos - self._start, self._segment.hexdigest())
        self._segment = hashlib.sha256()
        self._start = self._pos

    def digest(self) -> FileDigest:
        self._end_segment()
        return FileDigest(self._pos, self._whole.hexdigest(), dict(self.items))


class Recorder:
    """The digests of every file written through ``create``, by file name (thread-safe: DCP may write files from
    several threads)."""

    def __init__(self) -> None:
        self.digests: dict[str, FileDigest] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create(self, path: Path) -> Iterator[HashingStream]:
        with path.open("wb") as raw:
            stream = HashingStream(raw)
            yield stream
        with self._lock:
            self.digests[path.name] = stream.digest()


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
