"""Errors as data: every error type lives in job.errors, carries its exit code and fix, and the CLI's exit code
comes from the attribute; collective timeouts are recognised by one rule, checked on a real gloo timeout."""

from __future__ import annotations

import ast
import datetime
import errno
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

# A reserved port waits in TIME_WAIT: no bind(0) gets it, the store's SO_REUSEADDR bind does. A port bound and
# released at once could be handed to another test's process before rank 0 binds it.
from ephemeral_port_reserve import reserve
from support import ROOT

from job import cli, errors
from job.data.workers import unreadable_image
from job.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_TIMEOUT,
    BadInput,
    BadShard,
    CheckpointLoadError,
    CheckpointWriteError,
    CollectiveTimeout,
    CorruptCheckpointError,
    DataStall,
    DoctorFailed,
    DoesNotFit,
    FailedAfterStart,
    JobError,
    NonFiniteError,
    NonFiniteStateError,
    TrainingFailed,
    TransientIOError,
    UserCodeError,
    WeightsError,
    exit_code_of,
    is_collective_timeout,
)

# Every error type and the exit code docs/design.md and the job.errors table give it.
CASES = [
    (BadInput("train.steps=0 must be >= 1.", "pass --train.steps 10.", setting="train.steps", value=0), EXIT_BAD_INPUT),
    (CollectiveTimeout("collective timed out on rank 0.", "raise dist.train_timeout_s."), EXIT_TIMEOUT),
    (DoctorFailed("preflight checks failed: rendezvous."), EXIT_FAILURE),
    (
        DataStall("no batch within data.loader_timeout_s=5.", "raise it.", setting="data.loader_timeout_s", value=5),
        EXIT_FAILURE,
    ),
    (CheckpointWriteError("writing checkpoint failed: no space.", "free space."), EXIT_FAILURE),
    (NonFiniteStateError("not saving: NaN in model.w.", "lower optim.lr."), EXIT_FAILURE),
    (CheckpointLoadError("state.pt refused by weights_only=True.", "move it away."), EXIT_FAILURE),
    (
        CorruptCheckpointError(Path("run/ckpt/step_00000004"), ["rank 1: shards/__1_0.distcp (item w) does not match"]),
        EXIT_FAILURE,
    ),
    (NonFiniteError("too many non-finite steps.", "lower optim.lr."), EXIT_FAILURE),
    (TrainingFailed({"77": 3, "78": 124}, {"77": "a.err", "78": "b.err"}), 124),
    (
        BadShard("shard d/train-000003.tar: not a tar file.", "re-create it.", setting="data.path", value="d/x.tar"),
        EXIT_BAD_INPUT,
    ),
    (UserCodeError("model.name='pkg.mod:net': no module pkg.", "install it.", setting="model.name"), EXIT_BAD_INPUT),
    (WeightsError("model.weights=w.pt: no such file.", "pass a state dict.", setting="model.weights"), EXIT_BAD_INPUT),
    (
        DoesNotFit(
            "train.strategy='ddp' needs about 9 MiB per device.",
            "--train.strategy fsdp.",
            setting="train.strategy",
            value="ddp",
            need_bytes=9 << 20,
            capacity_bytes=8 << 20,
        ),
        EXIT_BAD_INPUT,
    ),
    (TransientIOError("data: cannot read x.png: the storage failed.", "retry."), EXIT_FAILURE),
    (FailedAfterStart.of(BadInput("data: cannot read x.png.", "replace it.", setting="data.path"), 7), EXIT_FAILURE),
]
IDS = [type(err).__name__ for err, _ in CASES]
# What each of CASES prints: the message, then " Fix: " and the fix when there is one.
TEXT = {
    "BadInput": "train.steps=0 must be >= 1. Fix: pass --train.steps 10.",
    "CollectiveTimeout": "collective timed out on rank 0. Fix: raise dist.train_timeout_s.",
    "DoctorFailed": "preflight checks failed: rendezvous.",
    "DataStall": "no batch within data.loader_timeout_s=5. Fix: raise it.",
    "CheckpointWriteError": "writing checkpoint failed: no space. Fix: free space.",
    "NonFiniteStateError": "not saving: NaN in model.w. Fix: lower optim.lr.",
    "CheckpointLoadError": "state.pt refused by weights_only=True. Fix: move it away.",
    "CorruptCheckpointError": "checkpoint run/ckpt/step_00000004 is corrupt: rank 1: shards/__1_0.distcp (item w) does "
    "not match. Fix: move run/ckpt/step_00000004 out of the run directory to use the one before (nothing was deleted).",
    "NonFiniteError": "too many non-finite steps. Fix: lower optim.lr.",
    "TrainingFailed": "training failed in job(s) 77 (exit 3), 78 (exit 124). Fix: read the job log(s): a.err, b.err.",
    "BadShard": "shard d/train-000003.tar: not a tar file. Fix: re-create it.",
    "UserCodeError": "model.name='pkg.mod:net': no module pkg. Fix: install it.",
    "WeightsError": "model.weights=w.pt: no such file. Fix: pass a state dict.",
    "DoesNotFit": "train.strategy='ddp' needs about 9 MiB per device. Fix: --train.strategy fsdp.",
    "TransientIOError": "data: cannot read x.png: the storage failed. Fix: retry.",
    "FailedAfterStart": "data: cannot read x.png. (met after training started, at step 7: exit 1, not 2) Fix: replace it.",
}


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (OSError(errno.EIO, "Input/output error"), EXIT_FAILURE),
        (OSError(errno.ESTALE, "Stale file handle"), EXIT_FAILURE),
    ]
    + [(OSError(errno.ENOENT, "No such file"), EXIT_BAD_INPUT), (ValueError("truncated PNG"), EXIT_BAD_INPUT)],
    ids=["EIO", "ESTALE", "ENOENT", "decode"],
)
def test_an_unreadable_image_is_bad_input_unless_the_storage_failed(err: Exception, code: int) -> None:
    """A transient error of network storage is retried (1); a missing or corrupt file is bad input (2)."""
    made = unreadable_image("d/train/0/x.png", err)
    assert exit_code_of(made) == code and made.setting == "data.path" and made.value == "d/train/0/x.png"


def _cli_code(monkeypatch: pytest.MonkeyPatch, err: BaseException) -> int:
    def command(argv: list[str]) -> int:
        raise err

    monkeypatch.setitem(cli.COMMANDS, "train", command)
    return cli.main(["train"])


@pytest.mark.parametrize(("err", "code"), CASES, ids=IDS)
def test_cli_returns_the_errors_exit_code(monkeypatch: pytest.MonkeyPatch, err: JobError, code: int) -> None:
    assert err.exit_code == code
    assert _cli_code(monkeypatch, err) == code


@pytest.mark.parametrize(("err", "code"), CASES, ids=IDS)
def test_the_exit_code_is_read_from_the_attribute(monkeypatch: pytest.MonkeyPatch, err: JobError, code: int) -> None:
    subclass = type(f"Other{type(err).__name__}", (type(err),), {"exit_code": 77})
    other = pickle.loads(pickle.dumps(err))
    other.__class__ = subclass
    vars(other).pop("exit_code", None)  # TrainingFailed's code is per instance; without it the class's counts
    assert _cli_code(monkeypatch, other) == 77
    again = pickle.loads(pickle.dumps(err))
    again.exit_code = 99
    assert _cli_code(monkeypatch, again) == 99


def test_foreign_errors_map_to_1_and_torch_timeouts_to_124(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    assert _cli_code(monkeypatch, ValueError("boom")) == EXIT_FAILURE
    assert _cli_code(monkeypatch, dist.DistBackendError("NCCL watchdog")) == EXIT_TIMEOUT


def test_bad_input_is_one_line_and_other_errors_show_their_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_code(monkeypatch, CASES[0][0])
    err = capsys.readouterr().err
    assert err == "ddp-job train: error: train.steps=0 must be >= 1. Fix: pass --train.steps 10.\n"
    _cli_code(monkeypatch, CASES[1][0])
    err = capsys.readouterr().err
    assert (
        "Traceback" in err
        and "CollectiveTimeout: collective timed out on rank 0. Fix: raise dist.train_timeout_s." in err
    )


@pytest.mark.parametrize(("err", "code"), CASES, ids=IDS)
def test_errors_render_what_and_fix_and_survive_pickling(err: JobError, code: int) -> None:
    assert str(err) == TEXT[type(err).__name__]
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err) and str(copy) == str(err) and copy.__dict__ == err.__dict__
    assert copy.exit_code == code


def test_one_string_is_enough_to_build_an_error() -> None:
    # torch's DataLoader and multiprocessing rebuild an exception as type(err)(text)
    assert (
        str(BadInput("Caught BadInput in DataLoader worker process 0."))
        == "Caught BadInput in DataLoader worker process 0."
    )


def test_every_exception_type_of_the_package_is_defined_in_job_errors() -> None:
    defined = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, BaseException)}
    elsewhere = []
    for path in sorted((ROOT / "job").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "job":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            bases = {b.id for b in getattr(node, "bases", []) if isinstance(b, ast.Name)}
            if isinstance(node, ast.ClassDef) and bases & (
                defined | {"Exception", "RuntimeError", "ValueError", "OSError"}
            ):
                elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not elsewhere, elsewhere
    assert {t for t, _ in ((type(e), c) for e, c in CASES)} == {
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, JobError) and obj is not JobError
    }


# --- collective timeouts: one rule (job.errors.is_collective_timeout) -----------------------------------

GLOO_HANG = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from job.errors import exit_code_of, is_collective_timeout
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
t = torch.ones(4)
dist.all_reduce(t)
dist.set_timeout(datetime.timedelta(seconds=2))
if rank == 1:
    # stops participating until rank 0 has seen both timeouts (the test then closes this stdin): had it left
    # earlier, a slowed rank 0 would see a closed connection instead of a timeout
    sys.stdin.read()
    os._exit(0)
for op, call in (("all_reduce", lambda: dist.all_reduce(t)), ("barrier", dist.barrier)):
    try:
        call()
        print(json.dumps({"op": op, "raised": None}), flush=True)
    except Exception as e:
        print(json.dumps({"op": op, "raised": f"{type(e).__module__}.{type(e).__name__}",
                          "timeout": is_collective_timeout(e), "code": exit_code_of(e)}), flush=True)
# Skip interpreter teardown, as the job's entrypoint does: destroying a gloo group whose collectives timed
# out can abort in C++ ("terminate called without an active exception"), which is not what is tested here.
os._exit(0)
"""


def test_a_real_gloo_collective_timeout_is_recognised(tmp_path: Path) -> None:
    """torch 2.14.1 raises a plain RuntimeError for a gloo timeout (no torch type): the documented fallback."""
    port = str(reserve())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_HANG, str(rank), port],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]  # rank 0's end first; then rank 1's stdin closes
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = [json.loads(line) for line in outs[0][0].splitlines()]
    assert [s["op"] for s in seen] == ["all_reduce", "barrier"], outs[0]
    for s in seen:
        assert s["raised"] == "builtins.RuntimeError", s
        assert s["timeout"] is True and s["code"] == EXIT_TIMEOUT, s


class _SlowItems:
    """A dataset whose items take longer than the loader's timeout."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        import time

        time.sleep(5)
        return i


def test_a_real_dataloader_timeout_is_recognised_and_nothing_else() -> None:
    """torch 2.14.1 raises a plain RuntimeError when no batch arrives within the loader's timeout."""
    from torch.utils.data import DataLoader

    with pytest.raises(RuntimeError) as e:
        next(iter(DataLoader(_SlowItems(), num_workers=1, timeout=0.5)))
    assert type(e.value) is RuntimeError and errors.is_loader_timeout(e.value)
    assert not errors.is_loader_timeout(RuntimeError("CUDA out of memory"))
    assert not errors.is_loader_timeout(DataStall("DataLoader timed out: ours, typed."))


def test_torch_store_timeouts_are_recognised_by_type() -> None:
    import torch.distributed as dist

    with pytest.raises(dist.DistStoreError) as e:
        dist.HashStore().wait(["never-set"], datetime.timedelta(milliseconds=200))
    assert is_collective_timeout(e.value) and exit_code_of(e.value) == EXIT_TIMEOUT


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("DataLoader timed out after 5 seconds"),  # this rank's input pipeline, not a peer
        RuntimeError("Connection closed by peer [127.0.0.1]:1234"),  # a peer died: a failure, not a timeout
        DataStall("DataLoader timed out after 5 seconds: no batch within data.loader_timeout_s=5."),
        TimeoutError("Timed out waiting for the lock"),  # not torch's type or gloo's RuntimeError
    ],
)
def test_other_errors_are_not_collective_timeouts(err: BaseException) -> None:
    assert not is_collective_timeout(err)
    assert exit_code_of(err) == EXIT_FAILURE
