"""``sentiment``: a small text classifier with two inputs and two outputs, as HF models have.

Token embeddings averaged over the attention mask, then a linear layer to two logits
(negative, positive). Small enough to train in seconds on a CPU; it exists to demo the
text handler and the multi-tensor path (``input_ids`` and ``attention_mask`` in, ``logits``
and ``embedding`` out), not to be a good sentiment model.
"""

from __future__ import annotations

import torch
from torch import nn

PAD_ID = 0


class SentimentClassifier(nn.Module):
    """``(batch, length)`` token ids and mask -> ``{"logits": (batch, 2), "embedding":
    (batch, width)}``. Masked positions count for nothing, so an instance's answer does not
    depend on how much padding its batch needed."""

    def __init__(self, vocab_size: int = 1000, width: int = 32, classes: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width, padding_idx=PAD_ID)
        self.project = nn.Linear(width, width)
        self.classify = nn.Linear(width, classes)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        keep = attention_mask.unsqueeze(-1).to(self.tokens.weight.dtype)
        summed = (self.tokens(input_ids) * keep).sum(dim=1)
        pooled = summed / keep.sum(dim=1).clamp(min=1.0)
        embedding = torch.tanh(self.project(pooled))
        return {"logits": self.classify(embedding), "embedding": embedding}
