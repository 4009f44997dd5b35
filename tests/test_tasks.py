"""The task contract (job.tasks): every guarantee of the image classifier holds for a task that is not one.

Tested with the built-in causal language model (job.tasks.lm) on a byte corpus of the standard library, and a
user's regression task (support.user_tasks), by real torchrun runs on gloo: it learns well below the corpus's
unigram baseline with no_sync accumulation, bf16, clipping and EMA; 2 processes with ZeRO and torch.compile
train what 1 process does; a SIGTERM-stopped run resumes bitwise at 2 and 4 processes; 1 process evaluates the
same sums as 2; the metrics reach TensorBoard. Bad tasks exit 2 before any process group, writing nothing.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from support.cli import run_cli, torchrun, user_code_env
from support.runs import assert_bitwise_equal, load_final_state
from support.tolerance import summation_order_tolerance
from test_faults import Job
from test_observe import scalars
from test_train import max_abs_diff

from job.config import load_config
from job.data import corpus
from job.data.items import SeededItems
from job.errors import UserCodeError

FINAL = re.compile(r"^FINAL step=(\d+) (.*) val_count=(\d+) run_dir=", re.M)
COMMON = ["--log.progress", "off", "--doctor.enabled", "false", "--data.num-workers", "0"]


def final(stdout: str) -> dict[str, float]:
    """The FINAL line's values: step, count and each val_<name>."""
    m = FINAL.search(stdout)
    assert m, f"no FINAL line in:\n{stdout[-3000:]}"
    values = {k: float(v) for k, v in (kv.split("=") for kv in m[2].split())}
    return {"step": int(m[1]), "count": int(m[3]), **values}


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus_dir(tmp_path_factory.mktemp("corpus") / "pycorpus")


def corpus_dir(out: Path) -> Path:
    r = run_cli(["make-data", "--format", "text", "--out", str(out), "--max-bytes", "200000"])
    assert r.returncode == 0, r.stderr
    return out


def lm_args(corpus_path: Path, out: Path, name: str, *extra: str, **model: int | float) -> list[str]:
    options = {"path": str(corpus_path), "seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, **model}
    return [
        *("--task.name", "causal_lm", "--task.options", json.dumps(options)),
        *("--run.output-dir", str(out), "--run.name", name),
        *("--train.global-batch-size", "16", "--log.every", "5", *COMMON, *extra),
    ]


# --- the contract's parts, in process ---------------------------------------------------------------------


def test_item_reads_are_seeded_per_epoch_and_index_and_leave_the_callers_rng_alone() -> None:
    class Draws:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[float, float, float]:
            return torch.rand(()).item(), random.random(), float(np.random.rand())

    def error(what: str, fix: str) -> UserCodeError:
        return UserCodeError(what, fix)

    items = SeededItems(Draws(), "train", seed=7, error=error)
    torch.manual_seed(0)
    random.seed(0)
    before = (torch.rand(()).item(), random.random())
    torch.manual_seed(0)
    random.seed(0)
    first = items[(1, 2)]
    torch.manual_seed(99)  # whatever the caller's state, the item is the same draw
    assert items[(1, 2)] == first
    assert items[(1, 3)] != first and items[(2, 2)] != first
    assert SeededItems(Draws(), "train", seed=8, error=error)[(1, 2)] != first
    torch.manual_seed(0)
    random.seed(0)
    items[(1, 2)]
    assert (torch.rand(()).item(), random.random()) == before


def test_corpus_is_deterministic_and_its_baseline_is_the_unigram_cross_entropy(tmp_path: Path) -> None:
    a, b = corpus_dir(tmp_path / "a"), corpus_dir(tmp_path / "b")
    for name in ("train.bin", "val.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    meta = json.loads((a / "corpus.json").read_text())
    train = np.frombuffer((a / "train.bin").read_bytes(), np.uint8)
    val = np.frombuffer((a / "val.bin").read_bytes(), np.uint8)
    assert meta["train_tokens"] == len(train) == 200000 and meta["val_tokens"] == len(val) > 0
    counts = np.bincount(train, minlength=256) + 1.0
    want = -sum(math.log(counts[t] / counts.sum()) for t in val[:2000]) / 2000
    assert abs(corpus.unigram_baseline(train, val[:2000]) - want) < 1e-9
    assert bytes(val[:200]) not in (a / "train.bin").read_bytes()  # validation files are held out


def test_param_groups_freeze_what_they_leave_out_and_scale_the_lr(tmp_path: Path) -> None:
    """The regression task freezes its biases (in no group) and halves the first layer's LR."""
    from job.cluster.env import detect_env
    from job.config.plan import make_plan
    from job.parallel import distributed
    from job.train.parts import build_parts
    from job.train.step import TrainState, train_step

    args = ["--task.name", "support.user_tasks:regression", "--run.output-dir", str(tmp_path), *COMMON]
    cfg = load_config([*args, "--train.global-batch-size", "8", "--optim.lr", "0.1", "--optim.momentum", "0"], {})
    env = detect_env({})
    plan = make_plan(cfg, 1)
    rt = distributed.setup(env, cfg.dist)
    try:
        parts = build_parts(cfg, env, plan, rt)
        model = parts.raw_model
        before = {k: v.clone() for k, v in model.state_dict().items()}
        lrs = [g["lr"] for g in parts.optimizer.param_groups]
        state = TrainState()
        batches = parts.loaders.batches(state)
        out = [train_step(parts, batches, plan, state, cfg.train) for _ in range(2)]
    finally:
        distributed.teardown()
    after = model.state_dict()
    assert lrs == [pytest.approx(0.5 * plan.lr), pytest.approx(plan.lr)]
    assert not model[0].bias.requires_grad and not model[2].bias.requires_grad
    for key in ("0.bias", "2.bias"):
        assert torch.equal(before[key], after[key]), key
    for key in ("0.weight", "2.weight"):
        assert not torch.equal(before[key], after[key]), key
    assert set(out[-1].extras) == {"mae"} and out[-1].extras["mae"].ndim == 0


def test_extra_loss_values_reach_tensorboard_averaged_like_the_loss(tmp_path: Path) -> None:
    """The regression task's ``loss`` returns ``{"mae": ...}``: train/mae is logged at each log step as the
    window's mean of the steps' values (2 micro-batches each), read back with TensorBoard's reader."""
    from job.cluster.env import detect_env
    from job.config.plan import make_plan
    from job.observe.metrics import TensorBoardWriter, TrainLog
    from job.observe.observer import Observer
    from job.parallel import distributed
    from job.train.parts import build_parts
    from job.train.step import TrainState, train_step

    args = ["--task.name", "support.user_tasks:regression", "--run.output-dir", str(tmp_path), *COMMON]
    cfg = load_config([*args, "--train.global-batch-size", "8", "--train.micro-batch-size", "4"], {})
    env = detect_env({})
    plan = make_plan(cfg, 1)
    rt = distributed.setup(env, cfg.dist)
    writer = TensorBoardWriter(tmp_path / "tb")
    try:
        parts = build_parts(cfg, env, plan, rt)
        observer = Observer(cfg, env, None, parts.raw_model, parts.device, plan.global_batch_size, writer, 0)
        train_log = TrainLog(2, 4, plan.global_batch_size, parts.device, writer, observer)
        state = TrainState()
        batches = parts.loaders.batches(state)
        mae = []
        for _ in range(4):
            train_log.before_step()
            out = train_step(parts, batches, plan, state, cfg.train)
            mae.append(out.extras["mae"].item())
            train_log.after_step(state.step, out, parts.optimizer.param_groups[0]["lr"])
    finally:
        writer.close()
        distributed.teardown()
    got = scalars(tmp_path / "tb")["train/mae"]
    assert [s for s, _ in got] == [2, 4]
    assert [v for _, v in got] == pytest.approx([(mae[0] + mae[1]) / 2, (mae[2] + mae[3]) / 2], rel=1e-6)


BAD_TASKS = [
    ("support.user_tasks:Missing", "has no attribute 'Missing'"),
    ("support.user_tasks:NoMetrics", "has no method metrics"),
    ("support.user_tasks:NanLoss", "is nan on the preflight batch"),
    ("support.user_tasks:VectorLoss", "not a scalar float tensor"),
    ("support.user_tasks:MeanMetrics", "not a (sum, count) pair"),
    ("support.user_tasks:IterableData", "not a map-style dataset"),
    ("support.user_tasks:EmptyVal", "dataset('val') is empty"),
    ("support.user_tasks:RaggedItems", "do not collate"),
    ("no_such_package.tasks:Task", "no module named 'no_such_package'"),
]


@pytest.mark.parametrize(("name", "what"), BAD_TASKS, ids=[n.split(":")[1] for n, _ in BAD_TASKS])
def test_a_bad_task_exits_2_naming_it_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, what: str
) -> None:
    from job.cli import main

    out = tmp_path / "runs"
    code = main(["train", "--task.name", name, "--run.output-dir", str(out), "--train.global-batch-size", "8", *COMMON])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"task.name={name!r}" in err and what in err, err
    assert not out.exists()


def test_bad_task_message_names_the_setting_the_value_and_the_fix(tmp_path: Path) -> None:
    """Under torchrun, 2 processes: the preflight refuses before any process group starts (no rendezvous, no
    run directory), and the message names task.name, the value and what to return instead."""
    out = tmp_path / "runs"
    r = torchrun(
        2,
        ["--task.name", "support.user_tasks:MeanMetrics", "--run.output-dir", str(out), *COMMON],
        env=user_code_env(tmp_path),
    )
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "task.name='support.user_tasks:MeanMetrics'" in text and "not a (sum, count) pair" in text, text[-3000:]
    assert "give each metric as (sum, count)" in text  # the fix
    assert re.search(r"exitcode\s*:\s*2", text), text[-2000:]
    assert "rendezvous" not in text.lower() and "pid=" not in text  # no process group, no start-up line
    assert not out.exists()


# --- real runs ----------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_causal_lm_learns_below_the_unigram_baseline_and_one_process_evaluates_the_same_sums(
    text: Path, tmp_path: Path
) -> None:
    """2 ranks x micro 4 x 2 accumulation steps with bf16 autocast, clipping and EMA: validation loss ends well
    below the corpus's unigram baseline, one all-reduce per optimizer step, the task's metrics (loss, accuracy,
    perplexity) and MFU's FLOPs in the logs and TensorBoard. The checkpoint then evaluated by 1 process gives
    the same validation values as 2 (sums and counts over the whole set)."""
    baseline = json.loads((text / "corpus.json").read_text())["unigram_baseline_nats"]
    out = tmp_path / "runs"
    extra = [
        *("--train.steps", "150", "--train.micro-batch-size", "4", "--train.global-batch-size", "16"),
        *("--train.precision", "bf16", "--train.grad-clip-norm", "1.0", "--ema.enabled", "true"),
        *("--ema.decay", "0.9", "--ddp.comm-stats", "true", "--train.eval-every", "75", "--log.every", "25"),
        *("--optim.name", "adamw", "--optim.lr", "0.003", "--optim.weight-decay", "0.01"),
        *("--sched.warmup-steps", "10", "--observe.peak-tflops", "1.0"),
    ]
    args = lm_args(text, out, "two", *extra, n_embd=64, n_head=4)
    r = torchrun(2, args, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    two, log = final(r.stdout), r.stdout + r.stderr
    print(f"\nunigram baseline {baseline:.4f} nats/token; after 150 steps val_loss {two['val_loss']:.4f}")
    assert two["val_loss"] < 0.85 * baseline, (two, baseline)
    assert two["val_perplexity"] == pytest.approx(math.exp(two["val_loss"]), rel=1e-3)
    assert re.search(r"all-reduce calls per optimizer step \[1(, 1){149}\]", log), log[-3000:]
    flops = re.search(r"observe: ([\d.]+) GFLOP per training sample", log)
    assert flops and float(flops[1]) > 0
    tb = scalars(out / "two" / "tb")
    assert {"train/loss", "val/loss", "val/accuracy", "val/perplexity", "ema/val/loss", "perf/mfu"} <= set(tb)
    assert all(0 < v < 1 for _, v in tb["perf/mfu"])  # the task's FLOPs per item over a 1 TFLOP/s peak
    assert [s for s, _ in tb["val/loss"]] == [75, 150]
    shutil.copytree(out / "two", out / "one", ignore=shutil.ignore_patterns("tb", "progress"))
    one_args = [*args, "--ckpt.allow-world-size-change", "true"]
    one_args[one_args.index("two")] = "one"
    r1 = run_cli(["train", *one_args])
    assert r1.returncode == 0, (r1.stdout + r1.stderr)[-4000:]
    assert "resumed from" in r1.stdout + r1.stderr
    one = final(r1.stdout)
    assert one["count"] == two["count"] == json.loads((text / "corpus.json").read_text())["val_tokens"] // 32
    got, want = scalars(out / "one" / "tb"), tb
    for tag in ("val/loss", "val/accuracy"):
        assert got[tag][-1][0] == 150
        assert got[tag][-1][1] == pytest.approx(want[tag][-1][1], rel=1e-5, abs=1e-6), tag


@pytest.mark.integration
def test_two_processes_with_zero_and_compile_train_what_one_process_does(text: Path, tmp_path: Path) -> None:
    """The same 6 SGD steps: 1 process x 16 items, and 2 processes x micro 4 x 2 accumulation steps with ZeRO,
    2 DataLoader workers and the per-item random window shift; both under torch.compile (aot_eager: the traced
    step around ZeRO's optimizer; inductor's kernels are built in tests/test_image.py)."""
    out = tmp_path / "runs"
    extra = ["--train.steps", "6", "--optim.name", "sgd", "--optim.lr", "0.5", "--sched.name", "constant"]
    extra += ["--model.compile", "true", "--model.compile-backend", "aot_eager"]
    extra += ["--log.tensorboard", "false", "--log.jsonl", "true", "--log.every", "1"]
    one = run_cli(["train", *lm_args(text, out, "one", *extra)], env=user_code_env(tmp_path), timeout=900)
    assert one.returncode == 0, (one.stdout + one.stderr)[-4000:]
    two_args = lm_args(text, out, "two", *extra, "--train.micro-batch-size", "4", "--optim.zero", "true")
    two_args[two_args.index("--data.num-workers") + 1] = "2"
    two = torchrun(2, two_args, env=user_code_env(tmp_path), timeout=900)
    assert two.returncode == 0, (two.stdout + two.stderr)[-4000:]
    model = load_final_state(out / "one")["model"]
    diff = max_abs_diff(model, load_final_state(out / "two")["model"])
    # 16 windows x 32 tokens x the MLP's fan-in of 4 x 32 feed a gradient element; momentum 0.9, decay 1e-4.
    tol = summation_order_tolerance([out / "one", out / "two"], 16 * 32 * 4 * 32, 0.9, 1e-4, model)
    print(f"\nmax |param diff| 1 proc vs 2 procs (ZeRO, compile): {diff:.3g} (tolerance {tol:.3g})")
    assert diff < tol
    assert final(one.stdout)["val_loss"] == pytest.approx(final(two.stdout)["val_loss"], abs=1e-4)


@pytest.mark.integration
def test_causal_lm_resumes_bitwise_after_sigterm(text: Path, tmp_path: Path) -> None:
    """Dropout and the random window shift draw from RNGs the checkpoint and the per-item seeding restore: a run
    of 2 processes with 2 DataLoader workers each, stopped by SIGTERM and resumed, ends bitwise where an
    uninterrupted one does (model, optimizer, schedule). At 4 ranks (2 nodes x 2) the same task is drained and
    resumed bitwise through the Kubernetes simulations (tests/test_k8s_sim.py, tests/test_k8s_trainjob_sim.py)
    and Slurm (tests/test_slurm.py)."""
    nproc = 2
    out = tmp_path / "runs"
    steps = 12
    args = lm_args(
        text,
        out,
        "ref",
        "--train.steps",
        str(steps),
        "--train.micro-batch-size",
        "2",
        "--optim.name",
        "adamw",
        "--optim.lr",
        "0.003",
        "--sched.warmup-steps",
        "3",
        "--log.every",
        "1",
        "--log.tensorboard",
        "false",
        "--debug.straggler-delay-s",
        "0.15",
        "--debug.straggler-rank",
        "0",
        dropout=0.1,
    )
    args[args.index("--data.num-workers") + 1] = "2"
    started: list[Job] = []
    try:
        ref = Job(tmp_path, [], args, nproc=nproc)
        started.append(ref)
        args[args.index("ref")] = "chain"
        first = Job(tmp_path, [], args, nproc=nproc)
        started.append(first)
        first.wait_for(rf"\[rank 0/{nproc}\] INFO step 4/{steps} ")
        first.signal(signal.SIGTERM)
        _, m = first.wait_for(r"stop requested \(signal SIGTERM[^)]*\): saving at step (\d+)")
        assert first.finish() == 143, first.tail()
        assert int(m[1]) < steps
        second = Job(tmp_path, [], args, nproc=nproc)
        started.append(second)
        second.wait_for(rf"resumed from .*step-{int(m[1]):07d}")
        assert second.finish() == 0, second.tail()
        assert ref.finish() == 0, ref.tail()
    finally:
        for job in started:
            job.kill()
    want, got = load_final_state(out / "ref"), load_final_state(out / "chain")
    for key in ("model", "optimizer", "scheduler"):
        assert_bitwise_equal(want[key], got[key], key)
    assert want["trainer"] == got["trainer"]
