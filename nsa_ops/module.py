"""NSAAttention: the user-facing NSA layer (projections, RoPE, phi, gate MLP, GQA, decode cache)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import reference
from .cache import NSACache
from .compression import PhiMLP
from .config import NSAConfig
from .decode import decode_attention
from .functional import nsa_attention
from . import validation as check


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding (rotate-half pairing) of x [B,T,heads,D] at positions pos [T]."""
    D = x.shape[-1]
    cdt = reference.compute_dtype(x.dtype)
    inv_freq = theta ** -(torch.arange(0, D, 2, device=x.device, dtype=cdt) / D)
    angle = pos.to(cdt)[:, None] * inv_freq[None]  # [T, D/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[None, :, None]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[None, :, None]
    xc = x.to(cdt)
    x1, x2 = xc[..., :D // 2], xc[..., D // 2:]
    return (xc * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class NSAAttention(nn.Module):
    """x [B,T,hidden] -> [B,T,hidden] through Native Sparse Attention (NSA-SPEC.md).

    RoPE rotates q and k before phi, so compressed keys are pooled from rotated keys. The gate MLP
    reads x and yields one gate per query head and branch; its last layer starts at zero, so the
    gates start at act(0): 0.5 each (sigmoid) or 1/3 each (softmax over the 3 branches).
    """

    def __init__(self, config: NSAConfig):
        super().__init__()
        config.validate()
        self.config = c = config
        HQ, H = c.num_heads, c.num_kv_heads
        self.q_proj = nn.Linear(c.hidden_size, HQ * c.head_dim_qk, bias=c.bias)
        self.k_proj = nn.Linear(c.hidden_size, H * c.head_dim_qk, bias=c.bias)
        self.v_proj = nn.Linear(c.hidden_size, H * c.head_dim_v, bias=c.bias)
        self.o_proj = nn.Linear(HQ * c.head_dim_v, c.hidden_size, bias=c.bias)
        self.gate = nn.Sequential(nn.Linear(c.hidden_size, c.hidden_size, bias=c.bias), nn.SiLU(),
                                  nn.Linear(c.hidden_size, 3 * HQ, bias=c.bias))
        nn.init.zeros_(self.gate[-1].weight)
        if c.bias:
            nn.init.zeros_(self.gate[-1].bias)
        if c.phi == "mlp":
            self.phi_k = PhiMLP(c.block_len, c.head_dim_qk)
            self.phi_v = PhiMLP(c.block_len, c.head_dim_v)
        else:
            self.phi_k = self.phi_v = reference.compress_mean

    def new_cache(self, batch_size: int = 1, capacity: Optional[int] = None) -> NSACache:
        """An empty cache in this module's dtype and device (capacity defaults to max_position
        when the config sets one; None grows on demand)."""
        w = self.q_proj.weight
        return NSACache(self.config, batch_size, capacity or self.config.max_position,
                        dtype=w.dtype, device=w.device)

    def gates(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(g_cmp, g_slc, g_win), each [B,T,HQ], activated."""
        g = self.gate(x).unflatten(-1, (self.config.num_heads, 3))
        g = torch.sigmoid(g) if self.config.gate_act == "sigmoid" else torch.softmax(g, -1)
        return g.unbind(-1)

    def _qkv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        q = self.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim_qk))
        k = self.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim_qk))
        v = self.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim_v))
        return rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta), v

    def _check_positions(self, end: int) -> None:
        limit = self.config.max_position
        if limit is not None and end > limit:
            raise ValueError(f"positions must be < max_position={limit}, got a sequence of "
                             f"{end} tokens")

    def forward(self, x: Tensor, cache: Optional[NSACache] = None,
                cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """Prefill (cache=None): x [B,T,hidden], or varlen B == 1 with cu_seqlens int32 [N+1].
        Decode (cache given): x holds the next Tq tokens of every sequence; they are appended to
        the cache and their outputs returned (equal to the prefill outputs at those positions)."""
        check.check_tensor("x", x, 3, "[B, T, hidden]")
        if x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"x must have hidden size {self.config.hidden_size} "
                             f"([B, T, hidden]), got {tuple(x.shape)}")
        c = self.config
        B, T, _ = x.shape
        if cache is None:
            check.check_cu_seqlens(cu_seqlens, x)
            _, pos = reference.token_layout(T, cu_seqlens, x.device)
            if c.max_position is not None:
                self._check_positions(T if cu_seqlens is None else
                                      int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
            q, k, v = self._qkv(x, pos)
            o = nsa_attention(q, k, v, *self.gates(x), block_len=c.block_len,
                              block_stride=c.block_stride, sel_block=c.sel_block,
                              num_sel=c.num_sel, window=c.window, phi=(self.phi_k, self.phi_v),
                              scale=c.scale, cu_seqlens=cu_seqlens)
        else:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens must be None when decoding with a cache "
                                 "(a cache holds B sequences of equal length)")
            if cache.config != c:
                raise ValueError("cache must be built for this module's config "
                                 "(use module.new_cache())")
            self._check_positions(cache.length + T)
            pos = torch.arange(cache.length, cache.length + T, device=x.device)
            q, k, v = self._qkv(x, pos)
            cache.append(k, v, self.phi_k, self.phi_v)
            o = decode_attention(q, cache, *self.gates(x), scale=c.scale)
        return self.o_proj(o.flatten(-2))
