"""What a sharded checkpoint costs in storage reads, measured (``rchar`` of /proc/self/io in every rank,
tests/support/ckpt_io_worker.py under real torchrun on gloo):

  save   2 processes, 4 saves (2 sync, 2 async) with ckpt.keep_last 2: each rank hashes what it writes as it writes
         it, rank 0 commits with the digests and prunes by manifests: the saves read next to nothing
  load   that 2-process checkpoint loaded at 3 processes: each stored item is read once, by one rank, and verified
         as it is read; the loaded state is the saved one; a flipped byte in one shard is refused by every rank with
         the same list
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.ci import bin_path
from support.cli import base_env

from job.checkpoint import store
from job.checkpoint.digest import sha256_of
from job.checkpoint.verified import ITEMS

WORKER = ROOT / "tests" / "support" / "ckpt_io_worker.py"


def launch(nproc: int, args: list[str], tmp_path: Path) -> None:
    import subprocess

    cmd = [bin_path("torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(WORKER), *args]
    r = subprocess.run(cmd, env=base_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def reports(out: Path, mode: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}-rank*.json"))]


def checkpoint_bytes(path: Path) -> int:
    files = json.loads((path / store.MANIFEST).read_text())["files"]
    return sum(int(entry["size"]) for entry in files.values())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ckpt_io")
    run_dir = out / "run"
    launch(2, ["save", str(run_dir), str(out)], out)
    return {"out": out, "run_dir": run_dir, "save": reports(out, "save")}


@pytest.mark.integration
def test_saves_read_next_to_nothing_and_keep_the_newest_two(saved: dict[str, Any]) -> None:
    run_dir = saved["run_dir"]
    assert [p.name for _, p in store.scan(run_dir)] == ["step-0000005", "step-0000004"]
    size = checkpoint_bytes(run_dir / "step-0000005")
    read = sum(r["rchar"] for r in saved["save"])
    per_save = read / saved["save"][0]["saves"] / size
    print(f"\nsaves: {read} bytes read by 2 ranks over 4 saves of {size} bytes: {per_save:.4f}x per save")
    assert len(saved["save"]) == 2
    assert per_save < 0.02  # the manifests pruning reads, DCP's small files; before, rank 0 read 3x per save


@pytest.mark.integration
def test_digests_taken_while_writing_match_the_files(saved: dict[str, Any]) -> None:
    """Every file's sha256 in the manifest and every item's in its own file, which rank 0 wrote without reading,
    match the bytes on disk; the manifest lists no item (every rank reads it)."""
    step = saved["run_dir"] / "step-0000005"
    ok, reason, manifest = store.verify(step)
    assert ok, reason
    shards = {n: e for n, e in manifest["files"].items() if n.startswith("shards/__")}
    assert sorted(shards) == ["shards/__0_0.distcp", "shards/__1_0.distcp"]
    assert all("items" not in entry for entry in manifest["files"].values())
    every_item = json.loads((step / ITEMS).read_text())
    for name in shards:
        data = (step / name).read_bytes()
        items = every_item[name.removeprefix("shards/")]
        assert sum(length for length, _ in items.values()) == len(data)
        for offset, (length, sha) in items.items():
            assert sha256_of(data[int(offset) : int(offset) + length]) == sha, (name, offset)


@pytest.fixture(scope="module")
def loaded(saved: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The 2-process checkpoint loaded at 3 processes, with a copy of an older one with a flipped byte in a shard and
    one with a flipped byte in its item digests: each rank's report."""
    tmp_path = tmp_path_factory.mktemp("ckpt_io_load")
    good = saved["run_dir"] / "step-0000005"
    bad, bad_items = tmp_path / "step-0000004", tmp_path / "step-0000003"
    shutil.copytree(saved["run_dir"] / "step-0000004", bad)
    flip(bad / "shards" / "__1_0.distcp")
    shutil.copytree(good, bad_items)
    flip(bad_items / ITEMS)
    launch(3, ["load", str(good), str(bad), str(bad_items), str(saved["out"])], tmp_path)
    return reports(saved["out"], "load")


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.integration
def test_a_load_at_another_world_size_reads_each_item_once_and_refuses_a_corrupt_one(
    saved: dict[str, Any], loaded: list[dict[str, Any]]
) -> None:
    good = saved["run_dir"] / "step-0000005"
    ranks = loaded
    assert len(ranks) == 3
    size = checkpoint_bytes(good)
    read = sum(r["step-0000005"]["rchar"] for r in ranks)
    print(f"\nload 2 -> 3 processes: {read} bytes read of a {size}-byte checkpoint: {read / size:.3f}x")
    assert all(r["step-0000005"]["model_equal"] and r["step-0000005"]["adam_equal"] for r in ranks)
    assert all(r["step-0000005"]["step"] == 1 for r in ranks)  # state.pt, as rank 0 sent it
    assert read <= 1.1 * size  # DCP alone reads whole chunks per rank: 2x here, and a hash pass before: 3x
    refused = [r["step-0000004"].get("corrupt") for r in ranks]
    print(f"corrupt shard: {refused[0]}")
    assert refused[0] and all(found == refused[0] for found in refused)
    assert any("__1_0.distcp" in f and "sha256" in f for f in refused[0])
    refused = [r["step-0000003"].get("corrupt") for r in ranks]
    print(f"corrupt item digests: {refused[0]}")
    assert refused[0] and all(found == refused[0] for found in refused)
    assert any(ITEMS in f and "sha256" in f for f in refused[0])


@pytest.mark.integration
def test_only_rank_0_reads_the_files_every_rank_needs_whole(loaded: list[dict[str, Any]]) -> None:
    """state.pt, DCP's .metadata and the item digests grow with the saving ranks and every loading rank needs all of
    them: rank 0 reads each once and sends it; the other ranks open nothing but shards (the load of the test above;
    reading these files on each of W ranks would read W x W_save x per-rank bytes)."""
    ranks = loaded
    assert len(ranks) == 3
    opened = [r["step-0000005"]["opened"] for r in ranks]
    print(f"\nfiles opened per rank: {opened}")
    small = ["items.json", "shards/.metadata", "state.pt"]
    assert sorted(n for n in opened[0] if not n.startswith("shards/__")) == small
    for others in opened[1:]:
        assert others and all(n.startswith("shards/__") for n in others), others
