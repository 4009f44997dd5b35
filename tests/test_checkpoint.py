"""job.checkpoint.store and job.checkpoint.resume, without a process group: durability, verification, fallback, pruning,
weights_only loading, refusal of non-finite state, disk full on a real small filesystem, resume checks.

Real files, real torch.save/torch.load, a real kill -9 of a process in the middle of saving and a real
tmpfs mounted for the disk-full case (root needed; in CI a missing capability fails instead of skipping).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.ci import require

from job.checkpoint import store as ckpt
from job.checkpoint.resume import check_resumable, config_differences, map_data_position
from job.config import load_config
from job.errors import BadInput

REPO = Path(__file__).resolve().parents[1]


def state(seed: int, mib: float = 0.25) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * 2**20 / 4)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(5, generator=g)}}, "param_groups": [{"lr": 0.1}]},
        "trainer": {"step": seed, "epoch": 0},
    }


def save(run_dir: Path, step: int, seed: int | None = None, keep_last: int = 10, mib: float = 0.25) -> None:
    m = ckpt.CheckpointManager(run_dir, keep_last, async_save=False, is_main=True)
    m.save(step, lambda: state(step if seed is None else seed, mib), {"world_size": 1})


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# --- durability and verification ----------------------------------------------------------------------


def test_save_writes_manifest_last_and_loads_back(tmp_path: Path) -> None:
    save(tmp_path, 3)
    d = tmp_path / "step-0000003"
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "state.pt"]
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert manifest["files"]["state.pt"]["size"] == (d / "state.pt").stat().st_size
    assert len(manifest["files"]["state.pt"]["sha256"]) == 64
    found = ckpt.find_latest(tmp_path)
    assert found is not None and found.step == 3
    assert_same(ckpt.load_state(found), state(3))
    assert not list(tmp_path.glob("*.tmp-*"))


def _corrupt_truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _corrupt_flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    for i in (len(data) // 3, len(data) // 2, len(data) - 10):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize(("how", "reason"), [(_corrupt_truncate, "truncated"), (_corrupt_flip, "sha256")])
def test_corrupt_newest_falls_back_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how, reason: str
) -> None:
    save(tmp_path, 2)
    save(tmp_path, 4)
    how(tmp_path / "step-0000004" / "state.pt")
    with caplog.at_level(logging.WARNING, logger="job"):
        found = ckpt.find_latest(tmp_path)
    assert found is not None and found.step == 2
    assert_same(ckpt.load_state(found), state(2))
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(tmp_path / "step-0000004" / "state.pt") in warning and reason in warning


def test_missing_or_broken_manifest_is_not_a_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save(tmp_path, 1)
    save(tmp_path, 2)
    save(tmp_path, 3)
    (tmp_path / "step-0000003" / "manifest.json").unlink()  # a save that never completed
    (tmp_path / "step-0000002" / "manifest.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="job"):
        assert ckpt.find_latest(tmp_path).step == 1
    text = caplog.text
    assert "step-0000003/manifest.json is missing" in text and "step-0000002/manifest.json is unreadable" in text


def test_tmp_directories_are_ignored_and_cleaned(tmp_path: Path) -> None:
    save(tmp_path, 1)
    torn = tmp_path / "step-0000002.tmp-123-4"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"partial")
    assert ckpt.find_latest(tmp_path).step == 1
    ckpt.CheckpointManager(tmp_path, 3, False, True).clean_stale_tmp()
    assert not torn.exists() and (tmp_path / "step-0000001").is_dir()


# One interpreter imports torch once; each "go" on stdin forks a child that saves 4 MiB checkpoints in a
# loop until it is killed (a fresh process per kill would pay torch's import each time). The child marks
# its pid and each save's start and end on the shared stdout; the parent reports the child's death.
SAVER = r"""
import os, sys, torch
from pathlib import Path
from job.checkpoint import store as ckpt
zygote = os.getpid()
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        print("child", os.getpid(), flush=True)
        m = ckpt.CheckpointManager(Path(sys.argv[1]), 1000, async_save=False, is_main=True)
        step = 0
        while os.getppid() == zygote:  # never outlive the test's saver process
            step += 1
            print("begin", step, flush=True)
            m.save(step, lambda: {"w": torch.full((1 << 20,), float(step))}, {"world_size": 1})
            print("end", step, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print("reaped", pid, flush=True)
"""
KILL_AT = (0.0, 0.2, 0.4, 0.6, 0.8)  # how far into a save's writing each kill lands (1: a whole save's writing)


def _read_until(saver: subprocess.Popen, prefix: str) -> str:
    while line := saver.stdout.readline():
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"the saver exited before printing {prefix!r}")


def _appears(run_dir: Path, step: int) -> float:
    """When the save of ``step`` has created its directory (staging or final: whatever the saver writes)."""
    deadline = time.monotonic() + 60
    while not any(run_dir.glob(f"{ckpt.step_dir_name(step)}*")):
        assert time.monotonic() < deadline, f"no directory for step {step} in {run_dir}"
        time.sleep(0.001)
    return time.monotonic()


def _kill_during_a_save(saver: subprocess.Popen, run_dir: Path, fraction: float) -> bool:
    """Start a saving child; SIGKILL it ``fraction`` of its second save's writing time (its directory made to
    the save returned) after its third save made its directory. True if the child's own log shows it died
    inside a save (a begin without its end)."""
    saver.stdin.write("go\n")
    saver.stdin.flush()
    child = int(_read_until(saver, "child ").split()[1])
    _read_until(saver, "begin 2")
    made = _appears(run_dir, 2)
    _read_until(saver, "end 2")
    writing_s = time.monotonic() - made
    _read_until(saver, "begin 3")
    seen = _appears(run_dir, 3)
    time.sleep(max(0.0, seen + fraction * writing_s - time.monotonic()))
    os.kill(child, signal.SIGKILL)
    last = "begin 3"
    while (line := saver.stdout.readline().strip()) != f"reaped {child}":
        assert line, "the saver exited"
        last = line
    return last.startswith("begin")


def test_kill_9_during_saves_never_leaves_a_bad_checkpoint(tmp_path: Path) -> None:
    """A real process saving 4 MiB checkpoints in a loop is killed with SIGKILL at several points of a save;
    every directory with a final name verifies, the newest one loads, a torn one is only ever a .tmp.
    The kills are shown to land inside saves, some of them before the save's final rename."""
    run_dir = tmp_path / "run"
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(run_dir)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    in_save = torn = 0
    try:
        for attempt, fraction in enumerate(KILL_AT):
            in_save += _kill_during_a_save(saver, run_dir, fraction)
            torn += bool(list(run_dir.glob("step-*.tmp-*")))  # killed between the save's mkdir and rename
            finals = ckpt.scan(run_dir)
            assert finals, "at least the first save completed"
            for step, path in finals:
                ok, reason, _ = ckpt.verify(path)
                assert ok, f"attempt {attempt}: {path}: {reason}"
            found = ckpt.find_latest(run_dir)
            loaded = ckpt.load_state(found)
            assert torch.equal(loaded["w"], torch.full((1 << 20,), float(found.step)))
            ckpt.CheckpointManager(run_dir, 1000, False, True).clean_stale_tmp()
            assert not list(run_dir.glob("*.tmp-*"))
            # the next "attempt" starts where this one stopped: move the numbers on so steps never repeat
            for step, path in finals:
                path.rename(run_dir / f"old{attempt}-{path.name}")
    finally:
        saver.stdin.close()
        try:
            saver.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a child still saving: the saver's death stops it too
            saver.kill()
    print(f"\n{len(KILL_AT)} kills: {in_save} inside a save, {torn} before its rename")
    assert in_save * 2 > len(KILL_AT), f"only {in_save} of {len(KILL_AT)} kills landed inside a save"
    assert torn >= 1, "no kill landed while a checkpoint was being written (before its rename)"


# --- keep-last-K ---------------------------------------------------------------------------------------


def test_keep_last_k(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)
    assert [s for s, _ in ckpt.scan(tmp_path)] == [5, 4]


def test_keep_last_never_deletes_the_only_valid_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 1, keep_last=1)
    save(tmp_path, 2, keep_last=10)
    save(tmp_path, 3, keep_last=10)
    _corrupt_flip(tmp_path / "step-0000002" / "state.pt")
    _corrupt_truncate(tmp_path / "step-0000003" / "state.pt")
    m = ckpt.CheckpointManager(tmp_path, 1, False, True)
    resumed = ckpt.find_latest(tmp_path)  # a resume skips the two broken ones, hashing them as it reads them
    assert resumed is not None and resumed.step == 1
    m.resumed_from(resumed)
    m.prune()  # two newer but broken checkpoints do not count towards K=1
    assert ckpt.find_latest(tmp_path).step == 1
    assert (tmp_path / "step-0000001").is_dir()
    save(tmp_path, 4, keep_last=1)  # now a newer valid one exists: the old valid one may go
    assert ckpt.find_latest(tmp_path).step == 4
    assert not (tmp_path / "step-0000001").exists()


def _rchar() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def test_saving_and_pruning_read_nothing_but_manifests(tmp_path: Path) -> None:
    """Each file is hashed as it is written, and pruning trusts the manifests this process wrote: 4 saves of 4 MiB
    with keep_last 2 read a few kilobytes (the manifests), where hashing after writing and re-verifying the kept
    checkpoints read 3 times the checkpoint per save."""
    m = ckpt.CheckpointManager(tmp_path, 2, async_save=False, is_main=True)
    m.save(1, lambda: state(1, mib=4), {"world_size": 1})  # the first save pays torch.save's lazy imports
    before = _rchar()
    for step in range(2, 6):
        m.save(step, lambda s=step: state(s, mib=4), {"world_size": 1})
    read = _rchar() - before
    size = (tmp_path / "step-0000005" / "state.pt").stat().st_size
    print(f"\n4 saves of {size} bytes read {read} bytes")
    assert [s for s, _ in ckpt.scan(tmp_path)] == [5, 4]
    assert ckpt.verify(tmp_path / "step-0000005")[0]
    assert read < 0.01 * size


def test_an_interrupted_prune_leaves_no_torn_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill in the middle of deleting an old checkpoint: what is left is a .tmp- directory that the next
    start removes, never a half-deleted step-* directory among the checkpoints."""
    save(tmp_path, 1, keep_last=10)
    save(tmp_path, 2, keep_last=10)

    def killed_midway(path: Path, ignore_errors: bool = False) -> None:
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()  # one file gone, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.CheckpointManager(tmp_path, 1, False, True).prune()
    monkeypatch.undo()
    assert [s for s, _ in ckpt.scan(tmp_path)] == [2]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("step-0000001")]
    assert len(leftovers) == 1 and ".tmp-" in leftovers[0], leftovers
    ckpt.CheckpointManager(tmp_path, 1, False, True).clean_stale_tmp()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000002"]


def test_a_corrupted_checkpoint_of_the_same_step_is_replaced(tmp_path: Path) -> None:
    """Resume fell back past a corrupted step-4; training reaches step 4 again: the new save must win."""
    save(tmp_path, 4, seed=100)
    _corrupt_flip(tmp_path / "step-0000004" / "state.pt")
    save(tmp_path, 4, seed=4)
    found = ckpt.find_latest(tmp_path)
    assert found.step == 4
    assert_same(ckpt.load_state(found), state(4))
    assert not list(tmp_path.glob("*.tmp-*"))


# --- what may be saved and loaded ------------------------------------------------------------------------


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loading_never_runs_code(tmp_path: Path) -> None:
    """A state.pt that would run code on unpickling (here: create a file), with a manifest that verifies."""
    marker = tmp_path / "code-ran"
    d = tmp_path / "run" / "step-0000001"
    d.mkdir(parents=True)
    torch.save({"model": _RunsCode(str(marker))}, d / "state.pt")
    assert not marker.exists()
    f = d / "state.pt"
    (d / "manifest.json").write_text(
        json.dumps(
            {"step": 1, "world_size": 1, "files": {"state.pt": {"size": f.stat().st_size, "sha256": ckpt._sha256(f)}}}
        )
    )
    found = ckpt.find_latest(tmp_path / "run")
    assert found is not None and found.step == 1  # it verifies: only weights_only stands in the way
    with pytest.raises(ckpt.CheckpointLoadError, match=r"step-0000001/state.pt.*weights_only=True"):
        ckpt.load_state(found)
    assert not marker.exists()


def test_non_finite_state_is_never_saved(tmp_path: Path) -> None:
    bad = state(1)
    bad["optimizer"]["state"][0]["momentum_buffer"][2] = float("nan")
    bad["model"]["b"][0] = float("inf")
    m = ckpt.CheckpointManager(tmp_path, 3, async_save=False, is_main=True)
    with pytest.raises(ckpt.NonFiniteStateError, match=r"model\.b.*optimizer\.state\.0\.momentum_buffer"):
        m.save(1, lambda: bad, {"world_size": 1})
    assert not any(tmp_path.iterdir())


def test_async_save_copies_state_first_and_waits(tmp_path: Path) -> None:
    """The background write sees the state as it was at save(); training may change it right after."""
    live = state(7, mib=8)
    expected = state(7, mib=8)
    # The writer waits 0.5 s: the second save is requested while the first write is in flight, and the
    # host buffers it would reuse are still being read.
    m = ckpt.CheckpointManager(tmp_path, 3, async_save=True, is_main=True, write_delay_s=0.5)
    m.save(1, lambda: live, {"world_size": 1})
    assert m.in_flight()
    live["model"]["w"].add_(1.0)  # the training thread goes on mutating parameters in place
    m.save(2, lambda: live, {"world_size": 1})  # waits for save 1: at most one in flight
    live["model"]["w"].add_(1.0)
    m.save(3, lambda: live, {"world_size": 1})
    m.wait()
    assert not m.in_flight()
    assert_same(ckpt.load_state(ckpt.Found(1, tmp_path / "step-0000001", {})), expected)
    expected["model"]["w"].add_(1.0)
    assert_same(ckpt.load_state(ckpt.Found(2, tmp_path / "step-0000002", {})), expected)
    assert torch.equal(ckpt.load_state(ckpt.find_latest(tmp_path))["model"]["w"], live["model"]["w"])


def test_host_staging_reuses_buffers_and_keeps_the_structure() -> None:
    from job.checkpoint.snapshot import HostStaging

    live = {"w": torch.randn(64, 3).t(), "pair": (torch.arange(5), 3), "n": [1.5]}  # .t(): non-contiguous
    staging = HostStaging()
    first = staging.snapshot(live)
    ptrs = [first["w"].data_ptr(), first["pair"][0].data_ptr()]
    assert isinstance(first["pair"], tuple) and first["pair"][1] == 3 and first["n"] == [1.5]
    assert first["w"].stride() == live["w"].stride() and torch.equal(first["w"], live["w"])
    assert first["w"].data_ptr() != live["w"].data_ptr()
    live["w"].mul_(2)
    assert not torch.equal(first["w"], live["w"])  # a copy, not a view of the live tensor
    second = staging.snapshot(live)
    assert [second["w"].data_ptr(), second["pair"][0].data_ptr()] == ptrs  # no new allocation
    assert torch.equal(second["w"], live["w"])
    live["pair"] = (torch.arange(6), 3)  # shape changed: that buffer alone is reallocated
    third = staging.snapshot(live)
    assert third["w"].data_ptr() == ptrs[0] and third["pair"][0].data_ptr() != ptrs[1]
    assert torch.equal(third["pair"][0], torch.arange(6))
    assert staging.nbytes == 64 * 3 * 4 + 6 * 8


# --- disk full -----------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        require(False, f"cannot mount a tmpfs (root needed): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_keeps_earlier_checkpoints_and_says_where_and_how_much(small_fs: Path, async_save: bool) -> None:
    run_dir = small_fs / "run"
    m = ckpt.CheckpointManager(run_dir, 3, async_save=async_save, is_main=True)
    m.save(1, lambda: state(1, mib=1), {"world_size": 1})
    m.wait()
    with pytest.raises(ckpt.CheckpointWriteError) as err:  # sync: from save(); async: from wait()
        m.save(2, lambda: state(2, mib=4), {"world_size": 1})  # 4 MiB into the 2 MiB left
        m.wait()
    msg = str(err.value)
    assert str(run_dir / "step-0000002") in msg and "No space left on device" in msg
    assert "needs about 4.0 MiB" in msg and "MiB are free" in msg and "Fix:" in msg
    ok, reason, _ = ckpt.verify(run_dir / "step-0000001")
    assert ok, reason
    assert [s for s, _ in ckpt.scan(run_dir)] == [1]
    assert not list(run_dir.glob("*.tmp-*")), "the torn save is removed, giving the space back"
    assert_same(ckpt.load_state(ckpt.find_latest(run_dir)), state(1, mib=1))


# --- resume checks (pure) --------------------------------------------------------------------------------


def _manifest(argv: list[str], world_size: int, micro: int = 4, mbie: int = 2) -> dict:
    cfg = load_config(argv, {})
    from job.config import config_to_dict

    return {
        "step": 6,
        "world_size": world_size,
        "config": config_to_dict(cfg),
        "trainer": {"step": 6, "epoch": 1, "micro_batches_in_epoch": mbie},
        "plan": {"world_size": world_size, "micro_batch_size": micro, "global_batch_size": 16},
    }


def test_resume_with_changed_config_is_refused_naming_the_setting_and_the_flag() -> None:
    saved = _manifest(["--optim.lr", "0.1"], 2)
    how = [
        "--train.activation-checkpointing",
        "true",
        "--model.compile",
        "true",
        "--model.compile-mode",
        "max-autotune",
    ]
    cfg = load_config(["--optim.lr", "0.2", "--train.steps", "50", "--run.name", "other", *how], {})
    # steps, name, and how the same forward runs may change
    assert config_differences(saved["config"], cfg) == ["optim.lr: checkpoint 0.1 -> now 0.2"]
    with pytest.raises(
        BadInput, match=r"optim\.lr: checkpoint 0\.1 -> now 0\.2(.|\n)*--ckpt\.allow-config-change true"
    ):
        check_resumable(saved, cfg, 2, 4)
    check_resumable(saved, load_config(["--optim.lr", "0.2", "--ckpt.allow-config-change", "true"], {}), 2, 4)


def test_resume_with_other_world_size_is_refused_unless_allowed_and_mappable() -> None:
    saved = _manifest([], 2, micro=4, mbie=2)  # 2 micro-batches x 2 ranks x 4 = 16 samples into the epoch
    with pytest.raises(BadInput, match=r"world_size=2.*world_size=1.*--ckpt\.allow-world-size-change true") as e:
        check_resumable(saved, load_config([], {}), 1, 8)
    # What holds across a world-size change, and what does not (tests/test_fsdp.py: a model without dropout
    # resumed 2 -> 1 -> 4 sees every sample as often and ends within summation order of the uninterrupted run).
    assert "each sample is trained on as often and in the same order" in e.value.fix
    assert "dropout masks differ" in e.value.fix
    allowed = load_config(["--ckpt.allow-world-size-change", "true"], {})
    check_resumable(saved, allowed, 1, 8)
    assert map_data_position(saved["trainer"], saved["plan"], 1, 8) == 2  # 16 samples = 2 rows of 1 x 8
    assert map_data_position(saved["trainer"], saved["plan"], 4, 2) == 2  # 2 rows of 4 x 2
    assert map_data_position(saved["trainer"], saved["plan"], 1, 16) == 1
    with pytest.raises(BadInput, match=r"16 samples.*not a multiple of 12"):
        check_resumable(saved, allowed, 3, 4)
