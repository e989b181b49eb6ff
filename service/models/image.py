"""A tiny image classifier over 3x224x224 inputs, for measuring input encodings, not accuracy."""

from __future__ import annotations

import torch
from torch import nn


class TinyImageClassifier(nn.Module):
    """(batch, 3, 224, 224) float32 -> (batch, 10) logits, with one strided convolution."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, kernel_size=3, stride=4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.features(images))
        return logits
