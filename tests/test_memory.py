"""The memory arithmetic of job.parallel.memory: per-device bytes by strategy (pure, on a meta model), the verdict
that names ``--train.strategy fsdp`` where ddp cannot fit, preflight's refusal, and the estimate against the state
a real model holds after an optimizer step (the fsdp side is measured per rank by ``ddp-job bench memory``,
tests/test_benchmarks.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from job.cluster.env import detect_env
from job.config import OptimConfig, load_config
from job.doctor.checks import FAIL, PASS, WARN, check_memory
from job.errors import DoesNotFit
from job.parallel import memory
from job.parallel.memory import Setup
from job.tasks.lm.gpt import GPT, GPTConfig
from job.train import run as job_run
from job.train.optim import build_optimizer


def gpt(n_layer: int = 4, n_embd: int = 64, device: str = "meta", vocab_size: int = 256) -> GPT:
    with torch.device(device):
        return GPT(GPTConfig(vocab_size=vocab_size, seq_len=32, n_layer=n_layer, n_head=4, n_embd=n_embd))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("vocab_size", [256, 8192], ids=["blocks_largest", "root_largest"])
def test_fsdp_state_per_rank_is_ddp_over_world_size_plus_the_gathered_units(
    world_size: int, precision: str, vocab_size: int
) -> None:
    """The root (embedding, tied head, final norm) stays gathered beside the unit computed and the one prefetched;
    with a large vocabulary the root is the largest unit of all."""
    model = gpt(n_layer=6, n_embd=96, vocab_size=vocab_size)
    ddp, fsdp = memory.both(model, list(model.blocks), Setup("fsdp", world_size, precision=precision, ema=True))
    assert ddp.parameters == 4 * sum(p.numel() for p in model.parameters())  # tied head counted once
    assert ddp.state == 5 * ddp.parameters  # weights, gradients, 2 AdamW moments, EMA: fp32 each
    assert fsdp.state <= 1.1 * ddp.state / world_size + fsdp.gathered_unit
    assert fsdp.state >= ddp.state / world_size  # padded chunks never hold less than their share
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - 6 * block  # embeddings and final norm: the root unit
    assert (root > block) == (vocab_size == 8192)
    dtype = {"fp32": 4, "bf16": 2}[precision]
    assert fsdp.gathered_unit == (root + 2 * block) * dtype
    kept = memory.both(
        model, list(model.blocks), Setup("fsdp", world_size, precision=precision, reshard_after_forward=False)
    )
    assert kept[1].gathered_unit == (root + 6 * block) * dtype  # every unit stays gathered until its backward
    assert ddp.gathered_unit == kept[0].gathered_unit == 0


def test_zero_shards_only_the_optimizer_state() -> None:
    model = gpt()
    plain = memory.estimate(model, [], Setup("ddp", 4))
    zero = memory.estimate(model, [], Setup("ddp", 4, zero=True))
    assert (zero.parameters, zero.gradients, zero.ema) == (plain.parameters, plain.gradients, plain.ema)
    assert zero.optimizer == plain.optimizer // 4
    sgd = memory.estimate(model, [], Setup("ddp", 1, optimizer="sgd"))
    assert sgd.optimizer == plain.optimizer // 2  # one momentum buffer, not two moments
    assert memory.estimate(model, [], Setup("ddp", 1, optimizer="sgd", momentum=0.0)).optimizer == 0


def test_fsdp_accumulation_keeps_unsharded_gradients() -> None:
    model = gpt()
    one = memory.estimate(model, list(model.blocks), Setup("fsdp", 4))
    accum = memory.estimate(model, list(model.blocks), Setup("fsdp", 4, grad_accum_steps=2))
    ddp = memory.estimate(model, list(model.blocks), Setup("ddp", 4))
    assert one.gradients < ddp.gradients / 3 and accum.gradients == ddp.gradients


def test_verdict_names_train_strategy_fsdp_where_only_fsdp_fits() -> None:
    model = gpt(n_layer=8)
    ddp, fsdp = memory.both(model, list(model.blocks), Setup("ddp", 4), activation_bytes=10_000)
    assert fsdp.total < ddp.total
    between = (fsdp.total + ddp.total) // 2
    assert memory.verdict("ddp", ddp, fsdp, ddp.total) == memory.FITS
    assert memory.verdict("ddp", ddp, fsdp, between) == memory.USE_FSDP
    assert memory.verdict("fsdp", ddp, fsdp, between) == memory.FITS
    assert memory.verdict("ddp", ddp, fsdp, fsdp.total - 1) == memory.NONE_FITS
    with pytest.raises(DoesNotFit) as info:
        memory.require_fits("ddp", ddp, fsdp, between)
    err = info.value
    assert (err.setting, err.value, err.exit_code) == ("train.strategy", "ddp", 2)
    assert "--train.strategy fsdp" in err.fix and (err.need_bytes, err.capacity_bytes) == (ddp.total, between)
    memory.require_fits("ddp", ddp, fsdp, ddp.total)  # fits: nothing raised
    memory.require_fits("ddp", ddp, fsdp, 1)  # nothing fits: the doctor warns, preflight does not guess a fix
    checks = {c: check_memory("ddp", ddp, fsdp, c) for c in (ddp.total, between, 1)}
    assert [checks[c].status for c in (ddp.total, between, 1)] == [PASS, FAIL, WARN]
    assert checks[between].fix.startswith("--train.strategy fsdp")


def test_estimate_matches_the_state_a_model_holds_after_a_step() -> None:
    torch.manual_seed(0)
    model = gpt(n_layer=2, n_embd=32, device="cpu")
    optimizer = build_optimizer(model, OptimConfig(name="adamw"), 1e-3, torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 33))
    model(tokens[:, :-1]).sum().backward()
    optimizer.step()
    held = memory.measured_state(model, optimizer)
    est = memory.estimate(model, list(model.blocks), Setup("ddp", 1))
    steps = 4 * len(optimizer.state)  # AdamW's 0-d step counts, which the estimate leaves out
    assert (held["parameters"], held["gradients"]) == (est.parameters, est.gradients)
    assert held["optimizer"] == est.optimizer + steps


def corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tofile(root / name)
    return root


def lm_args(tmp_path: Path, *extra: str) -> list[str]:
    options = f'{{"path": "{corpus(tmp_path / "corpus")}", "n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 16}}'
    common = ["--task.name", "causal_lm", "--task.options", options, "--run.output-dir", str(tmp_path / "runs")]
    return [*common, "--optim.name", "adamw", "--train.global-batch-size", "8", *extra]


TWO_RANKS = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
TWO_RANKS |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "memory", "GROUP_RANK": "0"}


def test_preflight_refuses_ddp_that_cannot_fit_where_fsdp_would(tmp_path: Path, monkeypatch) -> None:
    cfg = load_config(lm_args(tmp_path), {})
    env = detect_env(TWO_RANKS)
    pre = job_run.preflight(cfg, env)  # the real capacity: this small model fits
    ddp, fsdp = job_run.memory_estimates(cfg, 2, pre.task, pre.checked, 2)
    assert ddp.activations > 0 and ddp.activations == fsdp.activations  # saved tensors of the preflight batch
    monkeypatch.setattr(memory, "capacity_bytes", lambda device, local_world_size: (ddp.total + fsdp.total) // 2)
    with pytest.raises(DoesNotFit) as info:
        job_run.preflight(cfg, env)
    assert (info.value.setting, info.value.value) == ("train.strategy", "ddp")
    job_run.preflight(load_config(lm_args(tmp_path / "f", "--train.strategy", "fsdp"), {}), env)  # fsdp fits


def test_activations_counted_on_the_meta_model_equal_those_of_the_cpu_model() -> None:
    """Under fsdp preflight builds on meta and counts the loss forward's saved tensors from shapes alone
    (job.tasks.preflight.SavedBytes): about the bytes of the CPU model, each storage once, parameters not (the
    attention kernels' meta functions save a little more than the CPU kernel: 5% here)."""
    from torch.nn import functional

    from job.tasks.preflight import SavedBytes

    def saved(device: str) -> int:
        model = gpt(device=device).train()
        batch = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        batch = batch.to(device)
        counter = SavedBytes(model)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            logits = model(batch[:, :-1])
            functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        return counter.total

    on_cpu = saved("cpu")
    assert on_cpu > 0
    assert on_cpu <= saved("meta") <= 1.1 * on_cpu


MEMINFO = "MemTotal:       24683772 kB\nMemFree:         1000000 kB\nMemAvailable:     250000 kB\n"


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ([], 24683772 * 1024),  # no cgroup file
        (["max\n"], 24683772 * 1024),  # cgroup v2 without a limit
        (["9223372036854771712\n"], 24683772 * 1024),  # cgroup v1's "no limit"
        (["max\n", "4294967296\n", "8589934592\n"], 4 << 30),  # the smallest limit on the path
    ],
)
def test_a_cpu_device_holds_the_hosts_memory_not_what_is_free_this_moment(limits: list[str], expected: int) -> None:
    """MemAvailable (250 MB here) is a moment's reading on a shared host: a busy neighbour must not make a run
    that fits the host exit 2. The total, bounded by the cgroup's limit, is what the run's processes share."""
    assert memory.host_memory_bytes(MEMINFO, limits) == expected


def test_a_limit_set_on_a_cgroup_above_the_process_bounds_it(tmp_path: Path) -> None:
    """A Slurm step (cgroup v2) sets its job's limit below the mount's root, and the process runs in a cgroup below
    that: the limit files are the process's own cgroup's and each one's above it, up to the root."""
    job = tmp_path / "system.slice" / "slurmstepd.scope" / "job_7"
    (job / "step_0" / "user" / "task_0").mkdir(parents=True)
    (job / "memory.max").write_text("8589934592\n")
    (job / "step_0" / "memory.max").write_text("max\n")
    v2 = "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n"
    files = memory.cgroup_limit_files(v2, tmp_path)
    assert files[0] == job / "step_0" / "user" / "task_0" / "memory.max" and files[-1] == tmp_path / "memory.max"
    limits = [f.read_text() for f in files if f.exists()]
    assert memory.host_memory_bytes(MEMINFO, limits) == 8 << 30
    v1 = "12:cpu,cpuacct:/slurm/uid_0/job_7\n4:memory:/slurm/uid_0/job_7/step_0\n0::/\n"
    assert memory.cgroup_limit_files(v1, tmp_path) == [
        tmp_path / "memory" / "slurm" / "uid_0" / "job_7" / "step_0" / "memory.limit_in_bytes",
        tmp_path / "memory" / "slurm" / "uid_0" / "job_7" / "memory.limit_in_bytes",
        tmp_path / "memory" / "slurm" / "uid_0" / "memory.limit_in_bytes",
        tmp_path / "memory" / "slurm" / "memory.limit_in_bytes",
        tmp_path / "memory" / "memory.limit_in_bytes",
        tmp_path / "memory.max",  # the unified line of a hybrid layout
    ]
    assert memory.cgroup_limit_files("0::/\n", tmp_path) == [tmp_path / "memory.max"]  # a cgroup namespace
