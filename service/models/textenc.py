"""``textenc``: a small Transformer encoder from token ids to one 256-vector per sequence."""

from __future__ import annotations

import torch
from torch import nn

PAD_ID = 0


class TextEncoder(nn.Module):
    """(batch, length) int64 token ids, 0 = padding -> (batch, width) mean-pooled embedding.

    Padded positions are masked out of attention (as keys) and out of the mean, so an
    instance's output does not depend on how much padding its batch needed.
    """

    def __init__(
        self,
        vocab_size: int = 1000,
        width: int = 256,
        layers: int = 4,
        heads: int = 4,
        feedforward: int = 1024,
        max_length: int = 512,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width, padding_idx=PAD_ID)
        self.positions = nn.Embedding(max_length, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=feedforward, dropout=0.0, batch_first=True,
            norm_first=True,
        )  # fmt: skip
        # Nested tensors would drop padding inside torch; we pad and mask explicitly so eager,
        # compiled and bucketed runs compute the same thing.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        padding = token_ids == PAD_ID
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        hidden = self.tokens(token_ids) + self.positions(positions)
        hidden = self.norm(self.encoder(hidden, src_key_padding_mask=padding))
        keep = (~padding).unsqueeze(-1).to(hidden.dtype)
        pooled: torch.Tensor = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return pooled
