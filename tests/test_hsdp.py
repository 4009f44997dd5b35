"""HSDP: fsdp on a replicate x shard mesh (shard within a node, replicate across nodes), on 2 network-namespace
nodes x 2 processes, beside ddp and fsdp over all four ranks.

Two module fixtures, each on two nodes of its own (support.netns_nodes). ``counted``: job.bench.traffic_worker,
the bytes each rank sends per step within its node and across, under ddp, fsdp and hsdp. ``runs``:
  ddp       ddp-job train, ddp at 1 process on this host (the same global batch): the reference
  hsdp      the same config under fsdp with the default mesh (2 x 2): the uninterrupted run
  stopped   hsdp with a stop requested before it starts: stops after step 1, saves, exits 143
  same      resumed from stopped's save at 2 x 2, to the end (bitwise against hsdp)
  to_fsdp   from stopped's save as fsdp over 4 (fsdp.replicate_degree 1), stopped after one step
  to_ddp    from to_fsdp's save as ddp over 4, stopped after one step
  to_one    from to_ddp's save at 1 process (on this host), stopped after one step
  back      from to_one's save as hsdp 2 x 2 again, to the end
The chain stopped -> to_fsdp -> to_ddp -> to_one -> back trains every sample as often as hsdp does.
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
from support import ROOT
from support.ci import require_tool
from support.cli import base_env, run_cli, torchrun, user_code_env
from support.lm import make_corpus
from support.netns_nodes import Nodes, netns_nodes
from support.runs import assert_bitwise_equal, load_final_state
from support.tolerance import adamw_tolerance

from job.bench import traffic
from job.cluster.env import detect_env
from job.cluster.stop import STOP_FILE
from job.config import load_config
from job.config.schema import FsdpConfig
from job.doctor.checks import PASS, check_memory
from job.errors import BadInput
from job.parallel import fsdp, memory
from job.train import run as job_run

STEPS = 5
GLOBAL = 16  # micro 2: grad_accum_steps 2 at 4 processes, 8 at 1
OPTIONS = {"seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0}
TERMS = GLOBAL * 32 * 4 * 32  # windows x tokens x the MLP's fan-in of 4 x n_embd feed one gradient element
DIGITS = 5e-4  # "to four digits": a count within 0.05 % of its formula (of P where the formula is 0)


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
        *("--ckpt.allow-world-size-change", "true", "--ema.enabled", "true", "--ema.decay", "0.5"),
        *extra,
    ]


def run_dir_of(args: list[str]) -> Path:
    return Path(args[args.index("--run.output-dir") + 1]) / args[args.index("--run.name") + 1]


def check_exit(returncodes: list[int], log: str, stopped: bool, ranks: int) -> None:
    """Every rank finished (0), or with ``stopped`` every rank exited 143 after its stop save (torchrun itself
    then exits 1, naming each worker's exit code)."""
    if not stopped:
        assert returncodes == [0] * len(returncodes), log[-4000:]
        return
    assert set(returncodes) == {1}, log[-4000:]
    codes = re.findall(r"^\s+exitcode\s+:\s+(-?\d+) \(pid", log, re.M)  # torchrun's failure report
    assert codes == ["143"] * ranks, log[-4000:]


def on_nodes(nodes: Nodes, args: list[str], tmp: Path, stopped: bool = False) -> str:
    env = user_code_env(tmp, VISITS=str(run_dir_of(args) / "visits"))
    results = nodes.torchrun(2, ["-m", "job", "train", *args], env, timeout=600)
    log = "".join(r.stdout + r.stderr for r in results)
    check_exit([r.returncode for r in results], log, stopped, 4)
    return log


def on_host(args: list[str], tmp: Path, stopped: bool = False) -> str:
    """One process on this host."""
    r = torchrun(1, args, env=user_code_env(tmp, VISITS=str(run_dir_of(args) / "visits")), timeout=600)
    log = r.stdout + r.stderr
    check_exit([r.returncode], log, stopped, 1)
    return log


def resume_from(src: Path, step: int, dst: Path, stop: bool) -> None:
    """``dst`` holds ``src``'s checkpoint of ``step``; with ``stop`` a stop request too (honoured after one step)."""
    dst.mkdir(parents=True)
    name = f"step-{step:07d}"
    shutil.copytree(src / name, dst / name)
    if stop:
        (dst / STOP_FILE).touch()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tool("ip")
    out = tmp_path_factory.mktemp("hsdp")
    corpus = make_corpus(out / "corpus")
    logs: dict[str, str] = {}
    as_fsdp = ["--train.strategy", "fsdp"]
    logs["ddp"] = on_host(train_args(out, corpus, "ddp"), out)
    with netns_nodes(2) as nodes:
        logs["hsdp"] = on_nodes(nodes, train_args(out, corpus, "hsdp", *as_fsdp), out)
        (out / "stopped").mkdir()
        (out / "stopped" / STOP_FILE).touch()
        logs["stopped"] = on_nodes(nodes, train_args(out, corpus, "stopped", *as_fsdp), out, stopped=True)
        resume_from(out / "stopped", 1, out / "same", stop=False)
        logs["same"] = on_nodes(nodes, train_args(out, corpus, "same", *as_fsdp), out)
        resume_from(out / "stopped", 1, out / "to_fsdp", stop=True)
        one_group = [*as_fsdp, "--fsdp.replicate-degree", "1"]
        logs["to_fsdp"] = on_nodes(nodes, train_args(out, corpus, "to_fsdp", *one_group), out, stopped=True)
        resume_from(out / "to_fsdp", 2, out / "to_ddp", stop=True)
        logs["to_ddp"] = on_nodes(nodes, train_args(out, corpus, "to_ddp"), out, stopped=True)
        resume_from(out / "to_ddp", 3, out / "to_one", stop=True)
        logs["to_one"] = on_host(train_args(out, corpus, "to_one", *as_fsdp), out, stopped=True)
        resume_from(out / "to_one", 4, out / "back", stop=False)
        logs["back"] = on_nodes(nodes, train_args(out, corpus, "back", *as_fsdp), out)
    return {"out": out, "logs": logs}


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """job.bench.traffic_worker on the two nodes: each rank's record under ddp, fsdp and hsdp."""
    require_tool("ip")
    out = tmp_path_factory.mktemp("traffic")
    with netns_nodes(2) as nodes:
        results = nodes.torchrun(2, ["-m", "job.bench.traffic_worker", "--out", str(out)], base_env(out), 600)
    check_exit([r.returncode for r in results], "".join(r.stdout + r.stderr for r in results), False, 4)
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/rank*.json"))]


def visits(run_dir: Path) -> Counter[int]:
    """Items trained on by every process of the run."""
    seen: Counter[int] = Counter()
    for f in sorted((run_dir / "visits").glob("*.txt")):
        seen.update(int(i) for i in f.read_text().split())
    return seen


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    keys = a.keys() & b.keys()
    assert len(keys) >= 10, sorted(keys)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys if a[k].is_floating_point())


@pytest.mark.integration
def test_bytes_per_link_class_match_the_formulas_to_four_digits(counted: list[dict[str, Any]]) -> None:
    """Per rank and step: within-node and cross-node bytes of ddp, fsdp and hsdp as job.bench.traffic computes
    them; hsdp crosses the nodes with fewer bytes than fsdp, and holds half of ddp's state per rank."""
    records = counted
    table = traffic.rows(records)
    assert sorted({r["strategy"] for r in table}) == ["ddp 4x1", "fsdp 1x4", "hsdp 2x2"]
    assert sorted(r["node"] for r in table if r["strategy"] == "hsdp 2x2") == [0, 0, 1, 1]
    p = records[0]["param_bytes"]
    for r in table:
        for link in ("node", "cross"):
            got, want = r["sent"][link], r["expected"][link]
            print(f"{r['strategy']} rank {r['rank']} {link}: counted {got:.0f} formula {want:.0f}")
            assert abs(got - want) <= DIGITS * max(want, p), (r, link)
    cross = {
        s: sum(r["sent"]["cross"] for r in table if r["strategy"] == s) / 2 for s in ("ddp 4x1", "fsdp 1x4", "hsdp 2x2")
    }
    assert cross["hsdp 2x2"] < cross["ddp 4x1"] < cross["fsdp 1x4"], cross
    state = {r["strategy"]: r["state_bytes"] for r in table}
    assert state["hsdp 2x2"] * 2 == pytest.approx(state["ddp 4x1"], rel=1e-4)
    assert state["fsdp 1x4"] * 4 == pytest.approx(state["ddp 4x1"], rel=1e-4)


@pytest.mark.integration
def test_hsdp_is_the_default_across_nodes_and_ends_within_fp32_tolerance_of_ddp(runs: dict[str, Any]) -> None:
    out, logs = runs["out"], runs["logs"]
    assert "fsdp mesh: hsdp 2x2" in logs["hsdp"]
    assert "fsdp mesh: fsdp 1x4" in logs["to_fsdp"]
    want, got = load_final_state(out / "ddp"), load_final_state(out / "hsdp")
    diff = max_diff(want["model"], got["model"])
    moved = max_diff(load_final_state(out / "stopped")["model"], got["model"])
    tol = adamw_tolerance([out / "ddp", out / "hsdp"], TERMS)
    print(f"max |param diff| hsdp 2x2 vs ddp at 1 process: {diff:.3g} (tolerance {tol:.3g}); moved: {moved:.3g}")
    assert diff <= tol and moved > 1e-3, (diff, tol, moved)
    assert visits(out / "hsdp") == visits(out / "ddp")


@pytest.mark.integration
def test_a_stopped_hsdp_run_saves_exits_143_and_resumes_bitwise(runs: dict[str, Any]) -> None:
    out, logs = runs["out"], runs["logs"]
    assert (out / "stopped" / "STOPPED").is_file()
    assert "saving at step 1 and exiting 143" in logs["stopped"]
    assert "resumed from" in logs["same"]
    want, got = load_final_state(out / "hsdp"), load_final_state(out / "same")
    assert_bitwise_equal(want["model"], got["model"], "model")
    assert_bitwise_equal(want["optimizer"], got["optimizer"], "optimizer")
    assert_bitwise_equal(want["ema"], got["ema"], "ema")
    assert want["trainer"] == got["trainer"]


@pytest.mark.integration
def test_hsdp_to_fsdp_to_ddp_to_one_and_back_sees_every_sample_as_often(runs: dict[str, Any]) -> None:
    """Step 1 under hsdp 2x2, 2 under fsdp over 4, 3 under ddp over 4, 4 at 1 process, 5 under hsdp 2x2: the samples
    trained on and the parameters match the uninterrupted hsdp run's."""
    out = runs["out"]
    whole = visits(out / "hsdp")
    chain = sum((visits(out / name) for name in ("stopped", "to_fsdp", "to_ddp", "to_one", "back")), Counter())
    print(f"\nvisits: uninterrupted {sum(whole.values())} items, chain {sum(chain.values())} items")
    assert sum(whole.values()) == STEPS * GLOBAL
    assert chain == whole
    diff = max_diff(load_final_state(out / "hsdp")["model"], load_final_state(out / "back")["model"])
    tol = adamw_tolerance(
        [out / "hsdp", *(out / name for name in ("stopped", "to_fsdp", "to_ddp", "to_one", "back"))], TERMS
    )
    print(f"max |param diff| hsdp -> fsdp -> ddp -> 1 -> hsdp vs uninterrupted hsdp: {diff:.3g} (tolerance {tol:.3g})")
    assert diff <= tol


def test_the_mesh_shards_within_a_node_and_replicates_across_nodes_unless_told() -> None:
    shape = fsdp.mesh_shape
    assert shape(FsdpConfig(), 4, 2) == (2, 2)
    assert shape(FsdpConfig(), 16, 8) == (2, 8)
    assert shape(FsdpConfig(), 4, 4) == (1, 4)  # one node: fsdp over every rank
    assert shape(FsdpConfig(), 6, 4) == (1, 6)  # nodes of unequal size: no mesh of whole nodes
    assert shape(FsdpConfig(), 4, 1) == (1, 4)  # one process per node: shard groups of one would shard nothing
    assert shape(FsdpConfig(replicate_degree=1), 4, 2) == (1, 4)
    assert shape(FsdpConfig(replicate_degree=2), 8, 8) == (2, 4)
    assert shape(FsdpConfig(shard_degree=4), 8, 2) == (2, 4)
    assert shape(FsdpConfig(replicate_degree=2, shard_degree=2), 4, 4) == (2, 2)


@pytest.mark.parametrize(("replicate", "shard"), [(3, 0), (0, 3), (2, 3)])
def test_a_shape_that_does_not_make_the_world_size_names_both_settings_and_a_fit(replicate: int, shard: int) -> None:
    with pytest.raises(BadInput) as err:
        fsdp.mesh_shape(FsdpConfig(replicate_degree=replicate, shard_degree=shard), 4, 2)
    text = str(err.value)
    assert "fsdp.replicate_degree" in text and "fsdp.shard_degree" in text
    assert err.value.fix.startswith("--fsdp.replicate-degree 2 --fsdp.shard-degree 2")
    assert err.value.exit_code == 2


def test_train_refuses_a_bad_mesh_with_exit_2_before_writing(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    args = train_args(tmp_path, corpus, "bad", "--train.strategy", "fsdp", "--fsdp.replicate-degree", "2")
    r = run_cli(["train", *args], env=user_code_env(tmp_path, VISITS=str(tmp_path / "visits")))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "fsdp.replicate_degree=2 x fsdp.shard_degree=0" in r.stderr
    assert not (tmp_path / "bad").exists()


def test_memory_estimate_shards_over_the_shard_group_only() -> None:
    from job.tasks.lm.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, n_embd=64))
    units = list(model.blocks)
    hsdp = memory.estimate(model, units, memory.Setup("fsdp", 4, shard_degree=2))
    fsdp_4 = memory.estimate(model, units, memory.Setup("fsdp", 4))
    two = memory.estimate(model, units, memory.Setup("fsdp", 2))
    assert hsdp.state == two.state and hsdp.state > fsdp_4.state
    assert hsdp.label == "hsdp 2x2" and fsdp_4.label == "fsdp 1x4"
    assert "hsdp 2x2" in memory.estimate(model, units, memory.Setup("ddp", 4)).table(hsdp)


TWO_BY_TWO = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
TWO_BY_TWO |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "hsdp"}


def test_preflight_and_the_doctor_estimate_the_run_on_its_mesh(tmp_path: Path) -> None:
    """Rank 0 of 2 nodes x 2 processes, train.strategy fsdp: preflight's estimate (which the doctor's memory check
    reports) is hsdp 2x2's, the state sharded over the node's 2 ranks."""
    corpus = make_corpus(tmp_path / "corpus")
    options = json.dumps({"path": str(corpus), **OPTIONS})
    args = ["--task.name", "causal_lm", "--task.options", options, "--run.output-dir", str(tmp_path / "runs")]
    cfg = load_config([*args, "--train.strategy", "fsdp", "--train.global-batch-size", "8"], {})
    env = detect_env(TWO_BY_TWO)
    pre = job_run.preflight(cfg, env)
    estimates = job_run.memory_estimates(cfg, env.world_size, pre.task, pre.checked, env.local_world_size)
    assert estimates is not None
    ddp, sharded = estimates
    assert (sharded.label, sharded.shards) == ("hsdp 2x2", 2)
    assert sharded.parameters < ddp.parameters
    check = check_memory("fsdp", ddp, sharded, 2**40)
    assert check.status == PASS and "hsdp 2x2" in check.data["table"] and "hsdp 2x2" in check.detail


def test_a_launchers_torchrun_worker_gets_the_mesh_of_its_nodes() -> None:
    """A TrainJob pod's torchrun worker as recorded (2 nodes x 2 processes; Slurm's and the PyTorchJob's torchrun
    export the same variables): the default mesh is nodes x processes per node, nothing set by the user."""
    recorded = json.loads((ROOT / "tests" / "data" / "k8s" / "trainjob-pod-env.json").read_text())
    env = detect_env(recorded["ddp-smoke-node-0-1/local-rank-1"])
    assert (env.num_nodes, env.local_world_size) == (2, 2)
    assert fsdp.mesh_shape(FsdpConfig(), env.world_size, env.local_world_size) == (2, 2)


@pytest.mark.integration
def test_an_hsdp_checkpoint_exports_and_evaluates_as_its_run_did(runs: dict[str, Any], tmp_path: Path) -> None:
    """``ddp-job export`` of the hsdp run's newest checkpoint is its model bitwise; ``ddp-job evaluate`` of it at 1
    process prints the validation the run printed at its end under hsdp 2 x 2."""
    from safetensors.torch import load_file

    run_dir = runs["out"] / "hsdp"
    exported = tmp_path / "hsdp.safetensors"
    r = run_cli(["export", "--checkpoint", str(run_dir), "--out", str(exported)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bitwise_equal(load_file(exported), load_final_state(run_dir)["model"], "model")
    final = re.search(rf"^FINAL step={STEPS} (.*) run_dir=", runs["logs"]["hsdp"], re.M)
    assert final, runs["logs"]["hsdp"][-3000:]
    args = ["evaluate", "--config", str(run_dir / "config.yaml"), "--dist.nproc-per-node", "1"]
    r = run_cli(
        [*args, "--ckpt.path", str(run_dir / f"step-{STEPS:07d}")], env=user_code_env(tmp_path, VISITS=str(tmp_path))
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = re.search(rf"^EVAL step={STEPS} (.*) checkpoint=", r.stdout, re.M)
    assert got, r.stdout[-3000:]
    assert got[1] == final[1]
