"""The runs and checks of tests/test_third_party_*.py: a model of examples/hf_models.py trained on 2 processes of
gloo under ddp and fsdp, resumed, exported.

Each model's runs (``train``), 3 steps of SGD with momentum, a checkpoint after each:
  ddp      DDP: the reference
  fsdp     the same config under fsdp
  resumed  fsdp resumed from fsdp's step 2 at 2 processes
Step 1 runs at ``lr x 1e-45`` (``sched.warmup_start_factor``), below the smallest float32: SGD's update
``p - lr * g`` rounds to ``p``, so the step-1 checkpoint holds the initial parameters. Steps 2 and 3 train at
``lr``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from job.checkpoint.export import read_model
from support.cli import ROOT, torchrun, user_code_env
from support.runs import assert_bitwise_equal
from support.tolerance import summation_order_tolerance

EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))  # examples/hf_models.py, as a user's PYTHONPATH=examples makes it importable
import hf_models  # noqa: E402

STEPS = 3
LR = 0.05
MOMENTUM = 0.9
SEED = 0  # run.seed's default: the job seeds torch with it before build_model
UNITS = {"vit": "[Block]", "convnext": "[ConvNeXtStage]", "resnet": "[BasicBlock]"}
"""fsdp.units of the timm models; the Hugging Face models shard by their _no_split_modules."""
FP32_EPS = float(torch.finfo(torch.float32).eps)


def env(tmp: Path) -> dict[str, str]:
    e = user_code_env(tmp)
    e["PYTHONPATH"] = f"{EXAMPLES}:{e['PYTHONPATH']}"
    return e


def args(model: str, out: Path, name: str, *extra: str) -> list[str]:
    options = {"model": model, "train_items": 64, "val_items": 8}
    return [
        *("--task.name", "hf_models:task", "--task.options", json.dumps(options)),
        *("--run.output-dir", str(out), "--run.name", name, "--data.num-workers", "0"),
        *("--optim.name", "sgd", "--optim.lr", str(LR), "--optim.momentum", str(MOMENTUM)),
        *("--optim.weight-decay", "0", "--sched.name", "constant"),
        *("--sched.warmup-steps", "1", "--sched.warmup-start-factor", "1e-45"),
        *("--train.steps", str(STEPS), "--train.global-batch-size", "8", "--train.micro-batch-size", "4"),
        *("--ckpt.every", "1", "--ckpt.keep-last", "5", "--log.every", "1", "--log.tensorboard", "false"),
        *("--log.jsonl", "true"),  # every step's lr and gradient norm: the tolerance's update path
        *extra,
    ]


def run(model: str, out: Path, name: str, *extra: str) -> str:
    r = torchrun(2, args(model, out, name, *extra), env=env(out), timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout + r.stderr


def fsdp_args(model: str) -> list[str]:
    extra = ["--train.strategy", "fsdp"]
    if model in UNITS:
        extra += ["--fsdp.units", UNITS[model]]
    return extra


def train(model: str, out: Path) -> dict[str, str]:
    """The three runs of the module docstring; their logs."""
    import shutil

    logs = {"ddp": run(model, out, "ddp"), "fsdp": run(model, out, "fsdp", *fsdp_args(model))}
    step = "step-0000002"
    (out / "resumed").mkdir()
    shutil.copytree(out / "fsdp" / step, out / "resumed" / step)
    logs["resumed"] = run(model, out, "resumed", *fsdp_args(model))
    return logs


def step_dir(out: Path, name: str, step: int) -> Path:
    return out / name / f"step-{step:07d}"


def own_init(model: str) -> dict[str, torch.Tensor]:
    """The model's parameters as the library initialises them on the CPU, seeded as the job seeds it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        net = hf_models.MODELS[model]()
    return {name: p.detach() for name, p in net.named_parameters()}


def check_initial(model: str, out: Path) -> None:
    """The step-1 checkpoints (the initial parameters) of both strategies: the parameters bitwise the library's own
    init, and everything (BatchNorm's statistics after one forward too) bitwise equal between the strategies."""
    want = own_init(model)
    ddp, fsdp = read_model(step_dir(out, "ddp", 1)), read_model(step_dir(out, "fsdp", 1))
    assert_bitwise_equal(dict(ddp), dict(fsdp), "ddp vs fsdp at step 1")
    assert want.keys() <= ddp.keys()
    assert_bitwise_equal({k: ddp[k] for k in want}, want, "step 1 vs the library's init")


def terms(model: str) -> int:
    """The products that feed one gradient element (tests/support/tolerance.py): the global batch's 8 items times
    the positions of an item (tokens, or pixels at the stem) times the widest fan-in of the model (the softmax
    over the vocabulary; a 3x3 convolution over 64 channels)."""
    if model in hf_models.TEXT:
        return 8 * hf_models.SEQ_LEN * hf_models.VOCAB
    return 8 * hf_models.IMAGE**2 * 3 * 3 * 64


def check_within_tolerance(model: str, out: Path) -> tuple[float, float]:
    """ddp and fsdp end within the rounding bound of their order of summation, having moved far more than it;
    (difference, tolerance)."""
    initial = read_model(step_dir(out, "ddp", 1))
    ddp, fsdp = read_model(step_dir(out, "ddp", STEPS)), read_model(step_dir(out, "fsdp", STEPS))
    tol = summation_order_tolerance([out / "ddp", out / "fsdp"], terms(model), MOMENTUM)
    moved, diff = max_diff(ddp, initial), max_diff(ddp, fsdp)
    assert moved > 10 * tol, f"training moved the parameters by {moved}: too little to tell a wrong run apart"
    assert diff <= tol, f"{model}: ddp and fsdp end {diff} apart, more than {tol}"
    return diff, tol


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def check_resumed(out: Path, tmp: Path) -> None:
    """The run resumed at step 2 ends bitwise equal to the uninterrupted one: model (buffers included) and
    optimizer state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    full = {}
    for name in ("fsdp", "resumed"):
        target = tmp / f"{name}.pt"
        dcp_to_torch_save(step_dir(out, name, STEPS) / "shards", target)
        full[name] = torch.load(target, map_location="cpu", weights_only=True)
    assert_bitwise_equal(full["fsdp"]["model"], full["resumed"]["model"], "model")
    assert_bitwise_equal(full["fsdp"]["optimizer"], full["resumed"]["optimizer"], "optimizer")


def val_loss(run_dir: Path) -> float:
    """The run's final validation loss, as the FINAL line reports it (full precision from status.json)."""
    return float(json.loads((run_dir / "status.json").read_text())["metrics"]["val/loss"])


def exported_loss(model: str, exported: Path) -> float:
    """The validation loss of the exported file loaded strictly into the library's own class, on the CPU."""
    from safetensors.torch import load_file

    net = hf_models.MODELS[model]()
    net.load_state_dict(load_file(exported), strict=True)
    net.eval()
    task = hf_models.task(model=model, train_items=64, val_items=8)
    data = task.dataset("val")
    batch = torch.utils.data.default_collate([data[i] for i in range(len(data))])
    with torch.no_grad():
        total, count = task.metrics(net, batch)["loss"]
    return float(total) / float(count)


def eval_tolerance(loss: float) -> float:
    """The loss of one model on the same items, batched otherwise: each item's loss is a float32 forward whose
    sums are at most ``VOCAB`` long (the softmax over the vocabulary, the widest reduction of these models), so
    relative ``VOCAB * eps`` per item; the mean over 8 items adds ``8 * eps``."""
    return (hf_models.VOCAB + 8) * FP32_EPS * abs(loss) + math.ulp(loss)
