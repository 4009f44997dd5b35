"""A small CNN, as ddp-job calls a user model: ``tiny_cnn(num_classes=N, **model.options)``."""

from __future__ import annotations

from torch import nn


def tiny_cnn(num_classes: int, width: int = 16, dropout: float = 0.0) -> nn.Module:
    """Three conv blocks and a linear head: B x 3 x H x W floats -> B x num_classes logits, for any H, W >= 8."""

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, width),
        nn.MaxPool2d(2),
        *block(width, 2 * width),
        nn.MaxPool2d(2),
        *block(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(4 * width, num_classes),
    )
