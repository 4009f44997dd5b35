"""Names inside a step directory that several modules share, in a module that imports nothing heavy: the launcher
reads the checkpoint store (job.checkpoint.store) and must not pay torch.distributed.checkpoint's import (about half
a second per process) for two strings."""

from __future__ import annotations

SHARDS = "shards"
"""The DCP folder inside a step directory."""
ITEMS = "items.json"
"""Next to the DCP folder: the sha256 of every stored item, by file inside the folder (``{"__0_0.distcp": {"<offset>":
[length, sha256]}}``); the manifest lists it with its own size and sha256. A file of its own, read by rank 0 alone
on a load, so that the manifest every rank reads stays O(files) while the items grow with every saving rank's
tensors. A checkpoint without it lists the items in its manifest's entries (job.checkpoint.verified)."""
