"""What a run takes and leaves: the arguments of the smallest real run, and readers of its checkpoints and logs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def tiny_args(
    data: Path | None = None,
    *,
    classes: int = 4,
    image_size: int = 16,
    train_size: int = 64,
    val_size: int = 8,
    workers: int = 0,
    model: str = "resnet18",
) -> list[str]:
    """The data and model of the smallest real run: ``model`` on ``image_size``-pixel images of ``classes``
    classes, ``workers`` DataLoader workers. The images are the image folder ``data``, else synthetic
    (``train_size`` and ``val_size`` of them)."""
    if data is None:
        source = ["--data.source", "synthetic"]
        source += ["--data.synthetic-train-size", str(train_size), "--data.synthetic-val-size", str(val_size)]
    else:
        source = ["--data.path", str(data)]
    return [
        *source,
        "--data.num-classes",
        str(classes),
        "--data.image-size",
        str(image_size),
        "--data.num-workers",
        str(workers),
        "--model.name",
        model,
    ]


# TensorBoard's event-file name (tensorboard.summary.writer.event_file_writer): the host name may itself contain
# dots, so the pid is found from the right, never by a fixed field index from the left.
TFEVENTS_NAME = re.compile(r"events\.out\.tfevents\.(?P<time>\d+)\.(?P<host>.+)\.(?P<pid>\d+)\.(?P<n>\d+)")
RANK_PID = re.compile(r"rank (\d+)/\d+ local \d+/\d+ node \d+/\d+ launcher=\S+ backend=\S+ pid=(\d+)")


def tfevents_writer(path: Path) -> tuple[str, int]:
    """(host, pid) of the process that wrote a TensorBoard event file, from its name
    ``events.out.tfevents.<time>.<host>.<pid>.<n>``."""
    m = TFEVENTS_NAME.fullmatch(path.name)
    assert m, f"not a TensorBoard event-file name (events.out.tfevents.<time>.<host>.<pid>.<n>): {path.name}"
    return m["host"], int(m["pid"])


def rank_pids(log: str) -> dict[int, set[int]]:
    """Each rank's pids, from the start-up line every rank prints (``rank R/W ... pid=P``)."""
    pids: dict[int, set[int]] = {}
    for rank, pid in RANK_PID.findall(log):
        pids.setdefault(int(rank), set()).add(int(pid))
    return pids


def load_final_state(run_dir: Path) -> dict[str, Any]:
    """The whole state of the newest checkpoint in run_dir: its state.pt with the model, optimizer and EMA of its
    shards (job.checkpoint.store.read_checkpoint)."""
    from job.checkpoint import store

    steps = sorted(p for p in run_dir.glob("step-*") if ".tmp" not in p.name)
    assert steps, f"no checkpoint in {run_dir}: {list(run_dir.iterdir()) if run_dir.exists() else 'missing'}"
    return store.read_checkpoint(steps[-1])


def assert_bitwise_equal(a: object, b: object, where: str = "") -> None:
    """``a`` and ``b`` (tensors, or dicts, lists and tuples of them) hold the same dtypes and the same bits."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


FINAL_LINE = re.compile(r"^FINAL (.*) run_dir=", re.M)


def assert_same_end(want_dir: Path, want_log: str, got_dir: Path, got_log: str) -> None:
    """The run in ``got_dir`` ended where the one in ``want_dir`` did: its newest checkpoint holds the same
    model and optimizer bits and the same trainer state, and its last FINAL line (the validation metrics)
    reads the same."""
    from job.checkpoint import store

    want_ckpt, got_ckpt = store.find_latest(want_dir), store.find_latest(got_dir)
    assert want_ckpt is not None and got_ckpt is not None, (want_ckpt, got_ckpt)
    want, got = store.read_checkpoint(want_ckpt.path), store.read_checkpoint(got_ckpt.path)
    for key in ("model", "optimizer"):
        assert_bitwise_equal(want[key], got[key], key)
    assert want["trainer"] == got["trainer"]
    assert FINAL_LINE.findall(got_log)[-1:] == FINAL_LINE.findall(want_log)[-1:] != [], "validation differs"
