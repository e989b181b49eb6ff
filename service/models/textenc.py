"""``textenc``: a small Transformer encoder from token ids to one 256-vector per sequence."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

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
        # The torch modules hold the weights (same names and seeded values as ever); the forward
        # pass is ``encoder_layer`` below.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        real = token_ids != PAD_ID
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        hidden = self.tokens(token_ids) + self.positions(positions)
        attend = real[:, None, None, :]  # (batch, 1, 1, length): keys that may be attended
        for layer in self.encoder.layers:
            hidden = encoder_layer(layer, hidden, attend)
        hidden = self.norm(hidden)
        keep = real.unsqueeze(-1).to(hidden.dtype)
        pooled: torch.Tensor = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return pooled


def encoder_layer(
    layer: nn.TransformerEncoderLayer, hidden: torch.Tensor, attend: torch.Tensor
) -> torch.Tensor:
    """What ``layer`` computes (pre-norm, ReLU, no dropout), with its attention done by
    ``scaled_dot_product_attention``.

    torch's own encoder layer runs a slow masked softmax on CPU; the fused attention kernels
    (flash attention on CPU and CUDA) do the same arithmetic faster, and the same code runs
    under autocast and compile.
    """
    batch, length, width = hidden.shape
    attention = layer.self_attn
    heads = attention.num_heads
    projected = functional.linear(
        layer.norm1(hidden), attention.in_proj_weight, attention.in_proj_bias
    )
    query, key, value = projected.view(batch, length, 3, heads, width // heads).permute(
        2, 0, 3, 1, 4
    )
    attended = functional.scaled_dot_product_attention(query, key, value, attn_mask=attend)
    hidden = hidden + attention.out_proj(attended.transpose(1, 2).reshape(batch, length, width))
    feedforward: torch.Tensor = layer.linear2(functional.relu(layer.linear1(layer.norm2(hidden))))
    return hidden + feedforward
