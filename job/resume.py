"""What a resume must restore beyond weights: RNG states, and the refusal of incompatible resumes."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from job.config import JobConfig, config_to_dict
from job.exitcodes import BadInput

# Settings that may differ between the saved run and the resumed one without changing the math:
# where things live, how processes are launched, logging, checkpoint cadence, the training horizon.
MAY_CHANGE = (
    "run.name", "run.output_dir", "dist.", "data.path", "data.num_workers", "data.prefetch_factor",
    "data.pin_memory", "train.steps", "train.eval_every", "train.stop_signals", "train.max_nonfinite_skips",
    "train.inject_nan_at_steps", "ckpt.", "log.", "doctor.", "observe.",
    "data.device_prefetch", "ddp.comm_stats",  # copy overlap / a counting hook: same math
)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states in types that ``torch.load(weights_only=True)`` accepts."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict[str, Any], current: JobConfig) -> list[str]:
    a, b = _flat(saved), _flat(config_to_dict(current))
    keys = sorted(set(a) | set(b))
    return [f"{k}: checkpoint {a.get(k)!r} -> now {b.get(k)!r}" for k in keys
            if a.get(k) != b.get(k) and not k.startswith(MAY_CHANGE)]


def check_resumable(manifest: dict[str, Any], cfg: JobConfig, world_size: int) -> None:
    """Refuse a resume that would silently change the run; say what differs and which flag allows it.

    World-size changes: the data position is stored per optimizer step and each global batch holds the
    same samples whatever the world size (see job.data), so a resume with another world size continues
    the same sample sequence as long as train.global_batch_size is unchanged. Per-rank RNG streams
    cannot be mapped and are re-seeded.
    """
    diffs = config_differences(manifest.get("config", {}), cfg)
    if diffs and not cfg.ckpt.allow_config_change:
        raise BadInput(
            f"the newest checkpoint (step {manifest.get('step')}) was written with a different config:\n  "
            + "\n  ".join(diffs)
            + "\nFix: restore those settings, use a new run.name, or pass --ckpt.allow-config-change true."
        )
    saved_ws = manifest.get("world_size")
    if saved_ws != world_size and not cfg.ckpt.allow_world_size_change:
        raise BadInput(
            f"the newest checkpoint (step {manifest.get('step')}) was written with world_size={saved_ws}, "
            f"this run has world_size={world_size}. Fix: launch {saved_ws} processes, or pass "
            f"--ckpt.allow-world-size-change true (the data order is kept when train.global_batch_size is unchanged)."
        )
