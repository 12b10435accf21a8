"""Learnable compression phi = "mlp": intra-block position embedding + MLP, residual on mean."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import reference


class ZeroLinear(nn.Linear):
    """An nn.Linear that starts at zero, and returns to zero on `reset_parameters`: NSA's last
    layers that start a module at a known function (the gate at act(0), phi at mean pooling).
    As a module of its own, it keeps that when a model built on the meta device is materialised
    with `to_empty` and every module's `reset_parameters` (FSDP's meta-device initialisation).
    It draws nn.Linear's initialisation first, so a seed gives the other layers the weights it
    gave them when this layer was a zeroed nn.Linear."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class PhiMLP(nn.Module):
    """phi(x_blk) = mean(x_blk + pe) + MLP(flatten(x_blk + pe)); equals mean pooling at init and
    after `reset_parameters`."""

    def __init__(self, block_len: int, head_dim: int, hidden: Optional[int] = None):
        super().__init__()
        hidden = hidden or 2 * head_dim
        self.block_len = block_len
        self.pos_emb = nn.Parameter(torch.zeros(block_len, head_dim))
        self.fc1 = nn.Linear(block_len * head_dim, hidden)
        # zero output layer (and zero pe): the module starts as exact mean pooling
        self.fc2 = ZeroLinear(hidden, head_dim)

    def reset_parameters(self) -> None:
        """pos_emb back to zero (fc1 and fc2 reset themselves)."""
        nn.init.zeros_(self.pos_emb)

    def forward(self, x: Tensor, block_len: int, block_stride: int,
                cu_seqlens: Optional[Tensor] = None) -> Tensor:
        if block_len != self.block_len:
            raise ValueError(f"block_len must be {self.block_len} (PhiMLP was built for it), "
                             f"got {block_len}")
        return reference.compress_mlp(x, block_len, block_stride, self.pos_emb, self.fc1.weight,
                                      self.fc1.bias, self.fc2.weight, self.fc2.bias, cu_seqlens)
