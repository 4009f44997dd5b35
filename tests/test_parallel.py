"""ZeRO, DDP communication hooks and the all-reduce count, with real torchrun (2 processes, gloo).

ZeRO equivalence tolerance: final parameters of 2 processes with ZeroRedundancyOptimizer vs 2 without agree
to atol 1e-6 (float32; each rank runs the same AdamW arithmetic on its shard, then broadcasts; we observed
exact equality, the tolerance leaves room for a foreach kernel grouping tensors differently).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from support import ROOT
from support.ci import bin_path
from support.cli import base_env, make_data, torchrun
from support.runs import load_final_state

from job.checkpoint import store

ACCUM = 3  # micro 4 x 3 accumulation steps x 2 ranks = global batch 24


def common_args(out: Path) -> list[str]:
    return [
        "--run.output-dir",
        str(out),
        "--data.source",
        "synthetic",
        "--data.synthetic-train-size",
        "96",
        "--data.synthetic-val-size",
        "16",
        "--data.image-size",
        "16",
        "--data.num-classes",
        "4",
        "--model.name",
        "resnet18",
        "--train.steps",
        "4",
        "--train.global-batch-size",
        str(4 * ACCUM * 2),
        "--train.micro-batch-size",
        "4",
        "--optim.name",
        "adamw",
        "--optim.lr",
        "0.001",
        "--sched.warmup-steps",
        "1",
        "--ckpt.every",
        "2",
        "--log.every",
        "1",
        "--log.tensorboard",
        "false",
        "--ddp.comm-stats",
        "true",
        "--ddp.bucket-cap-mb",
        "4",
    ]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """plain: 2 ranks, plain AdamW. zero: the same with optim.zero. resumed: zero, restarted from zero's step 2."""
    out = tmp_path_factory.mktemp("zero")
    env = base_env(out)
    logs = {}
    for name, extra in (("plain", []), ("zero", ["--optim.zero", "true"])):
        r = torchrun(2, [*common_args(out), "--run.name", name, *extra], env=env)
        assert r.returncode == 0, r.stderr[-4000:]
        logs[name] = r.stderr + r.stdout
    (out / "resumed").mkdir()
    shutil.copytree(out / "zero" / "step-0000002", out / "resumed" / "step-0000002")
    r = torchrun(2, [*common_args(out), "--run.name", "resumed", "--optim.zero", "true"], env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    logs["resumed"] = r.stderr + r.stdout
    for name, text in logs.items():
        (out / f"{name}.log").write_text(text)
    return {name: out / name for name in logs}


def test_zero_matches_plain_optimizer(zero_runs: dict[str, Path]) -> None:
    plain, zero = load_final_state(zero_runs["plain"]), load_final_state(zero_runs["zero"])
    assert plain["trainer"]["step"] == zero["trainer"]["step"] == 4
    worst = max((plain["model"][k].float() - v.float()).abs().max().item() for k, v in zero["model"].items())
    assert worst <= 1e-6, f"ZeRO and plain AdamW differ by {worst}"
    moved = max(
        (plain["model"][k].float() - v.float()).abs().max().item()
        for k, v in load_final_state_at(zero_runs["zero"], 2)["model"].items()
        if v.is_floating_point()
    )
    assert moved > 0, "parameters did not change between step 2 and 4: the comparison would be vacuous"


def load_final_state_at(run_dir: Path, step: int) -> dict:
    return store.read_checkpoint(run_dir / f"step-{step:07d}")


def test_zero_checkpoint_is_complete_and_resume_is_bitwise(zero_runs: dict[str, Path]) -> None:
    zero, resumed = load_final_state(zero_runs["zero"]), load_final_state(zero_runs["resumed"])
    assert "resumed from" in (zero_runs["resumed"].parent / "resumed.log").read_text()
    # Complete: the consolidated optimizer state holds AdamW moments for every parameter, not one rank's shard.
    n_params = len([k for k, v in zero["model"].items() if k.endswith(("weight", "bias"))])
    opt_state = zero["optimizer"]["state"]
    assert len(opt_state) == n_params and all("exp_avg_sq" in s for s in opt_state.values())
    for k, v in zero["model"].items():
        assert torch.equal(v, resumed["model"][k]), f"model tensor {k} differs after resume"
    for idx, s in zero["optimizer"]["state"].items():
        for name, t in s.items():
            assert torch.equal(t, resumed["optimizer"]["state"][idx][name]), f"optimizer state {idx}.{name} differs"


@pytest.mark.parametrize("run", ["plain", "zero"])
def test_one_all_reduce_per_bucket_per_optimizer_step(zero_runs: dict[str, Path], run: str) -> None:
    log = (zero_runs[run].parent / f"{run}.log").read_text()
    m = re.search(
        r"comm: all-reduce calls per optimizer step \[([\d, ]+)\] \(total (\d+)\), distinct buckets (\d+), "
        r"grad_accum_steps (\d+)",
        log,
    )
    assert m, log[-3000:]
    per_step = [int(x) for x in m.group(1).split(",")]
    total, buckets, accum = int(m.group(2)), int(m.group(3)), int(m.group(4))
    assert accum == ACCUM and len(per_step) == 4 and sum(per_step) == total
    assert buckets >= 3, "a 4 MiB bucket cap splits resnet18's 45 MB of gradients into several buckets"
    # Every step reduces each bucket exactly once: the ACCUM - 1 no_sync() micro-steps communicate nothing,
    # and step 1 too uses the final buckets (wrap_model lets DDP rebuild them at start-up).
    assert per_step == [buckets] * 4, per_step


def test_static_graph_with_accumulation_trains_like_plain_ddp(zero_runs: dict[str, Path], tmp_path: Path) -> None:
    """static_graph's first iteration must be synced: a fresh DDP fails in a backward under no_sync(). The
    start-up passes of wrap_model make that first iteration, so step 1 may start with no_sync() micro-steps,
    and the parameters end as with plain DDP (same arithmetic, same final bucket layout)."""
    r = torchrun(
        2, [*common_args(tmp_path), "--run.name", "static", "--ddp.static-graph", "true"], env=base_env(tmp_path)
    )
    assert r.returncode == 0, r.stderr[-4000:]
    plain, static = load_final_state(zero_runs["plain"]), load_final_state(tmp_path / "static")
    assert static["trainer"]["step"] == 4
    for k, v in plain["model"].items():
        assert torch.equal(v, static["model"][k]), f"model tensor {k} differs with static_graph"


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("hooks")
    data = make_data(out / "data", classes=4, per_class=8, size=16)
    cmd = [
        bin_path("torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "tests" / "support" / "parallel_worker.py"),
        str(out / "results.json"),
        str(data),
    ]
    r = subprocess.run(cmd, env=base_env(out), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("hook", ["bf16", "fp16"])
def test_compression_hook_trains_and_keeps_ranks_in_sync(worker_results: dict, hook: str) -> None:
    res = worker_results["hooks"][hook]
    losses = res["losses"]
    assert losses[-1] < losses[0], losses
    assert res["max_param_diff_across_ranks"] == 0.0, res


def test_zero_shards_resnet50_adamw_state(worker_results: dict) -> None:
    mem = worker_results["memory"]
    plain, zero, params = mem["plain"], mem["zero"], mem["param_bytes"]
    # AdamW keeps exp_avg and exp_avg_sq (2 x parameter bytes) plus a 0-d step per parameter.
    assert plain[0] == plain[1] and 2 * params <= plain[0] < 2 * params + 4096
    assert sum(zero) == plain[0], (zero, plain)
    assert max(zero) <= 0.55 * plain[0], f"ZeRO per-rank state {zero} is not about half of {plain[0]}"


def test_fsdp_meta_build_never_holds_the_whole_model_on_a_rank(worker_results: dict) -> None:
    """train.strategy=fsdp builds the GPT on the meta device and materialises each rank's shards one tensor at a
    time (job.parallel.meta_init): a rank's peak of live CPU bytes is its half of the parameters plus a few of the
    largest tensor, where building it whole first peaks above the whole model (the tracker sees that)."""
    for rank in worker_results["meta"]:
        whole, largest, mine = rank["param_bytes"], rank["largest_bytes"], rank["mine_bytes"]
        assert rank["shards_equal_cpu_build"]
        assert whole / 2 <= mine <= 0.55 * whole, rank
        assert rank["cpu_peak"] >= whole, rank
        assert rank["meta_peak"] <= mine + 4 * largest < 0.7 * whole, rank


@pytest.mark.parametrize("static_graph", [False, True])
def test_start_up_bucket_rebuild_changes_no_state(static_graph: bool) -> None:
    """wrap_model's throwaway passes leave parameters, BatchNorm statistics, gradients, mode and the random
    state as they were, and leave DDP with its buckets rebuilt. In-process, one gloo rank; mobilenet_v3_small
    has BatchNorm and dropout (which draws random numbers in training mode)."""
    import torch.distributed as dist

    from job.config import load_config
    from job.parallel import ddp as parallel
    from job.parallel.distributed import Runtime
    from job.tasks.image.model import build_model, image_probe

    cfg = load_config(
        [
            "--model.name",
            "mobilenet_v3_small",
            "--data.image-size",
            "32",
            "--data.num-classes",
            "4",
            "--ddp.static-graph",
            str(static_graph).lower(),
        ],
        {},
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        raw = build_model(cfg.model, cfg.data.num_classes)
        before = {k: v.clone() for k, v in raw.state_dict().items()}
        rng = torch.get_rng_state()
        probe = image_probe(cfg.data.image_size, torch.device("cpu"))
        model = parallel.wrap_model(raw, cfg, Runtime(torch.device("cpu"), "gloo", None), probe)
        assert model._has_rebuilt_buckets
        assert torch.equal(torch.get_rng_state(), rng)
        assert raw.training and all(p.grad is None for p in raw.parameters())
        assert any(k.endswith("num_batches_tracked") for k in before), "no BatchNorm: the check would be vacuous"
        for k, v in raw.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed"
    finally:
        dist.destroy_process_group()


# --- PowerSGD after a skipped update (its state, on the CPU) ----------------------------------------------------


def test_powersgd_state_is_made_good_after_a_skipped_update() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from job.parallel.ddp import PowerSgdReset

    state = PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    reset = PowerSgdReset(state)
    kept, skipped = torch.tensor(0.0), torch.tensor(1.0)
    q1, error1 = torch.randn(12), torch.randn(40)
    state.q_memory_dict[0], state.error_dict[0] = q1.clone(), error1.clone()
    reset.after_update(kept)
    assert torch.equal(state.q_memory_dict[0], q1) and torch.equal(state.error_dict[0], error1)
    # A non-finite bucket poisons both, as the hook leaves them after NaN gradients.
    state.q_memory_dict[0].fill_(float("nan"))
    state.error_dict[0][::2] = float("inf")
    state.q_memory_dict[1] = torch.full((6,), float("nan"))  # a bucket whose first compressed step is skipped
    reset.after_update(skipped)
    assert torch.equal(state.q_memory_dict[0], q1)  # the warm start of the last finite step
    assert torch.equal(state.error_dict[0], torch.zeros(40))  # no error owed for gradients never applied
    assert torch.isfinite(state.q_memory_dict[1]).all() and state.q_memory_dict[1].abs().sum() > 0
    q2 = torch.randn(12)
    state.q_memory_dict[0].copy_(q2)
    reset.after_update(kept)
    assert torch.equal(state.q_memory_dict[0], q2)
