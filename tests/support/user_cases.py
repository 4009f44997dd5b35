"""User code that breaks the contract of docs/user-code.md in one way each, named by import path in the tests
(``support.user_cases:NAME``; the tests put tests/ on PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path

import torch
from tinyshapes.data import shapes
from tinyshapes.model import tiny_cnn
from torch import nn

NOT_CALLABLE = 3


def model_without_num_classes(classes: int) -> nn.Module:
    return tiny_cnn(classes)


def model_with_wrong_output(num_classes: int) -> nn.Module:
    return tiny_cnn(num_classes + 1)


def model_that_is_not_a_module(num_classes: int) -> object:
    return {"num_classes": num_classes}


class Items:
    """A map-style dataset of the given items (the same for both splits)."""

    def __init__(self, items: list[object]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> object:
        return self.items[index]


def data_channels_last(split: str, path: Path) -> Items:
    return Items([(torch.zeros(20, 20, 3, dtype=torch.uint8), 0)] * 16)


def data_float_images(split: str, path: Path) -> Items:
    return Items([(torch.rand(3, 20, 20), 1)] * 16)


def data_label_out_of_range(split: str, path: Path) -> Items:
    image, _ = shapes(split, path)[0]
    return Items([(image, 7)] * 16)


def data_without_split(path: Path) -> Items:
    return Items([])


def data_empty(split: str, path: Path) -> Items:
    return Items([])


def data_iterable(split: str, path: Path) -> object:
    return iter([])


def tensor_images(split: str, path: Path, n: int = 24) -> Items:
    """Valid: uint8 3 x H x W tensors of varying sizes, labels as 0-dim int tensors."""
    g = torch.Generator().manual_seed(int(split == "val"))
    items = []
    for i in range(n):
        size = 18 + i % 5
        items.append((torch.randint(0, 256, (3, size, size + 2), dtype=torch.uint8, generator=g), torch.tensor(i % 4)))
    return Items(items)
