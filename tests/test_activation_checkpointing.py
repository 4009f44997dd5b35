"""train.activation_checkpointing: each unit's activations recomputed in backward, the same math and the same
state-dict keys. In-process on the language model; the multi-process fsdp run with it is in tests/test_fsdp.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.runs import assert_bitwise_equal

from job.config import load_config
from job.errors import BadInput
from job.parallel import fsdp
from job.tasks.lm.gpt import GPT, GPTConfig

AC = ["--train.activation-checkpointing", "true"]


def train(checkpointed: bool, steps: int = 3) -> tuple[GPT, list[float], int]:
    """A few SGD steps of the language model (dropout on: the recomputation must replay its RNG); its parameters,
    losses and how often its blocks ran forward."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, dropout=0.1))
    if checkpointed:
        cfg = load_config([*AC, "--fsdp.units", "[Block]"], {})
        assert fsdp.checkpoint_activations(model, cfg, None) == 2
    calls = [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    for block in model.blocks:
        block.register_forward_pre_hook(count)  # a pre-hook: the recomputation may stop before the end
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.randint(0, 256, (steps, 4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for batch in data:
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, calls[0]


def test_checkpointed_units_train_the_same_and_really_recompute() -> None:
    plain, plain_losses, plain_calls = train(False)
    checkpointed, losses, calls = train(True)
    assert plain_calls == 3 * 2  # 3 steps x 2 blocks, once each
    assert calls == 2 * plain_calls  # the forward again in backward: activations were not kept
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # names and keys unchanged
    moved = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), GPT(plain.cfg).parameters()))
    assert moved > 1e-3
    assert_bitwise_equal(plain.state_dict(), checkpointed.state_dict(), "parameters with and without it")


def test_no_units_or_dp_is_bad_input_naming_the_settings() -> None:
    model = GPT(GPTConfig(n_layer=1))
    with pytest.raises(BadInput) as e:
        fsdp.check_units(model, load_config(AC, {}), None)
    assert e.value.setting == "train.activation_checkpointing" and "fsdp.units" in e.value.fix
    with pytest.raises(BadInput) as e:
        fsdp.check_units(model, load_config([*AC, "--train.strategy", "dp", "--fsdp.units", "[Block]"], {}), None)
    assert e.value.setting == "train.activation_checkpointing" and "train.strategy" in str(e.value)
    fsdp.check_units(model, load_config([*AC, "--fsdp.units", "[Block]"], {}), None)  # units named: accepted
