"""`ddp-job make-data --format text`: a byte-level text corpus from the Python standard library's own sources,
which every machine that runs the job has, for the causal_lm task (job.tasks.lm).

Layout::

    OUT/train.bin      the training text, one token per byte (vocabulary 256)
    OUT/val.bin        the validation text: every VAL_EVERY-th source file, never seen in training
    OUT/corpus.json    the arguments, the files read, and the unigram baseline; written last (marks it complete)

The unigram baseline is the cross-entropy, in nats per token, of the validation text under the training text's
byte frequencies (add-one smoothed): what a model that ignores context scores. A language model that learns
anything from context goes well below it. Files are taken in sorted order of their path below the standard
library, so the same Python version gives the same corpus; the set is written into a temporary sibling and
renamed to OUT in one step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from job.errors import BadInput

VAL_EVERY = 10
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
SEPARATOR = b"\n\n"


def stdlib_sources(root: Path | None = None) -> Iterator[Path]:
    """The standard library's ``.py`` files in sorted path order, tests and installed packages left out."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if not SKIP_DIRS.intersection(path.relative_to(root).parts):
            yield path


def unigram_baseline(train: np.ndarray, val: np.ndarray) -> float:
    """Cross-entropy (nats per token) of ``val`` under ``train``'s add-one-smoothed byte frequencies."""
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


def _collect(max_bytes: int) -> tuple[bytes, bytes, int]:
    train, val, files = bytearray(), bytearray(), 0
    for i, path in enumerate(stdlib_sources()):
        if len(train) >= max_bytes:
            break
        text = path.read_bytes() + SEPARATOR
        if i % VAL_EVERY == VAL_EVERY - 1:
            val += text
        else:
            train += text
        files += 1
    return bytes(train[:max_bytes]), bytes(val[: max(max_bytes // (VAL_EVERY - 1), 1)]), files


def make_corpus(out: Path, max_bytes: int) -> dict:
    """Write the corpus to ``out`` (a no-op when it holds the same one); returns its corpus.json."""
    if max_bytes < 4096:
        raise BadInput(
            f"make-data --max-bytes {max_bytes}: too small for a corpus.",
            "pass --max-bytes 4096 or more (default 1000000).",
            setting="--max-bytes",
            value=max_bytes,
        )
    args = {"format": "text", "max_bytes": max_bytes, "python": sys.version.split()[0]}
    meta_file = out / "corpus.json"
    if meta_file.exists() and json.loads(meta_file.read_text()).get("args") == args:
        return dict(json.loads(meta_file.read_text()))
    if out.exists():
        raise BadInput(
            f"make-data --out {out}: exists and does not hold this corpus.",
            "pass a new directory, or remove it first.",
            setting="--out",
            value=str(out),
        )
    train, val, files = _collect(max_bytes)
    meta = {
        "args": args,
        "files": files,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "vocab_size": 256,
        "unigram_baseline_nats": unigram_baseline(np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8)),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the corpus is for every user of the machine
        (tmp / "train.bin").write_bytes(train)
        (tmp / "val.bin").write_bytes(val)
        (tmp / "corpus.json").write_text(json.dumps(meta, indent=1))
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def describe(meta: dict) -> str:
    return (
        f"{meta['train_tokens']} train / {meta['val_tokens']} val byte tokens from {meta['files']} standard-library "
        f"files; unigram baseline {meta['unigram_baseline_nats']:.4f} nats/token "
        f"(perplexity {math.exp(meta['unigram_baseline_nats']):.2f})"
    )
