"""The built-in ``causal_lm`` task: a small GPT-style model (job.tasks.lm.gpt) trained with next-token loss over
fixed-length windows of a token file, evaluated by exact loss and perplexity over the validation windows.

``task.options`` (all optional but ``path``):

    path        directory of train.bin and val.bin, one uint8 token per byte (``ddp-job make-data --format text``)
    seq_len     tokens a window predicts (64); item i is the seq_len + 1 tokens from i x seq_len
    jitter      shift each training window by a random 0..seq_len-1 tokens (true): drawn from the RNG the job
                seeds from (run.seed, epoch, index), so resume stays exact
    n_layer, n_head, n_embd, dropout    the model (2, 4, 64, 0.0)

The dataset is indexable, so the job's sampler stays the only source of sample order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

from job.errors import BadInput
from job.tasks.lm.gpt import GPT, GPTConfig

OPTIONS = ("path", "seq_len", "jitter", "n_layer", "n_head", "n_embd", "dropout")
FILES = {"train": "train.bin", "val": "val.bin"}


def _bad(option: str, value: Any, what: str, fix: str) -> BadInput:
    return BadInput(f"task.options.{option}={value!r}: {what}", fix, setting=f"task.options.{option}", value=value)


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens of a token file (memory-mapped): item i starts at i x seq_len, shifted by
    a random 0..seq_len-1 with ``jitter``."""

    def __init__(self, file: Path, seq_len: int, jitter: bool) -> None:
        self.file, self.seq_len, self.jitter = file, seq_len, jitter
        self.tokens = np.memmap(file, dtype=np.uint8, mode="r")
        self.n = max((len(self.tokens) - 1) // seq_len - int(jitter), 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        if self.jitter:
            start += int(torch.randint(self.seq_len, ()))  # the job seeded this generator for (epoch, index)
        window = self.tokens[start : start + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))


@dataclass
class CausalLM:
    """The task: ``build_model``, ``dataset``, ``loss``, ``metrics``, plus ``flops_per_item`` and ``summarize``."""

    path: Path
    gpt: GPTConfig
    jitter: bool = True

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> CausalLM:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise _bad(unknown[0], options[unknown[0]], "not an option of task.name=causal_lm.", f"use only {OPTIONS}.")
        if "path" not in options:
            raise BadInput(
                "task.name=causal_lm needs task.options.path: the directory of train.bin and val.bin.",
                "make one with `ddp-job make-data --format text --out data/pycorpus` and pass "
                '--task.options \'{"path": "data/pycorpus"}\'.',
                setting="task.options",
                value=options,
            )
        sizes = {k: options.get(k, getattr(GPTConfig, k)) for k in ("seq_len", "n_layer", "n_head", "n_embd")}
        for key, value in sizes.items():
            if not (isinstance(value, int) and value >= 1):
                raise _bad(key, value, "must be a positive integer.", f"e.g. {getattr(GPTConfig, key)}.")
        if sizes["n_embd"] % sizes["n_head"]:
            raise _bad("n_head", sizes["n_head"], f"must divide n_embd={sizes['n_embd']}.", "e.g. n_head 4, n_embd 64.")
        dropout = options.get("dropout", 0.0)
        gpt = GPTConfig(vocab_size=256, dropout=float(dropout), **sizes)
        task = cls(Path(options["path"]), gpt, bool(options.get("jitter", True)))
        task.check_files()
        return task

    def check_files(self) -> None:
        for split, name in FILES.items():
            file = self.path / name
            if not file.is_file():
                raise _bad(
                    "path",
                    str(self.path),
                    f"has no {name} (the {split} tokens).",
                    f"make the corpus with `ddp-job make-data --format text --out {self.path}`.",
                )
            if file.stat().st_size < 2 * (self.gpt.seq_len + 1):
                raise _bad(
                    "path", str(self.path), f"{name} holds fewer than two windows of seq_len={self.gpt.seq_len}.", ""
                )

    def build_model(self) -> nn.Module:
        return GPT(self.gpt)

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """Under train.strategy=fsdp: one unit per transformer block."""
        return list(cast(GPT, model).blocks)

    def dataset(self, split: str) -> TokenWindows:
        return TokenWindows(self.path / FILES[split], self.gpt.seq_len, jitter=self.jitter and split == "train")

    def loss(self, model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(nll sum, tokens): the job divides by the optimizer step's tokens over every micro-batch and rank."""
        logits = model(batch[:, :-1])
        targets = batch[:, 1:].flatten()
        return functional.cross_entropy(logits.flatten(0, 1).float(), targets, reduction="sum"), targets.numel()

    def metrics(self, model: nn.Module, batch: torch.Tensor) -> dict[str, tuple[Any, Any]]:
        logits = model(batch[:, :-1]).flatten(0, 1).float()
        targets = batch[:, 1:].flatten()
        hits = (logits.argmax(dim=1) == targets).sum()
        nll = functional.cross_entropy(logits, targets, reduction="sum").double()
        return {"loss": (nll, targets.numel()), "accuracy": (hits, targets.numel())}

    def summarize(self, values: dict[str, float]) -> dict[str, float]:
        """Perplexity from the exact mean loss (a ratio of sums, not a mean of per-rank perplexities)."""
        return {"val/perplexity": math.exp(min(values["val/loss"], 50.0))}

    def flops_per_item(self) -> float:
        with torch.device("meta"):
            model = GPT(self.gpt)
        return model.flops_per_token() * self.gpt.seq_len
