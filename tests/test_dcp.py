"""One checkpoint format for both strategies: DDP runs write their model, optimizer and EMA as every rank's shards with
torch.distributed.checkpoint, laid out as an fsdp run's, so either strategy resumes the other's checkpoints.

Real torchrun runs on gloo of the causal language model, its training items counted (support.counting_lm), with
the settings of tests/test_fsdp.py:
  ddp        2 processes, DDP, 6 steps: the uninterrupted run
  to_fsdp    resumed from ddp's step 2 under fsdp, ends at step 6 (its step 4 is saved)
  to_ddp     resumed from to_fsdp's step 4 under ddp: the ddp -> fsdp -> ddp chain
  legacy     resumed under ddp from ddp's step 2 rewritten as a checkpoint of the earlier format (state.pt only)
  legacy_fsdp  the same checkpoint resumed under fsdp
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli import run_cli, torchrun
from support.lm import make_corpus
from support.runs import assert_bitwise_equal, load_final_state
from test_fsdp import GLOBAL, STEPS, counting_env, max_diff, resume_from, run, train_args, visits

from job.checkpoint import store

FSDP = ("--train.strategy", "fsdp")


def as_earlier_format(step_dir: Path, dst: Path) -> None:
    """The checkpoint at ``step_dir`` as the earlier DDP format wrote it at ``dst``'s step: everything in state.pt
    (the model's state dict, ``optimizer.state_dict()`` with parameters numbered, AveragedModel's state dict), no
    shards, committed by the same store."""
    whole = store.read_checkpoint(step_dir)
    optimizer = whole["optimizer"]
    order = [name for group in optimizer["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(order)}
    whole["optimizer"] = {
        "state": {number[name]: s for name, s in optimizer["state"].items()},
        "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in optimizer["param_groups"]],
    }
    manifest = json.loads((step_dir / store.MANIFEST).read_text())
    meta = {k: v for k, v in manifest.items() if k not in ("files", "step", "shards")}
    dst.mkdir(parents=True)
    store._write_checkpoint(dst, int(manifest["step"]), whole, meta)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dcp")
    corpus = make_corpus(out / "corpus")
    logs = {"ddp": run(2, train_args(out, corpus, "ddp"), out)}
    resume_from(out / "ddp", 2, out / "to_fsdp")
    logs["to_fsdp"] = run(2, train_args(out, corpus, "to_fsdp", *FSDP), out)
    resume_from(out / "to_fsdp", 4, out / "to_ddp")
    logs["to_ddp"] = run(2, train_args(out, corpus, "to_ddp"), out)
    as_earlier_format(out / "ddp" / "step-0000002", out / "legacy")
    logs["legacy"] = run(2, train_args(out, corpus, "legacy"), out)
    as_earlier_format(out / "ddp" / "step-0000002", out / "legacy_fsdp")
    logs["legacy_fsdp"] = run(2, train_args(out, corpus, "legacy_fsdp", *FSDP), out)
    return {"out": out, "corpus": corpus, "logs": logs}


@pytest.mark.integration
def test_a_ddp_checkpoint_is_every_ranks_shards(runs: dict[str, Any]) -> None:
    """Nothing gathered onto rank 0: each rank wrote its half of the model, optimizer and EMA."""
    step = runs["out"] / "ddp" / "step-0000002"
    manifest = json.loads((step / store.MANIFEST).read_text())
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata", "state.pt"} <= set(manifest["files"])
    assert manifest["shards"] == ["model", "optimizer", "ema"]
    saved = torch.load(step / "state.pt", map_location="cpu", weights_only=True)
    assert not {"model", "optimizer", "ema"} & set(saved)
    sizes = [manifest["files"][f"shards/__{rank}_0.distcp"]["size"] for rank in (0, 1)]
    print(f"\nshard files of a 2-process DDP checkpoint: {sizes} bytes")
    assert max(sizes) < 0.6 * sum(sizes)


@pytest.mark.integration
def test_ddp_to_fsdp_to_ddp_sees_every_sample_as_often_and_ends_within_fp32_tolerance(
    runs: dict[str, Any],
) -> None:
    """Steps 1-2 under ddp, 3-4 under fsdp, 5-6 under ddp (2 processes each, no config change allowed: the strategy
    may change on resume): the samples trained on and the parameters match the uninterrupted DDP run's."""
    out = runs["out"]
    whole = visits(out / "ddp", None)
    calls = 2 * 4  # 2 steps of 4 micro-batches per process
    chain = visits(out / "ddp", calls) + visits(out / "to_fsdp", calls) + visits(out / "to_ddp", None)
    print(f"\nvisits: uninterrupted {sum(whole.values())} items, chain {sum(chain.values())} items")
    assert sum(whole.values()) == STEPS * GLOBAL
    assert chain == whole
    assert "resumed from" in runs["logs"]["to_fsdp"] and "resumed from" in runs["logs"]["to_ddp"]
    want, got = load_final_state(out / "ddp"), load_final_state(out / "to_ddp")
    diff, ema_diff = max_diff(want["model"], got["model"]), max_diff(want["ema"], got["ema"])
    opt_diff = max_diff(_flat(want["optimizer"]["state"]), _flat(got["optimizer"]["state"]))
    print(
        f"max |diff| ddp -> fsdp -> ddp vs uninterrupted ddp: model {diff:.3g}, EMA {ema_diff:.3g}, Adam {opt_diff:.3g}"
    )
    assert diff <= 1e-5 and ema_diff <= 1e-5 and opt_diff <= 1e-5
    assert want["trainer"] == got["trainer"]
    moved = max_diff(store.read_checkpoint(out / "ddp" / "step-0000002")["model"], want["model"])
    assert moved > 1e-3, "parameters barely moved: the comparison would be vacuous"


def _flat(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": t for name, s in state.items() for key, t in s.items() if t.ndim}


@pytest.mark.integration
def test_a_checkpoint_of_the_earlier_format_still_resumes_under_either_strategy(runs: dict[str, Any]) -> None:
    """state.pt only: under ddp the resumed run ends bitwise where the uninterrupted one does; under fsdp within
    fp32 tolerance."""
    out = runs["out"]
    assert not (out / "legacy" / "step-0000002" / "shards").exists()
    assert "resumed from" in runs["logs"]["legacy"] and "resumed from" in runs["logs"]["legacy_fsdp"]
    want, got = load_final_state(out / "ddp"), load_final_state(out / "legacy")
    for key in ("model", "optimizer", "ema", "trainer"):
        assert_bitwise_equal(want[key], got[key], key)
    fsdp = load_final_state(out / "legacy_fsdp")
    assert max_diff(want["model"], fsdp["model"]) <= 1e-5 and max_diff(want["ema"], fsdp["ema"]) <= 1e-5


@pytest.mark.integration
def test_a_corrupt_shard_only_rank_1_hashes_makes_both_ranks_fall_back(runs: dict[str, Any], tmp_path: Path) -> None:
    """On resume each rank verifies the items it reads (at the same world size, rank 1 reads the shard file it
    wrote); a flipped byte in rank 1's shard of step 6 makes both ranks skip it and resume from step 5, and nothing
    is deleted."""
    run_dir = tmp_path / "runs" / "corrupt"
    run_dir.mkdir(parents=True)
    for step in (5, 6):
        shutil.copytree(runs["out"] / "ddp" / f"step-{step:07d}", run_dir / f"step-{step:07d}")
    shard = run_dir / "step-0000006" / "shards" / "__1_0.distcp"
    manifest = json.loads((run_dir / "step-0000006" / store.MANIFEST).read_text())
    assert "shards/__1_0.distcp" in store.share(manifest["files"], 1, 2)
    assert "shards/__1_0.distcp" not in store.share(manifest["files"], 0, 2)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    args = train_args(tmp_path / "runs", runs["corpus"], "corrupt")
    r = torchrun(2, args, env=counting_env(tmp_path, run_dir), timeout=600)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    for rank in (0, 1):
        lines = [line for line in text.splitlines() if f"[rank {rank}/2]" in line]
        skipped = [line for line in lines if "skipping checkpoint" in line and "step-0000006" in line]
        assert skipped and "rank 1:" in skipped[0] and "__1_0.distcp" in skipped[0], lines[:20]
        assert any(f"resumed from {run_dir / 'step-0000005'}" in line for line in lines), lines[:20]
    assert (run_dir / "step-0000005").is_dir()


def test_each_file_is_hashed_by_one_rank_and_each_rank_hashes_its_own_shards() -> None:
    files = {f"shards/__{r}_0.distcp": {"size": 100 + r} for r in range(4)}
    files |= {"shards/.metadata": {"size": 10}, "state.pt": {"size": 50}}
    for world_size in (1, 2, 3, 4, 8):
        shares = [store.share(files, rank, world_size) for rank in range(world_size)]
        assert sorted(f for s in shares for f in s) == sorted(files)
        for rank in range(min(world_size, 4)):
            assert f"shards/__{rank}_0.distcp" in shares[rank]
    two = [store.share(files, rank, 2) for rank in (0, 1)]
    loads = [sum(files[f]["size"] for f in s) for s in two]
    assert max(loads) - min(loads) <= 150  # the 4 shards of a 4-process save spread over 2 ranks, then the rest


@pytest.mark.integration
@pytest.mark.parametrize(("run_name", "strategy", "nproc"), [("ddp", "fsdp", "2"), ("to_fsdp", "ddp", "1")])
def test_evaluate_reads_either_strategys_checkpoint_under_either(
    runs: dict[str, Any], tmp_path: Path, run_name: str, strategy: str, nproc: str
) -> None:
    """``ddp-job evaluate`` of a DDP checkpoint under fsdp at 2 processes, and of an fsdp one under ddp at 1: the
    EVAL line carries the run's FINAL values."""
    run_dir = runs["out"] / run_name
    final = re.search(r"^FINAL step=6 (.*) run_dir=", runs["logs"][run_name], re.M)
    assert final
    r = run_cli(
        [
            "evaluate",
            *("--config", str(run_dir / "config.yaml"), "--dist.nproc-per-node", nproc),
            *("--train.strategy", strategy, "--ckpt.path", str(run_dir / "step-0000006")),
        ],
        env=counting_env(tmp_path, tmp_path / "visits"),
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = re.search(r"^EVAL step=6 (.*) checkpoint=", r.stdout, re.M)
    assert got, r.stdout[-3000:]
    print(f"\nrun:      {final[1]}\nevaluate: {got[1]}")
    assert got[1] == final[1]


class Averaged(torch.nn.Module):
    """What a sharded checkpoint needs of an EMA (job.train.ema.Ema's shape)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        from torch.optim.swa_utils import AveragedModel

        self.averaged = AveragedModel(model, use_buffers=True)
        self.updates = 0
        self.loaded_none = False

    @property
    def module(self) -> torch.nn.Module:
        return self.averaged.module

    def load_state_dict(self, saved: Any, strict: bool = True, assign: bool = False) -> Any:
        self.loaded_none = saved is None


def test_ddp_shards_refuse_non_finite_values_and_an_ema_enabled_on_resume_starts_fresh(tmp_path: Path) -> None:
    """In one gloo process: a NaN in a replicated model's state writes nothing (every rank would refuse); a checkpoint
    without an EMA loads into a run with one, which starts from the weights."""
    import torch.distributed as dist

    from job.checkpoint.sharded import Sharded
    from job.errors import NonFiniteStateError
    from job.parallel import fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        fsdp.init_optimizer_state(opt)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        tmp, _, _ = Sharded(model, opt, 0).save(tmp_path, "step-0000001", True)
        with torch.no_grad():
            model.weight[1, 2] = float("nan")
        with pytest.raises(NonFiniteStateError):
            Sharded(model, opt, 0).save(tmp_path, "step-0000002", True)
        assert not (tmp_path / "step-0000002.tmp-shards").exists()
        fresh = torch.nn.Linear(4, 3)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        fsdp.init_optimizer_state(fresh_opt)
        ema = Averaged(fresh)
        Sharded(fresh, fresh_opt, 0, ema=ema).load(tmp, {}, {})
        assert ema.loaded_none and ema.updates == 0
        assert torch.equal(fresh.bias, model.bias) and int(fresh_opt.state[fresh.bias]["step"]) == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars", "lamb"])
def test_optimizer_state_created_up_front_trains_like_a_fresh_one(name: str) -> None:
    """Under ddp too the optimizer's state is created before the first step (a load needs its shape): three steps from
    it equal three from a fresh optimizer, bitwise (timm's LAMB counts its steps in the parameter groups)."""
    from timm.optim import Lamb, Lars

    from job.parallel import fsdp

    optimizers: dict[str, Any] = {
        "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "adamw": (torch.optim.AdamW, {"lr": 0.1}),
        "lars": (Lars, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
        "lamb": (Lamb, {"lr": 0.1, "max_grad_norm": None, "weight_decay": 0.1}),
    }
    cls, kwargs = optimizers[name]
    trained = []
    for up_front in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = cls(model.parameters(), **kwargs)
        if up_front:
            fsdp.init_optimizer_state(opt)
        for _ in range(3):
            model(torch.ones(2, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        trained.append(dict(model.state_dict()))
    assert_bitwise_equal(trained[0], trained[1], name)


def _resumable(run_dir: Path, total_steps: int, micro_batch_size: int) -> Any:
    """A Linear under AdamW + warmup and cosine over ``total_steps`` with the job's checkpointer (one gloo process):
    (checkpointer, optimizer, scheduler, trainer state)."""
    from job.checkpoint import cadence
    from job.checkpoint.checkpointer import Checkpointer
    from job.checkpoint.sharded import Sharded
    from job.checkpoint.states import Layout, Progress, Schedule, States
    from job.config.plan import Plan
    from job.config.schema import SchedConfig
    from job.parallel import fsdp
    from job.train.optim import build_scheduler
    from job.train.step import TrainState

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    fsdp.init_optimizer_state(optimizer)
    scheduler = build_scheduler(optimizer, SchedConfig(name="cosine", warmup_steps=1), total_steps)
    state = TrainState()
    layout = Layout(1, Plan(1, 16, micro_batch_size, 16 // micro_batch_size, total_steps, 0.1))
    states = States()
    states.add("layout", layout)
    states.add("trainer", Progress(state, layout, micro_batch_size))
    states.add("scheduler", Schedule(scheduler, layout, state))
    manager = store.CheckpointManager(run_dir, 5, False, True, sharded=Sharded(model, optimizer, 0))
    meta = {"world_size": 1, "plan": layout.current["plan"]}
    return Checkpointer(manager, states, cadence.Fixed(1), total_steps, lambda: meta), optimizer, scheduler, state


def test_a_resume_with_other_steps_and_micro_batch_keeps_the_new_lr_and_the_sample_position(tmp_path: Path) -> None:
    """Saved after 3 steps of 4 at micro batch 2 (8 micro-batches a step: 24 of them, 48 samples), resumed with
    train.steps 8 at micro batch 4: the first resumed step runs at the 8-step schedule's learning rate (the
    optimizer's saved one belongs to the 4-step schedule), and the position is 12 micro-batches of 4 samples."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saving, optimizer, scheduler, state = _resumable(tmp_path, 4, 2)
        for _ in range(3):
            optimizer.step()
            scheduler.step()
        state.step, state.micro_batches_in_epoch, state.samples_seen = 3, 24, 48
        saved_lr = optimizer.param_groups[0]["lr"]
        saving.save(3)
        resumed, optimizer, scheduler, state = _resumable(tmp_path, 8, 4)
        found = store.find_latest(tmp_path)
        assert found is not None and found.step == 3
        resumed.restore(found)
        _, fresh_optimizer, fresh_scheduler, _ = _resumable(tmp_path / "fresh", 8, 4)
        for _ in range(3):
            fresh_optimizer.step()
            fresh_scheduler.step()
        want = fresh_optimizer.param_groups[0]["lr"]
        assert abs(want - saved_lr) > 0.01
        assert optimizer.param_groups[0]["lr"] == want
        assert state.step == 3 and state.micro_batches_in_epoch == 12 and state.samples_seen == 48
    finally:
        dist.destroy_process_group()


def test_shards_saved_at_three_ranks_load_the_same_values_under_either_strategy(tmp_path: Path) -> None:
    """Rows that do not split evenly over 3 ranks (chunks of 3, 3 and 1 rows; of 1, 1 and none), saved as every
    rank's shards under ddp or fsdp and loaded into a fresh, untrained model and optimizer under either: every
    parameter, every optimizer state tensor (gathered whole) and the learning rate equal what was saved, on every
    rank."""
    import subprocess

    from support import ROOT
    from support.ci import bin_path
    from support.cli import base_env

    worker = ROOT / "tests" / "support" / "dcp_worker.py"
    cmd = [bin_path("torchrun"), "--standalone", "--nproc-per-node=3", str(worker), str(tmp_path)]
    r = subprocess.run(cmd, env=base_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results) == ["ddp->ddp", "ddp->fsdp", "fsdp->ddp", "fsdp->fsdp"]
    for name, ranks in results.items():
        assert len(ranks) == 3, name
        for rank in ranks:
            assert rank["tensors"] == 4 * 4 + 1, (name, rank)  # 4 parameters with exp_avg, exp_avg_sq, step; lr
            assert rank["fresh_diff"] > 0, (name, rank)  # each tensor differs from the untrained build's
            assert rank["loaded_diff"] == 0, (name, rank)


def test_a_micro_batch_change_that_splits_a_row_is_refused_before_anything_starts() -> None:
    """At the same world size too: 3 micro-batches of 2 samples (6) are not a whole number of micro-batches of 4."""
    from job.checkpoint.resume import check_resumable
    from job.config import config_to_dict, load_config
    from job.errors import BadInput

    cfg = load_config(["--ckpt.allow-config-change", "true", "--train.micro-batch-size", "4"], {})
    plan = {"world_size": 1, "global_batch_size": 16, "micro_batch_size": 2}
    manifest = {"step": 1, "world_size": 1, "plan": plan, "trainer": {"epoch": 0, "micro_batches_in_epoch": 3}}
    manifest["config"] = config_to_dict(cfg)
    with pytest.raises(BadInput) as info:
        check_resumable(manifest, cfg, 1, 4)
    assert info.value.setting == "train.micro_batch_size" and "6 is not a multiple of 4" in info.value.what
    manifest["trainer"]["micro_batches_in_epoch"] = 4
    check_resumable(manifest, cfg, 1, 4)  # 8 samples: 2 micro-batches of 4
