"""train.strategy=fsdp: FSDP2 sharding beside DDP, and its sharded checkpoints (torch.distributed.checkpoint).

Real torchrun runs on gloo of the causal language model, its training items counted (support.counting_lm):
  ddp      2 processes, DDP: the reference for the parameters
  fsdp     2 processes, the same config under fsdp: the uninterrupted run
  one      resumed from fsdp's step 2 at 1 process, ends at step 6 (its step 4 is saved)
  four     resumed from one's step 4 at 4 processes: the 2 -> 1 -> 4 chain
  again    resumed from four's step 5 at 4 processes (bitwise)
  kept     resumed from fsdp's step 2 at 2 processes with fsdp.reshard_after_forward false, evaluated after every
           step: preflight's check and each evaluation leave the units gathered before a step or a save (bitwise;
           also the plain resume at the same world size: a separate run of it would repeat this one's assertions)
  compiled resumed from fsdp's step 2 at 2 processes with model.compile (aot_eager) and activation checkpointing
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli import run_cli, torchrun, user_code_env
from support.lm import make_corpus
from support.runs import assert_bitwise_equal, load_final_state
from support.tolerance import adamw_tolerance

from job.errors import BadInput

STEPS = 6
GLOBAL = 16  # micro 2: grad_accum_steps 4 at 2 processes, 8 at 1, 2 at 4
OPTIONS = {"seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0}
TERMS = GLOBAL * 32 * 4 * 32  # windows x tokens x the MLP's fan-in of 4 x n_embd feed one gradient element


def train_args(out: Path, corpus: Path, name: str, *extra: str) -> list[str]:
    options = {"path": str(corpus), **OPTIONS}
    return [
        *("--task.name", "support.counting_lm:task", "--task.options", json.dumps(options)),
        *("--run.output-dir", str(out), "--run.name", name, "--data.num-workers", "0"),
        *("--optim.name", "adamw", "--optim.lr", "0.003", "--optim.weight-decay", "0.1"),
        *("--sched.name", "cosine", "--sched.warmup-steps", "2", "--train.grad-clip-norm", "0.5"),
        *("--train.steps", str(STEPS), "--train.global-batch-size", str(GLOBAL), "--train.micro-batch-size", "2"),
        *("--ckpt.every", "1", "--ckpt.keep-last", "5", "--log.every", "1", "--log.tensorboard", "false"),
        *("--log.jsonl", "true"),  # train/lr of every step: support.tolerance.adamw_tolerance
        *("--ema.enabled", "true", "--ema.decay", "0.5", "--debug.nan-at-steps", "[3]"),
        *extra,
    ]


def counting_env(tmp: Path, run_dir: Path) -> dict[str, str]:
    return user_code_env(tmp, VISITS=str(run_dir / "visits"))


def run(n: int, args: list[str], tmp: Path) -> str:
    run_dir = Path(args[args.index("--run.output-dir") + 1]) / args[args.index("--run.name") + 1]
    r = torchrun(n, args, env=counting_env(tmp, run_dir), timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout + r.stderr


def resume_from(src: Path, step: int, dst: Path) -> None:
    dst.mkdir(parents=True)
    name = f"step-{step:07d}"
    shutil.copytree(src / name, dst / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    corpus = make_corpus(out / "corpus")
    fsdp = ["--train.strategy", "fsdp"]
    logs = {
        "ddp": run(2, train_args(out, corpus, "ddp"), out),
        "fsdp": run(2, train_args(out, corpus, "fsdp", *fsdp), out),
    }
    resize = [*fsdp, "--ckpt.allow-world-size-change", "true"]
    resume_from(out / "fsdp", 2, out / "one")
    logs["one"] = run(1, train_args(out, corpus, "one", *resize), out)
    resume_from(out / "one", 4, out / "four")
    logs["four"] = run(4, train_args(out, corpus, "four", *resize), out)
    resume_from(out / "four", 5, out / "again")
    logs["again"] = run(4, train_args(out, corpus, "again", *fsdp), out)
    resume_from(out / "fsdp", 2, out / "kept")
    kept = [*fsdp, "--fsdp.reshard-after-forward", "false", "--train.eval-every", "1"]
    logs["kept"] = run(2, train_args(out, corpus, "kept", *kept), out)
    resume_from(out / "fsdp", 2, out / "compiled")
    # aot_eager: Dynamo and AOTAutograd trace each unit's forward and backward, where FSDP's hooks and the
    # recomputation meet the graph; inductor's kernels are built in tests/test_image.py.
    compiled = [*fsdp, "--model.compile", "true", "--model.compile-backend", "aot_eager"]
    compiled += ["--train.activation-checkpointing", "true"]
    logs["compiled"] = run(2, train_args(out, corpus, "compiled", *compiled), out)
    return {"out": out, "corpus": corpus, "logs": logs}


def shards(step_dir: Path, tmp: Path) -> dict[str, Any]:
    """Every rank's shards of a checkpoint gathered into full tensors, on one process without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir / "shards", target)
    full: dict[str, Any] = torch.load(target, map_location="cpu", weights_only=True)
    return full


def newest(run_dir: Path) -> Path:
    return sorted(p for p in run_dir.glob("step-*") if ".tmp" not in p.name)[-1]


def visits(run_dir: Path, calls: int | None, micro: int = 2) -> Counter[int]:
    """Items trained on by the run's processes: per process its first ``calls`` micro-batches (None: all)."""
    seen: Counter[int] = Counter()
    for f in sorted((run_dir / "visits").glob("*.txt")):
        lines = f.read_text().split()
        if calls is not None:
            lines = lines[: calls * micro]
        seen.update(int(i) for i in lines)
    return seen


def after(log: str, marker: str) -> list[str]:
    """What follows ``marker`` on each line of ``log`` holding it, up to the run directory (which differs)."""
    return [line.split(marker, 1)[1].split("run_dir")[0] for line in log.splitlines() if marker in line]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = a.keys() & b.keys()
    assert len(keys) >= 10, sorted(keys)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys if a[k].is_floating_point())


@pytest.mark.integration
def test_fsdp_ends_within_fp32_tolerance_of_ddp(runs: dict[str, Any], tmp_path: Path) -> None:
    """Clipping, accumulation (4 micro-batches, one reduce-scatter), AdamW with decay, warmup + cosine, EMA, and
    a NaN loss at step 3 that the non-finite guard skips."""
    out = runs["out"]
    ddp_state = load_final_state(out / "ddp")
    fsdp = shards(newest(out / "fsdp"), tmp_path)
    assert newest(out / "fsdp").name == f"step-{STEPS:07d}"
    diff = max_diff(ddp_state["model"], fsdp["model"])
    ddp_ema = {k.removeprefix("module."): v for k, v in ddp_state["ema"].items() if k.startswith("module.")}
    ema_diff = max_diff(ddp_ema, fsdp["ema"]["module"])
    tol = adamw_tolerance([out / "ddp", out / "fsdp"], TERMS)  # the EMA averages parameters within it
    print(
        f"\nmax |param diff| FSDP vs DDP, 2 processes, fp32, {STEPS} steps: {diff:.3g} (EMA {ema_diff:.3g}; "
        f"tolerance {tol:.3g})"
    )
    assert diff <= tol and ema_diff <= tol
    assert int(fsdp["ema"]["n_averaged"]) == int(ddp_state["ema"]["n_averaged"]) == STEPS
    assert load_final_state(out / "fsdp")["trainer"]["nonfinite_skips"] == ddp_state["trainer"]["nonfinite_skips"] == 1
    start = load_final_state(out / "ddp")  # the final state; step 2's parameters are far from it
    moved = max_diff(shards(out / "fsdp" / "step-0000002", tmp_path)["model"], start["model"])
    assert moved > 1e-3, "parameters barely moved: the comparison would be vacuous"
    for marker in ("FINAL ", "INFO EMA "):  # exact evaluation of the model and of its EMA: the same metrics
        want, got = after(runs["logs"]["ddp"], marker), after(runs["logs"]["fsdp"], marker)
        assert len(want) == 1 and want == got, (want, got)


@pytest.mark.integration
@pytest.mark.parametrize(("name", "n"), [("fsdp", 2), ("four", 4)])
def test_fsdp_builds_on_meta_and_each_rank_keeps_its_shards(runs: dict[str, Any], name: str, n: int) -> None:
    """The runs above start from the meta model (so the FSDP == DDP comparison checks its initialisation): no
    fallback to the CPU build, and rank 0's parameters are its 1/n (job.parallel.meta_init). The log line counts
    the shards the model holds, not what the process allocated on the way: that no rank holds the whole model
    while materialising is measured by tracking every live tensor in tests/test_parallel.py."""
    log = runs["logs"][name]
    assert "building the whole model on the CPU" not in log
    held = re.findall(r"model built on the meta device; rank 0 holds (\d+) of its (\d+) parameter bytes", log)
    assert len(held) == 1, log[-3000:]
    mine, whole = map(int, held[0])
    assert whole / n <= mine <= 1.1 * whole / n, (mine, whole)


@pytest.mark.integration
def test_checkpoint_holds_every_ranks_shards_and_commits_them(runs: dict[str, Any]) -> None:
    step = runs["out"] / "fsdp" / "step-0000002"
    manifest = json.loads((step / "manifest.json").read_text())
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata", "state.pt"} <= set(manifest["files"])
    saved = torch.load(step / "state.pt", map_location="cpu", weights_only=True)
    assert "model" not in saved and "optimizer" not in saved  # nothing gathered onto rank 0
    assert {"trainer", "scheduler", "rng", "layout"} <= set(saved)
    assert not list(runs["out"].glob("*/*.tmp-*"))


@pytest.mark.integration
def test_a_corrupt_shard_or_a_bare_metadata_falls_back_to_the_previous_checkpoint(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """A flipped byte in one rank's shard fails verification; a step directory holding DCP's ``.metadata`` but no
    manifest (a save cut before its commit) is not a checkpoint. Either way a resume (2 ranks, each verifying what
    it reads: rank 1 its own shard) uses the newest valid one, and nothing is deleted. The resumed run is asked for
    4 steps: it restores step 4 and only evaluates, so no save rewrites a step."""
    run_dir = tmp_path / "runs" / "fsdp"
    shutil.copytree(runs["out"] / "fsdp", run_dir, ignore=shutil.ignore_patterns("visits"))
    shard = run_dir / "step-0000006" / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (run_dir / "step-0000005" / "manifest.json").unlink()
    args = train_args(run_dir.parent, runs["corpus"], "fsdp", "--train.strategy", "fsdp")
    args[args.index("--train.steps") + 1] = "4"
    log = run(2, args, tmp_path)
    skipped = [line for line in log.splitlines() if f"skipping checkpoint {run_dir / 'step-0000006'}" in line]
    assert skipped and "rank 1:" in skipped[0] and "__1_0.distcp" in skipped[0] and "sha256" in skipped[0], log[-3000:]
    assert f"resumed from {run_dir / 'step-0000004'} (step 4)" in log and "FINAL step=4 " in log, log[-3000:]
    assert (run_dir / "step-0000005" / "shards" / ".metadata").exists() and shard.exists()
    assert shard.read_bytes() == bytes(data)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("whole", "resumed"), [("fsdp", "kept"), ("four", "again")], ids=["2_kept_gathered_evaluating", "4"]
)
def test_resume_at_the_same_world_size_is_bitwise(
    runs: dict[str, Any], tmp_path: Path, whole: str, resumed: str
) -> None:
    out = runs["out"]
    assert "resumed from" in runs["logs"][resumed]
    want, got = shards(newest(out / whole), tmp_path), shards(newest(out / resumed), tmp_path)
    assert_bitwise_equal(want["model"], got["model"], "model")
    assert_bitwise_equal(want["optimizer"], got["optimizer"], "optimizer")
    assert_bitwise_equal(want["ema"], got["ema"], "ema")
    assert load_final_state(out / whole)["trainer"] == load_final_state(out / resumed)["trainer"]


@pytest.mark.integration
def test_resume_two_to_one_to_four_sees_every_sample_as_often(runs: dict[str, Any], tmp_path: Path) -> None:
    """Steps 1-2 at 2 processes, 3-4 at 1, 5-6 at 4: the samples trained on match the uninterrupted run's."""
    out = runs["out"]
    whole = visits(out / "fsdp", None)
    chain = visits(out / "fsdp", 2 * 4) + visits(out / "one", 2 * 8) + visits(out / "four", None)
    print(
        f"\nvisits: uninterrupted {sum(whole.values())} items, chain {sum(chain.values())} items, "
        f"distinct {len(whole)} / {len(chain)}, max visits {max(whole.values())} / {max(chain.values())}"
    )
    assert sum(whole.values()) == STEPS * GLOBAL
    assert chain == whole
    diff = max_diff(shards(newest(out / "fsdp"), tmp_path)["model"], shards(newest(out / "four"), tmp_path)["model"])
    tol = adamw_tolerance([out / name for name in ("fsdp", "one", "four")], TERMS)
    print(f"max |param diff| 2->1->4 vs uninterrupted: {diff:.3g} (tolerance {tol:.3g})")
    assert diff <= tol
    assert "world size changed" in runs["logs"]["four"]


@pytest.mark.integration
def test_compiled_and_checkpointed_units_train_what_eager_fsdp_does(runs: dict[str, Any], tmp_path: Path) -> None:
    """Steps 3-6 with each unit compiled and its activations recomputed, resumed from a checkpoint saved
    without either: the same keys, and the uninterrupted eager run's parameters and EMA within fp32 tolerance."""
    out = runs["out"]
    log = runs["logs"]["compiled"]
    assert "resumed from" in log
    assert "compiled 2 units" in log and "checkpointing the activations of 2 units" in log
    assert newest(out / "compiled").name == f"step-{STEPS:07d}"
    want, got = shards(newest(out / "fsdp"), tmp_path), shards(newest(out / "compiled"), tmp_path)
    assert want["model"].keys() == got["model"].keys() and want["optimizer"].keys() == got["optimizer"].keys()
    diff, ema_diff = max_diff(want["model"], got["model"]), max_diff(want["ema"]["module"], got["ema"]["module"])
    tol = adamw_tolerance([out / "fsdp", out / "compiled"], TERMS)
    print(
        f"\nmax |param diff| compiled + activation checkpointing vs eager fsdp: {diff:.3g} (EMA {ema_diff:.3g}; "
        f"tolerance {tol:.3g})"
    )
    assert diff <= tol and ema_diff <= tol
    assert load_final_state(out / "compiled")["trainer"]["nonfinite_skips"] == 1


@pytest.mark.integration
def test_a_load_failing_on_one_rank_ends_every_rank_naming_checkpoint_and_rank(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "runs"
    resume_from(runs["out"] / "fsdp", 2, out / "failing")
    args = train_args(out, runs["corpus"], "failing", "--train.strategy", "fsdp", "--debug.fail-load-rank", "1")
    r = torchrun(2, args, env=counting_env(tmp_path, out / "failing"), timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode != 0
    for rank in (0, 1):  # rank 0 ends with the same error, not in a broken or timed-out collective
        errors = [line for line in text.splitlines() if f"[rank {rank}/2] ERROR" in line]
        assert errors and "step-0000002" in errors[0] and "failed on rank(s) [1]" in errors[0], errors
    assert "timed out" not in text


def test_bad_unit_and_zero_under_fsdp_are_bad_input_naming_the_settings(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    base = ["train", *train_args(tmp_path, corpus, "bad", "--train.strategy", "fsdp")]
    env = counting_env(tmp_path, tmp_path / "bad")
    r = run_cli([*base, "--fsdp.units", "[Nope]"], env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "fsdp.units" in r.stderr and "Nope" in r.stderr and "Block" in r.stderr
    r = run_cli([*base, "--optim.zero", "true"], env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "optim.zero" in r.stderr and "train.strategy" in r.stderr
    assert not (tmp_path / "bad" / "config.yaml").exists()  # nothing written (the task made its visits folder)


def test_unit_names_resolve_to_modules_and_unknown_ones_are_refused() -> None:
    from job.config import load_config
    from job.parallel import fsdp
    from job.tasks.lm.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=3))
    cfg = load_config(["--train.strategy", "fsdp", "--fsdp.units", "[Block]"], {})
    assert fsdp.unit_modules(model, cfg, None) == list(model.blocks)
    with pytest.raises(BadInput) as e:
        fsdp.unit_modules(model, load_config(["--fsdp.units", "[Blok]"], {}), None)
    assert e.value.setting == "fsdp.units" and "Block" in str(e.value)


class WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)  # never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def test_optimizer_state_covers_every_parameter_so_a_sharded_load_finds_its_keys(tmp_path: Path) -> None:
    """The pitfall of torch's optimizer-state initialisation: a parameter without a gradient has no state when
    saved, but a fresh optimizer creates state for it on load, and the load fails on the missing keys. The
    state created up front (at lr 0) covers it at both ends, moves no weight, and trains like a fresh state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from job.checkpoint.sharded import Sharded
    from job.parallel import fsdp

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = fully_shard(WithUnused(), mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        return model, opt

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, opt = build()
        before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        fsdp.init_optimizer_state(opt)
        after = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert_bitwise_equal(before, after, "weights after the state's creation")
        ref_model, ref_opt = build()
        for m, o in ((model, opt), (ref_model, ref_opt)):
            m(torch.ones(2, 4)).sum().backward()
            o.step()
        assert_bitwise_equal(
            {k: v.full_tensor() for k, v in model.state_dict().items()},
            {k: v.full_tensor() for k, v in ref_model.state_dict().items()},
            "one step from the created state vs from a fresh one",
        )
        Sharded(model, opt, 0).save(tmp_path, "ckpt", True)
        loaded, loaded_opt = build()
        fsdp.init_optimizer_state(loaded_opt)
        Sharded(loaded, loaded_opt, 0).load(tmp_path / "ckpt.tmp-shards", {}, {})
        assert len(loaded_opt.state) == 4
    finally:
        dist.destroy_process_group()


def test_accumulation_reduce_scatters_once_per_optimizer_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 micro-batches per step: each unit's gradients are reduce-scattered on the last one only (FSDP2's
    reduction of one parameter group, counted where FSDP calls it). In-process, one gloo rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from job.train.step import _sync_context

    calls: list[int] = []
    reduce = _fsdp_param_group.foreach_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return reduce(*args, **kwargs)

    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", counting)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        for unit in (model[0], model[1]):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root's own unit: the last Linear
        per_step = []
        for _step in range(2):
            calls.clear()
            for micro in range(4):
                with _sync_context(model, sync=micro == 3):
                    model(torch.ones(2, 4)).sum().backward()
            per_step.append(len(calls))
        assert per_step == [3, 3]  # 3 units, once each per step (4 per step each without no_sync)
    finally:
        dist.destroy_process_group()
