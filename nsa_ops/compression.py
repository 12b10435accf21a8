"""Learnable compression phi = "mlp": intra-block position embedding + MLP, residual on mean."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import reference


class PhiMLP(nn.Module):
    """phi(x_blk) = mean(x_blk + pe) + MLP(flatten(x_blk + pe)); equals mean pooling at init."""

    def __init__(self, block_len: int, head_dim: int, hidden: Optional[int] = None):
        super().__init__()
        hidden = hidden or 2 * head_dim
        self.block_len = block_len
        self.pos_emb = nn.Parameter(torch.zeros(block_len, head_dim))
        self.fc1 = nn.Linear(block_len * head_dim, hidden)
        self.fc2 = nn.Linear(hidden, head_dim)
        # zero output layer (and zero pe): the module starts as exact mean pooling
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor, block_len: int, block_stride: int,
                cu_seqlens: Optional[Tensor] = None) -> Tensor:
        if block_len != self.block_len:
            raise ValueError(f"block_len must be {self.block_len} (PhiMLP was built for it), "
                             f"got {block_len}")
        return reference.compress_mlp(x, block_len, block_stride, self.pos_emb, self.fc1.weight,
                                      self.fc1.bias, self.fc2.weight, self.fc2.bias, cu_seqlens)
