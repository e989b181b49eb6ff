"""``digits``: a small CNN classifying scikit-learn's 8x8 handwritten digits."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """(batch, 8, 8) pixel intensities in [0, 1] -> (batch, 10) class logits."""

    def __init__(self, channels: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.features(images.unsqueeze(1)))
        return logits
