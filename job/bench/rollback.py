"""Bytes the non-finite rollback moves per step (job.train.rollback), counted, not timed.

A dispatch mode sees every tensor operation and adds up the bytes each reads and writes (from its schema: an
``out=`` argument and a copy's destination are written, not read; a view or an allocation moves nothing). One update with the
rollback, less the same update alone, is what the rollback costs; divided by the bytes it tracks (the parameters
and optimizer state an update changes) it is the number of passes over them. The copy it keeps between steps is
reported too. The model is ResNet-50 (25.6 M parameters) unless ``--quick`` (ResNet-18), on the CPU: bytes do not
depend on the device.

    ddp-job bench rollback [--quick]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
from timm.optim import Lamb
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from job.bench import common
from job.train.rollback import Rollback, state_tensors

WRITE_ONLY = {"copy_", "_foreach_copy_"}
"""Operations that overwrite their destination without reading it."""


def _nbytes(value: Any) -> int:
    return sum(t.nbytes for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


class ByteCounter(TorchDispatchMode):
    """Bytes read and written by the tensor operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.read = self.written = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if not _nbytes((args, kwargs)) or _is_view(schema):
            return out  # an allocation or a view: no data moves
        writes = False
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            writes = writes or written
            if written:
                self.written += _nbytes(value)
            if not (written and (arg.is_out or schema.name.split("::")[-1] in WRITE_ONLY)):
                self.read += _nbytes(value)
        if not writes:  # a functional op: its fresh outputs are written; views of an input move nothing
            fresh = [r for r, ret in zip(tree_flatten(out)[0], schema.returns) if ret.alias_info is None]
            self.written += _nbytes(fresh)
        return out


def _is_view(schema: Any) -> bool:
    """Whether every result aliases an input and nothing is written (view, split, reshape of a contiguous one)."""
    returns = [r.alias_info for r in schema.returns]
    written = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return bool(returns) and all(r is not None for r in returns) and not written


def moved(fn: Callable[[], Any]) -> int:
    """Bytes read plus written by ``fn``'s tensor operations."""
    with ByteCounter() as counter:
        fn()
    return int(counter.read + counter.written)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "lamb": lambda p: Lamb(p, lr=1e-3),
}


def measure(model_name: str, optimizer: str) -> dict[str, Any]:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)()
    opt = OPTIMIZERS[optimizer](model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # creates the state
    rollback = Rollback(opt, torch.device("cpu"))
    tracked = sum(t.nbytes for t in [*model.parameters(), *state_tensors(opt)])
    alone = moved(opt.step)
    rows = {}
    for flag in (0.0, 1.0):
        found_inf = torch.tensor(flag)
        rows[f"flag_{int(flag)}"] = moved(lambda: rollback.step(found_inf)) - alone  # noqa: B023 (called at once)
    copy_bytes = rollback.copy_bytes()
    return {
        "model": model_name,
        "optimizer": optimizer,
        "tracked_bytes": tracked,
        "update_bytes": alone,
        "rollback_bytes": rows,
        "passes": {k: v / tracked for k, v in rows.items()},
        "copy_bytes": copy_bytes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ddp-job bench rollback", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="ResNet-18 instead of ResNet-50 (CI)")
    a = p.parse_args(argv)
    model_name = "resnet18" if a.quick else "resnet50"
    results = [measure(model_name, name) for name in OPTIMIZERS]
    mib = 1 << 20
    rows = [
        [
            f"{r['model']} {r['optimizer']}",
            f"{r['tracked_bytes'] / mib:.1f}",
            f"{r['update_bytes'] / mib:.1f}",
            f"{r['rollback_bytes']['flag_0'] / mib:.1f} ({r['passes']['flag_0']:.2f}x)",
            f"{r['rollback_bytes']['flag_1'] / mib:.1f} ({r['passes']['flag_1']:.2f}x)",
            f"{r['copy_bytes'] / mib:.1f}",
        ]
        for r in results
    ]
    common.table(
        "rollback: bytes moved per step beside the update (MiB; x = passes over the tracked tensors)",
        ["model, optimizer", "tracked", "update alone", "rollback, flag unset", "rollback, flag set", "copy kept"],
        rows,
    )
    common.emit("rollback", {"quick": a.quick, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
