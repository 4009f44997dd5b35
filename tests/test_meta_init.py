"""The model built on the meta device (job.parallel.meta_init): its replay gives every parameter and buffer the
value the CPU build seeded alike gives it, bit for bit, and leaves the CPU generator where that build leaves it;
what it cannot replay is built on the CPU instead, the reason named. That no rank of a sharded run allocates the
whole model is checked in a real 2-process gloo run (tests/support/parallel_worker.py, tests/test_parallel.py)
and in the training runs of tests/test_fsdp.py."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from support.third_party import hf_models
from torch import nn

from job.parallel import meta_init
from job.tasks.lm.gpt import GPT, GPTConfig

SEED = 11


class Tied(nn.Module):
    """An embedding with a padding row (zeroed through a view), initialisers that skip meta tensors, a strided slice
    of a weight drawn in place (its rows lie apart in the storage), a weight tied to another, a computed
    non-persistent buffer and BatchNorm's statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16, padding_idx=3)
        self.proj = nn.Linear(16, 16)
        nn.init.trunc_normal_(self.proj.weight, std=0.02, a=-0.04, b=0.04)
        with torch.no_grad():
            self.proj.weight[:, :4].normal_(0, 0.5)
        self.mix = nn.Linear(16, 16, bias=False)
        nn.init.orthogonal_(self.mix.weight)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.BatchNorm1d(16)
        self.register_buffer("freqs", 1.0 / (1e4 ** (torch.arange(0, 8).float() / 8)), persistent=False)


def resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


BUILDS: dict[str, Callable[[], nn.Module]] = {
    "causal_lm_gpt": lambda: GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16)),
    "resnet18": resnet18,
    "tied_padded_orthogonal": Tied,
    "timm_vit": hf_models.vit,  # trunc_normal_ of timm's own, a drop-path schedule read with .item() on the CPU
    "timm_convnext": hf_models.convnext,
}


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: t.detach() for name, t in named}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_replay_gives_the_cpu_build_bitwise_and_leaves_the_rng_as_it(name: str) -> None:
    build_model = BUILDS[name]
    torch.manual_seed(SEED)
    cpu = build_model()
    rng_after_cpu = torch.random.get_rng_state()
    torch.manual_seed(SEED + 1)  # the state the build finds must not matter: the replay draws from SEED
    model, replay = meta_init.build(build_model, SEED)
    assert replay is not None, "the build fell back to the CPU"
    assert all(t.is_meta for t in tensors(model).values())
    assert torch.equal(torch.random.get_rng_state(), rng_after_cpu)
    replay.materialise(model, torch.device("cpu"))
    want, got = tensors(cpu), tensors(model)
    assert want.keys() == got.keys() and len(got) >= 6
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    if name == "tied_padded_orthogonal":  # the cases the test model exists for: really exercised
        assert model.head.weight is model.embed.weight and not model.embed.weight[3].any()
        assert model.proj.weight[:, :4].abs().max() > 0.04 >= model.proj.weight[:, 4:].abs().max()
        assert torch.allclose(model.mix.weight @ model.mix.weight.T, torch.eye(16), atol=1e-5)


class FromData(nn.Module):
    """A buffer computed from data the record cannot hold: a NumPy array, made on the CPU whatever the device."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("stats", torch.from_numpy(np.linspace(0.0, 1.0, 4, dtype=np.float32)))


class ReadsValues(nn.Module):
    """A buffer whose shape depends on a value: ``.item()`` has no value to read on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        width = int(self.proj.weight.abs().sum().item() * 0) + 3
        self.register_buffer("pad", torch.zeros(width))


class SkipsOnMeta(nn.Module):
    """Initialises itself only where the default device is not meta, as transformers' ``init_weights`` does: on
    meta the record holds torch's default initialisers, not the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        if torch.tensor([]).device.type != "meta":
            nn.init.normal_(self.proj.weight, std=0.02)


@pytest.mark.parametrize(
    ("build_model", "reason"),
    [
        (FromData, "stats is made on cpu, not on the meta device"),
        (ReadsValues, "the build fails on the meta device"),
        (SkipsOnMeta, "initialising operation 5 is nothing on meta, aten.normal_.default on the CPU"),
        (hf_models.gpt2, "the build initialises differently on the meta device"),
    ],
)
def test_what_it_cannot_replay_is_built_on_the_cpu_naming_why(
    build_model: Callable[[], nn.Module], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(SEED)
    want = tensors(build_model())
    rng_after_cpu = torch.random.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="job"):
        model, replay = meta_init.build(build_model, SEED)
    assert replay is None
    assert reason in caplog.text and "building the whole model on the CPU" in caplog.text
    got = tensors(model)
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert torch.equal(torch.random.get_rng_state(), rng_after_cpu)
    caplog.clear()
    meta_init.build(build_model, SEED, warn=False)  # the other ranks: rank 0 alone says why
    assert not caplog.text
