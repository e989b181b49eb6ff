"""The multilayer perceptron every peer was measured with (``shared/PEERS.md``)."""

from __future__ import annotations

import torch
from torch import nn


class PeerMLP(nn.Module):
    """(batch, 256) float32 -> (batch, 10): 256 -> 1024 -> GELU -> 1024 -> GELU -> 10."""

    def __init__(self, features: int = 256, hidden: int = 1024, classes: int = 10) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(features, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.layers(features)
        return logits
