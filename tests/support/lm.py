"""The causal language-model task at its smallest, for the launcher tests: its byte corpus and its settings.

Dropout and the per-item random window shift are on, so a resume is bitwise only when the model, the optimizer,
the data position and every RNG stream come back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.cli import run_cli

OPTIONS = {"seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.1}
"""task.options besides the corpus's path: a 2-layer GPT over 32-byte windows."""

CORPUS_BYTES = 200_000
"""How much of the standard library's sources the training split holds."""


def make_corpus(out: Path) -> Path:
    """``ddp-job make-data --format text`` at ``out``: train.bin, val.bin and corpus.json."""
    r = run_cli(["make-data", "--format", "text", "--out", str(out), "--max-bytes", str(CORPUS_BYTES)])
    assert r.returncode == 0, r.stderr
    return out


def job_config(cfg: dict[str, Any], corpus: str) -> dict[str, Any]:
    """A job.yaml's settings (as a mapping) with the image task's data and model replaced by the language model
    over ``corpus`` (its path as the job sees it), trained by AdamW at a constant rate without TensorBoard.
    Everything else (run, dist, train, ckpt, log, debug) is kept, so the launcher's settings stay as rendered."""
    out = {k: v for k, v in cfg.items() if k not in ("data", "model", "optim", "sched")}
    out["task"] = {"name": "causal_lm", "options": {"path": corpus, **OPTIONS}}
    out["data"] = {"num_workers": 0}
    out["optim"] = {"name": "adamw", "lr": 0.003}
    out["sched"] = {"name": "constant"}
    out["log"] = {**cfg.get("log", {}), "tensorboard": False}
    return out
