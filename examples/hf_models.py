"""Third-party models as ddp-job tasks: tiny Hugging Face transformers and timm models, built from a config in code
(nothing downloaded), trained on synthetic data made from the item's index.

    PYTHONPATH=examples ddp-job train --task.name hf_models:task --task.options '{"model": "gpt2"}' ...

``model`` picks one of ``MODELS``: ``gpt2``, ``llama`` (causal language models, the model's own ``outputs.loss``),
``bert`` (masked language model; its position ids are a buffer), ``vit``, ``convnext`` and ``resnet`` (timm
image classifiers, cross-entropy; the ResNet has BatchNorm's running statistics). ``build_model`` returns the library's own class (``GPT2LMHeadModel``,
``timm.create_model``), so a ``ddp-job export`` of the run loads into it with ``strict=True``. Under
``train.strategy: fsdp`` the Hugging Face models shard by the blocks their ``_no_split_modules`` names; the timm
models take ``fsdp.units`` (``Block`` for the ViT, ``ConvNeXtStage`` for the ConvNeXt, ``BasicBlock`` for the
ResNet).

The sizes are tiny on purpose (a few hundred thousand parameters): this file is the tests' table of real
third-party models and the example of docs/tasks.md; a real run puts its own model and data in the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

VOCAB = 256
SEQ_LEN = 32
IMAGE = 32
CLASSES = 10
MASK_ID = 1
"""BERT's masked positions: every fourth token is replaced by this id and predicted."""


def gpt2(width: int = 32, layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_head=2, n_embd=width, vocab_size=VOCAB, n_positions=SEQ_LEN, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def llama(width: int = 32, layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=SEQ_LEN,
    )
    return LlamaForCausalLM(config)


def bert(width: int = 32, layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * width,
        max_position_embeddings=SEQ_LEN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def resnet(width: int = 32, layers: int = 2) -> nn.Module:
    import timm

    return timm.create_model(
        "resnet18",
        pretrained=False,
        layers=(1, 1, 1, 1),
        channels=(width // 4, width // 2, width, 2 * width),
        stem_width=width // 4,
        num_classes=CLASSES,
    )


def vit(width: int = 32, layers: int = 2) -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=IMAGE,
        patch_size=8,
        embed_dim=width,
        depth=layers,
        num_heads=2,
        num_classes=CLASSES,
    )


def convnext(width: int = 32, layers: int = 2) -> nn.Module:
    import timm

    depths = (1, 1, layers - 1, 1)
    dims = (width // 4, width // 2, width, 2 * width)
    return timm.create_model("convnext_atto", pretrained=False, depths=depths, dims=dims, num_classes=CLASSES)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit": vit,
    "convnext": convnext,
    "resnet": resnet,
}
TEXT = ("gpt2", "llama", "bert")


class Synthetic(Dataset):
    """Item ``index`` of ``split``: token ids or an image and its class, drawn from a generator seeded by both."""

    def __init__(self, text: bool, split: str, size: int) -> None:
        self.text, self.offset, self.size = text, 0 if split == "train" else 10**6, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.offset + index)
        if self.text:
            # A learnable sequence: a random start, then each token the previous plus a random small step.
            steps = torch.randint(0, 3, (SEQ_LEN,), generator=g)
            tokens = (torch.randint(2, VOCAB, (1,), generator=g) + steps.cumsum(0)) % (VOCAB - 2) + 2
            return {"tokens": tokens}
        label = torch.randint(0, CLASSES, (1,), generator=g)
        image = torch.randn(3, IMAGE, IMAGE, generator=g) + label.float() / CLASSES
        return {"image": image, "label": label[0]}


class ThirdParty:
    """The task: ``model`` is a key of ``MODELS``, ``width`` and ``layers`` its hidden size and depth (the image
    models' third stage); ``train_items``/``val_items`` size the synthetic splits."""

    def __init__(
        self, model: str, train_items: int = 256, val_items: int = 16, width: int = 32, layers: int = 2
    ) -> None:
        if model not in MODELS:
            raise ValueError(f"task option model={model!r}: one of {', '.join(MODELS)}")
        self.name, self.sizes = model, {"train": train_items, "val": val_items}
        self.width, self.layers = width, layers

    def build_model(self) -> nn.Module:
        return MODELS[self.name](self.width, self.layers)

    def dataset(self, split: str) -> Synthetic:
        return Synthetic(self.name in TEXT, split, self.sizes[split])

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.losses(model, batch).mean()

    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
        losses = self.losses(model, batch)
        return {"loss": (losses.sum(), losses.numel())}

    def losses(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each item's loss (a mean over its tokens for the language models)."""
        if self.name not in TEXT:
            return functional.cross_entropy(model(batch["image"]), batch["label"], reduction="none")
        tokens = batch["tokens"]
        if self.name == "bert":
            masked = torch.zeros_like(tokens, dtype=torch.bool)
            masked[:, ::4] = True
            logits = model(input_ids=tokens.masked_fill(masked, MASK_ID)).logits
            per_token = functional.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
            return (per_token * masked).sum(1) / masked.sum(1)
        logits = model(input_ids=tokens).logits[:, :-1]
        return functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def task(**options: Any) -> ThirdParty:
    return ThirdParty(**options)
